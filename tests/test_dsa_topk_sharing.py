"""DSA top-k sharing (--dsa-indexer-topk-freq > 1, megatron-core 0.19.2).

Source: experimental_attention_variant/dsa.py (is_dsa_skip_topk_layer lines 37-47, source_dsa_compute_layer 50-56,
DSAttention.__init__ 1562-1584: a reusing layer builds no indexer; DSAttention.forward 1891-1893: no indexer loss
without its own top-k, 1961-1976: the top-k read from the holder, 2197-2200: a computing layer stores its top-k there;
_get_index_share_carrier 1593-1599: the holder hangs on the attention mask, else on the config) and
models/gpt/experimental_attention_variant_module_specs.py _validate_dsa_index_share_pipeline_split (340-375). The
reusing layer's core and the handed-over top-k were measured on CPU with the real module
(benchmarks/referee/dsa_probe.py measure_shared, stored in benchmarks/results/referee-dsa-measured.json "shared").
"""
import json
import os
import sys

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.estimator.core import chunk_activations
from megatron_memguard.estimator.layers import dsa
from megatron_memguard.estimator.layers.mla import mla_rotary_bytes
from megatron_memguard.estimator.params import mtp_layer_kind, total_parameters
from megatron_memguard.partition import MIXER_DSA, MIXER_DSA_SHARED, layer_kinds

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_dsa import BASE, HYBRID, LOSS, MEASURED, TP2  # noqa: E402

with open(MEASURED) as _f:
    SHARED = json.load(_f)["shared"]


def _layout(*extra, world_size=2, base=BASE + TP2):
    return layout_from_flags(list(base) + list(extra), world_size=world_size)


def _mixers(L):
    return "".join("c" if k.mixer == MIXER_DSA else "s" if k.mixer == MIXER_DSA_SHARED else "." for k in layer_kinds(L))


# ---------------------------------------------------------------- which layers reuse a top-k

@pytest.mark.parametrize("freq, offset, want", [
    # is_dsa_skip_topk_layer: (max(n - max(offset, 1), 0) % freq) != 0 for the 1-indexed layer n
    (2, 0, "cscscscs"),
    (4, 0, "csssc" "sss"),
    (4, 3, "cccsssc" "s"),     # layers up to the offset compute: max(n - 3, 0) = 0
    (3, 1, "csscssc" "s"),
])
def test_which_layers_reuse_a_topk_by_hand(freq, offset, want):
    L = _layout("--num-layers", "8", "--dsa-indexer-topk-freq", str(freq), "--dsa-indexer-skip-topk-offset", str(offset))
    assert _mixers(L) == want


def test_reusing_layers_build_no_indexer():
    # DSAttention.__init__: self.indexer = None on a skip layer; measured: the reusing core has no parameters
    assert all(r["skip_layer_params"] == 0 for r in SHARED.values())
    one, two = _layout(), _layout("--dsa-indexer-topk-freq", "2")
    # 4 layers, layers 2 and 4 reuse: two indexers fewer, 131,072 + 65,536 + 128 + 8,192 parameters each
    assert dsa.indexer_param_count(one) == 204_928
    assert total_parameters(one) - total_parameters(two) == 2 * 204_928


# ---------------------------------------------------------------- the reusing layer's core, measured

def _predicted(r):
    """The reusing layer's core from core_items (no indexer, no loss): bytes kept, forward and backward peaks above the
    inputs (the probe hands in a contiguous V up weight: no copy)."""
    s, b, H, kvl, pe, v = r["seq"], r["batch"], r["heads"], r["kv_lora"], r["rope"], r["v_head"]
    saved, held, iw, _, sf, sb, _, _ = dsa.core_items(s, b, H, kvl, pe, v, r["index_heads"], r["index_dim"],
                                                      r["topk"], 2, r["loss_coeff"] > 0, False, indexer=False)
    saved.pop("dsa_v_up_weight")
    assert not held and iw == 0 and not set(saved) & dsa.LOSS_NAMES
    total, late = sum(saved.values()), sum(saved.get(k, 0) for k in dsa.LATE)
    return total, total - late + sf, sb - late + H * v * kvl * 2


