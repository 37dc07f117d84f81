"""Multi-token prediction in hybrid Mamba models: the '/' parts of --hybrid-layer-pattern (and the legacy
--mtp-hybrid-override-pattern) read with megatron-core's rules, each MTP depth's HybridStack in the parameters
(by hand, and against megatron-core 0.19.2's HybridModel built on CPU) and in the last stage's activations.

Sources: megatron-core 0.19.2 models/hybrid/hybrid_layer_allocation.py (parse_hybrid_pattern), models/hybrid/
hybrid_model.py (the MTP block on the last pipeline stage, mtp_process), transformer/multi_token_prediction.py
(MultiTokenPredictionLayer: enorm, hnorm, eh_proj [h/TP, 2h], a HybridStack of the depth's pattern without a final
norm, final_layernorm; _build_layers: one layer for every depth with mtp_use_repeated_layer), megatron/training/
arguments.py validate_args (mtp_num_layers taken from the pattern; the legacy flag converted); 0.17.1 and 0.18.2
have the same code."""

import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.params import chunk_params, total_parameters
from megatron_memguard.partition import LayerKind
from test_mamba import SMALL, _err, _layout, real_hybrid_params   # the small hybrid model of tests/test_mamba.py, read the same way


MOE = "--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 128 --moe-token-dispatcher-type alltoall"

# one layer of each kind at h 256 (RMSNorm, no biases; tests/test_mamba.py counts them the same way):
ATTN = 256 + (4 + 2 * 2) * 64 * 256 + 256 * 256           # fused norm, qkv [(4 + 2 x 2) x 64, 256], proj = 196,864
MLP = 256 + 512 * 256 + 256 * 512                         # fused norm, fc1, fc2 = 262,400
# Mamba: d_inner 512 (16 heads of 32), 2 groups, state 16: in_proj [2 x 512 + 2 x 2 x 16 + 16 = 1104, 256] with its
# fused norm, conv1d (512 + 64) x 4 and its bias, dt_bias / A_log / D 16 each, gated norm 512, out_proj [256, 512]
MAMBA = 256 + 1104 * 256 + 576 * 5 + 3 * 16 + 512 + 256 * 512   # = 417,392
# one MTP depth besides its stack: enorm, hnorm, final_layernorm (256 each, RMSNorm) and eh_proj [256, 512]
DEPTH = 3 * 256 + 256 * 512


def test_parameters_by_hand():
    assert MAMBA == 417_392 and ATTN == 196_864 and MLP == 262_400
    base = total_parameters(_layout("M*M-"))
    L = _layout("M*M-/*-/*-")
    assert (L.mtp_num_layers, L.hybrid_mtp_pattern, L.hybrid_layer_pattern, L.num_layers) == (2, "*-", "M*M-", 4)
    # two depths, each its own stack of an attention and an MLP layer
    assert total_parameters(L) - base == 2 * (DEPTH + ATTN + MLP) == 2 * 591_104
    # --mtp-use-repeated-layer: one depth's parameters, run at both depths
    R = _layout("M*M-/*-/*-", "--mtp-use-repeated-layer")
    assert total_parameters(R) - base == DEPTH + ATTN + MLP
    M = _layout("M*M-/MM/MM")
    assert total_parameters(M) - base == 2 * (DEPTH + 2 * MAMBA)
    # every parameter is on the one chunk, in HybridModel's names for the MTP block
    names = [p.name for p in chunk_params(L, L.chunks[0])]
    assert sum(p.numel for p in chunk_params(L, L.chunks[0])) == total_parameters(L)
    assert "mtp.layers.1.mtp_model_layer.layers.1.mlp.linear_fc2.weight" in names
    assert "mtp.layers.0.eh_proj.weight" in names and "mtp.layers.1.final_layernorm.weight" in names
    # per TP rank (TP 2): eh_proj [128, 512] (column-parallel), the attention layer's norm 256, qkv [256, 256] and
    # proj [256, 128], the MLP layer's norm 256, fc1 [256, 256] and fc2 [256, 256]; the three norms whole
    T = _layout("M*M-/*-/*-", "--tensor-model-parallel-size 2", world=2)
    per_rank = sum(p.numel for p in chunk_params(T, T.chunks[0]) if p.name.startswith("mtp."))
    assert per_rank == 2 * (3 * 256 + 128 * 512 + (256 + 256 * 256 + 256 * 128) + (256 + 2 * 256 * 256)) == 592_384


