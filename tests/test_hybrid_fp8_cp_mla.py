"""Hybrid models as NVIDIA trains them: FP8 / FP4 Mamba layers, context parallelism in Mamba layers and MLA '+'
layers. Numbers by hand from the sources named in each test: megatron-core 0.19.2 ssm/mamba_mixer.py,
ssm/mamba_context_parallel.py (the same in 0.16.1), models/hybrid/hybrid_layer_specs.py and hybrid_block.py;
Transformer Engine 2.11 (the quantized tensors, estimator/fp8.py); parameter counts of '+' layers against
megatron-core 0.19.2's own HybridModel built on CPU."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.estimator.params import chunk_params, total_parameters
from megatron_memguard.partition import LayerKind, model_kind_runs
from test_mamba import SMALL, real_hybrid_params

MAMBA = LayerKind("mamba", "none")


def _layout(pattern, extra="", world=1, version=None):
    return layout_from_flags(SMALL + ["--hybrid-layer-pattern", pattern] + extra.split(), world_size=world,
                             megatron_version=version)


def _err(pattern, extra="", world=1, version=None):
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _layout(pattern, extra, world, version)
    return str(e.value)


# --- FP8 / FP4 ---------------------------------------------------------------------------------------------------
def test_fp8_quantizes_in_proj_and_out_proj_inputs_only():
    # SMALL: h 256, d_inner 512 (16 heads of 32), groups 2, state 16: in_proj out 2 x 512 + 2 x 2 x 16 + 16 = 1104;
    # seq 128 x MBS 2 = 256 tokens, TP 1. Tensorwise on Hopper: in_proj (TELayerNormColumnParallelLinear) keeps its
    # fused norm's output column-wise, as an FP8 transpose [h, T] of 1 byte an element, out_proj (TERowParallelLinear)
    # its input [T, d_inner] the same way, each with one fp32 scale-inverse (a 512-byte block of the allocator).
    # MambaMixer makes neither save its original input (no set_save_original_input in ssm/mamba_mixer.py).
    bf16 = layer_activations(_layout("MM", "--micro-batch-size 2"), True, MAMBA)
    L = _layout("MM", "--micro-batch-size 2 --fp8-format hybrid --fp8-recipe tensorwise")
    kind = LayerKind("mamba", "none", "tensorwise")
    assert {k for k, _ in model_kind_runs(L)} == {kind}     # HybridStack: every layer in get_fp8_context
    fp8 = layer_activations(L, True, kind)
    T = 256
    assert fp8.saved["mamba_in_proj_input"] == T * 256 + 512
    assert fp8.saved["mamba_out_proj_input"] == T * 512 + 512
    # the conv1d, the chunk scan and the gated norm are mamba_ssm kernels: their tensors stay BF16
    for name in ("layer_input", "norm1_stats", "mamba_zxbcdt", "mamba_scan_output", "mamba_norm_input",
                 "mamba_norm_stats"):
        assert fp8.saved[name] == bf16.saved[name]
    # backward: out_proj quantizes its output gradient [T, h] (Hopper: FP8 data + transpose sharing a scale) at its
    # step, in_proj its [T, 1104] at its step (TransformerEngineBaseModule.grad_output_preprocess, TE 2.11); the
    # gated norm's, the scan's and the fused norm's steps are unchanged
    extra = [w8 - w for (_, w8), (_, w) in zip(fp8.bwd_steps, bf16.bwd_steps)]
    assert extra == [2 * T * 256 + 512, 0, 0, 2 * T * 1104 + 512, 0]


def test_fp8_weight_cache_of_mamba_layers_by_hand():
    # two Mamba layers, tensorwise on Hopper: TE caches each BF16 weight as FP8 data + transpose sharing one fp32
    # scale-inverse (a 512-byte block): in_proj [1104, 256], out_proj [256, 512] (no other TE GEMM in the layer)
    L = _layout("MM", "--fp8-format hybrid --fp8-recipe tensorwise")
    est = estimate(L)
    cache = next(t for t in est.critical.terms if t.name == "fp8_weight_cache").bytes
    per_layer = 2 * (1104 * 256) + 512 + 2 * (256 * 512) + 512
    assert cache == 2 * per_layer


@pytest.mark.parametrize("recipe", ["--fp8-format e4m3 --fp8-recipe mxfp8", "--fp4-format e2m1 --fp4-recipe nvfp4",
                                    "--fp8-format hybrid --fp8-recipe delayed"])
def test_every_recipe_is_estimated(recipe):
    # state 28: in_proj's 2 x 512 + 2 x 2 x 28 + 16 = 1152 rows, a multiple of MXFP8's 32-element block
    L = _layout("M*M-", "--micro-batch-size 2 --mamba-state-dim 28 " + recipe)
    assert all(k.quantized for k, _ in model_kind_runs(L))
    assert estimate(L).critical.peak_allocated_bytes > 0


def test_first_last_layers_bf16_by_global_index():
    # fp8_utils.is_first_last_bf16_layer on the global index HybridStack passes (i + pp_layer_offset)
    L = _layout("M*M-", "--fp8-format hybrid --fp8-recipe tensorwise --first-last-layers-bf16 "
                "--num-layers-at-start-in-bf16 1 --num-layers-at-end-in-bf16 1")
    kinds = [k for k, n in model_kind_runs(L) for _ in range(n)]
    assert [k.quantized for k in kinds] == [None, "tensorwise", "tensorwise", None]


def test_fp8_in_proj_width_must_be_a_multiple_of_16():
    # MambaMixer.__init__ under FP8: (2 d_inner + 2 groups state + heads) % 16 == 0. 24 heads of 32, 3 groups:
    # 2 x 768 + 2 x 3 x 16 + 24 = 1656 = 16 x 103 + 8
    text = _err("M*M-", "--mamba-num-heads 24 --mamba-num-groups 3 --fp8-format hybrid --fp8-recipe tensorwise")
    assert "--mamba-num-heads" in text and "1656" in text and "multiple of 16" in text


def test_fp8_with_a_hybrid_mtp_pattern_is_refused_by_name():
    with pytest.raises(NotModelledError) as e:
        _layout("M*M-/*-", "--fp8-format hybrid --fp8-recipe tensorwise")
    assert str(e.value).startswith("--fp8-format")
    # 0.16.1's MambaStack opens get_fp8_context per layer, never an FP4 one
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(SMALL + "--hybrid-override-pattern M*M- --num-layers 4 --fp4-format e2m1 "
                          "--fp4-recipe nvfp4".split(), world_size=1, megatron_version="0.16")
    assert str(e.value).startswith("--fp4-format")
    L = layout_from_flags(SMALL + "--hybrid-override-pattern M*M- --num-layers 4 --fp8-format hybrid "
                          "--fp8-recipe tensorwise".split(), world_size=1, megatron_version="0.16")
    assert all(k.quantized == "tensorwise" for k, _ in model_kind_runs(L))


# --- context parallelism -----------------------------------------------------------------------------------------
def test_cp_splits_the_scan_by_heads_over_the_whole_sequence():
    # CP 2, TP 1, seq 128 x MBS 2: each rank holds 64 x 2 = 128 tokens of the residual stream; pre_conv_ssm
    # all-to-alls in_proj's output to the whole sequence (256 tokens) and half the heads (8) and groups (1):
    # the scan's zxbcdt [2, 128, 2 x 256 + 2 x 1 x 16 + 8 = 552] and out_x [2, 128, 256]; post_conv_ssm brings the
    # output back to [64, 2, 512] for the gated norm and out_proj
    la = layer_activations(_layout("M*M-", "--micro-batch-size 2 --context-parallel-size 2", world=2), True, MAMBA)
    assert la.saved["mamba_zxbcdt"] == 256 * 552 * 2
    assert la.saved["mamba_scan_output"] == 256 * 256 * 2
    assert la.saved["mamba_in_proj_input"] == 128 * 256 * 2
    assert la.saved["mamba_norm_input"] == la.saved["mamba_out_proj_input"] == 128 * 512 * 2
    assert la.saved["mamba_norm_stats"] == 128 * 2 * 4
    # pre_conv_ssm's working set: in_proj's output [128, 1104], the all-to-all'ed pieces, their concatenation and
    # its reordering (3 x [256, 552]); nothing of the scan made yet
    names, working = la.fwd_steps[0]
    assert working == 128 * 1104 * 2 + 3 * 256 * 552 * 2 and "mamba_zxbcdt" in names
    # the forward peak is the scan's, on the whole sequence: the reordered [l, b] input beside its [b, l] copy
    # (MBS 2) 256 x 552 x 2, the conv output 256 x 288 x 2, fp32 dt and dA_cumsum 2 x 256 x 8 x 4, the bf16 states
    # 2 x 8 x 32 x 16 x 2, fp32 C^T B 2 x 1 x 128^2 x 4, the gated output 256 x 256 x 2; less the gated norm's and
    # out_proj's tensors not made yet (2 x 128 x 512 x 2 + 128 x 2 x 4)
    assert la.fwd_transient == (282_624 + 147_456 + 16_384 + 16_384 + 131_072 + 131_072) - 263_168 == 461_824
    # pre_conv_ssm's backward, after the scan's: the layer-output gradient [128, 256], the reordered gradient
    # [256, 552], the five pieces all-to-all'ed back and their concatenation (2 x [128, 1104])
    names, working = la.bwd_steps[3]
    assert "mamba_zxbcdt" in names and "mamba_in_proj_input" not in names
    assert working == 128 * 256 * 2 + 256 * 552 * 2 + 2 * 128 * 1104 * 2


def test_cp_repeats_groups_when_a_rank_has_fewer_than_cp():
    # CP 4 with 2 groups: group_repeat_count 2, one group per rank: zxbcdt [2, 128, 2 x 128 + 2 x 16 + 4 = 292]
    la = layer_activations(_layout("M*M-", "--micro-batch-size 2 --context-parallel-size 4", world=4), True, MAMBA)
    assert la.saved["mamba_zxbcdt"] == 256 * 292 * 2


def test_cp_rules_of_mamba_context_parallel():
    # 24 heads, 3 groups, CP 2: heads split, groups 3 and CP 2 do not divide one another
    text = _err("M*M-", "--mamba-num-heads 24 --mamba-num-groups 3 --context-parallel-size 2", world=2)
    assert "--context-parallel-size" in text and "groups" in text
    # 16 heads over TP 2 (8 a rank) and CP 16: heads not divisible
    text = _err("M*M-", "--tensor-model-parallel-size 2 --context-parallel-size 16 --seq-length 256 "
                "--max-position-embeddings 256", world=32)
    assert "--context-parallel-size: 16 must divide the 8 Mamba heads" in text


def test_cp_halves_the_mamba_activations_of_nemotron_h():
    from test_mamba import NH8B
    one = layer_activations(layout_from_flags(NH8B + ["--tensor-model-parallel-size", "2"], world_size=8), True, MAMBA)
    two = layer_activations(layout_from_flags(NH8B + ["--tensor-model-parallel-size", "2", "--context-parallel-size",
                                                      "2"], world_size=8), True, MAMBA)
    # 128 heads and 8 groups over TP 2 x CP 2: no group repetition, every saved tensor halves
    assert {k: 2 * v for k, v in two.saved.items()} == one.saved


# --- MLA '+' layers ----------------------------------------------------------------------------------------------
MLA_BASE = [x for x in SMALL if x != "--group-query-attention"]
del MLA_BASE[MLA_BASE.index("--num-query-groups"):MLA_BASE.index("--num-query-groups") + 2]
MLA = "--q-lora-rank 64 --kv-lora-rank 32 --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 32"


def _mla(pattern, extra="", version=None):
    return layout_from_flags(MLA_BASE + ["--hybrid-layer-pattern", pattern] + extra.split(), world_size=1,
                             megatron_version=version)


def test_mla_layer_parameters_by_hand():
    # hybrid_layer_specs.py mla_layer (0.19.2): input norm [h], q down [64, 256], q up [4 x (32 + 16), 64], kv down
    # [32 + 16, 256], kv up [4 x (32 + 32), 32], linear_proj [256, 4 x 32]; no latent norms, no MLP
    L = _mla("M+M-", MLA)
    assert L.multi_latent_attention          # validate_args infers it from '+'
    rows = {p.name: p.numel for p in chunk_params(L, L.chunks[0]) if p.name.startswith("decoder.layers.1.")}
    assert sum(rows.values()) == 256 + 64 * 256 + 192 * 64 + 48 * 256 + 256 * 32 + 256 * 128 == 82_176


def test_mla_layer_parameters_match_megatron_core():
    real = real_hybrid_params("M+M-", False, 29657, config=dict(q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32,
                                                                  qk_pos_emb_head_dim=16, v_head_dim=32))
    L = _mla("M+M-", MLA)
    mine = {p.name: p.numel for p in chunk_params(L, L.chunks[0])}
    assert sum(real.values()) == total_parameters(L) == sum(mine.values())
    at = "decoder.layers.1."
    layer = [(n, v) for n, v in real.items() if n.startswith(at)]
    assert [(n, v) for n, v in mine.items() if n.startswith(at)] == layer


def test_qk_layernorm_does_not_reach_hybrid_mla_layers():
    # the hybrid mla_layer passes q_layernorm / kv_layernorm = IdentityOp and plain TEColumnParallelLinear
    # up-projections: --qk-layernorm adds no latent norm (GPT's TE spec would fuse one into each up-projection)
    with_flag = _mla("M+M-", MLA + " --qk-layernorm")
    assert total_parameters(with_flag) == total_parameters(_mla("M+M-", MLA))
    assert any("--qk-layernorm" in n for n in with_flag.notes)


def test_mla_layer_activations_are_gpt_mla_ones():
    # a '+' layer is GPT's MLA mixer with no MLP: its saved tensors are those of the MLA recipe
    L = _mla("M+M-", MLA + " --micro-batch-size 2")
    la = layer_activations(L, True, LayerKind("mla", "none"))
    assert la.saved["layer_input"] == 256 * 256 * 2 and "fc1_input" not in la.saved
    assert la.saved["q_latent"] == 256 * 64 * 2 and la.saved["kv_latent"] == 256 * 32 * 2


def test_mla_symbol_needs_megatron_core_019():
    for version in ("0.17", "0.18"):
        with pytest.raises((ConfigError, ConfigErrors)) as e:
            _mla("M+M-", MLA, version=version)
        assert "'+' (MLA) is not a layer symbol of megatron-core" in str(e.value)


def test_mxfp8_block_rule_names_the_mamba_shape():
    # MXFP8 quantizes every GEMM tensor in 32-element blocks (resolve/fp8_shapes.py): in_proj's 1104 rows are not
    text = _err("M*M-", "--fp8-format e4m3 --fp8-recipe mxfp8")
    assert "--mamba-num-heads: with --fp8-recipe mxfp8: mixer.in_proj's weight is [1104, 256]" in text


# --- --hybrid-attention-ratio / --hybrid-mlp-ratio ---------------------------------------------------------------
RATIOS = [(10, 0.2, 0.0), (10, 0.2, 0.3), (48, 0.1, 0.0), (48, 0.08, 0.5), (52, 4 / 52, 24 / 52), (7, 0.5, 0.5),
          (1, 0.0, 1.0), (56, 0.0, 0.0), (13, 0.33, 0.33), (100, 0.05, 0.45)]


def _megatron_allocation():
    """megatron-core's own allocation in this venv: 0.17+ pattern_from_ratios, 0.16.1 _allocate_auto."""
    try:
        from megatron.core.models.hybrid.hybrid_layer_allocation import pattern_from_ratios
        return pattern_from_ratios
    except ImportError:
        pass
    try:
        from megatron.core.ssm.mamba_hybrid_layer_allocation import _allocate_auto
    except ImportError:
        pytest.skip("no megatron-core in this venv")
    return lambda n, a, m: "".join(_allocate_auto(n, a, m))