PLAIN = sorted(n for n, r in SHARED.items() if not r.get("recompute_core"))
RECOMPUTED = sorted(n for n, r in SHARED.items() if r.get("recompute_core"))


@pytest.mark.parametrize("name", PLAIN)
def test_reusing_layer_core_matches_the_measured_module(name):
    r = SHARED[name]
    saved, fwd, bwd = _predicted(r)
    assert saved == pytest.approx(r["saved"], rel=0.002)
    # the forward's few [s]-sized causal bounds are not counted: within 0.5%
    assert fwd == pytest.approx(r["fwd_peak"], rel=0.005)
    assert bwd == pytest.approx(r["bwd_peak"], rel=0.002)


@pytest.mark.parametrize("name", sorted(SHARED))
def test_the_handed_over_topk_lives_on_the_config_or_dies_with_the_mask(name):
    r = SHARED[name]
    # fused_qk_topk_naive: int64 [b, s, min(top-k, s)]
    want = 8 * r["batch"] * r["seq"] * min(r["topk"], r["seq"])
    assert r["topk_dtype"] == "torch.int64" and r["topk_bytes"] == want
    if r.get("mask"):
        # on the batch's mask: dropped with it (the probe drops the mask before the backwards, as the forward step
        # returning does); nothing else keeps it once the indexer loss (if any) has run its backward
        assert not r["holder_on_config"] and not r["topk_alive_after_backward"]
    elif r.get("recompute_core"):
        # on the config; layer 1's replay in the backward puts a new top-k of the same size in its place
        assert r["holder_on_config"] and r["topk_kept_after_backward"] == want
    else:
        # on the config: still there after both backwards (dsa_topk_holder)
        assert r["holder_on_config"] and r["topk_kept_after_backward"] == want and r["topk_alive_after_backward"]


@pytest.mark.parametrize("name", RECOMPUTED)
def test_reusing_layer_recomputed_core_matches_the_measured_module(name):
    # --recompute-modules core_attn without the batch's mask (the replay finds the top-k on the config):
    # tensor_parallel.checkpoint keeps only the core's inputs (the probe's own); the forward runs without autograd
    # (core_items' no-grad working set, less the V up-weight copy: the probe hands a contiguous weight in); the
    # backward replays the core with autograd beside the output gradient, holding the replay's output through its
    # backward: the replay's saved tensors less the late ones, the sparse attention's backward, the V up-weight's
    # gradient (core_replay_steps)
    r = SHARED[name]
    s, b, H, kvl, pe, v = r["seq"], r["batch"], r["heads"], r["kv_lora"], r["rope"], r["v_head"]
    args = (s, b, H, kvl, pe, v, r["index_heads"], r["index_dim"], r["topk"], 2, r["loss_coeff"] > 0)
    ckpt = dsa.core_items(*args, True, indexer=False)
    replay = dsa.core_items(*args, False, indexer=False)
    up_w = H * v * kvl * 2
    total, late = sum(replay[0].values()), sum(replay[0].get(k, 0) for k in dsa.LATE)
    out = s * b * H * v * 2
    assert r["saved"] == 0 and set(ckpt[0]) == {"dsa_query"}
    assert r["fwd_peak"] == ckpt[6] - up_w
    assert r["bwd_peak"] == max(out + total + s * b * H * kvl * 2, out + total - late + replay[5]) + up_w


# ---------------------------------------------------------------- the holder in an estimate

