"""Which BF16 / quantized GEMM inputs FP8 / FP4 layers keep where megatron-core calls ``set_save_original_input``,
and who else keeps the BF16 attention output linear_proj reads, by hand from the source.

Sources: Transformer Engine 2.11 ``pytorch/module/linear.py`` ``_Linear.forward`` (with ``save_original_input``
the BF16 ``inp`` is saved, otherwise the quantized ``inputmat``; ``DelayedScaling`` asserts against it),
``attention/dot_product_attention/backends.py`` (``FusedAttnFunc`` saves and returns ``out``; ``FlashAttention``
returns a ``.transpose(0, 1).contiguous()`` copy of flash-attn's output), ``context_parallel.py``
(``AttnFuncWithCPAndKVP2P`` saves and returns ``out_f16``); megatron-core 0.16.1 / 0.19.2
``transformer/attention.py`` (``set_save_original_input(self.linear_proj)`` unless delayed)."""
import pytest

from megatron_memguard.estimator.activations import layer_activations

from test_fp8_attention import CTX, TF, lay

MIB = 2**20
# Llama-3.1-8B, TP 2 + SP, micro-batch 1, seq 8192: linear_proj reads [8192, 16 heads x 128] per rank
PROJ_BF16 = 2 * TF * CTX            # 32 MiB
PROJ_FP8 = TF * CTX + 512           # 16 MiB of FP8 data (Hopper: the transpose only) + a 512-byte scale block


def saved(recipe, *extra, version=None):
    return layer_activations(lay("--fp8-format", "hybrid", "--fp8-recipe", recipe, *extra, version=version)).saved


NOBODY_ELSE = [
    ["--recompute-activations"],                                   # core_attn recompute: no autograd in the forward
    ["--attention-backend", "unfused"],                            # TE's unfused context: a new tensor, not saved
    ["--attention-output-gate"],                                   # linear_proj reads the gated product
    ["--context-parallel-size", "2", "--attention-backend", "flash"],   # the ring keeps its bshd output instead
    ["--attention-backend", "flash"],                              # flash-attn keeps its bshd output instead
]


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("extra", NOBODY_ELSE, ids=lambda e: " ".join(e))
def test_delayed_keeps_only_the_fp8_copy_where_nothing_else_keeps_the_output(extra, version):
    delayed, tensorwise = saved("delayed", *extra, version=version), saved("tensorwise", *extra, version=version)
    cp = 2 if "--context-parallel-size" in extra else 1
    # delayed: linear_proj's quantized copy alone; tensorwise: the BF16 input itself (set_save_original_input)
    assert "proj_input" not in delayed and delayed["fp8_proj_input"] == TF * CTX // cp + 512
    assert tensorwise["proj_input"] == PROJ_BF16 // cp and "fp8_proj_input" not in tensorwise
    # every other saved tensor is the same under both per-tensor recipes: the layer differs by BF16 - FP8 output,
    # 16 MiB - 512 B at CP 1 (delayed used to count both, 32 MiB more: the BF16 output no one keeps)
    assert sum(tensorwise.values()) - sum(delayed.values()) == PROJ_BF16 // cp - (TF * CTX // cp + 512)
    if cp == 1:
        assert sum(tensorwise.values()) - sum(delayed.values()) == 16 * MIB - 512


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("extra", [[], ["--context-parallel-size", "2"]], ids=["fused", "fused-cp2"])
def test_delayed_keeps_both_where_the_attention_keeps_the_output(extra, version):
    # cuDNN FusedAttention (with or without its CP ring) saves the output it returns: the BF16 output stays next to
    # linear_proj's FP8 copy
    cp = 2 if "--context-parallel-size" in extra else 1
    delayed = saved("delayed", *extra, version=version)
    assert delayed["proj_input"] == PROJ_BF16 // cp and delayed["fp8_proj_input"] == TF * CTX // cp + 512



@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("extra", [[], ["--attention-backend", "unfused"], ["--recompute-activations"]],
                         ids=["fused", "unfused", "recompute"])
