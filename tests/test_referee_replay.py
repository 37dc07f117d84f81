"""Full recompute's replay against the CPU referee (docs/assumptions.md, "The replay of a checkpointed block").

Real megatron-core training steps on CPU with every live tensor byte counted (benchmarks/referee/), on 0.16.1
(Python 3.11) and 0.19.2 (Python 3.12), stored in benchmarks/results/referee-replay-measured.json. The grid's model
(4 layers, hidden 256, s 256, b 2, bf16, local spec) with a 128-word vocabulary, so that the peak lies in the backward:
at the top block's replay (uniform 1 and 2), at a lower layer's replay (block 3 of 4), or in the top layer's
backward without a replay (block 1 of 4: the reference).

CheckpointFunction.backward (tensor_parallel/random.py, 0.16.1 and 0.19.2) replays the block on
``detach_variable(inputs)``: the first layer's norm saves the kept input's storage again (no copy), while ``outputs``
and ``args`` keep the replayed output and the output gradient it was handed until ``torch.autograd.backward``
returns. Before memguard counted that (estimator/core.py ``_replay``), it counted the kept input twice and the output
and its gradient not at all: the uniform and block-3 peaks were 131,312 B (0.16.1) / 65,776 B (0.19.2) below the
measurement where the reference is 130,832 B / 196,368 B above it, i.e. one [s, b, h] bf16 tensor (262,144 B)
short of the backward without a replay.
"""
import json
import os

import pytest

from benchmarks.referee.grids.dense import resolve_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MEASURED = os.path.join(ROOT, "benchmarks", "results", "referee-replay-measured.json")
STORED = os.path.join(ROOT, "benchmarks", "results", "referee-measured.json")
VERSION = {"0.16.1": "0.16.1", "0.19.2": "0.19"}   # megatron-core release -> memguard's --megatron-version


def _offsets(entry: dict, core: str) -> list[int]:
    """Estimated minus measured peak (bytes) of each rank of a stored entry, with the release's defaults."""
    from benchmarks.referee.replay_grid import het_flags
    from megatron_memguard import estimate
    layout, _ = resolve_config(het_flags(entry["flags"], ROOT), entry["world_size"], VERSION[core])
    out = []
    for r in entry["ranks"]:
        assert "bwd" in r["peak_phase"], (entry["name"], r["peak_phase"])   # the peak this file is about
        st = estimate(layout, profile="local", device="cpu", dp_rank=r["dp_rank"]).stages[r["pp_rank"]]
        assert st.peak_phase.startswith("backward"), (entry["name"], st.peak_phase)
        out.append(st.peak_allocated_bytes - r["peak_bytes"])
    return out


@pytest.fixture(scope="module")
def measured():
    with open(MEASURED) as fh:
        data = json.load(fh)
    return {core: {e["name"]: e for e in data[core]["configs"]} for core in VERSION}


@pytest.mark.parametrize("core", list(VERSION))
def test_a_replay_is_estimated_as_exactly_as_a_backward_without_one(measured, core):
    entries = measured[core]
    tp1 = _offsets(entries["recomp_full_block1_of4_bwd"], core)
    tp2 = _offsets(entries["recomp_full_block1_of4_tp2_sp_bwd"], core)
    # the reference itself: the top layer's backward, within 256 B (the loss's scalars) since the tied output layer's
    # weight gradient is counted (test_the_tied_output_weight_gradient_...; not what this test checks: the same offset
    # on both sides of the replay is)
    assert abs(tp1[0]) < 256 and all(abs(x) < 256 for x in tp2)
    for name in ("recomp_full_uniform1_bwd", "recomp_full_uniform2_bwd", "recomp_full_block3_of4_bwd"):
        assert _offsets(entries[name], core) == tp1, name
    # TP2 with SP (the kept input is the rank's sequence shard) and TP2 with --distribute-saved-activations (the kept
    # 1/TP shard is swapped for the gathered input at the replay: the shard is what is freed)
    for name in ("recomp_full_uniform1_tp2_sp_bwd", "recomp_full_uniform1_distributed_bwd"):
        assert _offsets(entries[name], core) == tp2, name


