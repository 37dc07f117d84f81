"""FP8 / FP4 bytes per tensor, hand-computed from Transformer Engine 2.11's storage code and Megatron's
FP8 rules. Each test names the source line its numbers follow (TE paths relative to
transformer_engine/pytorch, Megatron paths to megatron/core)."""
import pytest

from megatron_memguard.estimator.fp8 import (
    Fp8Spec, element_bytes, moe_align_size, param_buffer_bytes_per_element, primary_weight,
    quantized_tensor, recipe_state_bytes, saved_input, uncached_weight_copies, weight_workspace,
)

# Llama-3.1-8B fc1 weight on TP 1 with SwiGLU: [2 x 14336, 4096] (HF config: intermediate 14336, hidden 4096)
ROWS, COLS = 2 * 14336, 4096
N = ROWS * COLS


def spec(recipe, **kw):
    if recipe == "nvfp4":
        return Fp8Spec.from_flat(fp4="e2m1", **kw)
    return Fp8Spec.from_flat(fp8="hybrid", fp8_recipe=recipe, **kw)


def test_spec_from_flat_megatron_names_and_defaults():
    s = Fp8Spec.from_flat({"fp8": "e4m3", "fp8_recipe": "tensorwise", "fp8_param": True, "lr": 3e-4,
                           "fp8_amax_history_len": None})
    assert s.fp8 == "e4m3" and s.recipe == "tensorwise" and s.fp8_param_gather
    # Megatron's --fp8-amax-history-len default is 1 (arguments.py), not TE's DelayedScaling default 1024
    assert s.fp8_amax_history_len == 1
    assert Fp8Spec.from_flat(fp8=None).recipe is None and not Fp8Spec().enabled
    assert Fp8Spec.from_flat(fp4="e2m1", fp4_param=True).primary_weights_quantized
    # --fp4-param-gather without --fp4-format quantizes nothing
    assert not Fp8Spec.from_flat(fp4_param_gather=True).primary_weights_quantized


def test_first_last_layers_bf16_uses_global_layer_index():
    # fp8_utils.is_first_last_bf16_layer: layer_no < start or layer_no >= num_layers - end
    s = spec("tensorwise", first_last_layers_bf16=True, num_layers_at_start_in_bf16=2,
             num_layers_at_end_in_bf16=1)
    assert [s.layer_quantized(i, 8) for i in range(8)] == [False, False] + [True] * 5 + [False]
    # PP 2 of 8 layers: stage 0 holds layers 0-3 (2 in FP8), stage 1 layers 4-7 (3 in FP8)
    assert s.quantized_layers(0, 4, 8) == 2 and s.quantized_layers(4, 4, 8) == 3
    # without the flag every layer is quantized; FP8 off: none
    assert spec("tensorwise").quantized_layers(0, 8, 8) == 8
    assert Fp8Spec().quantized_layers(0, 8, 8) == 0


def test_float8_workspace_hopper_keeps_transpose_blackwell_does_not():
    # tensor/float8_tensor.py make_empty: uint8 data [M, K] + transpose [K, M] + fp32 scale_inv [1];
    # storage/float8_tensor_storage.py update_usage: on non-TN GPUs (Blackwell) the transpose is dropped
    for r in ("delayed", "tensorwise"):
        hop = weight_workspace(spec(r), ROWS, COLS)
        assert hop.data == (N, N) and hop.scales == (4,)
        assert hop.allocated == 2 * N + 512
        bw = weight_workspace(spec(r), ROWS, COLS, non_tn=True)
        assert bw.data == (N,) and bw.allocated == N + 512


