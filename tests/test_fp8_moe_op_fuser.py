"""The routed experts under Transformer Engine's operation fuser in FP8 / FP4 (--use-transformer-engine-op-fuser with
--moe-grouped-gemm: megatron-core 0.19.2 transformer/moe/experts.py TEGroupedMLP._fused_forward), by hand from
TE 2.20.2 (the TE memguard pairs with core >= 0.17):

* TEGroupedMLP.__init__: under the fused impl FP8 / FP4 pad each expert's tokens to 256 (Fp8Padding(align_size=256));
* ops/fused/grouped_mlp.py fuse_grouped_mlp_ops: MXFP8 with E4M3 gradients and NVFP4 with its Hadamard transform run
  the CuTe-DSL fused kernel (NVTE_CUTEDSL_FUSED_GROUPED_MLP=1, SM 10); its fuser_forward saves fc1's grouped quantized
  input, the BF16 GLU input ``c_tensor`` [Np, 2F], the probs, fc2's grouped quantized input and the weight copies it
  quantized with both usages; MXFP8 drops the inputs' row-wise data ("MXFP8 wgrad only needs columnwise tiles"),
  NVFP4 keeps them whole;
* ops/basic/grouped_linear.py: delayed scaling never takes the grouped-tensor path
  (is_op_fuser_grouped_tensor_path_supported); _fuser_forward_split_quantize keeps each expert's quantized input and
  weight copy column-wise only (update_usage(rowwise_usage=False, columnwise_usage=True)); ops/basic/swiglu.py
  ScaledSwiGLU keeps its BF16 input and the scales.

Byte sizes: MXFP8 one E8M0 byte per 32 elements, padded [round128(rows), round4(cols/32)] row-wise and
[round4(rows/32), round128(cols)] column-wise; NVFP4 half a byte per element, one E4M3 byte per 16, padded
[round128(rows), round4(cols/16)] / [round128(cols), round4(rows/16)], one fp32 amax per usage (512 B allocations);
Hopper Float8 column-wise = the [cols, rows] transpose plus a 4-byte scale-inverse (a 512 B allocation)."""
import pytest

from megatron_memguard import estimate, layout_from_flags
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.partition import model_kind_runs

# a small SwiGLU MoE GPT on 8 GPUs (DP 8, EP 1): h 512, expert ffn 1024, 4 experts, top-1, seq 1024 x mbs 4 = 4096
# tokens, balanced routing: N = 4096 rows, 1024 per expert (a multiple of 256: no padding)
BASE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
        "--micro-batch-size 4 --global-batch-size 32 --bf16 --position-embedding-type rope --hidden-dropout 0 "
        "--attention-dropout 0 --swiglu --ffn-hidden-size 1024 --disable-bias-linear --num-experts 4 "
        "--moe-router-topk 1 --moe-router-load-balancing-type sinkhorn --moe-grouped-gemm "
        "--moe-token-dispatcher-type alltoall").split()
FUSER = ["--use-transformer-engine-op-fuser"]
CUTEDSL = {"NVTE_CUTEDSL_FUSED_GROUPED_MLP": "1"}
MXFP8 = ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"]
DELAYED = ["--fp8-format", "hybrid"]
NVFP4 = ["--fp4-format", "e2m1"]
PROBS = 4096 * 2          # the probs [N] in bf16 (no --moe-router-dtype)
GLU_IN = 4096 * 2048 * 2  # the GLU's BF16 input [N, 2F]


def layout(*flags):
    return layout_from_flags(BASE + list(flags), world_size=8, env=CUTEDSL)


def moe_saved(L):
    kind = next(k for k, _ in model_kind_runs(L) if "moe" in str(k).lower())
    return layer_activations(L, kind=kind).saved


