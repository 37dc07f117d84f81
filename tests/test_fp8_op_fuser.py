"""FP8 / FP4 under Transformer Engine's operation fuser (--use-transformer-engine-op-fuser, megatron-core 0.19.2
extensions/transformer_engine.py TEFusedMLP: norm, BasicLinear fc1, activation, BasicLinear fc2 ops), by hand from
TE 2.20.2 transformer_engine/pytorch/ops/basic/basic_linear.py (the TE version memguard assumes for core >= 0.17;
the flag exists from 0.18):

* _functional_forward quantizes a BF16 weight afresh every forward (``w = weight_quantizer(w)``; "workspace freshly
  created each forward pass") and keeps it for backward column-wise only (``update_usage(rowwise_usage=False,
  columnwise_usage=True)``): no cached workspace (the TE modules linear_fc1 / linear_fc2 never run forward);
* the input quantized by the op before (the norm: ``next_op_input_quantizer``, both usages set by
  ``pre_fuser_forward``) is kept column-wise, except a Float8 input all-gathered over TP ("FP8 does not support
  all-gather of transpose data"), kept as made: row-wise data and, on Hopper, its transpose;
* ``num_quantizers``: 2 forward (input, weight), 1 backward (grad output) per BasicLinear (a TE module: 3 and 2)."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.errors import ConfigError, NotModelledError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.gpus import lookup_gpu

# a small dense SwiGLU GPT, TP 2 + SP on 8 GPUs: h 512, ffn 1024, seq 1024, micro-batch 4 -> 4096 tokens, 2048 per
# TP rank; fc1 weight [2 x 1024 / 2, 512] = [1024, 512], fc2 [512, 512] per rank
BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --position-embedding-type rope --hidden-dropout 0 "
        "--attention-dropout 0 --swiglu --ffn-hidden-size 1024 --disable-bias-linear --tensor-model-parallel-size 2 "
        "--sequence-parallel").split()
FUSER = ["--use-transformer-engine-op-fuser"]
H100 = lookup_gpu("H100-80GB")
FC1, FC2 = 1024 * 512, 512 * 512   # weight elements per rank
T = 2048                            # tokens of the sequence-parallel shard


def pair(*flags):
    fl = BASE + list(flags)
    return layout_from_flags(fl, world_size=8), layout_from_flags(fl + FUSER, world_size=8)


def terms(L, gpu=H100):
    return {t.name: t.bytes for t in estimate(L, gpu=gpu).stages[0].terms}


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_per_tensor_recipes_by_hand(recipe):
    plain, fused = pair("--fp8-format", "e4m3", "--fp8-recipe", recipe, "--fp8-amax-history-len", "1024")
    sp, sf = layer_activations(plain).saved, layer_activations(fused).saved
    # the weight copies of one micro-batch: Hopper keeps the FP8 transpose (1 B/elem) + a 512-byte scale each
    assert sf["fp8_op_fuser_weights"] == (FC1 + 512) + (FC2 + 512) and "fp8_op_fuser_weights" not in sp
    # fc1's input all-gathered over TP: the TE module keeps the row-wise local shard, the op the shard with its
    # transpose (one scale); fc2's input is column-wise in both
    assert sp["fc1_input"] == T * 512 + 512 and sf["fc1_input"] == 2 * T * 512 + 512
    assert sf["fc2_input"] == sp["fc2_input"]
    tp, tf = terms(plain), terms(fused)
    # no cached workspaces for fc1 / fc2 (row-wise + transpose + scale each) on the 4 layers
    assert tp["fp8_weight_cache"] - tf["fp8_weight_cache"] == 4 * ((2 * FC1 + 512) + (2 * FC2 + 512))
    # recipe state of the two ops on 4 layers; delayed: an fp32 scale [n] and amax history [1024, n] per
    # direction, n = 3 / 2 (module) or 2 / 1 (op), each rounded to 512 B; tensorwise: a scale and an amax per
    # quantizer (5 against 3)
    if recipe == "delayed":
        module = (512 + 12 * 1024) + (512 + 8 * 1024)
        op = (512 + 8 * 1024) + (512 + 4 * 1024)
    else:
        module, op = 5 * 2 * 512, 3 * 2 * 512
    assert tp["fp8_scales"] - tf["fp8_scales"] == 4 * 2 * (module - op)
    # 4 layers, one micro-batch in flight (PP 1)
    per_layer = (FC1 + FC2 + 1024) + T * 512
    assert tf["layer_activations"] - tp["layer_activations"] == 4 * per_layer


def test_blackwell_keeps_one_fp8_copy():
    # non-TN FP8 GEMMs (compute capability 10.x): one FP8 copy serves both usages, no transpose
    from megatron_memguard.estimator.fp8_layers import layer_gemms, op_fuser_saved_input, op_fuser_weight
    from megatron_memguard.partition import model_kind_runs
    _, fused = pair("--fp8-format", "e4m3", "--fp8-recipe", "delayed")
    g = {x.name: x for x in layer_gemms(fused, model_kind_runs(fused)[0][0])}
    assert g["linear_fc1"].op_fused and g["linear_fc2"].op_fused and not g["linear_qkv"].op_fused
    assert op_fuser_weight(fused.fp8_spec, g["linear_fc1"], non_tn=True) == FC1 + 512
    assert op_fuser_saved_input(fused.fp8_spec, g["linear_fc1"], non_tn=True) == T * 512 + 512
    # estimate() hands the GPU in as data (Layout.fp8_gpu): on B200 the 4 layers' fc1 input keeps no transpose
    # [T, 512] (1 B/elem); the weight copies are column-wise only, 1 B/elem on both GPUs
    b200, h100 = terms(fused, lookup_gpu("B200")), terms(fused)
    assert h100["layer_activations"] - b200["layer_activations"] == 4 * T * 512
    assert layer_activations(fused.replace(fp8_gpu="B200")).saved["fc1_input"] == T * 512 + 512


def test_mxfp8_column_wise_copies():
    # MXFP8 column-wise data [rows, cols] (1 B) and E8M0 scales [round4(rows / 32), round128(cols)]
    # (mxfp8_tensor.py get_scale_shape): fc1 [1024, 512]: 32 x 512; fc2 [512, 512]: 16 x 512
    _, fused = pair("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")
    assert layer_activations(fused).saved["fp8_op_fuser_weights"] == (FC1 + 32 * 512) + (FC2 + 16 * 512)
    t = terms(fused, lookup_gpu("B200"))
    plain_t = terms(pair("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")[0], lookup_gpu("B200"))
    # both usages with their scales: [1024, 512] row-wise scales 1024 x 16, column-wise 32 x 512; [512, 512]:
    # 512 x 16 and 16 x 512
    assert plain_t["fp8_weight_cache"] - t["fp8_weight_cache"] == 4 * ((2 * FC1 + 2 * 16384) + (2 * FC2 + 2 * 8192))


def test_primary_fp8_weights_and_recompute_keep_no_copies():
    # --fp8-param-gather: BasicLinear uses the quantized parameter as it is (is_quantized_tensor(w))
    _, fused = pair("--fp8-format", "e4m3", "--fp8-recipe", "delayed", "--fp8-param-gather",
                    "--use-distributed-optimizer")
    assert "fp8_op_fuser_weights" not in layer_activations(fused).saved
    # 'mlp' recompute: the checkpoint keeps the MLP's input only, the ops' copies are made again in the backward
    _, fused = pair("--fp8-format", "e4m3", "--recompute-granularity", "selective", "--recompute-modules", "mlp")
    saved = layer_activations(fused).saved
    assert "fc2_input" not in saved and "fp8_op_fuser_weights" not in saved


def test_moe_experts_under_fp8_keep_megatron_rules():
    # the experts' fused grouped MLP under FP8 is sized (tests/test_fp8_moe_op_fuser.py) where Megatron builds it:
    # TP 2 makes the expert TP 2, which TEGroupedMLP._is_fused_impl_supported refuses (an assert at build time)
    moe = ("--num-experts 4 --moe-router-topk 1 --moe-router-load-balancing-type sinkhorn --moe-grouped-gemm "
           "--moe-token-dispatcher-type alltoall").split()
    with pytest.raises(ConfigError, match="op-fuser.*expert tensor parallel size 1, got 2"):
        layout_from_flags(BASE + FUSER + moe + ["--fp8-format", "hybrid"], world_size=8,
                          env={"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"})