def test_mla_delayed_proj_input(extra, version):
    # multi-latent attention (test_fp8_estimate.MLA: linear_proj reads [4096, 8 heads x v 64] per rank): the same
    # rule as standard attention; fused attention keeps the BF16 output, the unfused one and the checkpoint do not
    from megatron_memguard import layout_from_flags
    from test_fp8_estimate import MLA
    L = layout_from_flags(MLA + ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", *extra], world_size=2,
                          megatron_version=version)
    s = layer_activations(L).saved
    n = 4096 * 512
    assert s["fp8_proj_input"] == n + 512
    assert s.get("proj_input") == (2 * n if not extra else None)


def _mla(*extra, q_lora=True, version=None):
    from megatron_memguard import layout_from_flags
    from test_fp8_estimate import MLA
    flags = list(MLA)
    if not q_lora:
        i = flags.index("--q-lora-rank")
        del flags[i:i + 2]
    return layer_activations(layout_from_flags(flags + list(extra), world_size=2, megatron_version=version))


LN = ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"]
T, H = 2048, 1024          # test_fp8_estimate.MLA: seq 4096 / TP 2 (sequence parallel) tokens, hidden 1024


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_mla_layernorm_recompute_keeps_only_linear_q_projs_copy(recipe, version):
    # set_for_recompute_input_layernorm (multi_latent_attention.py, core 0.16.1 / 0.19.2): the down projections save
    # the BF16 norm output, which CheckpointWithoutOutput discards (nothing kept, as in BF16); linear_q_proj (no
    # --q-lora-rank) is not among them and keeps its quantized copy of its local input shard [2048, 1024]:
    # tensorwise row-wise (all-gathered in backward) 1 B/elem + a 512-byte scale; mxfp8 column-wise + E8M0 scales
    # [2048, 1024 / 32]
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    assert "qkv_input" not in _mla(*fp8, *LN, version=version).saved
    assert "qkv_input" not in _mla(*LN, q_lora=False, version=version).saved
    scales = 512 if recipe == "tensorwise" else T * H // 32
    assert _mla(*fp8, *LN, q_lora=False, version=version).saved["qkv_input"] == T * H + scales


@pytest.mark.parametrize("recipe", ["tensorwise", "mxfp8"])
def test_mla_layernorm_recompute_requantizes_in_the_down_projections_backward(recipe):
    # TE 2.11 _Linear.backward quantizes the saved BF16 input for the weight gradient: tensorwise both usages
    # (Hopper: data + transpose, 2 x [2048, 1024] + 512), mxfp8 column-wise ([2048, 1024] + scales); the step
    # of the down projections (before the input norm's) grows by that one copy over BF16's
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    bf16, q8 = _mla(*LN), _mla(*fp8, *LN)
    extra = 2 * T * H + 512 if recipe == "tensorwise" else T * H + T * H // 32
    assert q8.bwd_steps[-2][1] - bf16.bwd_steps[-2][1] == extra
    # without the recompute the down projections kept quantized copies: no new tensor at their step
    assert _mla(*fp8).bwd_steps[-2][1] == _mla().bwd_steps[-2][1]


MOE = ("--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 1024 --max-position-embeddings 1024 "
       "--micro-batch-size 4 --global-batch-size 32 --bf16 --tensor-model-parallel-size 2 --sequence-parallel "
       "--expert-model-parallel-size 2 --num-experts 8 --moe-router-topk 2 --moe-layer-freq ([0]*1+[1]*3) "
       "--moe-token-dispatcher-type alltoall --moe-grouped-gemm --disable-bias-linear "
       "--moe-shared-expert-intermediate-size 1024 --vocab-size 50257").split()
MOE_T, MOE_H = 1024 * 4 // 2, 512      # tokens per rank (sequence parallel), hidden


def _moe_layer(*extra, version=None):
    from megatron_memguard import layout_from_flags
    from megatron_memguard.partition import MLP_MOE, layer_kinds
    L = layout_from_flags(MOE + list(extra), world_size=4, megatron_version=version)
    kind = next(k for k in layer_kinds(L) if k.mlp == MLP_MOE)
    return layer_activations(L, True, kind)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("fp8", [[], ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"],
                                 ["--fp8-format", "hybrid", "--fp8-recipe", "blockwise"]], ids=["bf16", "tensorwise", "blockwise"])