def test_a_shorter_last_uniform_block_is_estimated_as_exactly_on_core_019(measured):
    """Uniform 3 of 4 layers: megatron-core 0.19.2's checkpointed_forward (recompute.py, the group's end clamped to
    min(i + 3, 4) since 0.17.1) checkpoints layers 0-2 and layer 3 alone; the peak is the 3-layer block's replay.
    Measured 84,294,896 B (2026-11-30), the estimate 240 B below it, the reference's offset (the loss's scalars).
    On 0.16.1 the same flags fail at the first forward (IndexError: the loop reads layer 4), which memguard refuses
    (tests/test_recompute.py)."""
    entries = measured["0.19.2"]
    assert _offsets(entries["recomp_full_uniform3_of4_bwd"], "0.19.2") == _offsets(
        entries["recomp_full_block1_of4_bwd"], "0.19.2") == [-240]
    assert entries["recomp_full_uniform3_of4_bwd"]["ranks"][0]["peak_bytes"] == 84_294_896
    assert "recomp_full_uniform3_of4_bwd" not in measured["0.16.1"]


@pytest.mark.parametrize("core", list(VERSION))
@pytest.mark.parametrize("blocks", ["top_attention_only", "top_mlp_only", "top_identity"])
def test_a_replayed_top_layer_without_a_pre_mlp_norm_is_estimated_as_exactly_as_without_a_replay(measured, core, blocks):
    """Heterogeneous models (tests/data/heterogeneous/top_*.json: h 512, s 256, b 2, GQA, SwiGLU, RMSNorm, rope) whose
    top layer has no pre-MLP norm (an attention-only block over three MLP-only ones: a Mamba or '*' hybrid layer's
    structure, one residual branch merged at the input norm), no attention (an MLP-only block over attention-only
    ones) or is an identity (both halves no-op) over an attention-only block. Block 3 of 4 leaves the top layer
    unreplayed (the reference); uniform 1 and 2 and block 4 of 4 replay it, handed the final norm's gradient, and the
    identity hands its gradient on unchanged (uniform 2: one block of the attention-only layer and the identity) or
    copied (AccumulateGrad clones a gradient its caller holds: its own block). Each replay errs by the reference's
    bytes exactly. Before, the attention-only layer (and the one under the identity) was estimated one [s, b, h] bf16
    tensor (524,288 B) high: its steps' release sets name the pre-MLP norm's input it never saved, which counted the
    handed gradient as a tensor of its own, and under uniform 2 the identity counted as the top layer."""
    entries = measured[core]
    ref = _offsets(entries[f"het_{blocks}_b3"], core)
    # the reference itself: within 256 B (the loss's and the schedule's scalars) whichever layer peaks; before, the
    # attention-only top layer's unfused softmax step was 524,288 B high (test_the_unfused_softmax_step_...)
    assert abs(ref[0]) < 256
    for r in ("u1", "b4", "u2"):
        assert _offsets(entries[f"het_{blocks}_{r}"], core) == ref, r