def test_pipeline_places_the_block_on_the_last_stage():
    # HybridModel's mtp_process: the last pipeline stage (mtp_on_this_rank without a layout); that stage also builds
    # the word embedding [1024, 256] for the MTP depths (pre_process or mtp_process)
    base = _layout("M*|M-", "--pipeline-model-parallel-size 2", world=2)
    L = _layout("M*|M-/*-/*-", "--pipeline-model-parallel-size 2", world=2)
    first, last = (sum(p.numel for p in chunk_params(L, c)) for c in L.chunks)
    b_first, b_last = (sum(p.numel for p in chunk_params(base, c)) for c in base.chunks)
    assert first == b_first
    assert last - b_last == 2 * (DEPTH + ATTN + MLP) + 1024 * 256
    # an empty last segment: the HybridStack of the last stage still builds the final norm (post_process,
    # hybrid_block.py), beside the MTP block; GPT's TransformerBlock would put it with the last decoder layer
    E = _layout("M*M-|/*-", "--pipeline-model-parallel-size 2", world=2)
    norms = [[p.name for p in chunk_params(E, c) if p.name.startswith("decoder.final")] for c in E.chunks]
    assert [c.num_layers for c in E.chunks] == [4, 0] and norms == [[], ["decoder.final_layernorm.weight"]]
    # with virtual stages ('|' segments = 2 x PP) the block is in the last rank's last virtual stage only
    # (MultiTokenPredictionBlock asserts is_vp_last_stage)
    V = _layout("M*|M-|MM|--/*-/*-", "--pipeline-model-parallel-size 2", world=2)
    holding = [(c.pp_rank, c.vpp_rank) for c in V.chunks if any(p.name.startswith("mtp.") for p in chunk_params(V, c))]
    assert V.vpp == 2 and holding == [(1, 1)]


@pytest.mark.parametrize("pattern, extra, repeated", [
    ("M*M-/*-/*-", "", False), ("M*M-/M*-/M*-", "--mtp-use-repeated-layer", True), ("M*-E/*E/*E", MOE, False)],
    ids=["two-depths", "repeated", "moe"])
def test_parameters_match_megatron_core(pattern, extra, repeated):
    real = real_hybrid_params(pattern, extra == MOE, 29653, repeated=repeated)
    L = _layout(pattern, extra)
    mine = {p.name: p.numel for p in chunk_params(L, L.chunks[0])}
    assert sum(mine.values()) == sum(real.values()) == total_parameters(L)
    depths = 1 if repeated else len(pattern.split("/")) - 1
    assert not any(n.startswith(f"mtp.layers.{depths}.") for n in real)
    for d in range(depths):
        at = f"mtp.layers.{d}."
        for part in ("enorm.", "hnorm.", "eh_proj.", "final_layernorm."):
            assert mine[at + part + "weight"] == real[at + part + "weight"]
        # each layer of the depth's stack (the MoE layer's experts are TE's grouped weights in memguard, local
        # experts there: the same numbers per layer)
        for i in range(len(pattern.split("/")[1])):
            inner = f"{at}mtp_model_layer.layers.{i}."
            assert (sum(v for n, v in mine.items() if n.startswith(inner))
                    == sum(v for n, v in real.items() if n.startswith(inner)) > 0)
    # the Mamba mixers' own parameters by name, in megatron-core's order
    assert ([(n, v) for n, v in mine.items() if n.startswith("mtp.") and ".mixer." in n and "layer_norm" not in n]
            == [(n, v) for n, v in real.items() if n.startswith("mtp.") and ".mixer." in n])


def _terms(L, stage=-1):
    return {t.name: t.bytes for t in estimate(L).stages[stage].terms}