def test_blockwise_weight_workspace_128x128_scales():
    # float8_blockwise_tensor.py get_scale_shape, block_scaling_dim 2 (Float8BlockScaling.w_block_scaling_dim):
    # rowwise (ceil(M/128), round4(ceil(K/128))) = (224, 32); columnwise (ceil(K/128), round4(ceil(M/128))) = (32, 224)
    q = weight_workspace(spec("blockwise"), ROWS, COLS)
    assert q.data == (N, N)
    assert q.scales == (224 * 32 * 4, 32 * 224 * 4)
    # a shape whose block count is not a multiple of 4: [1000, 300] -> rowwise (8, round4(3)=4), columnwise (3, 8)
    q = weight_workspace(spec("blockwise"), 1000, 300)
    assert q.scales == (8 * 4 * 4, 3 * 8 * 4)


def test_mxfp8_weight_workspace_e8m0_scales():
    # mxfp8_tensor.py make_empty: rowwise scale [round128(M), round4(K/32)], columnwise [round4(M/32), round128(K)], uint8
    q = weight_workspace(spec("mxfp8"), ROWS, COLS)
    assert q.data == (N, N)
    assert q.scales == (28672 * 128, 896 * 4096)
    # 2 + 2/32 bytes per element when no padding applies
    assert q.total == 2 * N + 2 * N // 32
    # padding: [64, 96] -> rowwise [128, round4(3)=4], columnwise [round4(2)=4, 128]
    assert weight_workspace(spec("mxfp8"), 64, 96).scales == (128 * 4, 4 * 128)


