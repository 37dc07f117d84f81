"""FP8 core attention (fp8_dot_product_attention, a TransformerConfig field without a Megatron flag): what
Transformer Engine 2.11's FusedAttention keeps, by hand from its source, and which settings megatron-core
0.16.1 / 0.19.2 and TE 2.11 let through.

Sources: TE 2.11 attention/dot_product_attention/backends.py FusedAttnFunc.forward (saves q_fp8, k_fp8,
v_fp8 and out_fp8 under delayed scaling; the BF16 output under current scaling, NVTE_DPA_FP8CS_O_in_F16=1),
utils.py combine_and_quantize (one Float8Tensor for q, k, v), csrc/extensions/attention.cpp (FP8 aux
tensors M and ZInv [b, h, s, 1] fp32), dot_product_attention.py init_fp8_metadata (only per-tensor recipes);
megatron-core fp8_utils.get_fp8_recipe (0.16.1: fp8_dpa on delayed and tensorwise; 0.19.2: also mxfp8),
fp4_utils.get_fp4_recipe (0.19.2 passes fp8_dpa to NVFP4BlockScaling)."""
import textwrap

import pytest

from megatron_memguard import estimate
from megatron_memguard.errors import ConfigError
from megatron_memguard.estimator.activations import layer_activations
from megatron_memguard.gpus import lookup_gpu
from megatron_memguard.readers.detect import read_config_file
from megatron_memguard.readers.megatron_flags import parse_megatron_flags
from megatron_memguard.resolve import resolve

from conftest import LLAMA31_8B
from test_readers_bridge import FLAT

# Llama-3.1-8B (h 4096, 32 heads, 8 KV heads, head dim 128), TP 2 + SP, PP 2, micro-batch 1, seq 8192
BASE = LLAMA31_8B + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
                     "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", "64"]
TF = 8192                    # tokens inside the TP region
A_T, G_T, D = 16, 4, 128     # heads, query groups and head dim per TP rank
QKV_W = (A_T + 2 * G_T) * D  # 3072
CTX = A_T * D                # 2048


def lay(*extra, version=None, env=None, **config):
    raw = parse_megatron_flags(BASE + list(extra), env=env)
    raw.args.update(config)
    return resolve(raw, world_size=16, megatron_version=version)


# the FP8 kernel's fp32 softmax statistics per (token, head): M and ZInv up to TE 2.14.1 (cpp_extensions/fused_attn.py
# "aux_ctx_tensors = [M, ZInv, rng_state]"), one from TE 2.15.0 ("ZInv ... only allocated for T3HD path";
# context_parallel.py "softmax_lse_per_step, rng_states = aux_ctx_tensors"); megatron-core 0.19 runs TE 2.20.2 unless
# MEMGUARD_TE_VERSION says otherwise
TE_STATS = [(None, 1), ("2.14.1", 2), ("2.15.0", 1)]


@pytest.mark.parametrize("te,n_stats", TE_STATS)
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_saved_tensors_by_hand(recipe, te, n_stats):
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    env = {"MEMGUARD_TE_VERSION": te} if te else None
    bf16_att = layer_activations(lay(*fp8, env=env)).saved
    got = layer_activations(lay(*fp8, env=env, fp8_dot_product_attention=True)).saved
    # the BF16 q, k, v the attention kept are gone: the qkv output (v is its view) and the rope'd q and k
    for name in ("qkv_output", "query_rope", "key_rope"):
        assert name in bf16_att and name not in got
    # one Float8Tensor [Tf, (a + 2 g) d] (1 B/elem) + its fp32 scale-inverse (one 512-byte allocator block)
    assert got["fp8_attention_qkv"] == TF * QKV_W + 512
    # M and ZInv (TE <= 2.14): two fp32 [b, a, s, 1] instead of BF16 attention's one; TE >= 2.15: one
    assert got["softmax_stats"] == n_stats * 1 * A_T * 8192 * 4 == n_stats * bf16_att["softmax_stats"]
    # delayed: the FP8 output is what the attention keeps; tensorwise keeps the BF16 output
    assert got["proj_input"] == (TF * CTX + 512 if recipe == "delayed" else 2 * TF * CTX)
    # linear_proj's own quantized copy (delayed only: other recipes keep the BF16 output it reads, the tensor the
    # attention saves: set_save_original_input, attention.py core 0.16.1 / 0.19.2) and the GEMM inputs are those
    # of the FP8 layer without FP8 attention
    assert ("fp8_proj_input" in got) == ("fp8_proj_input" in bf16_att) == (recipe == "delayed")
    for name in ("fp8_proj_input", "qkv_input", "fc1_input", "fc2_input"):
        assert got.get(name) == bf16_att.get(name)
    # net per layer: -(2 * 3072 + 2 * 2048 + 2 * 512) * Tf BF16 (qkv output 3072 wide, q 2048, k 512)
    saved_bf16 = 2 * TF * (QKV_W + CTX + G_T * D)
    delta = (TF * QKV_W + 512 + (n_stats - 1) * A_T * 8192 * 4 - saved_bf16
             - (TF * CTX - 512 if recipe == "delayed" else 0))
    assert sum(got.values()) - sum(bf16_att.values()) == delta


def test_forward_and_backward_working_sets():
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay("--fp8-format", "hybrid", "--fp8-recipe", "delayed", fp8_dot_product_attention=True)
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    bf16_qkv = 2 * TF * (QKV_W + CTX + G_T * D)          # qkv output, rope'd q and k: alive during the forward
    # combine_and_quantize: those + their BF16 concatenation + the FP8 copy
    assert f.fwd_steps[0][1] == bf16_qkv + 2 * TF * QKV_W + TF * QKV_W + 512
    # the kernel: FP8 output and its dequantized BF16 copy
    assert f.fwd_steps[1][1] == bf16_qkv + 2 * TF * CTX + TF * CTX + 512
    # backward at the core attention: dO in FP8 (scale 512), FP8 dq/dk/dv, the FP8 output still saved
    assert f.bwd_steps[1][1] - m.bwd_steps[1][1] == 3 * 512 + TF * CTX + TF * QKV_W + TF * CTX
    assert "fp8_attention_qkv" in f.bwd_steps[2][0] and "fp8_attention_qkv" not in f.bwd_steps[1][0]


def test_estimate_moves_by_the_layers_saved_bytes():
    gpu = lookup_gpu("H100-80GB")
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    off = layer_activations(lay(*fp8)).total
    on = layer_activations(lay(*fp8, fp8_dot_product_attention=True)).total
    e_off = estimate(lay(*fp8), gpu=gpu)
    e_on = estimate(lay(*fp8, fp8_dot_product_attention=True), gpu=gpu)
    t_off = {t.name: t.bytes for t in e_off.stages[0].terms}
    t_on = {t.name: t.bytes for t in e_on.stages[0].terms}
    # 16 layers on pp0, 2 micro-batches in flight on the first of 2 pipeline stages (1F1B warm-up)
    per_layer = off - on
    assert per_layer > 0 and (t_off["layer_activations"] - t_on["layer_activations"]) % per_layer == 0
    assert (t_off["layer_activations"] - t_on["layer_activations"]) // per_layer == 16 * 2
    assert t_on["parameters"] == t_off["parameters"]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_output_gate_keeps_the_bf16_output(recipe):
    # --attention-output-gate: the gate (x * sigmoid(gate)) keeps its inputs, the BF16 attention output and the
    # gate (a copy here: 4 query groups of 4 heads per rank); the qkv output (5120 wide with the gate) is
    # kept by nothing else once the attention keeps FP8 q, k, v
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--attention-output-gate"]
    bf16_att = layer_activations(lay(*fp8)).saved
    got = layer_activations(lay(*fp8, fp8_dot_product_attention=True)).saved
    assert bf16_att["qkv_output"] == 2 * TF * 5120 and "qkv_output" not in got
    # linear_proj reads the gated product: tensorwise keeps it BF16 (set_save_original_input); delayed keeps only
    # its FP8 copy (TE 2.11 linear.py), and nothing else keeps the BF16 product (the gate keeps its inputs)
    if recipe == "delayed":
        assert "proj_input" not in got and "proj_input" not in bf16_att
        assert got["fp8_proj_input"] == bf16_att["fp8_proj_input"] == TF * CTX + 512
    else:
        assert got["proj_input"] == bf16_att["proj_input"] == 2 * TF * CTX
    assert got["output_gate"] == bf16_att["output_gate"] == got["gate_attention_output"] == 2 * TF * CTX
    assert got["fp8_attention_qkv"] == TF * QKV_W + 512
    # delayed: the FP8 output the attention keeps, next to the BF16 one the gate keeps
    assert got.get("fp8_attention_output") == (TF * CTX + 512 if recipe == "delayed" else None)
    # the core attention's backward step comes after linear_proj's and the gate's: + dO in FP8, and (delayed)
    # FP8 dq/dk/dv; the FP8 output is still saved there (released with the softmax statistics)
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay(*fp8, fp8_dot_product_attention=True)
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    extra = TF * CTX + 512 + (TF * QKV_W + 512 if recipe == "delayed" else 0)
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, 0, extra, 0, 0]
    assert "fp8_attention_output" in f.bwd_steps[3][0] and "fp8_attention_output" not in f.bwd_steps[2][0]


@pytest.mark.parametrize("te,n_stats", TE_STATS)
def test_recompute_core_attention_keeps_the_checkpoint_inputs(te, n_stats):
    args = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--recompute-granularity", "selective",
            "--recompute-modules", "core_attn"]
    env = {"MEMGUARD_TE_VERSION": te} if te else None
    assert layer_activations(lay(*args, env=env, fp8_dot_product_attention=True)).saved == layer_activations(
        lay(*args, env=env)).saved
    # the replay in the backward: FP8 q/k/v, the second fp32 statistic [b, a, s] (TE <= 2.14), the FP8 output, dO
    # in FP8 and FP8 dq/dk/dv, at the core attention's step only
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay(*args, env=env, fp8_dot_product_attention=True)
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    replay = ((TF * QKV_W + 512) + (n_stats - 1) * A_T * 8192 * 4 + (TF * CTX + 512) + (TF * QKV_W + 512)
              + (TF * CTX + 512))
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, replay, 0, 0]
    assert f.saved == m.saved and f.fwd_steps == m.fwd_steps


def test_which_recipes_carry_it():
    # without FP8 the flag never reaches TE
    L = lay(fp8_dot_product_attention=True)
    assert not L.fp8_spec.fp8_dot_product_attention and any("no effect without --fp8-format" in n for n in L.notes)
    # blockwise: Float8BlockScaling is built without fp8_dpa (both versions)
    L = lay("--fp8-format", "e4m3", "--fp8-recipe", "blockwise", fp8_dot_product_attention=True)
    assert not L.fp8_spec.fp8_dot_product_attention
    # mxfp8: 0.16.1 drops it; 0.19.2 passes it (fp8_utils.get_fp8_recipe) to TE 2.20.2, which runs MXFP8 attention
    # in cuDNN >= 9.21 on Blackwell (attention/dot_product_attention/utils.py get_attention_backend): sized without
    # context parallelism (test_mxfp8_*) and under its p2p ring
    L = lay("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", fp8_dot_product_attention=True, version="0.16.1")
    assert not L.fp8_spec.fp8_dot_product_attention
    L = lay("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", fp8_dot_product_attention=True, version="0.19.2")
    assert L.fp8_spec.fp8_dot_product_attention and any("MXFP8 attention" in n and "cuDNN 9.21" in n for n in L.notes)
    # under CP: every communication type is sized (test_mxfp8_ring_*, test_mxfp8_a2a_*, test_mxfp8_all_gather_*,
    # test_mxfp8_two_level_*)
    for comm in ("p2p", "a2a", "all_gather"):
        assert lay("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8", "--context-parallel-size", "2", "--cp-comm-type",
                   comm, fp8_dot_product_attention=True, version="0.19.2").fp8_spec.fp8_dot_product_attention
    # nvfp4 (fp4_utils.get_fp4_recipe passes fp8_dpa, 0.19.2): TE 2.20.2 disables FusedAttention for
    # NVFP4BlockScaling and runs FP8 attention nowhere else
    with pytest.raises(ConfigError, match="fp8.dot.product.attention.*nvfp4 recipe.*no attention backend"):
        lay("--fp4-format", "e2m1", fp8_dot_product_attention=True, version="0.19.2")