def test_activations_per_depth():
    # seq 128, MBS 1, h 256, bf16: one Mamba layer keeps 808,448 bytes per micro-batch (the table of
    # docs/terms/mamba.md, tests/test_mamba.py): residual 65,536, rstd 512, in_proj input 65,536, zxbcdt
    # 128 x 1104 x 2, scan output, norm input and out_proj input 131,072 each, norm statistics 1,024
    mamba = 65_536 + 512 + 65_536 + 128 * 1104 * 2 + 3 * 131_072 + 1_024
    assert mamba == 808_448 == layer_activations(_layout("M*M-"), True, LayerKind("mamba", "none")).total
    base = _terms(_layout("M*M-"))
    L = _layout("M*M-/MM/MM")
    t = _terms(L)
    # two depths of two Mamba layers each, beside the decoder's four layers
    assert t["layer_activations"] - base["layer_activations"] == 2 * 2 * mamba
    # the block around the stacks (docs/terms/mtp_block_activations.md): per depth enorm's input 65,536, eh_proj's
    # [rows, 2h] input 131,072, the final norm's input 65,536, three fp32 rstd 3 x 512, the rolled ids (int64)
    # 1,024; once the (1 + 2)-fold concatenation of the hidden states 3 x 65,536; and depth 1's output, which depth
    # 2's hnorm keeps (MultiTokenPredictionBlock.forward, megatron-core 0.19.2), 65,536
    assert t["mtp_block_activations"] == 2 * (65_536 + 131_072 + 65_536 + 3 * 512 + 1_024) + 3 * 65_536 + 65_536
    # the repeated layer: the same activations at each depth (its weights once)
    assert _terms(_layout("M*M-/MM/MM", "--mtp-use-repeated-layer"))["layer_activations"] == t["layer_activations"]


def test_mtp_stack_working_sets_compose_layer_by_layer():
    # MultiTokenPredictionLayer runs its HybridStack with plain autograd (multi_token_prediction.py
    # _proj_and_transformer_layer, megatron-core 0.19.2): the depth's attention layer, above its Mamba layer, is
    # back-propagated first and frees what it saved before the Mamba layer's backward working set comes
    from megatron_memguard.estimator.core import chunk_activations
    L = _layout("*-/M*", "--vocab-size 128")             # a small vocabulary: the logits' gradient is not the peak
    mamba = layer_activations(L, True, LayerKind("mamba", "none"))
    attn = layer_activations(L, True, LayerKind("attention", "none"))
    # seq 128, MBS 1, h 256, bf16: input 65,536, fp32 rstd 512, qkv input 65,536, qkv output (4 + 2 x 2) x 64 x 128
    # x 2 = 131,072, fp32 softmax statistics 4 x 128 x 4 = 2,048, proj input 65,536
    assert attn.total == 65_536 + 512 + 65_536 + 131_072 + 2_048 + 65_536 == 330_240
    a = chunk_activations(L, L.stage_chunks(L.pp - 1)[-1])
    # the loss's items are back-propagated first (final norm input and fp32 rstd, output layer input, fp32 softmax
    # [128, 128], int64 target ids and bool mask 128 x 9): 198,272 B freed before the layers' backward
    out = 65_536 + 512 + 65_536 + 128 * 128 * 4 + 128 * 9
    assert a.bwd_top_extra == mamba.bwd_transient - attn.total - out == 707_584 - 330_240 - 198_272
    # (the stack's largest working set over everything kept was 330,240 B more)


def test_moe_mtp_layers_count_as_moe_layers():
    # an 'E' layer in the MTP pattern: its MoE half is MoE activations (the worst-case routing scales them) and the
    # stage allocates the MoE buffers even though its decoder layers hold no 'E'
    L = _layout("M*M-/*E/*E", MOE)
    # an 'E' layer: its pre-MLP norm 256, the router [4, 256], 4 experts of fc1 [128, 256] and fc2 [256, 128]
    moe_layer = 256 + 4 * 256 + 4 * (128 * 256 + 256 * 128)
    assert total_parameters(L) - total_parameters(_layout("M*M-/*-/*-")) == 2 * (moe_layer - MLP)
    terms = _terms(L)
    assert terms.get("moe_layer_activations", 0) > 0


def test_pattern_rules_name_the_flag():
    assert "all MTP patterns after '/' must be identical" in _err("--hybrid-layer-pattern M*M-/MM/M*")
    assert "'|' is not a layer symbol of an MTP pattern" in _err("--hybrid-layer-pattern M*M-/M|M/M|M")
    assert "'x' is not a layer symbol" in _err("--hybrid-layer-pattern M*M-/Mx")
    # a bad --mtp-num-layers is one error, also when the hybrid section reads it for the legacy flag
    assert _err("--hybrid-layer-pattern M*M- --mtp-hybrid-override-pattern MM --mtp-num-layers 101").count(
        "--mtp-num-layers: must be <= 100") == 1
    # megatron-core 0.16's pattern has no '/' (MTP patterns came with 0.17's unified pattern)
    assert "'/' is not a layer symbol in megatron-core 0.16" in _err(
        "--hybrid-override-pattern M*M-/MM --num-layers 4", version="0.16")
    # validate_args requires rope or no position embedding with MTP, also when the pattern sets the depths
    assert "--hybrid-layer-pattern: needs --position-embedding-type rope or none" in _err(
        "--hybrid-layer-pattern M*M-/MM --position-embedding-type learned_absolute")