@pytest.mark.parametrize("n, attention, mlp", RATIOS)
def test_pattern_from_ratios_is_megatron_cores(n, attention, mlp):
    from megatron_memguard.resolve.hybrid_ratios import pattern_from_ratios
    assert pattern_from_ratios(n, attention, mlp) == _megatron_allocation()(n, attention, mlp)


def _from_raw(version, **args):
    from megatron_memguard.readers.megatron_flags import parse_megatron_flags
    from megatron_memguard.resolve import resolve
    return resolve(parse_megatron_flags(SMALL).with_args(**args), world_size=1, megatron_version=version)


@pytest.mark.parametrize("version", ["0.16", "0.19"])
def test_ratios_without_a_pattern_are_estimated(version):
    # a namespace with the deprecated ratios (0.16.1 MambaStack / 0.19.2 HybridModel derive the pattern): 10 layers,
    # 2 attention (round(10 x 0.2)) evenly spaced, 3 MLP (round(10 x 0.3)) spread over the Mamba ones
    L = _from_raw(version, num_layers=10, hybrid_attention_ratio=0.2, hybrid_mlp_ratio=0.3)
    assert L.hybrid_layer_pattern == _megatron_allocation()(10, 0.2, 0.3) == "MM-*M-*MM-"
    assert L.num_layers == 10 and any("derived" in n for n in L.notes)
    assert estimate(L).critical.peak_allocated_bytes > 0