def test_refused_and_rejected_corners():
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    with pytest.raises(ConfigError, match="attention-backend fused or auto"):
        lay(*fp8, "--attention-backend", "flash", fp8_dot_product_attention=True)
    # TE 2.11 get_attention_backend: with fp8_dpa FusedAttention is off for a non-vanilla softmax and for a sliding
    # window, and FlashAttention / the unfused backend never run FP8: no backend
    with pytest.raises(ConfigError, match="^--fp8-dot-product-attention: .*softmax-type learnable"):
        lay(*fp8, "--softmax-type", "learnable", fp8_dot_product_attention=True)
    with pytest.raises(ConfigError, match="window-size 4096,0"):
        lay(*fp8, "--window-size", "4096,0", fp8_dot_product_attention=True)
    assert lay(*fp8, "--window-size", "-1,0", fp8_dot_product_attention=True).fp8_spec.fp8_dot_product_attention
    # fp8_mha only travels in the delayed recipe: with tensorwise it is dropped, fp8_dpa still acts
    L = lay("--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", fp8_dot_product_attention=True,
            fp8_multi_head_attention=True)
    assert L.fp8_spec.fp8_dot_product_attention
    assert any("fp8-multi-head-attention" in n and "no effect" in n for n in L.notes)


def test_multi_head_attention_is_dot_product_attention_under_megatron():
    # TE 2.11 dot_product_attention.py forward: fp8_mha forces fp8_dpa on; the FP8 output (FusedAttnFunc
    # is_output_fp8 = fp8_output) is asked for only by TE's MultiheadAttention (multi_head_attention.py
    # dpa_fp8_output), never by megatron-core's TEDotProductAttention (extensions/transformer_engine.py, 0.16.1 and
    # 0.19.2: no fp8_output argument): the same tensors as fp8_dot_product_attention
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed"]
    for version in ("0.16.1", "0.19.2"):
        mha = lay(*fp8, fp8_multi_head_attention=True, version=version)
        assert mha.fp8_spec.fp8_dot_product_attention
        assert any("estimated as fp8_dot_product_attention" in n for n in mha.notes)
        got = layer_activations(mha).saved
        assert got == layer_activations(lay(*fp8, fp8_dot_product_attention=True, version=version)).saved
        assert got["fp8_attention_qkv"] == TF * QKV_W + 512 and got["proj_input"] == TF * CTX + 512


# context parallelism 2: each rank holds s / CP = 4096 tokens (micro-batch 1)
TC = 4096
Q, KV = TC * CTX, 2 * TC * G_T * D   # q (= output) and k + v elements per rank: 8 Mi and 4 Mi
W = Q + KV
STATS = 1 * A_T * TC * 4             # fp32 log-sum-exp [b, a/t, s/CP]


@pytest.mark.parametrize("version", ["0.16.1", "0.19.2"])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_ring_attention_saved_by_hand(recipe, version):
    # TE 2.11 context_parallel.py AttnFuncWithCPAndKVP2P.forward, ctx.fp8 branch (1930-1936): saves q_fp8 (a view
    # of combine_and_quantize's one FP8 buffer of q, k, v), kv_fp8 (p2p_comm_buffers[-1], FP8), softmax_lse (fp32,
    # one statistic) and out_fp8 (delayed) or out_f16 (Float8CurrentScaling with NVTE_DPA_FP8CS_O_in_F16=1), the
    # very tensor it returns (1910: out_f16 = out.to(fwd_nominal_dtype), 1916: out_ret = out_f16)
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2"]
    bf16_att = layer_activations(lay(*fp8, version=version)).saved
    got = layer_activations(lay(*fp8, fp8_dot_product_attention=True, version=version)).saved
    assert bf16_att["query_rope"] == 2 * Q and "query_rope" not in got      # the BF16 ring kept the rope'd q
    assert bf16_att["cp_kv_buffer"] == 2 * KV and got["cp_kv_buffer"] == KV
    assert got["fp8_attention_qkv"] == TC * QKV_W + 512 == W + 512
    assert got["softmax_stats"] == bf16_att["softmax_stats"] == STATS
    assert got["proj_input"] == (Q + 512 if recipe == "delayed" else 2 * Q)
    delta = sum(got.values()) - sum(bf16_att.values())
    # delayed: W + KV + Q (+ two scales) instead of 2 Q + 2 KV + 2 Q: -2 Q; tensorwise keeps the BF16 output: -Q
    te211 = version == "0.16.1"
    if recipe == "delayed" or te211:
        assert delta == (-2 * Q + 1024 if recipe == "delayed" else -Q + 512)
        assert "cp_a2a_attention_output" not in got
    else:
        # TE 2.20.2 (megatron-core >= 0.17): the fp32 output is cast to BF16 twice, out_part (2255: out_part =
        # out.to(fwd_nominal_dtype)) and the returned out_f16 (2298); the saved one is out_part (2321: out_f16 =
        # out_part; 2325-2326: f16_tensors = (None, None, out_f16)), a second [s/CP, a d / TP] BF16 tensor next to
        # the returned one linear_proj keeps: 16 MiB per layer here
        assert got["cp_a2a_attention_output"] == 2 * Q == 16 * 2 ** 20
        assert delta == -Q + 512 + 2 * Q


@pytest.mark.parametrize("version,n_ring,n_out", [("0.16.1", 1, 2), ("0.19.2", 2, 2)])
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_ring_attention_working_sets_by_hand(recipe, version, n_ring, n_out):
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay("--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2",
            fp8_dot_product_attention=True, version=version)
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    delayed = recipe == "delayed"
    alive = 2 * Q + KV                       # Megatron's rope'd BF16 q and v made contiguous (FusedAttention.forward)
    # combine_and_quantize: BF16 concatenation [W] next to its FP8 copy
    assert f.fwd_steps[0][1] == alive + 2 * W + W + 512
    # output correction: TE 2.11 keeps every step's ring buffer (CP - 1 besides the saved one) and partial output,
    # dequantized to fp32 with its fp32 statistic; TE 2.20.2 two of each; + fp32 output, BF16 cast, FP8 copy;
    # TE 2.20.2 casts the fp32 output to BF16 twice (out_part, 2255, then out_f16, 2298): one more 2 Q bytes,
    # saved under tensorwise, a transient freed when the forward returns under delayed
    part = 2 * Q if version != "0.16.1" else 0
    assert f.fwd_steps[1][1] == (alive + n_ring * KV + n_out * (4 * Q + STATS) + 4 * Q + 2 * Q + part
                                 + (Q + 512 if delayed else 0))
    if version != "0.16.1" and not delayed:
        assert "cp_a2a_attention_output" in f.fwd_steps[1][0]        # counted there while made, not twice
    # backward (AttnFuncWithCPAndKVP2P.backward, ctx.fp8): dO in FP8 and BF16, kv_recv_buffer, dkv_send_buffer and
    # dkv_recv_buffer of [CP, K+V] FP8, the second half of the statistics made contiguous
    common = Q + 512 + 2 * Q + KV + 2 * 2 * KV + STATS // 2
    if delayed:
        # dq_buffer [CP, q] FP8; at the end the CP steps' FP8 dq/dk/dv go through combine_and_dequantize to fp32
        # ([CP, W] x 4 B, after a [CP, W] byte concatenation of the contiguous dK/dV) and are summed one by one:
        # the fp32 sum of dq and its BF16 cast (6 Q), or dv's fp32 sum and cast after dq's and dk's casts
        ring = common + 2 * Q + max(2 * KV + 2 * W + 8 * W, 8 * W + max(6 * Q, 2 * Q + 4 * KV))
    else:
        # fp32 dq_buffer and dkv_buffer; each step's BF16 dq/dk/dv, their fp32 casts and halves of q, out, dO
        ring = common + 4 * W + 6 * W + 2 * Q
    # attention.py _cp_attention_items' backward (BF16 k: kv1 = KV bytes): the BF16 dO handed in and the ring's own
    bf16_ring = 2 * Q + 3 * 2 * Q + 10 * KV + STATS
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, ring - bf16_ring, 0, 0]
    assert "cp_kv_buffer" in f.bwd_steps[2][0] and "fp8_attention_qkv" in f.bwd_steps[2][0]


def test_ring_attention_with_core_attention_recompute():
    # selective recompute's default module core_attn: the checkpoint keeps the BF16 q, k, v (saved unchanged);
    # the backward replays the FP8 ring forward (its saved tensors and the BF16 output it returns) and runs its
    # backward at the core attention's step
    args = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--context-parallel-size", "2",
            "--recompute-granularity", "selective"]
    assert layer_activations(lay(*args, fp8_dot_product_attention=True)).saved == layer_activations(lay(*args)).saved
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay(*args, fp8_dot_product_attention=True, version="0.16.1")
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    kept = (W + 512) + KV + STATS + 2 * Q + (Q + 512)
    ring = Q + 512 + 2 * Q + KV + 4 * KV + STATS // 2 + 2 * Q + max(2 * KV + 10 * W, 8 * W + 6 * Q)
    bf16 = (3 * 2 * Q + 10 * KV + STATS) + 2 * KV + STATS + 2 * 2 * Q   # attention_items' recompute step under CP
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + ring - bf16, 0, 0]


def test_ring_attention_with_core_attention_recompute_te_2_20():
    # megatron-core 0.19.2 (TE 2.20.2), tensorwise: the backward's replay of the ring forward keeps, besides TE
    # 2.11's saved tensors and the BF16 output it returns, out_part (context_parallel.py 2255, 2321-2326: the BF16
    # copy saved under NVTE_DPA_FP8CS_O_in_F16), 2 Q bytes more, through the ring's backward; no FP8 output
    args = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise", "--context-parallel-size", "2",
            "--recompute-granularity", "selective"]
    L = lay(*args, fp8_dot_product_attention=True, version="0.19.2")
    assert layer_activations(L).saved == layer_activations(lay(*args, version="0.19.2")).saved
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    kept = (W + 512) + KV + STATS + 2 * Q + 2 * Q
    # tensorwise ring backward (test_ring_attention_working_sets_by_hand): FP8 dO, BF16 dO, K/V receive buffer,
    # dK/dV send and receive [2, K+V] FP8, half the statistics; fp32 dq and dK/dV accumulators; each step's BF16
    # dq/dk/dv, their fp32 casts and the BF16 halves of q, out, dO
    ring = Q + 512 + 2 * Q + KV + 4 * KV + STATS // 2 + 4 * W + 6 * W + 2 * Q
    bf16 = (3 * 2 * Q + 10 * KV + STATS) + 2 * KV + STATS + 2 * 2 * Q   # attention_items' recompute step under CP
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + ring - bf16, 0, 0]


