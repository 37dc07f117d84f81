"""--use-grouped-gemm-for-dense-mlp under --use-transformer-engine-op-fuser: a dense model's MLP is
TEFusedMLPWithGroupedLinear (megatron-core 0.19.2 models/gpt/gpt_layer_specs.py get_mlp_module_spec_for_backend,
extensions/transformer_engine.py). Its __init__ raises ValueError without a bias-free SwiGLU; with TP > 1 its
_make_fused_impl and forward return TEFusedMLP's (``super()._make_fused_impl()`` / ``super().forward``), so the
estimate is the op fuser's alone; with TP 1 it runs the MLP under its own MXFP8 autocast: refused by name."""
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


def test_tp1_refused_by_name():
    with pytest.raises(NotModelledError) as e:
        layout_from_flags(BASE + FUSER + GROUPED, world_size=8)
    assert "--use-grouped-gemm-for-dense-mlp" in str(e.value) and "tensor-parallel size 1" in str(e.value)


@pytest.mark.parametrize("drop, words", [("--disable-bias-linear", "--disable-bias-linear"), ("--swiglu", "SwiGLU")])
def test_megatron_rules(drop, words):
    # TEFusedMLPWithGroupedLinear.__init__ (0.19.2): ValueError with add_bias_linear or without SwiGLU
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout_from_flags([f for f in BASE if f != drop] + FUSER + GROUPED + TP2, world_size=8)
    assert "--use-grouped-gemm-for-dense-mlp" in str(e.value) and words in str(e.value)