def test_ratio_rules():
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _from_raw("0.19", num_layers=4, hybrid_attention_ratio=0.7, hybrid_mlp_ratio=0.5)
    assert "--hybrid-mlp-ratio: 0.5 plus --hybrid-attention-ratio 0.7 must be at most 1" in str(e.value)
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _from_raw("0.19", num_layers=4, hybrid_attention_ratio=1.5)
    assert "--hybrid-attention-ratio: must be between 0 and 1" in str(e.value)
    # 0.16's allocate_layers: an override pattern must hold the ratios' counts (4 layers x 0.5: 2 attention)
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        _from_raw("0.16", num_layers=4, hybrid_override_pattern="MM*-", hybrid_attention_ratio=0.5)
    assert "--hybrid-override-pattern: must hold as many layers of each kind as the ratios give" in str(e.value)
    assert _from_raw("0.16", num_layers=4, hybrid_override_pattern="M*M-", hybrid_attention_ratio=0.25,
                     hybrid_mlp_ratio=0.25).hybrid_layer_pattern == "M*M-"
    # 0.17+: the builder passes only the pattern (noted)
    L = _from_raw("0.19", hybrid_layer_pattern="MM*-", hybrid_attention_ratio=0.5)
    assert L.hybrid_layer_pattern == "MM*-" and any("ignored beside the layer pattern" in n for n in L.notes)