def test_holder_without_a_mask_is_a_persistent_buffer_by_hand():
    L = _layout("--dsa-indexer-topk-freq", "2", "--no-create-attention-mask-in-dataloader")
    rows = {t.name: t.bytes for t in estimate(L).stages[0].terms}
    # computing layers 1 and 3, each int64 [b 1, s 4096, top-k 512] kept on the config
    assert rows["dsa_topk_holder"] == 2 * 8 * 4096 * 512 == 33_554_432
    assert "dsa_topk_holder" not in {t.name for t in estimate(_layout("--no-create-attention-mask-in-dataloader"))
                                     .stages[0].terms}


def test_holder_on_the_mask_lives_through_the_forward_by_hand():
    masked = _layout("--dsa-indexer-topk-freq", "2")
    bare = _layout("--dsa-indexer-topk-freq", "2", "--no-create-attention-mask-in-dataloader")
    assert "dsa_topk_holder" not in {t.name for t in estimate(masked).stages[0].terms}
    fm = chunk_activations(masked, masked.chunks[0]).fwd_extra
    fb = chunk_activations(bare, bare.chunks[0]).fwd_extra
    # the batch's mask [b, 1, s, s] bool (head.batch_items) and the two top-k hanging on it, to the forward's end
    assert fm - fb == 4096 * 4096 + 2 * 8 * 4096 * 512


def test_rotary_tables_one_per_reusing_layer():
    L = _layout("--dsa-indexer-topk-freq", "2")
    rows = {t.name: t.bytes for t in estimate(L).stages[0].terms}
    # two computing layers with their indexers' embeddings (two each), two reusing layers with one
    assert rows["rotary_cache"] == mla_rotary_bytes(L, 2 * 2 + 2)


def test_reusing_layers_keep_no_indexer_loss_terms():
    L = _layout(*LOSS, "--dsa-indexer-topk-freq", "2")
    from megatron_memguard.estimator.activations import layer_activations
    computing, reusing = (k for k in dict.fromkeys(layer_kinds(L)))
    assert "indexer_topk" in layer_activations(L, True, computing).saved
    saved = layer_activations(L, True, reusing).saved
    assert not set(saved) & dsa.LOSS_NAMES
    # the reusing layer keeps what a computing layer keeps without the loss
    plain = _layout("--dsa-indexer-topk-freq", "2")
    assert saved == layer_activations(plain, True, computing).saved


# ---------------------------------------------------------------- pipeline splits and refusals

@pytest.mark.parametrize("flags", [
    ["--num-layers", "6", "--pipeline-model-parallel-size", "2"],                      # layer 4 reuses layer 3's
    ["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "2",
     "--dsa-indexer-topk-freq", "4"],                                                  # chunk 3-4 reuses layer 1's
])
def test_a_split_between_source_and_reusing_layer_is_megatrons_error(flags):
    if "--dsa-indexer-topk-freq" not in flags:
        flags = flags + ["--dsa-indexer-topk-freq", "2"]
    with pytest.raises(ConfigError) as e:
        _layout(*flags, world_size=4).chunks
    assert e.value.key == "--dsa-indexer-topk-freq"
    assert "pipeline" in str(e.value) and "--pipeline-model-parallel-size 2" in str(e.value)


def test_a_split_on_computing_layers_is_estimated():
    L = _layout("--num-layers", "8", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage",
                "2", "--dsa-indexer-topk-freq", "2", world_size=4)
    assert [_mixers(L)[c.first_layer:c.first_layer + c.num_layers] for c in L.chunks] == ["cs"] * 4
    assert estimate(L).stages[1].peak_allocated_bytes > 0


def test_hybrid_d_layer_reusing_a_non_d_layer_is_an_error():
    flags = [f if f != "MD-MD-" else "DD-D-D" for f in HYBRID]
    with pytest.raises(ConfigError) as e:
        layout_from_flags(flags + ["--dsa-indexer-topk-freq", "2"], world_size=1).chunks
    assert e.value.key == "--dsa-indexer-topk-freq" and "not a DSA layer" in str(e.value)


