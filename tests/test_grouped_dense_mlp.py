"""--use-grouped-gemm-for-dense-mlp under --use-transformer-engine-op-fuser: a dense model's MLP is
TEFusedMLPWithGroupedLinear (megatron-core 0.19.2 models/gpt/gpt_layer_specs.py get_mlp_module_spec_for_backend,
extensions/transformer_engine.py). Its __init__ raises ValueError without a bias-free SwiGLU; with TP > 1 its
_make_fused_impl and forward return TEFusedMLP's (``super()._make_fused_impl()`` / ``super().forward``), so the
estimate is the op fuser's alone. With TP 1 it runs the norm op in BF16, then GroupedLinear(1) -> ScaledSwiGLU ->
GroupedLinear(1) under its own MXFP8BlockScaling() autocast; with NVTE_CUTEDSL_FUSED_GROUPED_MLP=1 TE 2.20.2 fuses
them into the CuTe-DSL kernel (ops/fused/grouped_mlp.py fuser_forward), which keeps fc1's and fc2's inputs
column-wise (MXFP8), the BF16 GLU input, the scales (torch.ones(tokens) in bf16) and its weight copies with both
usages (no update_usage on them). Sized for an MXFP8 (E4M3) model; refused by name elsewhere."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, ConfigErrors, NotModelledError
from megatron_memguard.gpus import lookup_gpu

BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --position-embedding-type rope --hidden-dropout 0 "
        "--attention-dropout 0 --swiglu --ffn-hidden-size 1024 --disable-bias-linear").split()
FUSER = ["--use-transformer-engine-op-fuser"]
GROUPED = ["--use-grouped-gemm-for-dense-mlp"]
TP2 = "--tensor-model-parallel-size 2 --sequence-parallel".split()


def terms(flags):
    L = layout_from_flags(BASE + flags, world_size=8)
    return L, {t.name: t.bytes for t in estimate(L, gpu=lookup_gpu("H100-80GB")).stages[0].terms}


@pytest.mark.parametrize("precision", [[], ["--fp8-format", "hybrid"]])
def test_tp2_runs_tefusedmlp(precision):
    L, grouped = terms(FUSER + GROUPED + TP2 + precision)
    _, fused = terms(FUSER + TP2 + precision)
    _, plain = terms(TP2 + precision)
    assert grouped == fused
    if precision:
        # under FP8 TEFusedMLP's BasicLinear ops keep per-micro-batch weight copies, not cached workspaces
        assert grouped["fp8_weight_cache"] < plain["fp8_weight_cache"]
    assert any("TEFusedMLP's path" in n for n in L.notes)


MXFP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]
CUTEDSL = {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}


def mx_both(rows, cols):
    # MXFP8 row-wise data + E8M0 scales [round128(rows), round4(cols/32)], column-wise data + [round4(rows/32),
    # round128(cols)]
    return (2 * rows * cols + -(-rows // 128) * 128 * -(-(cols // 32) // 4) * 4
            + -(-(rows // 32) // 4) * 4 * -(-cols // 128) * 128)


def test_tp1_mxfp8_fused_kernel_by_hand():
    from megatron_memguard.estimator.activations import layer_activations
    L = layout_from_flags(BASE + MXFP8 + FUSER + GROUPED, world_size=8, env=CUTEDSL)
    plain = layout_from_flags(BASE + MXFP8 + FUSER, world_size=8, env=CUTEDSL)
    assert L.grouped_dense_mlp and not plain.grouped_dense_mlp
    s, p = layer_activations(L).saved, layer_activations(plain).saved
    # 4096 tokens at TP 1; fc1 weight [2048, 512], fc2 [512, 1024]: both usages (TEFusedMLP: column-wise only)
    assert s["fp8_op_fuser_weights"] == mx_both(2048, 512) + mx_both(512, 1024) == 2 * (1048576 + 32768) + 2 * (
        524288 + 16384)
    assert p["fp8_op_fuser_weights"] == 1048576 + 32768 + 524288 + 16384
    assert s["dense_mlp_scales"] == 4096 * 2 and "dense_mlp_scales" not in p
    # the inputs and the GLU input are TEFusedMLP's: fc1 [4096, 512] and fc2 [4096, 1024] column-wise, [4096, 2048] bf16
    for k in ("fc1_input", "fc1_output", "fc2_input"):
        assert s[k] == p[k]
    assert s["fc1_output"] == 4096 * 2048 * 2


@pytest.mark.parametrize("flags, env, words", [
    ([], CUTEDSL, "another precision"),                                           # BF16 model
    (["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"], CUTEDSL, "another precision"),
    (MXFP8, {}, "NVTE_CUTEDSL_FUSED_GROUPED_MLP=1"),
    (MXFP8, {**CUTEDSL, "FP4_RECIPE": "nvfp4"}, "FP4_RECIPE=nvfp4"),
    (MXFP8 + ["--first-last-layers-bf16"], CUTEDSL, "--first-last-layers-bf16"),
])
def test_tp1_refused_by_name(flags, env, words):
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(BASE + flags + FUSER + GROUPED, world_size=8, env=env)
    assert "--use-grouped-gemm-for-dense-mlp" in str(e.value) and "tensor-parallel size 1" in str(e.value)
    assert words in str(e.value)


def test_tp1_tokens_multiple_of_128():
    # TE 2.20.2 fused grouped MLP fuser_forward: ValueError unless the rows (1000 x 1 here) are a multiple of 128
    flags = [f if f != "1024" else "1000" for f in BASE]
    flags[flags.index("--micro-batch-size") + 1] = "1"
    flags[flags.index("--global-batch-size") + 1] = "8"
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags(flags + MXFP8 + FUSER + GROUPED, world_size=8, env=CUTEDSL)
    assert "--use-grouped-gemm-for-dense-mlp" in str(e.value) and "multiple of 128" in str(e.value)


@pytest.mark.parametrize("drop, words", [("--disable-bias-linear", "--disable-bias-linear"), ("--swiglu", "SwiGLU")])
def test_megatron_rules(drop, words):
    # TEFusedMLPWithGroupedLinear.__init__ (0.19.2): ValueError with add_bias_linear or without SwiGLU
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags([f for f in BASE if f != drop] + FUSER + GROUPED + TP2, world_size=8)
    assert "--use-grouped-gemm-for-dense-mlp" in str(e.value) and words in str(e.value)