def test_unmodelled_mtp_settings_are_refused_by_name():
    # (every layer symbol is modelled now, in the MTP pattern too: 'G' tests/test_gdn.py, 'D' tests/test_dsa.py)
    assert _layout("M*M-/MG").hybrid_mtp_pattern == "MG"
    # block recompute is estimated (the depth skips its own checkpoint while its HybridStack checkpoints its first
    # layers: tests/test_hybrid_mtp_recompute.py), with a note saying so
    L = _layout("M*M-/MM", "--recompute-granularity full --recompute-method block --recompute-num-layers 1")
    assert any("HybridStack checkpoints its first 1 layer(s)" in n for n in L.notes)
    # more than one layer per uniform checkpoint is not a refusal but Megatron's assertion at the first forward
    # (MultiTokenPredictionLayer._checkpointed_forward, core 0.19.2, hybrid depths too): an error naming the flag
    assert _err("--hybrid-layer-pattern M*M-/MM --recompute-granularity full --recompute-method uniform "
                "--recompute-num-layers 2").startswith("--recompute-num-layers: must be 1 with the MTP depths of "
                                                       "--hybrid-layer-pattern under --recompute-method uniform, got 2")


def test_depth_count_comes_from_the_pattern():
    # validate_args: the pattern's depth count overrides --mtp-num-layers (a warning)
    L = _layout("M*M-/MM/MM", "--mtp-num-layers 3")
    assert L.mtp_num_layers == 2 and any("--mtp-num-layers: 3 ignored" in n for n in L.notes)
    # the legacy --mtp-hybrid-override-pattern is one depth, repeated --mtp-num-layers times
    legacy = _layout("M*M-", "--mtp-hybrid-override-pattern MM --mtp-num-layers 2")
    assert (legacy.mtp_num_layers, legacy.hybrid_mtp_pattern) == (2, "MM")
    assert total_parameters(legacy) == total_parameters(_layout("M*M-/MM/MM"))
    # a hybrid model with --mtp-num-layers and no MTP pattern builds no MTP layers (validate_args only warns)
    none = _layout("M*M-", "--mtp-num-layers 2")
    assert none.mtp_num_layers == 0 and total_parameters(none) == total_parameters(_layout("M*M-"))
    assert any("no MTP layers are built" in n for n in none.notes)


def test_depths_after_slash_are_bounded():
    # memguard's bound on --mtp-num-layers (numbers.BOUNDS: 100) holds for the depths a pattern gives
    assert "has 101 MTP depths after '/'" in _err("--hybrid-layer-pattern M*M-" + "/M" * 101)
    assert _layout("M*M-" + "/M" * 100).mtp_num_layers == 100


def test_nemotron_3_super_shape_and_what_still_blocks_its_recipe():
    # Megatron-Bridge 0.6.2 recipes/nemotronh/h100/nemotron_3_super.py: latent MoE, TP with SP, EP, one MTP depth
    # pattern run twice (mtp_num_layers 2, mtp_use_repeated_layer); here scaled down, the MTP pattern "*E"
    argv = SMALL + ("--hybrid-layer-pattern MEM*EM/*E/*E --mtp-use-repeated-layer " + MOE + " --moe-latent-size 128 "
                    "--moe-grouped-gemm --tensor-model-parallel-size 2 --sequence-parallel "
                    "--expert-model-parallel-size 2 --use-distributed-optimizer").split()
    L = layout_from_flags(argv, world_size=4)
    assert (L.mtp_num_layers, L.hybrid_mtp_pattern, L.mtp_use_repeated_layer) == (2, "*E", True)
    terms = _terms(L)
    assert terms["mtp_block_activations"] > 0 and terms["mtp_loss_buffers"] > 0
    # the recipe's TE CUDA graphs: TECudaGraphHelper takes mtp.layers[0].mtp_model_layer, a HybridStack, which it
    # does not graph (no GraphableMegatronModule, core 0.19.2 _layer_is_graphable), so the repeated depths replay no
    # shared graph: estimated
    graphed = layout_from_flags(argv + "--cuda-graph-impl transformer_engine".split(), world_size=4)
    assert graphed.mtp_use_repeated_layer and graphed.cuda_graph_impl == "transformer_engine"
    # what the recipe also sets is refused by name: the flex dispatcher's HybridEP backend
    for extra, key in (("--moe-token-dispatcher-type flex --moe-flex-dispatcher-backend hybridep",
                        "--moe-flex-dispatcher-backend"),):
        with pytest.raises(NotModelledError) as e:
            layout_from_flags(argv + extra.split(), world_size=4)
        assert str(e.value).startswith(key)