def test_moe_pre_mlp_norm_output_is_discarded_with_layernorm_recompute(fp8, version):
    # TransformerLayer.__init__ (core 0.16.1 / 0.19.2): the MoE layer's pre_mlp_layernorm is a TENorm, so 'layernorm'
    # recompute runs it in CheckpointWithoutOutput and discards its output after the MLP's forward; under FP8 / FP4
    # set_for_recompute_pre_mlp_layernorm makes the shared expert's fc1 save that BF16 output (no quantized copy).
    # The layer keeps [2048, 512] BF16 less (2 MiB), and the pre-MLP norm's backward step remakes it
    plain, rec = _moe_layer(*fp8, version=version), _moe_layer(*fp8, *LN, version=version)
    assert plain.saved["fc1_input"] == 2 * MOE_T * MOE_H == 2 * MIB and "fc1_input" not in rec.saved
    assert rec.saved["moe_shared_experts"] == plain.saved["moe_shared_experts"]
    # the dense layer's norm is fused into linear_fc1 (TELayerNormColumnParallelLinear, IdentityOp norm): unchanged
    from megatron_memguard import layout_from_flags
    from megatron_memguard.partition import MLP_DENSE, layer_kinds
    L = layout_from_flags(MOE + fp8 + LN, world_size=4, megatron_version=version)
    dense = layer_activations(L, True, next(k for k in layer_kinds(L) if k.mlp == MLP_DENSE))
    assert "fc1_input" in dense.saved


def test_moe_router_cuda_graph_keeps_the_pre_mlp_norm_output():
    # can_recompute_pre_mlp_layernorm_for_cudagraph: with TE CUDA graphs of the router but not of the preprocess the
    # recompute is disabled (the norm output is a graph output in a static buffer); with the preprocess too and
    # the alltoall dispatcher it stays on
    graphs = ["--cuda-graph-impl", "transformer_engine", "--cuda-graph-scope"]
    assert "fc1_input" in _moe_layer(*LN, *graphs, "moe_router", version="0.19.2").saved
    assert "fc1_input" not in _moe_layer(*LN, *graphs, "moe_router", "moe_preprocess", version="0.19.2").saved


def test_input_jitter_copy_counted_once_the_norm_output_is_discarded():
    # Router.apply_input_jitter: the product keeps the noise [T, h] and the gating keeps the jittered input. Without
    # shared experts the norm output it replaced was counted as fc1_input; once 'layernorm' recompute discards that
    # output the jittered copy is counted on its own: 2 x [2048, 512] BF16
    from megatron_memguard import layout_from_flags
    from megatron_memguard.partition import MLP_MOE, layer_kinds
    i = MOE.index("--moe-shared-expert-intermediate-size")
    flags = MOE[:i] + MOE[i + 2:] + ["--moe-input-jitter-eps", "0.01"]
    for extra, copies in (([], 1), (LN, 2)):
        L = layout_from_flags(flags + extra, world_size=4)
        s = layer_activations(L, True, next(k for k in layer_kinds(L) if k.mlp == MLP_MOE)).saved
        assert s["moe_router_input_jitter"] == copies * 2 * MOE_T * MOE_H
        assert ("fc1_input" in s) == (not extra)


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
def test_flash_backend_without_cp_by_hand(version):
    # TE 2.11 backends.py FlashAttention.forward (sbhd): contiguous [b, s, h, d] copies of q, k, v (kept by flash-attn
    # with its own output and the fp32 log-sum-exp), and a .contiguous() sbhd copy of the output for linear_proj.
    # Llama-3.1-8B per TP rank: q 16 heads, k and v 4 groups each, head dim 128, 8192 tokens, BF16
    flash = layer_activations(lay("--attention-backend", "flash", version=version)).saved
    fused = layer_activations(lay(version=version)).saved
    q, kv = 2 * TF * CTX, 2 * TF * 4 * 128
    assert flash["flash_qkv"] == q + 2 * kv == 48 * MIB
    assert flash["attention_output_bshd"] == flash["proj_input"] == q == 32 * MIB
    assert flash["softmax_stats"] == fused["softmax_stats"] == 16 * 8192 * 4
    # the rope'd q and k and the qkv output (v's base) are no longer kept by the attention
    for name in ("qkv_output", "query_rope", "key_rope"):
        assert name in fused and name not in flash
    # fused keeps qkv output 48 + rope'd q 32 + k 8 + output 32 MiB; flash 48 + 32 + 32 MiB: 8 MiB less per layer
    assert sum(fused.values()) - sum(flash.values()) == 8 * MIB