@pytest.mark.parametrize("core", list(VERSION))
def test_the_unfused_softmax_step_holds_what_the_referee_measured(measured, core):
    """The attention-only top layer (het_top_attention_only_b3: h 512, 8 heads in 2 query groups, s 256, b 2, bf16, local
    attention) peaks in its softmax's backward (dot_product_attention.py and fused_softmax.py's torch path, megatron-core
    0.16.1 and 0.19.2). What the backward made and holds then, from the referee's dump: the four [b, a, s, s] bf16
    tensors of the softmax and masked_fill_'s backward (2,097,152 B each: new_zeros, new_empty_strided, clone,
    masked_fill), the output gradient (the final norm's, 524,288 B) and v's gradient [b a, s, d] (bmm, 524,288 B):
    9,437,184 B. The context's gradient, which the bmm's backward read, is gone (memguard counted it until now:
    524,288 B high). The estimate's core-attention step is the same bytes."""
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.partition import layer_kinds
    from benchmarks.referee.replay_grid import het_flags
    entry = measured[core]["het_top_attention_only_b3"]
    rank = entry["ranks"][0]
    made = [s for s in rank["peak_top_storages"] if s["phase"].startswith("it2 bwd")]
    scores, h_bytes = 2 * 8 * 256 * 256 * 2, 256 * 2 * 512 * 2
    assert sorted((s["op"], s["bytes"] // s["count"]) for s in made) == sorted(
        [("new_zeros", scores), ("new_empty_strided", scores), ("clone", scores), ("masked_fill", scores),
         ("fused:rms_norm_bwd", h_bytes), ("bmm", h_bytes)])
    layout, _ = resolve_config(het_flags(entry["flags"], ROOT), 1, VERSION[core])
    la = layer_activations(layout, True, layer_kinds(layout)[3])
    core_step = max(w for names, w in la.bwd_steps if "attention_probs" in names)
    assert core_step == sum(s["bytes"] for s in made) == 4 * scores + 2 * h_bytes == 9_437_184


@pytest.mark.parametrize("core", list(VERSION))
def test_blocks_with_their_own_query_groups_are_estimated_to_the_referee_bytes(measured, core):
    """tests/data/heterogeneous/own_query_groups.json (small_blocks.json with block 0's attention of 1 query group, block
    2's of 8 over an identity; h 512, s 256, b 2, bf16, local attention, rope), no recompute: the peak is block 2's softmax
    backward. Without GQA rope makes q and k new tensors, so linear_qkv's output [s b, (8 + 2 x 8) x 64] bf16 (1,572,864 B)
    is kept only through v, which the bmm with the probs saves: its backward frees it before the softmax's. memguard
    counted it there, and the context's gradient: 2,097,152 B (1.7%) high. Now within 256 B on both cores."""
    entry = measured[core]["het_own_query_groups"]
    assert abs(_offsets(entry, core)[0]) < 256


def test_the_replay_saves_its_kept_input_without_a_copy(measured):
    """What is live at the uniform-1 peak (0.16.1): the [s, b, h] bf16 tensors made in the forward are the four kept
    block inputs (the embedding's output and three layer outputs), so the replayed top layer's saved input is one of
    them; the replay made three: its output, the output gradient it was handed (the final norm's input gradient) and
    the attention branch's residual gradient."""
    rank = measured["0.16.1"]["recomp_full_uniform1_bwd"]["ranks"][0]
    hs = [s for s in rank["peak_top_storages"] if s["dtype"] == "bfloat16" and s["shape"] == [256, 2, 256]]
    made_fwd = sum(s["count"] for s in hs if s["phase"].startswith("it2 fwd"))
    made_bwd = {s["op"]: s["count"] for s in hs if s["phase"].startswith("it2 bwd")}
    assert made_fwd == 4
    assert made_bwd["add"] == 2 and made_bwd["fused:layer_norm_bwd"] == 1
    # memguard names the three in the layer term's detail, each one such tensor: 256 x 2 x 256 x 2 B = 256 KiB
    from megatron_memguard import estimate
    entry = measured["0.16.1"]["recomp_full_uniform1_bwd"]
    layout, _ = resolve_config(entry["flags"], 1)
    term = next(t for t in estimate(layout, profile="local", device="cpu").stages[0].terms
                if t.name == "layer_activations")
    assert "a replay saves its kept input again (- 256.0 KiB) and holds its output and the gradient it is handed " \
           "(+ 256.0 KiB each; a received gradient is the schedule's)" in term.detail


def test_a_replay_handed_a_received_gradient_adds_only_its_output():
    """PP2 first stage, block 2 of 2 (referee-measured.json): the top layer's replay is handed the gradient the
    schedule received and holds (counted with the P2P buffers), so the replay adds its output and removes its kept
    input: the peak within 120 B, as before (adding the gradient too: +262,024 B)."""
    with open(STORED) as fh:
        entry = next(e for e in json.load(fh)["configs"] if e["name"] == "recomp_full_block2_pp2")
    stage0 = [r for r in entry["ranks"] if r["pp_rank"] == 0]
    assert stage0 and abs(_offsets(dict(entry, ranks=stage0), "0.16.1")[0]) <= 120


def test_the_kept_input_is_subtracted_once_from_the_layer_that_saves_it():
    """By hand, estimator/core.py _replay on made-up layers: a 100 B kept input, a 100 B replayed output, a 30 B
    working set. A layer whose norm saves its input (``layer_input``) makes the replay 150 - 100 + 100 + 30 = 180 B;
    an identity layer below it (a heterogeneous no-op layer, which saves nothing) hands it the same kept tensor; a
    layer that keeps no norm input of its own (here ``x`` only) aliases nothing: 150 + 100 + 30 = 280 B."""
    from megatron_memguard.estimator.activations import LayerActivations
    from megatron_memguard.estimator.core import _replay
    steps = ((frozenset(), 30),)
    layer = LayerActivations({"layer_input": 100, "x": 50}, (), steps)
    assert _replay([layer], 100, 100, 0) == 180
    assert _replay([LayerActivations(), layer], 100, 100, 0) == 180
    assert _replay([LayerActivations({"x": 150}, (), steps)], 100, 100, 0) == 280


# CPU referee (benchmarks/referee/run.py, megatron-core 0.16.1, 4 ranks: TP 2 x PP 2) of COMMON + DIST_FLAGS (the model of
# tests/test_mtp_recompute.py without MTP: h 128, s 64, b 2, one layer per stage, uniform full recompute of 1 layer),
# with and without --distribute-saved-activations: each stage's measured peak (TP rank 0), vocabulary 1000 (both stages
# peak in the backward) and 8000 (the last stage peaks in the forward, at the loss)
DIST_FLAGS = ("--num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 "
              "--micro-batch-size 2 --global-batch-size 4 --pipeline-model-parallel-size 2 --bf16 "
              "--tensor-model-parallel-size 2 --recompute-granularity full --recompute-method uniform "
              "--recompute-num-layers 1").split()
DIST_MEASURED = {(1000, 0): (3_763_912, 3_747_528), (1000, 1): (3_608_548, 3_608_548),
                 (8000, 0): (12_567_112, 12_550_728), (8000, 1): (14_593_108, 14_576_724)}


@pytest.mark.parametrize("vocab, stage", sorted(DIST_MEASURED))
def test_distributed_saved_activations_move_each_stage_by_the_measured_bytes(vocab, stage):
    """CheckpointFunction.forward (tensor_parallel/random.py, 0.16.1 and 0.19.2) swaps the kept input for a new
    1/TP buffer (split_tensor_into_1d_equal_chunks(new_buffer=True)) whose source is freed: the embedding's output
    on the first stage, the received tensor (the schedule's list holds the same tensor object) on the last. A
    dense stage then keeps [s b h] / 2 = 16,384 B less per micro-batch held, measured to the byte on both stages
    wherever the peak lies (the last stage's backward peak is the replay's, where the gathered input is back: no
    change), and estimated so: each stage errs by the same bytes with the flag as without it (vocabulary 1000:
    -72 B and -100 B; 8000: -17,480 B and -7,252 B; -50,248 B on the first stage before its end of
    backward counted the received output gradient it holds)."""
    from benchmarks.referee.grids.dense import COMMON
    from megatron_memguard import estimate
    base = COMMON + DIST_FLAGS + ["--vocab-size", str(vocab)]
    est = [estimate(resolve_config(base + extra, 4)[0], profile="local", device="cpu").stages[stage]
           .peak_allocated_bytes for extra in ([], ["--distribute-saved-activations"])]
    without, with_flag = DIST_MEASURED[(vocab, stage)]
    assert est[1] - est[0] == with_flag - without
    assert abs(est[0] - without) < 0.005 * without


def test_a_top_layer_without_a_pre_mlp_norm_holds_no_more_than_its_output_gradient():
    """A hybrid model's Mamba layer (MambaLayer.forward: residual, norm, mixer, bias-dropout-add; megatron-core 0.16.1
    and 0.19.2) and attention-only '*' layer have one residual branch: the gradient CheckpointFunction.backward holds
    is the layer's own output gradient (each step's G) until the input norm's backward merges the residual, the
    layer's last step. So the block's top layer of either kind adds nothing over its own backward working set, while a
    layer below it, or a full layer above its pre-MLP norm's merge, holds one [s, b, h] tensor more (here [128, 1, 256]
    bf16 = 65,536 B). (The replayed heterogeneous attention-only top layer on the referee: the test above.)"""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.activations import layer_activations
    from megatron_memguard.estimator.core import _replay_transient
    from megatron_memguard.partition import layer_kinds
    from test_mamba import SMALL
    L = layout_from_flags(SMALL + ["--hybrid-layer-pattern", "M*-"], world_size=1)
    grad = 128 * 1 * 256 * 2
    for kind in layer_kinds(L):
        la = layer_activations(L, True, kind)
        assert _replay_transient(la, grad, False) == la.bwd_transient + grad == la.bwd_transient + 65_536
        # the top layer: M and * merge at their last step, '-' (no attention) at its pre-MLP norm, its last step
        assert _replay_transient(la, grad, True) == la.bwd_transient, kind
    # a GPT layer (attention + MLP) on top holds the gradient from its pre-MLP norm's merge on: the attention steps
    gpt = layout_from_flags(SMALL + ["--num-layers", "1"], world_size=1)
    la = layer_activations(gpt)
    get = la.saved.get
    after_merge = max(w - sum(get(n, 0) for n in names) for names, w in la.bwd_steps if "mlp_norm_input" in names)
    assert _replay_transient(la, grad, True) == max(la.bwd_transient, after_merge + grad)


BOTTOM = os.path.join(ROOT, "benchmarks", "results", "referee-replay-bottom-measured.json")


@pytest.mark.parametrize("core", list(VERSION))
def test_a_bottom_layers_replay_raises_the_peak_by_what_it_holds(core):
    """Layers whose peak is the bottom layer's own backward (a wide FFN under narrower layers; CPU referee,
    benchmarks/referee/replay_bottom.py): the layers above have freed their tensors by then with or without recompute,
    so full uniform recompute of each layer pays nothing back and raises the peak by what CheckpointFunction.backward
    (tensor_parallel/random.py, 0.16.1 and 0.19.2) holds beside the bottom layer's backward: its replayed output (the
    handed gradient is the layer's own output gradient, held anyway until its pre-MLP norm's merge, below the FFN
    step that peaks). Heterogeneous blocks (h 512): +1 [s, b, h] bf16 tensor (524,288 B). Under an MoE layer (h 256,
    alltoall): +2 tensors (524,288 B): the MoE block's kept input outlives its backward (its dispatcher keeps the
    replayed routing probabilities, ``self.probs``, whose graph reaches the AccumulateGrad of the block's detached
    input: traced on the referee). Estimated to the byte (before: +1 tensor each). With a second wide dense layer
    between (three layers, moe_wide_bottom3: the bottom replay comes after that block freed its kept input, while the MoE
    block's stays with its input gradient, the detached input's ``.grad``, one more [s, b, h] tensor): the estimate errs
    by the same bytes with recompute as without (without the gradient: 262,144 B low). tests/test_properties_hybrid.py
    allows two such tensors per replayed block."""
    from benchmarks.referee.replay_bottom import flags_under
    from megatron_memguard import estimate
    with open(BOTTOM) as fh:
        entries = {e["name"]: e for e in json.load(fh)[core]["configs"]}
    for model, tensor, n in (("het_wide_bottom", 256 * 2 * 512 * 2, 1), ("moe_wide_bottom", 256 * 2 * 256 * 2, 2),
                             ("moe_wide_bottom3", 256 * 2 * 256 * 2, None)):
        meas, est = {}, {}
        for rec in ("none", "u1"):
            e = entries[f"{model}_{rec}"]
            assert "bwd" in e["peak_phase"], (model, rec)
            meas[rec] = e["peak_bytes"]
            layout, _ = resolve_config(flags_under(e["flags"], ROOT), 1, VERSION[core])
            est[rec] = estimate(layout, profile="local", device="cpu").stages[0].peak_allocated_bytes
        # the reference: the plain backward, within 256 B (the loss's scalars) since the MoE dispatcher's permutation
        # mapping is counted as held (test_referee_moe_stored.py test_the_alltoall_dispatchers_mapping_...; the MoE
        # models were 4,292 / 4,320 B low before: 8 T k = 8 x 512 x 1 = 4,096 B, the int64 mapping of T = s b = 512
        # tokens, top-1, which outlives the MoE layer's backward)
        assert abs(est["none"] - meas["none"]) < 256, model
        assert est["u1"] - meas["u1"] == est["none"] - meas["none"], model
        if n:
            assert meas["u1"] - meas["none"] == n * tensor, model


@pytest.mark.parametrize("core, vocab_rows", [("0.16.1", 256), ("0.19.2", 128)])
def test_the_tied_output_weight_gradient_waits_for_the_embeddings(measured, core, vocab_rows):
    """Tied embeddings at PP 1: the output layer multiplies by the word embedding's weight itself
    (LanguageModule.shared_embedding_or_output_weight, 0.16.1 and 0.19.2), so autograd keeps its weight gradient in
    the shared weight's AccumulateGrad input buffer until the embedding's backward. The referee (no
    gradient-accumulation fusion) has the output layer's dense gradient, an ``mm`` [V/TP, h] bf16 made in the backward,
    live at the top layer's backward peak: 0.16.1 pads the 128-word vocabulary (+1 EOD) to 256 rows, 0.19.2 keeps
    128 (h 256, 2 B): 131,072 B / 65,536 B, by which memguard was low (-131,312 B / -65,776 B) until it counted it:
    now -240 B (the loss's and the schedule's scalars), TP2 ranks too (vocabulary split in two, 65,536 B each)."""
    from megatron_memguard.estimator.head import tied_wgrad_wait
    entry = measured[core]["recomp_full_block1_of4_bwd"]
    layout, _ = resolve_config(entry["flags"], 1, VERSION[core])
    wait = vocab_rows * 256 * 2
    assert layout.padded_vocab_size == vocab_rows and tied_wgrad_wait(layout, True, True) == (wait, wait)
    assert _offsets(entry, core) == [-240]
    tp2 = measured[core]["recomp_full_block1_of4_tp2_sp_bwd"]
    assert _offsets(tp2, core) == [-240, -240]
    # untied, or the two halves on different chunks (PP > 1: the last stage's copy is a parameter of its own): nothing
    untied, _ = resolve_config(entry["flags"] + ["--untie-embeddings-and-output-weights"], 1, VERSION[core])
    assert tied_wgrad_wait(untied, True, True) == (0, 0) and tied_wgrad_wait(layout, True, False) == (0, 0)


def test_with_fused_weight_gradients_the_tied_wait_is_tes_placeholder_and_the_sum_is_new():
    """On a GPU with gradient-accumulation fusion the output layer hands autograd Transformer Engine's cached
    placeholder (tensor_parallel/layers.py get_dummy_wgrad, 0.16.1 and 0.19.2; counted by dummy_wgrads): nothing more
    beside the layers' backward. At the embedding's backward torch's InputBuffer cannot add into it (the cache shares
    its storage) and makes the sum out of place: one [V/TP, h] bf16 tensor more at the end of the backward. By hand:
    vocabulary 32,000 (padded to 32,000 at TP 2: 16,000 rows) x h 1024 x 2 B = 32,768,000 B."""
    from megatron_memguard import layout_from_flags
    from megatron_memguard.estimator.core import _chunk_activations
    flags = ("--num-layers 2 --hidden-size 1024 --num-attention-heads 8 --seq-length 512 --max-position-embeddings 512 "
             "--micro-batch-size 1 --global-batch-size 8 --tensor-model-parallel-size 2 --bf16 --vocab-size 32000 "
             "--tokenizer-type NullTokenizer --make-vocab-size-divisible-by 128").split()
    acts = {}
    for extra in ((), ("--untie-embeddings-and-output-weights",)):
        L = layout_from_flags(flags + list(extra), world_size=2)
        assert L.fused_wgrad and L.padded_vocab_size // L.tp == 16_000
        c = L.stage_chunks(0)[0]
        acts[bool(extra)] = _chunk_activations(L, c.kind_runs, True, True)
    assert acts[False].bwd_top_extra == acts[True].bwd_top_extra
    assert acts[False].bwd_bottom_extra - acts[True].bwd_bottom_extra == 16_000 * 1024 * 2 == 32_768_000