def test_bridge_provider_builds_the_pattern_from_its_mtp_field():
    # Megatron-Bridge 0.6.2 HybridModelProvider.finalize: hybrid_layer_pattern + '/' + mtp_hybrid_override_pattern
    # repeated mtp_num_layers times. On Nemotron-H 8B (h 4096; tests/test_mamba.py's by-hand layers) one "*-" depth
    # is enorm, hnorm, final norm 3 x 4096, eh_proj 4096 x 8192, the attention layer 41,947,136 and the MLP layer
    # 176,164,864
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve
    depth = 3 * 4096 + 4096 * 8192 + 41_947_136 + 176_164_864
    assert depth == 251_678_720
    base = total_parameters(resolve(read_bridge({}, "recipe", [], recipe="nemotronh_8b"), world_size=2))
    for repeated, built in ((False, 2), (True, 1)):
        model = {"mtp_num_layers": 2, "mtp_hybrid_override_pattern": "*-", "mtp_use_repeated_layer": repeated}
        L = resolve(read_bridge({"model": model}, "run_config.yaml", [], recipe="nemotronh_8b"), world_size=2)
        assert (L.mtp_num_layers, L.hybrid_mtp_pattern) == (2, "*-")
        assert total_parameters(L) - base == built * depth


def test_layout_document_round_trips():
    from megatron_memguard.layout import Layout
    L = _layout("M*|M-/*-/*-", "--pipeline-model-parallel-size 2 --mtp-use-repeated-layer", world=2)
    d = L.to_dict()
    assert (d["hybrid_layer_pattern"], d["hybrid_mtp_pattern"], d["mtp_num_layers"]) == ("M*|M-", "*-", 2)
    assert Layout.from_dict(d) == L
    assert ([s.peak_allocated_bytes for s in estimate(Layout.from_dict(d)).stages]
            == [s.peak_allocated_bytes for s in estimate(L).stages])
    # a hybrid model without MTP writes no MTP pattern (its document is as before)
    assert "hybrid_mtp_pattern" not in _layout("M*M-").to_dict()


def test_bridge_pattern_with_slash_runs_mtp_num_layers_depths():
    # a provider whose hybrid_layer_pattern holds the '/' parts itself: Bridge 0.6.2 does not reconcile
    # mtp_num_layers (its default 0) with them; HybridModel builds the pattern's depths (one with the repeated
    # layer) and its forward runs mtp_num_layers of them
    from megatron_memguard.readers.bridge import read_bridge
    from megatron_memguard.resolve import resolve
    pattern = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-/*-"
    base = total_parameters(resolve(read_bridge({}, "recipe", [], recipe="nemotronh_8b"), world_size=2))
    model = {"hybrid_layer_pattern": pattern, "mtp_num_layers": 3, "mtp_use_repeated_layer": True}
    L = resolve(read_bridge({"model": model}, "run_config.yaml", [], recipe="nemotronh_8b"), world_size=2)
    assert (L.mtp_num_layers, L.hybrid_mtp_pattern) == (3, "*-")
    assert total_parameters(L) - base == 251_678_720          # one "*-" depth's parameters (test above)
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        resolve(read_bridge({"model": {"hybrid_layer_pattern": pattern}}, "run_config.yaml", [],
                            recipe="nemotronh_8b"), world_size=2)
    assert "model.hybrid_layer_pattern: has 1 MTP depth(s) after '/' but mtp_num_layers is not set" in str(e.value)
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        resolve(read_bridge({"model": {"hybrid_layer_pattern": pattern, "mtp_num_layers": 2}}, "run_config.yaml", [],
                            recipe="nemotronh_8b"), world_size=2)
    assert "model.mtp_num_layers: is 2 but model.hybrid_layer_pattern has 1 MTP depth(s)" in str(e.value)