# --- LoRA / DoRA -------------------------------------------------------------------------------------------------
PEFT_BASE = dict(hidden_size=256, num_attention_heads=4, seq_length=128, max_position_embeddings=128,
                 micro_batch_size=2, global_batch_size=8, bf16=True, tokenizer_type="NullTokenizer", vocab_size=1024,
                 position_embedding_type="none", normalization="RMSNorm", add_bias_linear=False,
                 untie_embeddings_and_output_weights=True, hidden_dropout=0.0, attention_dropout=0.0, mamba_head_dim=32,
                 mamba_num_groups=2, mamba_state_dim=16, use_distributed_optimizer=True)


@pytest.mark.parametrize("peft", [dict(peft_scheme="lora"), dict(peft_scheme="dora"),
                                  dict(peft_scheme="lora", peft_dropout=0.1)], ids=["lora", "dora", "dropout"])
def test_peft_of_attention_mlp_pairs_is_the_gpt_models(peft):
    # '*-' pairs build one GPT layer's modules each (hybrid_layer_specs.py); Bridge wraps linear_qkv / linear_proj in
    # the '*' layer and linear_fc1 / linear_fc2 in the '-' layer, in the GPT layer's order: every term equal
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    H = resolve(RawConfig(args=dict(PEFT_BASE, hybrid_layer_pattern="*-*-", **peft), world_size=2))
    G = resolve(RawConfig(args=dict(PEFT_BASE, num_layers=2, **peft), world_size=2))
    eh, eg = estimate(H), estimate(G)
    assert eh.critical.breakdown == eg.critical.breakdown
    assert eh.critical.peak_allocated_bytes == eg.critical.peak_allocated_bytes


def test_peft_wildcards_on_a_hybrid_model_are_refused_by_name():
    from megatron_memguard.config import RawConfig
    from megatron_memguard.resolve import resolve
    with pytest.raises(NotModelledError) as e:
        resolve(RawConfig(args=dict(PEFT_BASE, hybrid_layer_pattern="M*M-", peft_scheme="lora",
                                    peft_target_modules=["*.linear_qkv"]), world_size=1))
    assert "'*' target patterns on a hybrid model" in str(e.value)