def test_hybrid_d_layers_share_topk():
    flags = [f if f != "MD-MD-" else "DDM-DD" for f in HYBRID]
    L = layout_from_flags(flags + ["--dsa-indexer-topk-freq", "2"], world_size=1)
    # D layers 1 and 5 compute (max(n - 1, 0) % 2 == 0), 2 and 6 reuse
    assert _mixers(L) == "cs..cs"
    assert estimate(L).stages[0].peak_allocated_bytes > 0


CORE = ["--recompute-granularity", "selective", "--recompute-modules", "core_attn"]


@pytest.mark.parametrize("extra, ok", [
    # measured (tensor_parallel.checkpoint on CPU): the replay of a reusing core gets the batch's mask detached, a new
    # tensor without the top-k, and raises "needs top-k indices from source computing layer"; on the config it works
    (CORE, False),
    (CORE + ["--no-create-attention-mask-in-dataloader"], True),
    # TransformerBlock._checkpointed_forward: uniform groups of k layers from the chunk's first (layer 2 with its
    # source 1 in the group of 2, not in its own group of 1), block: the first k layers checkpointed one by one
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "2"], True),
    (["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"], False),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "1"], True),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "2"], False),
])
def test_recomputed_reusing_layers_need_their_source_in_the_replay(extra, ok):
    if ok:
        assert estimate(_layout("--dsa-indexer-topk-freq", "2", *extra)).stages[0].peak_allocated_bytes > 0
        return
    with pytest.raises(ConfigError) as e:
        _layout("--dsa-indexer-topk-freq", "2", *extra).chunks
    assert e.value.key == "--dsa-indexer-topk-freq" and "layer 2" in str(e.value)
    assert "--no-create-attention-mask-in-dataloader" in str(e.value)


def test_a_middle_stage_replays_on_the_config():
    # PP 3 of 6 layers: the middle stage reads no batch (get_batch_on_this_tp_rank), its top-k hang on the config
    flags = ["--num-layers", "6", "--pipeline-model-parallel-size", "3", "--dsa-indexer-topk-freq", "2"]
    with pytest.raises(ConfigError):
        _layout(*flags, *CORE, world_size=6).chunks          # the first and last stages read the mask
    L = _layout(*flags, *CORE, "--no-create-attention-mask-in-dataloader", world_size=6)
    assert estimate(L).stages[1].peak_allocated_bytes > 0


def test_mtp_depths_reusing_a_topk_are_refused_by_name():
    with pytest.raises(NotModelledError) as e:
        _layout("--dsa-indexer-topk-freq", "2", "--mtp-num-layers", "2", "--position-embedding-type", "rope")
    assert e.value.key == "--dsa-indexer-topk-freq"


def test_the_first_mtp_depth_computes_its_topk():
    # MultiTokenPredictionLayer numbers its layer 1: a computing layer whatever the last decoder layer is
    L = _layout("--dsa-indexer-topk-freq", "2", "--mtp-num-layers", "1", "--position-embedding-type", "rope")
    assert layer_kinds(L)[-1].mixer == MIXER_DSA_SHARED and mtp_layer_kind(L).mixer == MIXER_DSA
    assert estimate(L).stages[0].peak_allocated_bytes > 0


def test_the_planner_drops_splits_megatron_refuses(capsys):
    # memguard plan: a PP / VPP split that puts a reusing layer away from its source breaks Megatron's rule for that
    # layout only (_validate_dsa_index_share_pipeline_split), the other layouts are planned
    from megatron_memguard.cli.main import main
    flags = [f if f != "4" or BASE[i - 1] != "--num-layers" else "8" for i, f in enumerate(BASE)]
    assert main(["plan", "--gpus", "8", "--gpu", "H100-80GB", "--", *flags, "--dsa-indexer-topk-freq", "2"]) == 0
    out = capsys.readouterr().out
    assert "break a Megatron rule" in out and " fits " in out