def test_context_parallel_comm_types():
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--context-parallel-size", "2"]
    # TE 2.11 to 2.14.1 attn_forward_func_with_cp: AttnFuncWithCPAndKVAllGather takes no fp8 (BF16 kernels);
    # from TE 2.15.0 it does (test_all_gather_attention_*)
    for version, env in (("0.16.1", None), ("0.19.2", {"MEMGUARD_TE_VERSION": "2.14.1"})):
        L = lay(*fp8, "--cp-comm-type", "all_gather", fp8_dot_product_attention=True, version=version, env=env)
        assert not L.fp8_spec.fp8_dot_product_attention and any("all_gather" in n for n in L.notes)
        assert not L.cp_kv_all_gather         # BF16 attention: the layout does not mark the FP8 all-gather path
    assert lay(*fp8, "--cp-comm-type", "all_gather", fp8_dot_product_attention=True).cp_kv_all_gather
    # AttnFuncWithCPAndQKVOA2A takes fp8 (sized below)
    L = lay(*fp8, "--cp-comm-type", "a2a", fp8_dot_product_attention=True)
    assert L.fp8_spec.fp8_dot_product_attention and L.cp_a2a_size == 2
    assert lay(*fp8, fp8_dot_product_attention=True).cp_a2a_size == 1
    # a2a+p2p: megatron-core hands TE [a2a group, p2p group] in the order of --hierarchical-context-parallel-sizes
    # (parallel_state.create_hierarchical_groups); attn_forward_func_with_cp runs a2a when the p2p group has one
    # rank, p2p when the a2a group has one
    for sizes, a2a in ((["2", "1"], 2), (["1", "2"], 1)):
        L = lay(*fp8, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", *sizes,
                fp8_dot_product_attention=True)
        assert L.cp_a2a_size == a2a
    cp4 = fp8[:4] + ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p"]
    # two levels: TE 2.11's (megatron-core 0.16) and TE 2.20.2's (>= 0.17) are sized (test_two_level_a2a_p2p_*)
    for version in ("0.16.1", "0.19.2"):
        L = lay(*cp4, "--hierarchical-context-parallel-sizes", "2", "2", fp8_dot_product_attention=True,
                version=version)
        assert L.cp_a2a_size == 2 and L.fp8_spec.fp8_dot_product_attention
    # one type per layer (TransformerConfig asserts one for each of the 32 layers): each layer's kind carries its own
    # (test_per_layer_comm_types_*)
    L = lay(*fp8, "--cp-comm-type", *["p2p", "all_gather"] * 16, fp8_dot_product_attention=True)
    assert L.fp8_spec.fp8_dot_product_attention and L.cp_comm_layers == ",".join(["p2p", "all_gather"] * 16)
    # a list of another length is Megatron's assert, not a refusal (before: the refusal, as for 32 types)
    with pytest.raises(ConfigError, match="gives 2 communication types for 32 layers"):
        lay(*fp8, "--cp-comm-type", "p2p", "all_gather", fp8_dot_product_attention=True)
    # TE asserts "CP implementation a2a+p2p requires cp_group = [a2a_cp_group, p2p_cp_group]!"
    with pytest.raises(ConfigError, match="hierarchical.context.parallel.sizes.*two sizes"):
        lay(*cp4, "--hierarchical-context-parallel-sizes", "2", "1", "2", fp8_dot_product_attention=True)
    # AttnFuncWithCPAndQKVOA2A.forward asserts "The number of attention heads needs to be divisible by CP size!"
    # for q and k: 8 KV heads over TP 2 leave 4 per rank, not a multiple of CP 8 (seq 8192 = 2 x 8 x 512)
    with pytest.raises(ConfigError, match="cp.comm.type.*multiples of the all-to-all.s 8 ranks"):
        _a2a_cp8(fp8[:4])


# --cp-comm-type all_gather under TE 2.15.0 .. 2.20.2 (megatron-core 0.19.2's default TE, or MEMGUARD_TE_VERSION)
AG_TE = [("0.19.2", None), ("0.16.1", {"MEMGUARD_TE_VERSION": "2.15.0"})]


@pytest.mark.parametrize("version,env", AG_TE)
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_all_gather_attention_saved_by_hand(recipe, version, env):
    # TE 2.15.0 / 2.20.2 context_parallel.py AttnFuncWithCPAndKVAllGather.forward, ctx.fp8 branch: q_fp8_save,
    # k_fp8_save, v_fp8_save wrap the FP8 data of q, k, v (combine_and_quantize, qkv_group 3: views of one FP8
    # buffer of [TC, (a + 2 g) d] bytes + a 512 B scale); fp8_tensors = (q, k, v, out_fp8) under delayed scaling,
    # (q, k, v, None) + f16_tensors (.., out_f16) under Float8CurrentScaling with NVTE_DPA_FP8CS_O_in_F16=1 (out_f16 is
    # the tensor returned to linear_proj); softmax_lse_per_step: one fp32 statistic for each half of the TC query
    # tokens ("softmax_lse_per_step[i], rng_states[i] = aux_ctx_tensors"). k_ag / v_ag (gathered) are not saved
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2",
           "--cp-comm-type", "all_gather"]
    L = lay(*fp8, fp8_dot_product_attention=True, version=version, env=env)
    assert L.fp8_spec.fp8_dot_product_attention and L.cp_kv_all_gather
    assert any("all_gather" in n and "2.15" in n for n in L.notes)
    bf16_att = layer_activations(lay(*fp8, version=version, env=env)).saved
    got = layer_activations(L).saved
    assert bf16_att["query_rope"] == 2 * Q and "query_rope" not in got
    assert bf16_att["cp_kv_buffer"] == 2 * KV and "cp_kv_buffer" not in got
    assert got["fp8_attention_qkv"] == TC * QKV_W + 512 == W + 512
    assert got["softmax_stats"] == STATS
    assert got["proj_input"] == (Q + 512 if recipe == "delayed" else 2 * Q)
    assert "cp_a2a_attention_output" not in got                  # no out_part on this path
    delta = sum(got.values()) - sum(bf16_att.values())
    # delayed: W + Q (+ two scales) instead of 2 Q (q) + 2 KV (ring buffer) + 2 Q (output): -3 Q - 2 KV + W = -2 Q - KV;
    # tensorwise keeps the BF16 output: -Q - KV. Llama-3.1-8B TP 2 CP 2 seq 8192: -20 MiB / -12 MiB per layer
    assert delta == (-2 * Q - KV + 1024 if recipe == "delayed" else -Q - KV + 512)
    assert -delta // 2 ** 20 == (19 if recipe == "delayed" else 11)      # (the scales: just under 20 / 12 MiB)