def test_nvfp4_weight_workspace_packed():
    # nvfp4_tensor.py make_empty: packed uint8 [M, K/2] per usage, E4M3 scales
    # [round128(M), round4(ceil(K/16))] and [round128(K), round4(ceil(M/16))], one fp32 amax per usage
    q = weight_workspace(spec("nvfp4"), ROWS, COLS)
    assert q.data == (N // 2, N // 2)
    assert q.scales == (28672 * 256, 4, 4096 * 1792, 4)
    assert q.allocated == N + 28672 * 256 + 4096 * 1792 + 2 * 512


def test_no_workspace_for_primary_quantized_weights_or_without_cache():
    # base.py get_weight_workspace returns a QuantizedTensor weight as it is; linear.py passes
    # cache_name=None when is_first_microbatch is None (Megatron: disable_parameter_transpose_cache)
    assert weight_workspace(spec("tensorwise", fp8_param_gather=True), ROWS, COLS).allocated == 0
    nocache = spec("tensorwise", disable_parameter_transpose_cache=True)
    assert weight_workspace(nocache, ROWS, COLS).allocated == 0
    assert uncached_weight_copies(nocache, ROWS, COLS).allocated == 2 * N + 512
    assert uncached_weight_copies(spec("tensorwise"), ROWS, COLS).allocated == 0
    assert weight_workspace(Fp8Spec(), ROWS, COLS).allocated == 0


def test_primary_fp8_weight_bytes_per_recipe():
    # distributed/param_and_grad_buffer.py: uint8 param buffer, modify_underlying_storage points the
    # rowwise data at it; TE keeps the transpose (Hopper) / columnwise copy and the scales.
    hop = primary_weight(spec("tensorwise", fp8_param_gather=True), ROWS, COLS)
    assert (hop.buffer, hop.te_storage) == (N, N + 512)          # 1 + 1 byte / param (moe-fp8.md 2.4 table)
    bw = primary_weight(spec("tensorwise", fp8_param_gather=True), ROWS, COLS, non_tn=True)
    assert (bw.buffer, bw.te_storage) == (N, 512)                # Blackwell: the buffer is all
    blk = primary_weight(spec("blockwise", fp8_param_gather=True), ROWS, COLS)
    assert (blk.buffer, blk.te_storage) == (N, N + 2 * 224 * 32 * 4)
    # MXFP8: the grad buffer doubles as the all-gather buffer (shared_buffer); all TE storage is extra
    mx = primary_weight(spec("mxfp8", fp8_param_gather=True), ROWS, COLS)
    assert mx.buffer == 0 and mx.te_storage == 2 * N + 28672 * 128 + 896 * 4096
    fp4 = primary_weight(spec("nvfp4", fp4_param_gather=True), ROWS, COLS)
    assert fp4.buffer == N // 2 and fp4.te_storage == N // 2 + 28672 * 256 + 4096 * 1792 + 2 * 512
    assert [param_buffer_bytes_per_element(spec(r, fp8_param_gather=True, fp4_param_gather=True))
            for r in ("tensorwise", "blockwise", "mxfp8", "nvfp4")] == [1.0, 1.0, 0.0, 0.5]
    assert primary_weight(spec("tensorwise"), ROWS, COLS).total == 0
    with pytest.raises(ValueError):
        param_buffer_bytes_per_element(spec("tensorwise"))


def test_recipe_state_bytes():
    # quantization.py DelayedScalingRecipeState: fp32 scale [n] + fp32 amax_history [len, n] per direction,
    # n = 3 GEMM tensors forward, 2 backward (base.py set_meta_tensor); 512-byte allocator blocks
    assert recipe_state_bytes(spec("delayed"), 1) == 4 * 512
    # history 1024 (Bridge's delayed preset): 12 KiB forward, 8 KiB backward histories
    assert recipe_state_bytes(spec("delayed", fp8_amax_history_len=1024), 1) == 512 + 12288 + 512 + 8192
    # a grouped linear of 8 experts: n = 24 and 16 -> 4 * 24 * 1024 + 4 * 16 * 1024 + two scale blocks
    assert recipe_state_bytes(spec("delayed", fp8_amax_history_len=1024), 8) == 98304 + 65536 + 2 * 512
    # Float8CurrentScalingQuantizer: fp32 scale [1] and amax [1] each, 5 quantizers per GEMM
    assert recipe_state_bytes(spec("tensorwise"), 1) == 10 * 512
    for r in ("blockwise", "mxfp8", "nvfp4"):
        assert recipe_state_bytes(spec(r), 4) == 0


def test_saved_gemm_inputs_per_recipe():
    T, h = 4096, 4096   # seq 4096, micro-batch 1, TP 1
    # layernorm_linear.py: Float8 with SP all-gather keeps the rowwise local shard; otherwise columnwise only
    assert saved_input(spec("tensorwise"), T, h, sp_gathered=True).data == (T * h,)
    assert saved_input(spec("tensorwise"), T, h).data == (T * h,)        # Hopper: the transpose only
    assert saved_input(spec("delayed"), T, h, non_tn=True).data == (T * h,)
    # blockwise input: 1x128 scales, columnwise (ceil(M/128), round4(K)) fp32; compact when gathered
    assert saved_input(spec("blockwise"), T, h).scales == (32 * 4096 * 4,)
    assert saved_input(spec("blockwise"), 100, 510, sp_gathered=True).scales == (1 * 510 * 4,)
    assert saved_input(spec("blockwise"), 100, 510).scales == (1 * 512 * 4,)
    # mxfp8 columnwise: [round4(M/32), round128(K)] E8M0
    assert saved_input(spec("mxfp8"), T, h).total == T * h + 128 * 4096
    # nvfp4 columnwise: packed half byte + [round128(K), round4(ceil(M/16))] + fp32 amax
    assert saved_input(spec("nvfp4"), T, h).total == T * h // 2 + 4096 * 256 + 4
    # nominal bytes per element agree with the exact ones on unpadded shapes
    for r in ("tensorwise", "blockwise", "mxfp8", "nvfp4"):
        q = saved_input(spec(r), T, h)
        assert q.total == pytest.approx(element_bytes(r) * T * h, abs=8)
    with pytest.raises(ValueError):
        saved_input(Fp8Spec(), T, h)


def test_moe_alignment():
    # fp8_utils.get_fp8_align_size (32 for mxfp8, else 16), fp4_utils.get_fp4_align_size (128)
    assert [moe_align_size(spec(r)) for r in ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")] == \
        [16, 16, 16, 32, 128]
    assert moe_align_size(Fp8Spec()) == 0


def test_dense_layer_terms_llama3_8b_tp2_sp():
    # Llama-3.1-8B shape (HF config): h 4096, ffn 14336, 32 heads, 8 KV heads, head dim 128, SwiGLU;
    # TP 2 with sequence parallelism, seq 8192, micro-batch 1
    from megatron_memguard.estimator.fp8_layers import (
        dense_layer_gemms, layer_recipe_state_bytes, primary_weight_extra_bytes, saved_inputs, weight_cache_bytes)
    g = dense_layer_gemms(hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32, num_query_groups=8,
                          kv_channels=128, gated_linear_unit=True, tensor_model_parallel_size=2,
                          sequence_parallel=True, seq_length=8192, micro_batch_size=1)
    shapes = {x.name: (x.rows, x.cols, x.tokens, x.sp_gathered) for x in g}
    assert shapes == {"linear_qkv": (3072, 4096, 4096, True), "linear_proj": (4096, 2048, 8192, False),
                      "linear_fc1": (14336, 4096, 4096, True), "linear_fc2": (4096, 7168, 8192, False)}
    weights = 3072 * 4096 + 4096 * 2048 + 14336 * 4096 + 4096 * 7168     # 109,051,904 per rank
    s = spec("tensorwise")
    # Hopper: data + transpose + one 512-byte scale block per weight
    assert weight_cache_bytes(s, g) == 2 * weights + 4 * 512
    assert weight_cache_bytes(s, g, non_tn=True) == weights + 4 * 512
    # tensorwise recipe state: 10 one-element tensors per GEMM, 4 modules
    assert layer_recipe_state_bytes(s, g) == 4 * 10 * 512
    # primary FP8 weights: only the Hopper transposes (+ scale) stay outside the uint8 buffer
    assert primary_weight_extra_bytes(spec("tensorwise", fp8_param_gather=True), g) == weights + 4 * 512
    # saved inputs: local SP shard rowwise for qkv / fc1 (4096 x 4096), full columnwise for fc2; linear_proj
    # keeps the BF16 attention output, no quantized copy (set_save_original_input: attention.py, core 0.16.1 and
    # 0.19.2, for every recipe but delayed)
    got = saved_inputs(s, g)
    assert got == {"linear_qkv": 4096 * 4096 + 512, "linear_proj": 0,
                   "linear_fc1": 4096 * 4096 + 512, "linear_fc2": 8192 * 7168 + 512}
    # delayed scaling: linear_proj's quantized copy, [8192, 2048] at 1 B/elem = 16 MiB + a 512-byte scale block
    assert saved_inputs(spec("delayed"), g)["linear_proj"] == 16 * 2**20 + 512
    for r in ("blockwise", "mxfp8", "nvfp4"):
        assert saved_inputs(spec(r), g)["linear_proj"] == 0


def test_linear_proj_saves_original_input_except_delayed():
    # megatron/core/transformer/attention.py and multi_latent_attention.py (core 0.16.1 and 0.19.2):
    # set_save_original_input(self.linear_proj) if (fp8 and fp8_recipe != 'delayed' and TE >= 2.6) or
    # (fp4 and TE >= 2.7); TE 2.11 (the modelled version) passes both gates
    from megatron_memguard.estimator.fp8_layers import proj_saves_original_input
    assert [proj_saves_original_input(spec(r)) for r in ("delayed", "tensorwise", "blockwise", "mxfp8", "nvfp4")] \
        == [False, True, True, True, True]
    assert not proj_saves_original_input(Fp8Spec())


def test_linear_proj_requantizes_its_input_in_backward():
    # TE 2.11 module/linear.py _Linear.backward: the saved BF16 input is quantized for the wgrad GEMM; per-tensor
    # current scaling (supports_only_rowwise_all_gather, float8_tensor.py) asks for rowwise + columnwise (no
    # gather in a row-parallel linear), the block recipes columnwise only. Llama-3.1-8B TP2: [8192, 2048]
    from megatron_memguard.estimator.fp8_layers import proj_backward_input
    T, w = 8192, 2048
    assert proj_backward_input(spec("tensorwise"), T, w) == 2 * T * w + 512              # Hopper: data + transpose
    assert proj_backward_input(spec("tensorwise"), T, w, non_tn=True) == T * w + 512     # Blackwell: one copy
    # mxfp8 columnwise: data + E8M0 [round4(8192/32), round128(2048)] = [256, 2048]
    assert proj_backward_input(spec("mxfp8"), T, w) == T * w + 256 * 2048
    # blockwise columnwise 1x128: data + fp32 [ceil(8192/128), round4(2048)] = [64, 2048]
    assert proj_backward_input(spec("blockwise"), T, w) == T * w + 64 * 2048 * 4
    # nvfp4 columnwise: half byte + E4M3 [round128(2048), round4(8192/16)] = [2048, 512] + fp32 amax (one block)
    assert proj_backward_input(spec("nvfp4"), T, w) == T * w // 2 + 2048 * 512 + 512


def test_non_tn_gpus():
    from megatron_memguard.estimator.fp8 import non_tn_gpu
    # utils.is_non_tn_fp8_gemm_supported: compute capability 10.0 <= cc < 12.0 or >= 13.0
    assert non_tn_gpu("B200") and non_tn_gpu("GB200")
    assert not non_tn_gpu("H100-80GB") and not non_tn_gpu("A100-80GB") and not non_tn_gpu("H200-141GB")


def test_saved_overrides_dense_and_mla():
    from megatron_memguard.estimator.fp8_layers import gemms_from_shapes, saved_overrides
    # dense layer, h 1024, ffn 4096 (SwiGLU), 16 heads x 64, TP 2 + SP, seq 2048, mbs 1: T = 1024, Tf = 2048
    shapes = {"linear_qkv": (1536, 1024), "linear_proj": (1024, 512), "linear_fc1": (4096, 1024),
              "linear_fc2": (1024, 2048)}
    g = gemms_from_shapes(shapes, T=1024, Tf=2048, tp=2, sequence_parallel=True)
    e = 2
    saved = {"qkv_input": 1024 * 1024 * e, "proj_input": 2048 * 512 * e, "fc1_input": 1024 * 1024 * e,
             "fc2_input": 2048 * 2048 * e, "fc1_output": 2048 * 4096 * e}
    got = saved_overrides(spec("tensorwise"), g, saved, act_bytes=e)
    # 1 byte per element + one 512-byte scale block (layernorm_linear.py / linear.py saved tensors); linear_proj
    # keeps the BF16 attention output itself (set_save_original_input, attention.py core 0.16.1 / 0.19.2)
    assert got == {"qkv_input": 1024 * 1024 + 512, "fc1_input": 1024 * 1024 + 512, "fc2_input": 2048 * 2048 + 512}
    # net per layer: -T*h (qkv) - T*h (fc1) - Tf*ffn/TP (fc2) (moe-fp8.md 2.5), + 3 scale blocks
    net = sum(got.values()) - sum(saved[k] for k in ("qkv_input", "fc1_input", "fc2_input"))
    assert net == -1024 * 1024 - 1024 * 1024 - 2048 * 2048 + 3 * 512
    # delayed scaling: linear_proj keeps its quantized copy [Tf, a d / TP], column-wise (Hopper: the transpose)
    assert saved_overrides(spec("delayed"), g, saved, act_bytes=e)["fp8_proj_input"] == 2048 * 512 + 512
    # 'mlp' recompute: fc2_input is not saved, so it is not made up
    del saved["fc2_input"]
    assert "fc2_input" not in saved_overrides(spec("tensorwise"), g, saved, act_bytes=e)
    # activation_func_fp8_input_store (config only): fc1 output kept as e4m3
    s = spec("tensorwise", activation_func_fp8_input_store=True)
    assert saved_overrides(s, g, saved, act_bytes=e, fc1_output_elements=2048 * 4096)["fc1_output"] == 2048 * 4096
    # disable_parameter_transpose_cache (config only): every micro-batch saves its own quantized weights,
    # Hopper data + transpose + scale per GEMM
    nocache = saved_overrides(spec("tensorwise", disable_parameter_transpose_cache=True), g, saved, act_bytes=e)
    assert nocache["fp8_weight_copies"] == sum(2 * r * c + 512 for r, c in shapes.values())

    # MLA without q-lora and with: the norm output is read by two GEMMs, each keeps its quantized copy
    mla = {"linear_q_down_proj": (256, 512), "linear_q_up_proj": (8 * 192, 256), "linear_kv_down_proj": (192, 512),
           "linear_kv_up_proj": (8 * 256, 128), "linear_proj": (512, 8 * 128),
           "linear_fc1": (2048, 512), "linear_fc2": (512, 1024)}
    g = gemms_from_shapes(mla, T=4096, Tf=4096, tp=1, sequence_parallel=False)
    saved = {"qkv_input": 4096 * 512 * e, "q_latent": 4096 * 256 * e, "kv_latent": 4096 * 128 * e,
             "fc1_input": 4096 * 512 * e, "fc2_input": 4096 * 1024 * e}
    got = saved_overrides(spec("mxfp8"), g, saved, act_bytes=e)
    # mxfp8 columnwise [4096, 512]: 4096*512 + E8M0 [round4(4096/32), round128(512)] = 128 * 512
    assert got["qkv_input"] == 2 * (4096 * 512 + 128 * 512)
    assert got["q_latent"] == 4096 * 256 + 128 * 256 and got["kv_latent"] == 4096 * 128 + 128 * 128
    # --qk-layernorm: the normalised latents inside latent_norms are quantized, the latents stay BF16
    saved_ln = dict(saved, latent_norms=4096 * (256 + 128) * e + 2 * 4096 * 4)
    got = saved_overrides(spec("mxfp8"), g, saved_ln, act_bytes=e)
    assert "q_latent" not in got
    assert got["latent_norms"] == 2 * 4096 * 4 + (4096 * 256 + 128 * 256) + (4096 * 128 + 128 * 128)


def test_grouped_saved_input_pads_each_expert():
    from megatron_memguard.estimator.fp8 import grouped_saved_input
    # 1000 tokens over 4 experts: 250 each, padded to 256 (FP8 align 16) -> 4 x (256 x 1024 + 512)
    assert grouped_saved_input(spec("tensorwise"), 1000, 1024, 4) == 4 * (256 * 1024 + 512)
    # mxfp8 aligns to 32: 250 -> 256; columnwise E8M0 [round4(256/32)=8, 1024]
    assert grouped_saved_input(spec("mxfp8"), 1000, 1024, 4) == 4 * (256 * 1024 + 8 * 1024)
    assert grouped_saved_input(spec("tensorwise"), 0, 1024, 4) == 0


def test_megatron_fp8_rules():
    from megatron_memguard.resolve.fp8 import not_modelled, rule_violations
    base = dict(num_layers=8, pipeline_model_parallel_size=2, use_distributed_optimizer=True)
    ok = dict(base, fp8="hybrid", fp8_recipe="tensorwise", fp8_param_gather=True, first_last_layers_bf16=True,
              num_layers_at_start_in_bf16=1, num_layers_at_end_in_bf16=4)
    assert rule_violations(ok) == []
    names = lambda d: [n for n, _ in rule_violations(d)]   # noqa: E731
    # arguments.py validate_args
    assert names(dict(base, fp8="hybrid", fp4="e2m1")) == ["fp4"]
    assert names(dict(base, fp4_param_gather=True)) == ["fp4_param_gather"]
    assert names(dict(base, fp8="e4m3", fp8_param_gather=True, use_distributed_optimizer=False)) == ["fp8_param_gather"]
    assert names(dict(base, fp8_param_gather=True)) == ["fp8_param_gather"]
    assert names(dict(base, fp8="e4m3", fp8_recipe="tensorwise", fp8_param_gather=True, optimizer_cpu_offload=True)) == \
        ["fp8_param_gather"]
    # TransformerConfig.__post_init__: delayed scaling refuses BF16 first/last layers; at most layers // PP
    assert names(dict(base, fp8="e4m3", first_last_layers_bf16=True)) == ["first_last_layers_bf16"]
    assert names(dict(ok, num_layers_at_end_in_bf16=5)) == ["num_layers_at_end_in_bf16"]
    assert names(dict(base, fp8="e4m3", recompute_granularity="selective", recompute_modules=("moe_act",))) == \
        ["recompute_modules"]
    # DDP config: the MXFP8 shared buffer needs primary FP8 weights
    assert names(dict(base, fp8="e4m3", fp8_recipe="mxfp8", reuse_grad_buf_for_mxfp8_param_ag=True)) == \
        ["reuse_grad_buf_for_mxfp8_param_ag"]
    assert names(dict(base, fp8="e4m3", fp8_recipe="tensorwise", fp8_output_proj=True)) == ["fp8_output_proj"]
    # extensions/transformer_engine.py TELMHeadColumnParallelLinear (core 0.19.2): no shared weight on PP 1
    # (skip_weight_param_allocation), no deferred embedding wgrad buffers
    mx = dict(base, fp8="e4m3", fp8_recipe="mxfp8", fp8_output_proj=True)
    assert names(mx) == [] and names(dict(mx, pipeline_model_parallel_size=1)) == ["fp8_output_proj"]
    assert names(dict(mx, pipeline_model_parallel_size=1, untie_embeddings_and_output_weights=True)) == []
    assert names(dict(mx, defer_embedding_wgrad_compute=True)) == ["fp8_output_proj"]
    assert names(dict(base, fp8="e5m2")) == ["fp8"]
    # TransformerConfig.__post_init__: a custom recipe needs its factory; with one, the factory is refused
    assert names(dict(base, fp8="e4m3", fp8_recipe="custom")) == ["fp8_quantizer_factory"]
    assert names(dict(base, fp4="e2m1", fp4_recipe="custom")) == ["fp4_quantizer_factory"]
    assert not_modelled(dict(fp8="e4m3", fp8_recipe="custom")) is None
    key, why = not_modelled(dict(fp8="e4m3", fp8_recipe="custom", fp8_quantizer_factory="pkg.mod.factory"))
    assert key == "fp8_quantizer_factory" and "--fp8-recipe tensorwise, blockwise or mxfp8" in why
    assert not_modelled(dict(fp4="e2m1", fp4_recipe="custom", fp4_quantizer_factory="p.m.f"))[0] == "fp4_quantizer_factory"
    assert not_modelled(dict(fp8="e4m3", fp8_recipe="tensorwise")) is None
    assert not_modelled(dict(fp8="e4m3", fp8_recipe="mxfp8", fp8_output_proj=True)) is None


def test_gpu_support():
    from megatron_memguard.estimator.fp8 import gpu_violation
    # quantization.py check_fp8_support / check_mxfp8_support / check_nvfp4_support
    assert "8.9" in gpu_violation(spec("tensorwise"), "A100-80GB")
    assert gpu_violation(spec("tensorwise"), "H100-80GB") is None
    assert gpu_violation(spec("blockwise"), "GB200") is None
    assert "Blackwell" in gpu_violation(spec("mxfp8"), "H100-80GB")
    assert gpu_violation(spec("nvfp4"), "B200") is None
    assert gpu_violation(Fp8Spec(), "A100-80GB") is None
    assert gpu_violation(spec("mxfp8"), "MI300X") is None       # not in the capability table: not checked