def mx_col(rows, cols):
    return rows * cols + -(-rows // 32 // 4) * 4 * -(-cols // 128) * 128


def mx_row(rows, cols):
    return rows * cols + -(-rows // 128) * 128 * -(-(cols // 32) // 4) * 4


def test_mxfp8_fused_kernel_by_hand():
    s = moe_saved(layout(*MXFP8, *FUSER))
    # fc1's input [1024, 512] per expert, column-wise: data 524288 + scales [32, 512]
    assert mx_col(1024, 512) == 524288 + 16384
    assert s["moe_expert_input"] == 4 * mx_col(1024, 512) + PROBS
    # the GLU input stays BF16 (c_dtype bfloat16); fc2's input [1024, 1024] per expert column-wise
    assert s["moe_expert_activations"] == GLU_IN + 4 * mx_col(1024, 1024)
    # the weight copies, both usages: fc1 [2048, 512], fc2 [512, 1024] per expert
    w = 4 * (mx_row(2048, 512) + mx_col(2048, 512) + mx_row(512, 1024) + mx_col(512, 1024))
    assert w == 4 * (2 * (1048576 + 32768) + 2 * (524288 + 16384))
    assert s["fp8_op_fuser_weights"] == w


def test_mxfp8_fused_experts_cache_no_workspace():
    # without the fuser each expert's TE GroupedLinear caches both usages of its weights (TE _fp8_workspaces);
    # the ops never run those modules: the 4 layers' expert caches go from fp8_weight_cache
    b200 = lookup_gpu("B200")
    plain, fused = (({t.name: t.bytes for t in estimate(layout(*MXFP8, *f), gpu=b200).stages[0].terms})
                    for f in ([], FUSER))
    per_layer = 4 * (mx_row(2048, 512) + mx_col(2048, 512) + mx_row(512, 1024) + mx_col(512, 1024))
    assert plain["fp8_weight_cache"] - fused["fp8_weight_cache"] == 4 * per_layer


def test_delayed_split_quantize_by_hand():
    s = moe_saved(layout(*DELAYED, *FUSER))
    # Hopper: the column-wise copy of a Float8 tensor is its transpose, 1 byte per element + a 4-byte scale (512 B)
    assert s["moe_expert_input"] == 4 * (1024 * 512 + 512) + PROBS
    assert s["moe_expert_activations"] == GLU_IN + 4 * (1024 * 1024 + 512)
    assert s["fp8_op_fuser_weights"] == 4 * (2048 * 512 + 512) + 4 * (512 * 1024 + 512)


def test_nvfp4_fused_kernel_keeps_whole_inputs():
    s = moe_saved(layout(*NVFP4, *FUSER))

    def nv_both(rows, cols):
        row = rows * cols // 2 + -(-rows // 128) * 128 * -(-(cols // 16) // 4) * 4
        col = rows * cols // 2 + -(-cols // 128) * 128 * -(-(rows // 16) // 4) * 4
        return row + col + 2 * 512      # two fp32 amax, 512 B allocations each

    assert nv_both(1024, 512) == 2 * (262144 + 32768) + 1024
    assert s["moe_expert_input"] == 4 * nv_both(1024, 512) + PROBS
    assert s["moe_expert_activations"] == GLU_IN + 4 * nv_both(1024, 1024)


def test_padding_to_256_per_expert():
    # 8 experts, micro-batch 1: 1024 rows, 128 per expert, each padded to 256 (Fp8Padding(align_size=256)):
    # the GLU input is [2048, 2048] bf16 and fc2's input 8 x [256, 1024]
    flags = list(BASE)
    flags[flags.index("--num-experts") + 1] = "8"
    flags[flags.index("--micro-batch-size") + 1] = "1"
    L = layout_from_flags(flags + MXFP8 + FUSER, world_size=8, env=CUTEDSL)
    s = moe_saved(L)
    assert s["moe_expert_activations"] == 2048 * 2048 * 2 + 8 * mx_col(256, 1024)
    assert s["moe_expert_input"] == 8 * mx_col(256, 512) + 2048 * 2


def test_primary_weights_make_no_copies():
    # --fp8-param-gather: the weights are quantized tensors, used as they are (is_quantized_tensor)
    s = moe_saved(layout(*MXFP8, "--fp8-param-gather", "--use-distributed-optimizer", *FUSER))
    assert "fp8_op_fuser_weights" not in s


TENSORWISE = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
BLOCKWISE = ["--fp8-format", "e4m3", "--fp8-recipe", "blockwise"]
MXFP8_HYBRID = ["--fp8-format", "hybrid", "--fp8-recipe", "mxfp8"]


def fuser_note(L):
    return next(n for n in L.notes if n.startswith("--use-transformer-engine-op-fuser: the experts' GroupedLinear"))


def test_tensorwise_grouped_tensor_path_by_hand():
    # TE 2.20.2 is_op_fuser_grouped_tensor_path_supported: tensorwise takes the grouped-tensor path on Hopper with
    # cuBLASLt >= 13.5 (Blackwell >= 13.3); _fuser_forward_grouped_tensor keeps the inputs column-wise (rowwise_data
    # = None: the Hopper transpose + a 4-byte scale-inverse, 512 B) and the weight copies with both usages (data and
    # transpose, one scale-inverse)
    L = layout(*TENSORWISE, *FUSER)
    s = moe_saved(L)
    assert s["moe_expert_input"] == 4 * (1024 * 512 + 512) + PROBS
    assert s["moe_expert_activations"] == GLU_IN + 4 * (1024 * 1024 + 512)
    assert s["fp8_op_fuser_weights"] == 4 * (2 * 2048 * 512 + 512) + 4 * (2 * 512 * 1024 + 512)
    # the split-quantize path (older cuBLASLt, Ada) keeps the transposes only: the row-wise data less
    note = fuser_note(L)
    assert "grouped-tensor path" in note and "cuBLASLt >= 13.5" in note
    assert f"{4 * (2048 * 512 + 512 * 1024):,} B) less" in note


def test_blockwise_grouped_tensor_path_by_hand():
    # blockwise (Hopper with cuBLASLt >= 13.6): inputs column-wise with 1x128 fp32 scales, [ceil(rows/128),
    # round4(cols)]; weights both usages with 128x128 block scales ([ceil(rows/128), round4(ceil(cols/128))] row-wise,
    # transposed column-wise), each scale tensor under 512 B
    s = moe_saved(layout(*BLOCKWISE, *FUSER))
    assert s["moe_expert_input"] == 4 * (1024 * 512 + 8 * 512 * 4) + PROBS
    assert s["moe_expert_activations"] == GLU_IN + 4 * (1024 * 1024 + 8 * 1024 * 4)
    assert s["fp8_op_fuser_weights"] == 4 * (2 * 2048 * 512 + 2 * 512 + 2 * 512 * 1024 + 2 * 512)
    assert "only on Hopper with cuBLASLt >= 13.6" in fuser_note(layout(*BLOCKWISE, *FUSER))


def _term_bytes(est, name):
    return next(t for t in est.stages[0].terms if t.name == name).bytes


def test_blockwise_on_blackwell_takes_the_split_quantize_path():
    # TE 2.20.2 ops/basic/grouped_linear.py is_op_fuser_grouped_tensor_path_supported (lines 121-123):
    # float8_block_scaling -> device_capability < (10, 0) and cublaslt_version >= 130600: on B200 / GB200 (SM 10.0) the
    # GPU alone rules the grouped-tensor path out, and _fuser_forward_split_quantize (line 1286) keeps each weight
    # copy column-wise only: 128x128 block scales, [cols, rows] data; the inputs are the same column-wise copies
    from megatron_memguard.estimator.fp8_layers import fused_experts_gpu_path
    L = layout(*BLOCKWISE, *FUSER)
    assert fused_experts_gpu_path(L, "H100-80GB") is None      # Hopper: the cuBLASLt version decides (not seen)
    for gpu in ("B200", "GB200"):
        assert "split-quantize path" in fused_experts_gpu_path(L, gpu)
    split = moe_saved(L.replace(fp8_gpu="B200"))
    grouped = moe_saved(L)
    # per expert: fc1 [2048, 512] column-wise 2048 x 512 B + scales [ceil(512/128), round4(ceil(2048/128))] fp32 = 4 x 16
    # x 4 B (one 512 B allocation); fc2 [512, 1024] 512 x 1024 B + [8, 4] x 4 B (512 B)
    assert split["fp8_op_fuser_weights"] == 4 * (2048 * 512 + 512 + 512 * 1024 + 512)
    assert grouped["fp8_op_fuser_weights"] - split["fp8_op_fuser_weights"] == 4 * (2048 * 512 + 512 + 512 * 1024 + 512)
    assert split["moe_expert_input"] == grouped["moe_expert_input"]
    assert split["moe_expert_activations"] == grouped["moe_expert_activations"]
    # estimate() hands the GPU in as data: on B200 the layer keeps 4 x 1.5 MiB (+ scales) less per micro-batch than
    # without a GPU or on an H100, and says why
    b200 = estimate(L, gpu=lookup_gpu("B200"))
    h100 = estimate(L, gpu=lookup_gpu("H100-80GB"))
    free = estimate(L)
    assert any("split-quantize path on Blackwell" in n for n in b200.notes)
    assert not any("split-quantize path on Blackwell" in n for n in h100.notes + free.notes)
    acts = {k: _term_bytes(e, "layer_activations") for k, e in (("b200", b200), ("h100", h100), ("free", free))}
    assert acts["h100"] == acts["free"] > acts["b200"]
    # tensorwise: the cuBLASLt version decides on both Hopper and Blackwell (the grouped-tensor path stays sized);
    # on Blackwell one Float8 copy serves both usages (is_non_tn_fp8_gemm_supported), so the weight copies are the
    # FP8 data + a scale-inverse per expert linear, not data + transpose as on Hopper
    T_ = layout(*TENSORWISE, *FUSER)
    assert fused_experts_gpu_path(T_, "B200") is None
    assert moe_saved(T_.replace(fp8_gpu="B200"))["fp8_op_fuser_weights"] == 4 * (2048 * 512 + 512) + 4 * (512 * 1024 + 512)
    assert fused_experts_gpu_path(layout(*MXFP8_HYBRID, *FUSER), "B200") is None
    # pre-Hopper: no FP8 at all (TE check_fp8_support: compute capability 8.9)
    from megatron_memguard.errors import ConfigError
    with pytest.raises(ConfigError, match="A100.*cannot run FP8"):
        estimate(L, gpu=lookup_gpu("A100-80GB"))


def test_mxfp8_hybrid_sized_as_the_grouped_tensor_path():
    # E5M2 gradients: fuse_grouped_mlp_ops declines the CuTe-DSL kernel; the unfused GroupedLinear ops' grouped-tensor
    # path (Blackwell, cuBLASLt >= 13.3) keeps what the fused kernel keeps: inputs column-wise, weights both usages,
    # the GLU's BF16 input (ScaledSwiGLU)
    s = moe_saved(layout(*MXFP8_HYBRID, *FUSER))
    assert s["moe_expert_input"] == 4 * mx_col(1024, 512) + PROBS
    assert s["moe_expert_activations"] == GLU_IN + 4 * mx_col(1024, 1024)
    assert s["fp8_op_fuser_weights"] == 4 * (mx_row(2048, 512) + mx_col(2048, 512) + mx_row(512, 1024)
                                             + mx_col(512, 1024))
    # the split-quantize path drops the row-wise data and E8M0 scales of the copies
    assert f"{4 * (mx_row(2048, 512) + mx_row(512, 1024)):,} B) less" in fuser_note(layout(*MXFP8_HYBRID, *FUSER))


def test_delayed_single_grouped_weight_is_an_error():
    # megatron-core 0.19.2 TransformerConfig.__post_init__ stops any FP8 recipe but mxfp8 with single grouped weights
    # (before TE 2.20.2's GroupedLinear.fuser_forward would: delayed scaling never takes the grouped-tensor path,
    # is_op_fuser_grouped_tensor_path_supported)
    from megatron_memguard.errors import ConfigError, ConfigErrors
    with pytest.raises((ConfigError, ConfigErrors)) as e:
        layout(*DELAYED, "--moe-single-grouped-weight", *FUSER)
    assert "--moe-single-grouped-weight" in str(e.value) and "delayed" in str(e.value)


def test_weight_cache_detail_counts_only_cached_weights():
    # the detail names the elements TE modules cache: 4 layers' linear_qkv [3 x 512, 512] and linear_proj [512, 512]
    # (the experts' GroupedLinear ops cache none)
    t = next(t for t in estimate(layout(*MXFP8, *FUSER), gpu=lookup_gpu("B200")).stages[0].terms
             if t.name == "fp8_weight_cache")
    assert f"{4 * (1536 * 512 + 512 * 512):,} GEMM weight elements" in t.detail