@pytest.mark.parametrize("version,env", AG_TE)
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_all_gather_attention_working_sets_by_hand(recipe, version, env):
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay("--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2",
            "--cp-comm-type", "all_gather", fp8_dot_product_attention=True, version=version, env=env)
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    delayed = recipe == "delayed"
    cp = 2
    alive = 2 * Q + KV                       # Megatron's rope'd BF16 q and v made contiguous (FusedAttention.forward)
    assert f.fwd_steps[0][1] == alive + 2 * W + W + 512            # combine_and_quantize
    # gather_along_first_dim of the FP8 k, v ([cp x TC, g, d] each) and their index_select'ed copies (k_ag, v_ag,
    # alive to the end); per step (two streams) both steps' BF16 out_per_step and out_f16, the statistics; delayed:
    # a step's FP8 output before its dequantization; TE 2.18.0 on (2.20.2 here, not 2.15.0): "out =
    # torch.zeros(o_shape, dtype=fwd_nominal_dtype, ...)", THD's accumulator made for sbhd too (BF16, Q). The step's
    # q half and K/V slice are views (sbhd, test_all_gather_step_inputs_are_views): no bytes. At the end both BF16
    # outputs, out_f16's statistics and (delayed) out_fp8 = O_quantizer(out_f16) (Q + a 512 B scale)
    zeros = 2 * Q if env is None else 0
    steps = cp * KV + 2 * Q + 2 * Q + zeros + STATS + (Q // 2 if delayed else 0)
    fwd_end = cp * KV + 4 * Q + zeros + STATS + (Q + 512 if delayed else 0)
    assert f.fwd_steps[1][1] == alive + max(steps, fwd_end)
    if env is None:
        assert round(max(steps, fwd_end) / 2 ** 20, 2) == (64.25 if delayed else 56.25)
    # (TE 2.20.2: 64.25 MiB over alive delayed, 56.25 MiB tensorwise; 72.25 / 68.25 MiB when the 4 MiB q half and
    # the 8 MiB widest K/V slice were counted as copies)
    # backward: dout (BF16) and dout_fp8, dq (torch.empty BF16), dk / dv torch.zeros of cp x TC rows (BF16), k_ag /
    # v_ag gathered again (FP8); dq/dk/dv_per_step (BF16) of both steps to the end: dq halves (Q) and K/V slices of
    # chunks r and 2 CP - r - 1 ((2 CP + 1) / 2 local K/V); delayed: the step's FP8 dq/dk/dv before .dequantize. The
    # halves of q, out, dO and the K/V slice are views (sbhd): no bytes
    held = 2 * Q + Q + 2 * Q + 2 * cp * KV
    collected = 2 * Q + 2 * (2 * cp + 1) * KV // 2
    step = (Q // 2 + cp * KV) if delayed else 0
    # at the end: index_select of dk, then dv (BF16, cp x TC rows: dk's gathered copy freed when replaced, so one
    # more half of the accumulators), then reduce_scatter's TC-row outputs (2 KV bytes: less); delayed: the steps
    # peak, tensorwise: the end
    end = cp * KV
    assert (step > end) == delayed
    ag = held + cp * KV + collected + max(step, end)
    bf16_ring = 2 * Q + 3 * 2 * Q + 10 * KV + STATS                # attention.py _cp_attention_items' backward
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, ag - bf16_ring, 0, 0]
    assert "fp8_attention_qkv" in f.bwd_steps[2][0] and "cp_kv_buffer" not in f.saved


def test_all_gather_step_inputs_are_views():
    # Why the FP8 all-gather path's per-step inputs cost no bytes: TE's own tensor operations replayed on CPU uint8
    # tensors (FP8 data; Float8Tensor.make_like(x, data=y) only wraps y, context_parallel.py 3657-3662), at the
    # layer's shape per rank (s/CP = TC tokens, b 1, a/t q heads, g/t KV heads, head dim D) in Megatron's sbhd.
    # TE 2.20.2 utils.py combine_and_quantize, qkv_group 3 (3524): q, k, v are .view()s of consecutive spans of one
    # flat FP8 buffer -> each contiguous; context_parallel.py AttnFuncWithCPAndKVAllGather.forward: q.view(2, s//2, ...)
    # (3452), k.movedim(0, 0).contiguous() (3457), gather + index_select + .view(-1, ...) (3461-3480), per step
    # q.select(0, i).contiguous() (3629) and x[start:end].movedim(0, 0).contiguous() for k_ag, v_ag (3647-3651);
    # backward: the same, plus out.select / dout.select (4217-4232) of out_fp8._data / dO_quantizer(dout)._data
    torch = pytest.importorskip("torch")
    cp, b = 2, 1
    flat = torch.zeros(TC * b * QKV_W, dtype=torch.uint8)
    nq, nk = TC * b * A_T * D, TC * b * G_T * D
    q = flat[:nq].view(TC, b, A_T, D)
    k = flat[nq:nq + nk].view(TC, b, G_T, D)
    k_local = k.movedim(0, 0).contiguous()
    assert k_local.data_ptr() == k.data_ptr()                       # already sequence-first: no copy
    q = q.view(2, TC // 2, b, A_T, D)
    k_ag = torch.cat([k_local] * cp).view(2 * cp, TC // 2, b, G_T, D)   # stands for gather_along_first_dim
    k_ag = torch.index_select(k_ag, 0, torch.tensor([0, 3, 1, 2])).view(-1, b, G_T, D)
    # rank 0's steps: chunk 0 sees K/V chunk 0, chunk 2 CP - 1 the whole gathered K/V (causal, DualChunkSwap)
    for i, (start, end) in enumerate([(0, TC // 2), (0, cp * TC)]):
        q_part = q.select(0, i).contiguous()
        k_part = k_ag[start:end].movedim(0, 0).contiguous()
        assert q_part.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        assert k_part.untyped_storage().data_ptr() == k_ag.untyped_storage().data_ptr()
        assert (q_part.nbytes, k_part.nbytes) == (Q // 2, (end - start) * b * G_T * D)
    # the contrast the old count assumed: a slice along another dim (bshd, batch 2) is copied
    kb = torch.zeros(2, TC, G_T, D, dtype=torch.uint8).movedim(1, 0).contiguous()
    assert kb[:TC // 2].movedim(0, 1).contiguous().untyped_storage().data_ptr() != kb.untyped_storage().data_ptr()


def test_all_gather_attention_with_core_attention_recompute():
    # core_attn recompute: saved tensors unchanged; the backward's replay keeps the FP8 q, k, v, the statistics, the
    # BF16 output returned and (delayed) the FP8 output through AttnFuncWithCPAndKVAllGather.backward
    args = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--context-parallel-size", "2",
            "--cp-comm-type", "all_gather", "--recompute-granularity", "selective"]
    L = lay(*args, fp8_dot_product_attention=True, version="0.19.2")
    assert layer_activations(L).saved == layer_activations(lay(*args, version="0.19.2")).saved
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    cp = 2
    kept = (W + 512) + STATS + 2 * Q + (Q + 512)
    held = 2 * Q + Q + 2 * Q + 2 * cp * KV
    ag = held + cp * KV + (2 * Q + (2 * cp + 1) * KV) + (Q // 2 + cp * KV)   # the step's FP8 dq/dk/dv (views in)
    bf16 = (3 * 2 * Q + 10 * KV + STATS) + 2 * KV + STATS + 2 * 2 * Q   # attention_items' recompute step under CP
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + ag - bf16, 0, 0]


def _a2a_cp8(fp8):
    raw = parse_megatron_flags(BASE + fp8 + ["--context-parallel-size", "8", "--cp-comm-type", "a2a"])
    raw.args.update(fp8_dot_product_attention=True)
    return resolve(raw, world_size=32)


# --cp-comm-type a2a: TE 2.11 context_parallel.py AttnFuncWithCPAndQKVOA2A with fp8 (megatron-core hands it BF16
# q, k, v: is_input_fp8 False) and flash_attn_a2a_communicate; CP 2, the shapes above
K = TC * G_T * D                     # k (and v) elements per rank: 2 Mi


def test_a2a_peak_by_hand():
    from megatron_memguard.estimator.layers.fp8_attention import a2a_peak
    # before the attention, q 4 and k, v 1 byte: send copies 4 + 1 and receive buffers 4 + 1 when q's received
    # buffer is reordered (two more copies of 4): 18; the last step (v's reorder) holds 6 + 6 + 2 = 14
    assert a2a_peak((4, 1, 1), True) == 18
    assert a2a_peak((4,), True) == 4 * 4          # send copy, receive buffer, movedim copy, index_select output
    # after the attention, one tensor: reordered send copy, receive buffer, its contiguous copy
    assert a2a_peak((4,), False) == 3 * 4
    # dq 4, dk 1, dv 1: all three send copies (6), receive buffers of dq and dk (5), dq's contiguous copy (4)
    assert a2a_peak((4, 1, 1), False) == 15


@pytest.mark.parametrize("te,n_stats", TE_STATS)
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_a2a_attention_saved_by_hand(recipe, te, n_stats):
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    env = {"MEMGUARD_TE_VERSION": te} if te else None
    bf16_att = layer_activations(lay(*fp8, env=env)).saved
    got = layer_activations(lay(*fp8, env=env, fp8_dot_product_attention=True)).saved
    # ctx.fp8 saves the exchanged FP8 q, k, v (three tensors, the one buffer's scale shared) instead of the BF16 ones
    # (BF16 a2a: cp_a2a_qkv, 2 W bytes; layers/cp_attention.py); no ring buffer, no rope'd q in either
    assert bf16_att["cp_a2a_qkv"] == 2 * W and "cp_a2a_qkv" not in got
    for name in ("query_rope", "cp_kv_buffer"):
        assert name not in bf16_att and name not in got
    assert got["fp8_attention_qkv"] == Q + 2 * K + 512 == W + 512
    # the FP8 kernel's M and ZInv (TE <= 2.14; one from 2.15), fp32 [b, a/CP, s] each = 1 x 16 x 4096 x 4 bytes
    assert got["softmax_stats"] == n_stats * STATS == n_stats * 1 * A_T * TC * 4
    if recipe == "delayed":
        # out_part: the kernel's FP8 output before its all-to-all (the BF16 one returned is linear_proj's to quantize)
        assert got["proj_input"] == Q + 512 and "cp_a2a_attention_output" not in got
    else:
        # out_part: the BF16 output before its all-to-all; linear_proj keeps the exchanged BF16 one it reads
        assert got["proj_input"] == bf16_att["proj_input"] == 2 * Q and got["cp_a2a_attention_output"] == 2 * Q
    delta = sum(got.values()) - sum(bf16_att.values())
    # against the BF16 a2a (exchanged BF16 q, k, v 2 W, one statistic, its BF16 output before the exchange 2 Q next
    # to linear_proj's): W + 512 instead of 2 W, one statistic more (TE <= 2.14), and delayed the FP8 output (Q + 512)
    # in place of the BF16 one (the exchanged BF16 output is kept by no one: linear_proj keeps its quantized copy,
    # fp8_proj_input, in both), tensorwise the same second BF16 output
    base = W + 512 - 2 * W + (n_stats - 1) * STATS
    assert delta == (base + Q + 512 - 2 * Q if recipe == "delayed" else base)
    # proj_input is the attention's (FP8) output under delayed scaling, linear_proj's alone under tensorwise (what
    # offloading's groups and PEFT's frozen linear_proj read)
    from megatron_memguard.estimator.layers.attention import attention_keeps_proj_input
    assert attention_keeps_proj_input(got) == (recipe == "delayed")


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_a2a_attention_working_sets_by_hand(recipe):
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay("--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2", "--cp-comm-type", "a2a",
            fp8_dot_product_attention=True)
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    delayed = recipe == "delayed"
    Mi = 2 ** 20
    alive = 2 * Q + 2 * K                    # Megatron's rope'd BF16 q and v made contiguous (FusedAttention.forward)
    # combine_and_quantize: BF16 concatenation [W] next to its FP8 copy
    assert f.fwd_steps[0][1] == alive + 2 * W + W + 512 == 56 * Mi + 512
    # the all-to-all of FP8 q (8 Mi), k, v (2 Mi each) next to the FP8 buffer: peak 4 q + 2 k (q's reorder)
    assert f.fwd_steps[1][1] == alive + W + 512 + 4 * Q + 2 * K == 68 * Mi + 512
    if delayed:
        # the saved FP8 output, its exchange (3 Q) or the exchanged FP8 output and its BF16 dequantization (Q + 2 Q)
        assert f.fwd_steps[2][1] == alive + W + 512 + Q + 512 + 3 * Q == 64 * Mi + 1024
    else:
        # the BF16 output's exchange (3 x 2 Q); the output saved before it is counted in the saved tensors
        assert f.fwd_steps[2][1] == alive + W + 512 + 3 * 2 * Q == 80 * Mi + 512
    # backward: BF16 dO handed in (2 Q) and its FP8 copy (Q + 512), then the largest of: dO's exchange (4 Q);
    # the exchanged dO, the kernel's dq, dk, dv and their exchange (peak: send copies, two receive buffers and
    # dq's contiguous copy); delayed, combine_and_dequantize: exchanged dO, kernel and exchanged FP8 gradients,
    # their concatenation (3 W) and its BF16 dequantization (2 W)
    if delayed:
        bwd = 2 * Q + Q + 512 + max(4 * Q, Q + W + (W + 2 * Q + K), Q + 3 * W + 2 * W)
        assert bwd == 92 * Mi + 512
    else:
        bwd = 2 * Q + Q + 512 + max(4 * Q, Q + 2 * W + 2 * (W + 2 * Q + K))
        assert bwd == 116 * Mi + 512
    # attention.py _cp_attention_items' backward (BF16 k: kv1 = KV bytes): the BF16 dO handed in and the ring's own
    bf16_ring = 2 * Q + 3 * 2 * Q + 10 * KV + STATS
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, bwd - bf16_ring, 0, 0]
    assert {"fp8_attention_qkv", "cp_a2a_attention_output"} <= f.bwd_steps[2][0]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_a2a_estimate_moves_by_the_layers_saved_bytes(recipe):
    # the stage's layer_activations move by 16 layers x 2 micro-batches in flight x the per-layer change counted by
    # hand in test_a2a_attention_saved_by_hand (FP8 q, k, v at 1 B/elem against BF16 a2a's; delayed keeps its
    # output in FP8)
    gpu = lookup_gpu("H100-80GB")
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "2", "--cp-comm-type", "a2a"]
    t_off = {t.name: t.bytes for t in estimate(lay(*fp8), gpu=gpu).stages[0].terms}
    t_on = {t.name: t.bytes for t in estimate(lay(*fp8, fp8_dot_product_attention=True), gpu=gpu).stages[0].terms}
    base = W + 512 - 2 * W               # one statistic, as BF16 attention's (TE 2.20.2)
    per_layer = base + Q + 512 - 2 * Q if recipe == "delayed" else base
    assert t_on["layer_activations"] - t_off["layer_activations"] == 16 * 2 * per_layer


def test_a2a_attention_with_core_attention_recompute():
    # the checkpoint keeps the BF16 q, k, v (saved unchanged); the backward's replay keeps the a2a function's saved
    # tensors and the BF16 output it returns through its backward
    args = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--context-parallel-size", "2", "--cp-comm-type",
            "a2a", "--recompute-granularity", "selective"]
    assert layer_activations(lay(*args, fp8_dot_product_attention=True)).saved == layer_activations(lay(*args)).saved
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay(*args, fp8_dot_product_attention=True)
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    kept = (W + 512) + STATS + (Q + 512) + 2 * Q     # one statistic (TE 2.20.2)
    bwd = 2 * Q + Q + 512 + Q + 3 * W + 2 * W
    bf16 = (3 * 2 * Q + 10 * KV + STATS) + 2 * KV + STATS + 2 * 2 * Q   # attention_items' recompute step under CP
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + bwd - bf16, 0, 0]


MLA = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--multi-latent-attention",
       "--q-lora-rank", "256", "--kv-lora-rank", "128", "--qk-head-dim", "64", "--qk-pos-emb-head-dim", "32",
       "--v-head-dim", "64", "--seq-length", "4096", "--max-position-embeddings", "4096", "--micro-batch-size", "1",
       "--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--swiglu",
       "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--bf16", "--vocab-size", "32000",
       "--use-distributed-optimizer", "--fp8-format", "hybrid"]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_multi_latent_attention_by_hand(recipe):
    n_stats = 1     # the TE 2.20.2 kernel's one statistic (megatron-core 0.19)
    # MLASelfAttention hands TE contiguous query, key [s b, a/t, 64 + 32] and value [s b, a/t, 64]; FusedAttnFunc
    # (TE 2.11 / 2.20.2) keeps one FP8 buffer of all three (combine_and_quantize, sbhd_sbhd_sbhd), its statistic(s), the
    # output (FP8 under delayed scaling) of v's width
    def mla(*extra, world_size=2, **config):
        raw = parse_megatron_flags(MLA + ["--fp8-recipe", recipe] + list(extra))
        raw.args.update(config)
        return resolve(raw, world_size=world_size)
    tf, a_t = 4096, 8
    bf16_att = layer_activations(mla()).saved
    L = mla(fp8_dot_product_attention=True)
    assert any("multi-latent attention" in n for n in L.notes)
    got = layer_activations(L).saved
    assert bf16_att["query"] == bf16_att["key"] == 2 * tf * a_t * 96 and bf16_att["value"] == 2 * tf * a_t * 64
    assert not {"query", "key", "value"} & set(got)
    assert got["fp8_attention_qkv"] == tf * a_t * (96 + 96 + 64) + 512
    assert got["softmax_stats"] == n_stats * bf16_att["softmax_stats"] == n_stats * a_t * tf * 4
    assert got["proj_input"] == (tf * a_t * 64 + 512 if recipe == "delayed" else 2 * tf * a_t * 64)
    # the planner's lower bound counts q, k, v and the output at 1 B/elem (and the norm output [T, h] BF16): below
    # what the layer keeps
    from megatron_memguard.estimator.layers import mla as mla_recipe
    bound = mla_recipe.bound_saved(L, 2, 1, 4096, True, set())
    assert bound == 2048 * 1024 * 2 + tf * a_t * (96 + 96 + 64) + tf * a_t * 64 <= sum(got.values())
    # under context parallelism TE 2.11 has no backend: FusedAttention refuses FP8 MLA with CP, FlashAttention FP8
    # with CP, UnfusedDotProductAttention CP (get_attention_backend)
    with pytest.raises(ConfigError, match="fp8.dot.product.attention.*multi-latent attention under context"):
        mla("--context-parallel-size", "2", world_size=4, fp8_dot_product_attention=True)


def test_bridge_config_carries_it(tmp_path):
    text = FLAT.replace("  bf16: true\ntrain", "  bf16: true\n  fp8: hybrid\n  fp8_recipe: delayed\n"
                        "  fp8_dot_product_attention: true\ntrain").replace("mixed_precision: bf16_mixed\n", "")
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    raw = read_config_file(str(p))
    assert raw.args["fp8_dot_product_attention"] is True
    L = resolve(raw, world_size=8)
    assert L.fp8_spec.fp8_dot_product_attention
    assert "fp8_attention_qkv" in layer_activations(L).saved


def test_bridge_config_a2a_heads_rule(tmp_path):
    # the Bridge shape (8 heads, 2 query groups, TP 2): k has 1 head per TP rank, which TE's all-to-all cannot split
    # over CP 2 (AttnFuncWithCPAndQKVOA2A: "The number of attention heads needs to be divisible by CP size!")
    text = FLAT.replace("  bf16: true\ntrain", "  bf16: true\n  fp8: hybrid\n  fp8_recipe: delayed\n"
                        "  fp8_dot_product_attention: true\n  cp_comm_type: a2a\ntrain").replace(
        "mixed_precision: bf16_mixed\n", "").replace("context_parallel_size: 1", "context_parallel_size: 2")
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    raw = read_config_file(str(p))
    assert raw.args["cp_comm_type"] == "a2a" and raw.args["context_parallel_size"] == 2
    with pytest.raises(ConfigError, match="cp_comm_type.*query groups \\(1\\).*2 ranks"):
        resolve(raw, world_size=8)


def _two_level_and_ring(recipe: str, version: str):
    """FP8 attention at CP 4 as an all-to-all over 2 ranks around a ring over 2, and as a plain ring over 4."""
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe, "--context-parallel-size", "4"]
    two = lay(*fp8, "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes", "2", "2",
              fp8_dot_product_attention=True, version=version)
    return two, lay(*fp8, fp8_dot_product_attention=True, version=version)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_two_level_a2a_p2p_by_hand(recipe):
    # --cp-comm-type a2a+p2p, --hierarchical-context-parallel-sizes 2 2 (CP 4: an all-to-all over 2 ranks around a
    # ring over 2), megatron-core 0.16.1 / TE 2.11 AttnFuncWithCPAndKVP2P with cp_size_a2a 2: seq 8192 / 4 = 2048
    # tokens per rank; in Mi: q 4 (and the output), k 1, v 1, W 6 elements; e = 2
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    two, ring = _two_level_and_ring(recipe, "0.16.1")
    Mi = 2 ** 20
    Q4, K4, KV4, W4, ST4 = 4 * Mi, Mi, 2 * Mi, 6 * Mi, 1 * A_T * 2048 * 4
    # the exchange trades sequence for heads: the ring's saved tensors keep their bytes (the whole FP8 q, k, v
    # buffer, the last FP8 ring buffer, one statistic, the output)
    saved = layer_activations(two).saved
    assert saved == layer_activations(ring).saved
    assert saved["fp8_attention_qkv"] == W4 + 512 and saved["cp_kv_buffer"] == KV4
    m = attention(two, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(two, m)
    alive = 2 * Q4 + 2 * K4                  # Megatron's rope'd BF16 q, v made contiguous
    # 1. megatron's BF16 q (8 Mi bytes), k, v (2 Mi each) exchanged: peak at q's reorder, 4 q + 2 k = 36 Mi
    # 2. combine_and_quantize of the exchanged BF16 q, k, v (2 W): their concatenation (2 W) and FP8 copy (W)
    # 3. the ring over 2 ranks (TE 2.11: 1 other ring buffer, 2 partial outputs in fp32 with their statistics),
    #    the fp32 output (16 Mi) and its exchange (send copy, receive buffer, reordered copy: 48 Mi), next to the
    #    exchanged BF16 q (8 Mi)
    assert [w for _, w in f.fwd_steps[:3]] == [alive + 36 * Mi, alive + 5 * W4 + 512,
                                               alive + KV4 + 2 * (4 * Q4 + ST4) + 16 * Mi + 48 * Mi + 2 * Q4]
    # backward: the ring's buffers over 2 ranks (FP8 dO, BF16 dO, K/V receive, dK/dV send and receive of 2 x KV,
    # half the statistics) and, delayed, dq_buffer of 2 x q; then the largest of: [out, dO] exchanged (delayed FP8
    # out 4 + dO 4 Mi: 24 Mi), the ring's steps with both exchanged kept (delayed: the end's fp32 dequantization
    # of 2 x W and sums, 72 Mi), the gradients' exchange (delayed: BF16 dq 8, dk 2, dv 2 Mi: 30 Mi next to them;
    # tensorwise: the fp32 accumulators' dq 16, dk 4, dv 4 Mi bytes: send copies 24, receive buffers of dq and dk
    # 20, dq's contiguous copy 16: 60 Mi)
    common = Q4 + 512 + 2 * Q4 + KV4 + 2 * 2 * KV4 + ST4 // 2
    if recipe == "delayed":
        ring_bwd = common + 2 * Q4 + max(2 * Q4 + 72 * Mi, 2 * Q4 + 2 * W4 + 30 * Mi, 24 * Mi)
        assert ring_bwd == 110 * Mi + ST4 // 2 + 512
    else:
        # (fp32 dq and dK/dV accumulators 4 W; [out, dO] exchanged: BF16 out 8 + dO 4 Mi, 40 Mi at out's reorder)
        ring_bwd = common + 4 * W4 + max(3 * Q4 + 6 * W4 + 2 * Q4, 3 * Q4 + 60 * Mi, 40 * Mi)
        assert ring_bwd == 118 * Mi + ST4 // 2 + 512
    bf16_ring = 2 * Q4 + 3 * 2 * Q4 + 10 * 2 * K4 + ST4   # attention.py _cp_attention_items' backward (dO + own)
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, ring_bwd - bf16_ring, 0, 0]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_two_level_a2a_p2p_te_2_20_by_hand(recipe):
    # the same layout on megatron-core 0.19.2, paired with TE 2.20.2: AttnFuncWithCPAndKVP2P with cp_size_a2a 2
    # (context_parallel.py) double-buffers the ring (two K/V buffers, two partial outputs), casts the fp32 output to
    # a BF16 copy before its exchange (out_part = out.to(fwd_nominal_dtype)), saved under tensorwise
    # (NVTE_DPA_FP8CS_O_in_F16: f16_tensors = (None, None, out_f16), out_f16 = out_part) and alive to the forward's
    # end under delayed; its backward quantizes dO first (dout_fp8 = dO_quantizer(dout)) and exchanges only dO's
    # FP8 bytes (the saved output is in the ring's layout already)
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    two, ring = _two_level_and_ring(recipe, "0.19.2")
    Mi = 2 ** 20
    Q4, K4, KV4, W4, ST4 = 4 * Mi, Mi, 2 * Mi, 6 * Mi, 1 * A_T * 2048 * 4
    saved, ring_saved = layer_activations(two).saved, layer_activations(ring).saved
    # the plain ring over 4 ranks saves out_part too (test_ring_attention_saved_by_hand): the same bytes
    assert saved == ring_saved
    if recipe == "delayed":
        assert "cp_a2a_attention_output" not in saved
    else:
        # out_part: the BF16 output [2048, 16 x 128] before its exchange, next to the BF16 one linear_proj reads
        assert saved["cp_a2a_attention_output"] == 2 * Q4
    m = attention(two, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(two, m)
    alive = 2 * Q4 + 2 * K4
    # 3. the ring over 2 ranks (2 K/V buffers besides the saved one, 2 partial outputs in fp32 with their statistics),
    #    out_part (8 Mi), then the fp32 output (16 Mi) and its exchange (48 Mi), next to the exchanged BF16 q (8 Mi)
    assert [w for _, w in f.fwd_steps[:3]] == [alive + 36 * Mi, alive + 5 * W4 + 512,
                                               alive + 2 * KV4 + 2 * (4 * Q4 + ST4) + 8 * Mi + 16 * Mi + 48 * Mi
                                               + 2 * Q4]
    # backward: the exchanged FP8 dO (4 Mi) kept through the ring instead of TE 2.11's exchanged out and dO; dO's
    # exchange alone peaks at 16 Mi (send copy, receive buffer, reorder's two copies)
    common = Q4 + 512 + 2 * Q4 + KV4 + 2 * 2 * KV4 + ST4 // 2
    if recipe == "delayed":
        ring_bwd = common + 2 * Q4 + max(Q4 + 72 * Mi, Q4 + 2 * W4 + 30 * Mi, 16 * Mi)
        assert ring_bwd == 106 * Mi + ST4 // 2 + 512
    else:
        ring_bwd = common + 4 * W4 + max(Q4 + 6 * W4 + 2 * Q4, Q4 + 60 * Mi, 16 * Mi)
        assert ring_bwd == 110 * Mi + ST4 // 2 + 512
    bf16_ring = 2 * Q4 + 3 * 2 * Q4 + 10 * 2 * K4 + ST4   # attention.py _cp_attention_items' backward (dO + own)
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, ring_bwd - bf16_ring, 0, 0]
    if recipe == "tensorwise":
        assert "cp_a2a_attention_output" in f.bwd_steps[2][0]       # released with the attention's saved tensors


# --- the mxfp8 recipe (megatron-core 0.19.2 with TE 2.20.2) ---
# TE 2.20.2 attention/dot_product_attention/backends.py FusedAttnFunc.forward: fp8_tensors = (q_fp8, k_fp8, v_fp8,
# None), f16_tensors = (None, None, None, out_f16) for qkv_type "mxfp8"; utils.py get_attention_quantizers turns
# columnwise usage on for the MXFP8 QKV and dO quantizers; combine_and_quantize (used_in_forward and
# used_in_backward) keeps both usages; mxfp8_transpose_swizzle re-lays the E8M0 scales into one rowwise buffer
# [b, h, s, align4(d/32)] and one columnwise buffer [b, h, s/32, align128(d)] for q, k, v together.
MX = ("--fp8-format", "e4m3", "--fp8-recipe", "mxfp8")


def test_mxfp8_attention_tensors_by_hand():
    from megatron_memguard.estimator.layers.fp8_attention import mxfp8_attention_tensors
    # Llama-3.1-8B per TP-2 rank, 8192 tokens: q 16 heads, k and v 4 heads, d 128: rowwise and columnwise data
    # (2 B/elem), 128/32 = 4 scales per row (no padding), 8192/32 = 256 column-scale rows of 128
    assert mxfp8_attention_tensors(TF, ((16, 128), (4, 128), (4, 128))) == (
        2 * TF * 3072 + TF * 24 * 4 + TF // 32 * 24 * 128) == 51_904_512
    # MLA's q/k head dim 192: 6 row scales padded to 8, 192 columns padded to 256; v 128
    assert mxfp8_attention_tensors(256, ((2, 192), (2, 192), (2, 128))) == (
        2 * 256 * 2 * (192 + 192 + 128) + 256 * 2 * (8 + 8 + 4) + 8 * 2 * (256 + 256 + 128))
    # one 32 x 32 block: 1 KiB of data each way; 1 row scale per token padded to 4 (128 B), 1 x 128 column
    # scales (128 B): the two scale buffers round up to a 512-byte allocator block each
    assert mxfp8_attention_tensors(32, ((1, 32),)) == 2 * 1024 + 512 + 512


def test_mxfp8_saved_tensors_by_hand():
    bf16_att = layer_activations(lay(*MX, version="0.19.2")).saved
    got = layer_activations(lay(*MX, fp8_dot_product_attention=True, version="0.19.2")).saved
    # the BF16 q, k, v the attention kept are gone (qkv output, rope'd q and k)
    for name in ("qkv_output", "query_rope", "key_rope"):
        assert name in bf16_att and name not in got
    # MXFP8 q, k, v, rowwise + columnwise, with their scales (1/32 of the data each way, d = 128)
    assert got["fp8_attention_qkv"] == 2 * TF * QKV_W + 2 * TF * QKV_W // 32
    # one fp32 statistic [b, a, s, 1], as in BF16 (backends.py: softmax_stats, rng_state, *aux = aux_ctx_tensors)
    assert got["softmax_stats"] == bf16_att["softmax_stats"] == A_T * 8192 * 4
    # the output stays BF16 (FusedAttnSpec o = model precision) and is saved once, as proj_input
    assert got["proj_input"] == bf16_att["proj_input"] == 2 * TF * CTX
    for name in ("qkv_input", "fc1_input", "fc2_input"):
        assert got.get(name) == bf16_att.get(name)
    saved_bf16 = 2 * TF * (QKV_W + CTX + G_T * D)
    assert sum(got.values()) - sum(bf16_att.values()) == got["fp8_attention_qkv"] - saved_bf16


def test_mxfp8_working_sets_by_hand():
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = lay(*MX, fp8_dot_product_attention=True, version="0.19.2")
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    bf16_qkv = 2 * TF * (QKV_W + CTX + G_T * D)          # qkv output, rope'd q and k: alive during the forward
    qkv8 = 2 * TF * QKV_W + 2 * TF * QKV_W // 32
    # get_qkv_layout (TE 2.20.2 utils.py): the rope'd q and k are new tensors, v a strided view of the qkv output:
    # no packed layout matches, so v is made contiguous (a BF16 copy [Tf, g d / TP])
    v_copy = 2 * TF * G_T * D
    # quantization: the BF16 q, k, v and their MXFP8 copies (no concatenation, unlike the per-tensor recipes)
    assert f.fwd_steps[0][1] == bf16_qkv + v_copy + qkv8
    # the kernel's BF16 output
    assert f.fwd_steps[1][1] == bf16_qkv + v_copy + 2 * TF * CTX
    # backward at the core attention: dO in MXFP8 rowwise + columnwise with its scales; dq, dk, dv are BF16
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, 2 * TF * CTX + 2 * TF * CTX // 32, 0, 0]
    assert "fp8_attention_qkv" in f.bwd_steps[2][0] and "fp8_attention_qkv" not in f.bwd_steps[1][0]
    # core_attn recompute: saved tensors unchanged, the replay's MXFP8 q, k, v and dO at the core step
    R = lay(*MX, "--recompute-granularity", "selective", "--recompute-modules", "core_attn",
            fp8_dot_product_attention=True, version="0.19.2")
    m = attention(R, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(R, m)
    assert f.saved == m.saved and f.fwd_steps == m.fwd_steps
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, qkv8 + 2 * TF * CTX + 2 * TF * CTX // 32,
                                                                         0, 0]


def test_mxfp8_estimate_moves_by_the_layers_saved_bytes():
    gpu = lookup_gpu("B200")
    off, on = lay(*MX, version="0.19.2"), lay(*MX, fp8_dot_product_attention=True, version="0.19.2")
    per_layer = layer_activations(off).total - layer_activations(on).total
    t_off = {t.name: t.bytes for t in estimate(off, gpu=gpu).stages[0].terms}
    t_on = {t.name: t.bytes for t in estimate(on, gpu=gpu).stages[0].terms}
    # 16 layers on pp0, 2 micro-batches in flight on the first of 2 stages (1F1B warm-up)
    assert per_layer > 0 and t_off["layer_activations"] - t_on["layer_activations"] == 16 * 2 * per_layer
    assert t_on["parameters"] == t_off["parameters"]


def test_mxfp8_shape_rules():
    # combine_and_quantize (TE 2.20.2 utils.py): "MXFP8 quantization requires s_q % 128 == 0, ... d_qk % 32 == 0"
    with pytest.raises(ConfigError, match="fp8.dot.product.attention.*seq-length divisible by 128.*got 8000"):
        lay(*MX, "--seq-length", "8000", "--max-position-embeddings", "8192", fp8_dot_product_attention=True,
            version="0.19.2")
    with pytest.raises(ConfigError, match="fp8.dot.product.attention.*head dim divisible by 32.*kv_channels 80"):
        lay(*MX, "--kv-channels", "80", fp8_dot_product_attention=True, version="0.19.2")


def test_mxfp8_softmax_and_sliding_window():
    # TE 2.20.2 get_attention_backend keeps FP8 FusedAttention for a non-vanilla softmax and a sliding window on
    # SM >= 10.0 with cuDNN >= 9.21 (utils.py "Filter: softmax type" / "sliding window"), where MXFP8 attention
    # runs anyway (GPT-OSS's sinks and 128-token window in Bridge 0.6.2's fp8mx perf recipes): sized, with a note;
    # the delayed recipe's TE 2.11 errors stay (test_refused_and_rejected_corners)
    L = lay(*MX, "--softmax-type", "learnable", "--window-size", "128,0", fp8_dot_product_attention=True,
            version="0.19.2")
    assert L.fp8_spec.fp8_dot_product_attention
    assert any("--softmax-type learnable and a sliding --window-size" in n for n in L.notes)
    got = layer_activations(L).saved
    # the window and the sinks change no tensor the MXFP8 attention keeps: q, k, v as by hand above
    assert got["fp8_attention_qkv"] == 2 * TF * QKV_W + 2 * TF * QKV_W // 32
    assert "query_rope" not in got and got["softmax_stats"] == A_T * 8192 * 4


def test_bridge_config_mxfp8(tmp_path):
    # a Bridge run_config under the mxfp8 recipe with fp8_dot_product_attention (Bridge 0.6.2's Blackwell perf
    # recipes: Qwen3-MoE, Nemotron-H), read for megatron-core 0.19.2: the MXFP8 attention is sized (2 B/elem of
    # q, k, v + E8M0 scales), not refused
    text = FLAT.replace("  bf16: true\ntrain", "  bf16: true\n  fp8: e4m3\n  fp8_recipe: mxfp8\n"
                        "  fp8_dot_product_attention: true\ntrain").replace("mixed_precision: bf16_mixed\n", "")
    p = tmp_path / "run_config.yaml"
    p.write_text(textwrap.dedent(text))
    L = resolve(read_config_file(str(p)), world_size=8, megatron_version="0.19.2")
    assert L.fp8_spec.fp8_dot_product_attention and L.fp8_spec.recipe == "mxfp8"
    from megatron_memguard.estimator.layers.base import shapes
    from megatron_memguard.estimator.layers.fp8_attention import mxfp8_attention_tensors
    x = shapes(L)
    qkv = ((x.a_t, x.d), (x.g_t, x.d), (x.g_t, x.d))
    assert layer_activations(L).saved["fp8_attention_qkv"] == mxfp8_attention_tensors(x.Tf, qkv) > 2 * x.Tf * (
        x.a_t + 2 * x.g_t) * x.d


def test_mxfp8_multi_latent_attention_by_hand():
    # MLASelfAttention hands TE contiguous query, key [s b, a/t, 64 + 32] and value [s b, a/t, 64] (no copies);
    # under mxfp8 (TE 2.20.2) each is kept rowwise and columnwise: q/k dim 96 -> 3 row scales padded to 4 and 96
    # column scales padded to 128 per 32 tokens; v dim 64 -> 2 row scales padded to 4, 64 padded to 128
    raw = parse_megatron_flags(MLA + ["--fp8-format", "e4m3", "--fp8-recipe", "mxfp8"])
    raw.args.update(fp8_dot_product_attention=True)
    L = resolve(raw, world_size=2, megatron_version="0.19.2")
    tf, a_t = 4096, 8
    got = layer_activations(L).saved
    assert not {"query", "key", "value"} & set(got)
    data = 2 * tf * a_t * (96 + 96 + 64)
    row = tf * a_t * (4 + 4 + 4)
    col = tf // 32 * a_t * (128 + 128 + 128)
    assert got["fp8_attention_qkv"] == data + row + col
    assert got["softmax_stats"] == a_t * tf * 4 and got["proj_input"] == 2 * tf * a_t * 64


# MXFP8 attention under the CP ring (TE 2.20.2 context_parallel.py AttnFuncWithCPAndKVP2P, fp8_recipe.mxfp8()):
# nothing is quantized up front; each step quantizes its own q, k, v (and dO) parts. The CPU referee cannot run FP8
# (no Blackwell GPU, no cuDNN): every number below is by hand from the source lines named.
MX_CP = MX + ("--context-parallel-size", "2")
# one step's MXFP8 q, k, v at full size, TC = 4096 tokens, d = 128 (4 row scales per token and head, 4096/32 = 128
# column-scale rows of 128): forward (utils.py 3407-3413, used_in_forward only): q and k rowwise, v columnwise;
# backward (3414-3420, used_in_backward only): q and k both ways, v rowwise; dO (dO_quantizer) both ways
FWD8 = (Q + KV) + TC * (A_T + G_T) * 4 + TC // 32 * G_T * 128
BWD8 = (2 * Q + KV + KV // 2) + TC * (A_T + 2 * G_T) * 4 + TC // 32 * (A_T + G_T) * 128
DO8 = 2 * Q + TC * A_T * 4 + TC // 32 * A_T * 128


def test_mxfp8_usage_tensors_by_hand():
    from megatron_memguard.estimator.layers.fp8_attention import mxfp8_usage_tensors
    assert mxfp8_usage_tensors(TC, ((A_T, D, True, False), (G_T, D, True, False), (G_T, D, False, True))) == FWD8
    assert FWD8 == 12_582_912 + 327_680 + 65_536
    assert mxfp8_usage_tensors(TC, ((A_T, D, True, True), (G_T, D, True, True), (G_T, D, True, False))) == BWD8
    # no columnwise tensor: no column-scale buffer (_build_outputs returns None for an empty list)
    assert mxfp8_usage_tensors(32, ((1, 32, True, False),)) == 1024 + 512


def test_mxfp8_ring_saved_by_hand():
    bf16_att = layer_activations(lay(*MX_CP, version="0.19.2")).saved
    got = layer_activations(lay(*MX_CP, fp8_dot_product_attention=True, version="0.19.2")).saved
    # 2313-2343: fp8_tensors = (None, None, None), f16_tensors = (q, kv, out_f16) with out_f16 = out_part: the BF16
    # q, the last BF16 ring buffer [2, s/CP, b, g/t, d] and one fp32 log-sum-exp, as the BF16 ring keeps them
    assert got["query_rope"] == bf16_att["query_rope"] == 2 * Q
    assert got["cp_kv_buffer"] == bf16_att["cp_kv_buffer"] == 2 * KV
    assert got["softmax_stats"] == STATS and "fp8_attention_qkv" not in got
    # 2255 out_part = out.to(bf16) of the fp32 output (the partial outputs were cast to fp32, 2162-2165), a second
    # BF16 tensor next to the returned one (2298) linear_proj keeps: 16 MiB per layer here
    assert got["cp_a2a_attention_output"] == 2 * Q == 16 * 2 ** 20
    assert got["proj_input"] == bf16_att["proj_input"] == 2 * Q
    assert sum(got.values()) - sum(bf16_att.values()) == 2 * Q


@pytest.mark.parametrize("te,n_ring,n_out", [(None, 2, 2), ("2.15.0", 1, 2)])
def test_mxfp8_ring_working_sets_by_hand(te, n_ring, n_out):
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    env = {"MEMGUARD_TE_VERSION": te} if te else None
    L = lay(*MX_CP, env=env, fp8_dot_product_attention=True, version="0.19.2")
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    # v made contiguous (backends.py 2531); BF16 ring buffers in flight (TE 2.20: two; 2.15-2.19: every step's,
    # CP - 1 besides the saved one), partial outputs in fp32 with their fp32 statistics, the fp32 output; then
    # two steps' forward MXFP8 q, k, v (two streams) or the end's out_part and returned output (2 x 2 Q, larger)
    ring = KV + n_ring * 2 * KV + n_out * (4 * Q + STATS) + 4 * Q
    assert 2 * FWD8 < 2 * 2 * Q
    assert f.fwd_steps[0][1] == ring + 2 * 2 * Q
    assert "cp_a2a_attention_output" in f.fwd_steps[0][0]             # counted there while made, not twice
    # backward (2540-2610): BF16 dO, kv_recv_buffer (empty_like(kv): BF16), dkv_send / dkv_recv [CP, K+V] uint8,
    # half the statistics, fp32 dq_buffer and dkv_buffer; a step (1370-1397, 2875-2876): BF16 halves of q, out,
    # dO, their MXFP8 copies, BF16 dq/dk/dv and their fp32 casts
    common = 2 * Q + 2 * KV + 2 * 2 * KV + STATS // 2 + 4 * W
    ring_bwd = common + 3 * Q + BWD8 + DO8 + 2 * W + 4 * W
    bf16_ring = 2 * Q + 3 * 2 * Q + 10 * KV + STATS      # attention.py _cp_attention_items' backward
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, ring_bwd - bf16_ring, 0, 0]
    assert "cp_a2a_attention_output" in f.bwd_steps[2][0]


def test_mxfp8_ring_with_core_attention_recompute():
    # the checkpoint keeps the BF16 q, k, v (saved unchanged); the backward's replay keeps the ring's last BF16
    # buffer, the statistics, out_part and the returned output through the ring's backward
    args = MX_CP + ("--recompute-granularity", "selective")
    L = lay(*args, fp8_dot_product_attention=True, version="0.19.2")
    assert layer_activations(L).saved == layer_activations(lay(*args, version="0.19.2")).saved
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    m = attention(L, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    kept = 2 * KV + STATS + 2 * Q + 2 * Q
    ring_bwd = 2 * Q + 2 * KV + 4 * KV + STATS // 2 + 4 * W + 3 * Q + BWD8 + DO8 + 6 * W
    bf16 = (3 * 2 * Q + 10 * KV + STATS) + 2 * KV + STATS + 2 * 2 * Q   # attention_items' recompute step under CP
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + ring_bwd - bf16, 0, 0]


def test_mxfp8_ring_rules():
    # cp_p2p_fwd_fused_attn -> combine_and_quantize asserts s_q % 128 == 0 and s_kv % 128 == 0 per step; a causal
    # off-diagonal step takes half of the rank's s/CP tokens: 6400 / 2 = 3200 = 25 x 128 per rank, but 6400 / 4 =
    # 1600 = 12.5 x 128 per half step
    with pytest.raises(ConfigError, match="fp8.dot.product.attention.*256 x --context-parallel-size \\(512\\).*got 6400"):
        lay(*MX_CP, "--seq-length", "6400", fp8_dot_product_attention=True, version="0.19.2")
    assert lay(*MX_CP, "--seq-length", "6144", fp8_dot_product_attention=True,
               version="0.19.2").fp8_spec.fp8_dot_product_attention                # 1536 = 12 x 128
    # the all-gather path's steps take the same halves (3629-3670: q.select(..) of [2, s/2, ..], the K/V of chunks
    # 0 .. c): the same rule; the all-to-all quantizes the exchanged whole sequence (4790-4800): 6400 = 50 x 128 runs
    with pytest.raises(ConfigError, match="256 x --context-parallel-size \\(512\\).*got 6400"):
        lay(*MX_CP, "--cp-comm-type", "all_gather", "--seq-length", "6400", fp8_dot_product_attention=True,
            version="0.19.2")
    assert lay(*MX_CP, "--cp-comm-type", "a2a", "--seq-length", "6400", fp8_dot_product_attention=True,
               version="0.19.2").fp8_spec.fp8_dot_product_attention
    # a2a+p2p over 2 x 2: the ring's steps take halves of the s/2 tokens a rank holds after the exchange: 256 x 2
    cp4 = MX + ("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p")
    with pytest.raises(ConfigError, match="256 x the ring's size in --hierarchical-context-parallel-sizes \\(512\\)"):
        lay(*cp4, "--hierarchical-context-parallel-sizes", "2", "2", "--seq-length", "6400",
            fp8_dot_product_attention=True, version="0.19.2")
    # 4 x 1 is the all-to-all over every rank (attn_forward_func_with_cp): 6400 runs; 1 x 4 the ring over 4: 1024
    assert lay(*cp4, "--hierarchical-context-parallel-sizes", "4", "1", "--seq-length", "6400",
               fp8_dot_product_attention=True, version="0.19.2").cp_a2a_size == 4
    with pytest.raises(ConfigError, match="\\(1024\\).*got 6400"):
        lay(*cp4, "--hierarchical-context-parallel-sizes", "1", "4", "--seq-length", "6400",
            fp8_dot_product_attention=True, version="0.19.2")


# MXFP8 attention under the other CP types (TE 2.20.2 context_parallel.py, fp8_recipe.mxfp8()); the CPU referee
# cannot run FP8: by hand from the source lines named. Llama-3.1-8B TP 2 + SP, CP 2, seq 8192, core 0.19.2 (the
# shapes above: Q, K, KV, W elements per rank; BF16 bytes are twice that)
def _mx_cp(comm, *extra, fp8=True):
    return lay(*MX_CP, "--cp-comm-type", *comm, *extra, version="0.19.2",
               **({"fp8_dot_product_attention": True} if fp8 else {}))


def _scales(tokens, row_heads, col_heads):
    """E8M0 scale bytes of mxfp8_transpose_swizzle's two buffers, head dim 128: 4 per token and head rowwise, 128
    per 32 tokens and head columnwise."""
    return tokens * row_heads * 4 + tokens // 32 * col_heads * 128


# AttnFuncWithCPAndQKVOA2A after the all-to-all: [s = 8192, b, heads / 2, d] tensors (8, 2, 2 heads); q, k, v and dO
# rowwise and columnwise (combine_and_quantize with used_in_backward: the quantizers' own usages, utils.py 3037-3078)
A2A8 = 2 * W + _scales(2 * TC, 12, 12)
A2A_DO8 = 2 * Q + _scales(2 * TC, 8, 8)


def test_mxfp8_a2a_saved_by_hand():
    bf16_att = layer_activations(_mx_cp(["a2a"], fp8=False)).saved
    got = layer_activations(_mx_cp(["a2a"])).saved
    # 4974-4979 (ctx.fp8, MXFP8): fp8_tensors = (q_part, k_part, v_part, None), the exchanged q, k, v in MXFP8 (4790-
    # 4800), instead of the BF16 all-to-all's exchanged BF16 ones (cp_a2a_qkv, 2 W bytes; layers/cp_attention.py);
    # f16_tensors = (.., out_part): the kernel's BF16 output before its exchange, as in BF16
    assert bf16_att["cp_a2a_qkv"] == 2 * W and "cp_a2a_qkv" not in got
    assert got["fp8_attention_qkv"] == A2A8 == 2 * W + 768 * 2 ** 10
    assert got["cp_a2a_attention_output"] == bf16_att["cp_a2a_attention_output"] == 2 * Q
    assert got["softmax_stats"] == STATS and got["proj_input"] == 2 * Q
    # both usages of FP8 data weigh as BF16: only the scales are added, 0.75 MiB per layer per micro-batch
    # (245.64 -> 246.39 MiB; the MXFP8 p2p ring keeps 245.64)
    delta = sum(got.values()) - sum(bf16_att.values())
    assert delta == A2A8 - 2 * W == 786_432
    assert round(sum(got.values()) / 2 ** 20, 2) == 246.39
    assert sum(layer_activations(_mx_cp(["p2p"])).saved.values()) == sum(bf16_att.values())


def test_mxfp8_a2a_working_sets_by_hand():
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = _mx_cp(["a2a"])
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    alive = 2 * Q + 2 * K                # Megatron's rope'd BF16 q and v made contiguous (FusedAttention.forward)
    # 4725-4733 and 4744-4758: the BF16 q (16 Mi bytes), k, v (4 Mi each) exchanged (flash_attn_a2a_communicate: peak
    # at q's reorder, 4 q + 2 k); 4790-4800: the exchanged BF16 q, k, v (the q, k, v locals, alive to the forward's
    # end) next to their MXFP8 copies; 4915-4925: the kernel's BF16 output (saved, out_part) exchanged back (send
    # copy, receive buffer, contiguous copy: 3 x 2 Q) next to them
    assert [w for _, w in f.fwd_steps[:3]] == [alive + 4 * 2 * Q + 2 * 2 * K, alive + 2 * W + A2A8,
                                              alive + 2 * W + 3 * 2 * Q]
    # backward (5083-5190): the BF16 dO handed in (2 Q) and its exchange (4 x 2 Q); then the exchanged dO (kept:
    # aux_ctx_tensors.append(dout)), its MXFP8 copy both ways, the kernel's BF16 dq, dk, dv and their exchange
    # (send copies 2 W, receive buffers of dq and dk, dq's contiguous copy)
    bwd = 2 * Q + max(8 * Q, 2 * Q + A2A_DO8 + 2 * W + (2 * W + 4 * Q + 2 * K))
    bf16_ring = 2 * Q + 3 * 2 * Q + 10 * KV + STATS      # attention.py _cp_attention_items' backward
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, bwd - bf16_ring, 0, 0]
    assert {"fp8_attention_qkv", "cp_a2a_attention_output"} <= f.bwd_steps[2][0]
    # core_attn recompute: saved unchanged (the checkpoint's BF16 q, k, v); the replay keeps the MXFP8 q, k, v,
    # the statistic, out_part and the returned output through the backward
    args = ("--recompute-granularity", "selective")
    R = _mx_cp(["a2a"], *args)
    assert layer_activations(R).saved == layer_activations(_mx_cp(["a2a"], *args, fp8=False)).saved
    m = attention(R, {"core_attn"}, True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(R, m)
    kept = A2A8 + STATS + 2 * Q + 2 * Q
    bf16 = bf16_ring + 2 * KV + STATS + 2 * Q           # attention_items' recompute step under CP
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, kept + bwd - bf16, 0, 0]


def test_mxfp8_all_gather_saved_by_hand():
    # 3906-3916 (ctx.fp8, MXFP8: "q/k/v/o all in f16"): f16_tensors = (q, k, v, out_f16): Megatron's rope'd q (a
    # view), the local k and v ([s/CP, b, g/t, d], .contiguous() at 3457: v's copy), the output returned (linear_proj's
    # proj_input) and softmax_lse_per_step of both steps (two halves of [b, a/t, s/CP]): the BF16 ring's bytes, no
    # out_part (the ring's 2255 has no counterpart here) and no MXFP8 tensor
    bf16_ring = layer_activations(_mx_cp(["p2p"], fp8=False)).saved
    got = layer_activations(_mx_cp(["all_gather"])).saved
    assert got == layer_activations(_mx_cp(["all_gather"], fp8=False)).saved == bf16_ring
    assert got["query_rope"] == 2 * Q and got["cp_kv_buffer"] == 2 * KV and got["softmax_stats"] == STATS
    assert "cp_a2a_attention_output" not in got and "fp8_attention_qkv" not in got
    # against the MXFP8 p2p ring: its out_part, 16 MiB per layer per micro-batch, is not kept (229.64 MiB)
    ring = layer_activations(_mx_cp(["p2p"])).saved
    assert sum(ring.values()) - sum(got.values()) == 2 * Q == 16 * 2 ** 20
    assert round(sum(got.values()) / 2 ** 20, 2) == 229.64


def test_mxfp8_all_gather_working_sets_by_hand():
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    L = _mx_cp(["all_gather"])
    m = attention(L, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(L, m)
    cp, wide = 2, 2 * TC                 # the widest step (rank 0's chunk 2 CP - 1) sees the whole gathered K/V
    # forward (3432-3481): nothing quantized up front; k, v gathered in BF16 and index_select'ed (k_ag, v_ag: cp x the
    # local K/V, 2 x 2 KV bytes); a step (3629-3670): q.select(..).contiguous() and the K/V slice are views (backends.py
    # 2531 made q contiguous before the CP function; dim-0 slices, test_all_gather_step_inputs_are_views), their
    # MXFP8 copies (used_in_forward only: q and k rowwise, v columnwise); out_per_step of both steps (2 Q) and out_f16
    # (2 Q, 3495) in BF16, TE >= 2.18's zeroed out (2 Q, 3513)
    fwd8 = Q // 2 + 2 * K * cp + _scales(TC // 2, A_T, 0) + _scales(wide, G_T, G_T)
    gathered = 2 * cp * KV
    assert f.fwd_steps[0][1] == gathered + fwd8 + 2 * Q + 2 * Q + 2 * Q
    # backward (4035-4300): dO (BF16, not quantized up front), dq (torch.empty, BF16), dk / dv zeros of cp x TC rows
    # (BF16), k_ag / v_ag gathered again (BF16); a step: the halves of q, out, dO (views of contiguous tensors, 4217-
    # 4232: no bytes), the MXFP8 q
    # and k both ways and v rowwise (used_in_backward only), dO both ways; every step's BF16 dq/dk/dv to the end (dq's
    # halves and the K/V of chunks r and 2 CP - r - 1: (2 CP + 1) / 2 local K/V)
    bwd8 = ((Q + 2 * K * cp + K * cp) + (TC // 2 * A_T + 2 * wide * G_T) * 4
            + (TC // 2 // 32 * A_T + wide // 32 * G_T) * 128)
    do8 = Q + _scales(TC // 2, A_T, A_T)
    held = 2 * Q + 2 * Q + gathered
    collected = 2 * Q + 2 * (2 * cp + 1) * KV // 2
    ag = held + gathered + collected + bwd8 + do8
    assert bwd8 + do8 > gathered // 2                  # the steps, not the end's reorder copy of dK
    bf16_ring = 2 * Q + 3 * 2 * Q + 10 * KV + STATS      # attention.py _cp_attention_items' backward
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, ag - bf16_ring, 0, 0]


def test_mxfp8_two_level_a2a_p2p_by_hand():
    # --cp-comm-type a2a+p2p, --hierarchical-context-parallel-sizes 2 2: AttnFuncWithCPAndKVP2P with cp_size_a2a 2
    # under MXFP8 exchanges Megatron's BF16 q, k, v (1703-1722, no quantization first) and runs the MXFP8 ring over 2
    # ranks on the exchanged ones (4096 tokens, 8 / 2 / 2 heads). In Mi elements per rank (seq 8192 / 4): q 4, k 1,
    # v 1, W 6
    from megatron_memguard.estimator.layers.attention import activations as attention
    from megatron_memguard.estimator.layers.fp8_attention import fp8_attention
    cp4 = MX + ("--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                "2", "2")
    two = lay(*cp4, fp8_dot_product_attention=True, version="0.19.2")
    Mi = 2 ** 20
    Q4, K4, KV4, W4, ST4 = 4 * Mi, Mi, 2 * Mi, 6 * Mi, 1 * A_T * 2048 * 4
    # saved (2313-2343, f16_tensors = (q, kv, out_f16), out_f16 = out_part): the exchanged BF16 q, the last BF16 ring
    # buffer, one statistic and out_part: what the BF16 two-level path (TE 2.20.2) and the MXFP8 ring over 4 keep
    saved = layer_activations(two).saved
    assert saved == layer_activations(lay(*cp4, version="0.19.2")).saved
    assert saved == layer_activations(lay(*MX, "--context-parallel-size", "4", fp8_dot_product_attention=True,
                                          version="0.19.2")).saved
    assert saved["cp_a2a_attention_output"] == 2 * Q4 and saved["cp_kv_buffer"] == 2 * KV4
    m = attention(two, set(), True, False, frozenset(), frozenset(), 0)
    f = fp8_attention(two, m)
    # forward: 1. v made contiguous (2 Mi bytes) next to the exchange of q (8 Mi), k, v (2 Mi each): 4 q + 2 k = 36 Mi
    # 2. Megatron's q (8) and the exchanged k, v (4) alive next to the ring over 2 ranks: 2 BF16 K/V buffers (8),
    #    2 partial outputs in fp32 (32) with their statistics, the fp32 output (16); then (2255-2268, 2298)
    #    out_part (8) and the fp32 output's exchange (48), larger than two steps' MXFP8 q, k, v
    fwd8 = (Q4 + 2 * K4) + 4096 * (8 + 2) * 4 + 4096 // 32 * 2 * 128
    ring = 2 * 2 * KV4 + 2 * (4 * Q4 + ST4) + 4 * Q4
    assert 2 * fwd8 < 48 * Mi
    assert [w for _, w in f.fwd_steps[:2]] == [2 * Mi + 36 * Mi, 2 * Mi + 8 * Mi + 4 * Mi + ring + 8 * Mi + 48 * Mi]
    # backward (2540-2645, 3129-3147): BF16 dO (8), kv_recv_buffer (4), dkv send / recv [2, K+V] uint8 (8), half the
    # statistics, fp32 dq_buffer and dkv_buffer (24); then the exchanged BF16 dO (8) next to a ring step: the BF16
    # halves of q, out, dO (12), their MXFP8 copies, BF16 dq/dk/dv (12) and their fp32 casts (24); the fp32
    # gradients' exchange (16 + 4 + 4 Mi bytes: 60 Mi) and dO's (32 Mi) are smaller
    bwd8 = (2 * Q4 + 2 * K4 + K4) + 4096 * (8 + 2 + 2) * 4 + 4096 // 32 * (8 + 2) * 128
    do8 = 2 * Q4 + 4096 * 8 * 4 + 4096 // 32 * 8 * 128
    common = 2 * Q4 + 2 * KV4 + 2 * 2 * KV4 + ST4 // 2 + 4 * W4
    step = 3 * Q4 + bwd8 + do8 + 2 * W4 + 4 * W4
    assert 2 * Q4 + step > 2 * Q4 + 60 * Mi > 32 * Mi
    bf16_ring = 2 * Q4 + 3 * 2 * Q4 + 10 * 2 * K4 + ST4   # attention.py _cp_attention_items' backward
    assert [b[1] - a[1] for a, b in zip(m.bwd_steps, f.bwd_steps)] == [0, common + 2 * Q4 + step - bf16_ring, 0, 0]


# --- one --cp-comm-type per layer (TransformerConfig.cp_comm_type as a list of num_layers types; megatron-core 0.19.2
# transformer_layer.py 361-368: each TransformerLayer hands cp_comm_type[layer_number - 1] to its attention) ---
def _stages(L):
    """Per pipeline stage: the layer_activations term and the peak (H100; B200 for MXFP8)."""
    e = estimate(L, gpu=lookup_gpu("B200" if L.fp8_spec.recipe == "mxfp8" else "H100-80GB"))
    return [({t.name: t.bytes for t in s.terms}["layer_activations"], s.peak_allocated_bytes) for s in e.stages]


def test_per_layer_comm_types_follow_the_layers_of_each_stage():
    from megatron_memguard.partition import model_kind_runs
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", "delayed", "--context-parallel-size", "2"]
    ring, ag = (_stages(lay(*fp8, "--cp-comm-type", c, fp8_dot_product_attention=True)) for c in ("p2p", "all_gather"))
    # per layer per micro-batch the FP8 ring keeps its last K/V buffer in FP8 (cp_kv_buffer, KV = 4 MiB: test_ring_*)
    # that the all-gather path does not (test_all_gather_attention_saved_by_hand); stage 0 holds 16 layers with 2
    # micro-batches in flight (PP 2, 1F1B), stage 1 16 with 1
    assert [r[0] - a[0] for r, a in zip(ring, ag)] == [16 * 2 * KV, 16 * 1 * KV]
    # the first 16 layers p2p, the last 16 all_gather: each stage is the uniform run of its layers' type
    half = lay(*fp8, "--cp-comm-type", *(["p2p"] * 16 + ["all_gather"] * 16), fp8_dot_product_attention=True)
    assert [(k.cp_comm, n) for k, n in model_kind_runs(half)] == [("p2p", 16), ("all_gather", 16)]
    assert _stages(half) == [ring[0], ag[1]]
    # alternating: 8 layers of each type on each stage
    alt = _stages(lay(*fp8, "--cp-comm-type", *["p2p", "all_gather"] * 16, fp8_dot_product_attention=True))
    assert [t for t, _ in alt] == [ring[0][0] - 16 * KV, ring[1][0] - 8 * KV]
    # TE 2.14.1 (before 2.15 AttnFuncWithCPAndKVAllGather takes no fp8): the all_gather layers run BF16 attention,
    # the p2p layers the FP8 ring; the layout keeps FP8 attention and says so
    env = {"MEMGUARD_TE_VERSION": "2.14.1"}
    old = lay(*fp8, "--cp-comm-type", *(["p2p"] * 16 + ["all_gather"] * 16), fp8_dot_product_attention=True,
              version="0.19.2", env=env)
    assert old.fp8_spec.fp8_dot_product_attention and any("all_gather layers run BF16" in n for n in old.notes)
    bf16 = _stages(lay(*fp8, "--cp-comm-type", "all_gather", fp8_dot_product_attention=True, version="0.19.2",
                       env=env))
    ring_old = _stages(lay(*fp8, fp8_dot_product_attention=True, version="0.19.2", env=env))
    assert _stages(old) == [ring_old[0], bf16[1]]
    # the layout's own flags are the first layer's: an all_gather first layer under TE 2.14.1 is no FP8 all-gather
    first = [lay(*fp8, "--cp-comm-type", *(["all_gather"] * 16 + ["p2p"] * 16), fp8_dot_product_attention=True,
                 version="0.19.2", env=e).cp_kv_all_gather for e in (env, None)]
    assert first == [False, True]
    # without FP8 attention the all_gather layers are sized as the ring: one kind, as before
    assert lay(*fp8, "--cp-comm-type", *["p2p", "all_gather"] * 16).cp_comm_layers is None


def test_per_layer_comm_types_with_an_all_to_all():
    # BF16 attention (once refused for lists with a2a): the all-to-all keeps its output before the exchange next to
    # linear_proj's (cp_a2a_attention_output, 2 Q = 16 MiB per layer per micro-batch: test_a2a_*); the last 16
    # layers a2a sit on stage 1 (1 micro-batch in flight)
    cp = ["--context-parallel-size", "2"]
    ring, a2a = (_stages(lay(*cp, "--cp-comm-type", c)) for c in ("p2p", "a2a"))
    assert [a[0] - r[0] for r, a in zip(ring, a2a)] == [16 * 2 * 2 * Q, 16 * 1 * 2 * Q]
    half = lay(*cp, "--cp-comm-type", *(["p2p"] * 16 + ["a2a"] * 16))
    assert half.cp_comm_layers == ",".join(["p2p"] * 16 + ["a2a"] * 16) and half.cp_a2a_size == 1
    assert _stages(half) == [ring[0], a2a[1]]
    # MXFP8 attention: p2p ring, all-to-all and all-gather layers side by side, each sized as its type alone
    mx = [_stages(_mx_cp([c])) for c in ("p2p", "a2a", "all_gather")]
    mixed = _stages(lay(*MX_CP, "--cp-comm-type", *(["p2p", "a2a", "all_gather"] * 10 + ["p2p", "a2a"]),
                        fp8_dot_product_attention=True, version="0.19.2"))
    # stage 0: layers 0-15 (6 p2p, 5 a2a, 5 all_gather), stage 1: layers 16-31 (5 p2p, 6 a2a, 5 all_gather)
    for stage, counts in ((0, (6, 5, 5)), (1, (5, 6, 5))):
        assert mixed[stage][0] == sum(n * m[stage][0] for n, m in zip(counts, mx)) // 16
    # a type's own rules still hold: TE's all-to-all splits 4 KV heads per TP rank over the a2a ranks (CP 8)
    raw = parse_megatron_flags(BASE + ["--context-parallel-size", "8", "--cp-comm-type"] + ["p2p", "a2a"] * 16)
    with pytest.raises(ConfigError, match="cp.comm.type.*multiples of the all-to-all.s 8 ranks"):
        resolve(raw, world_size=32)


def test_per_layer_comm_types_need_core_0_17():
    # megatron-core 0.16.1 transformer_layer.py 295-297 reads config.cp_comm_type[self.layer_number] with layer numbers
    # from 1 (transformer_block.py build_layer(layer_spec, i + 1)): each layer takes the next one's type and the last
    # layer's index is past the list (IndexError at model build); 0.17.0 (317-319) and 0.19.2 read [layer_number - 1]
    with pytest.raises(ConfigError, match="^--cp-comm-type: gives one type per layer, which megatron-core 0.16.1 "
                                          "cannot run .*last layer's index is past the list's end"):
        lay("--context-parallel-size", "2", "--cp-comm-type", *["p2p", "all_gather"] * 16, version="0.16.1")
    assert lay("--context-parallel-size", "2", "--cp-comm-type", *["p2p", "all_gather"] * 16, version="0.17.0").cp == 2
