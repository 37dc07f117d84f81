"""The core attention's backward working set without context parallelism, counted by hand from the kernels'
allocations: TE 2.11 / 2.20.2 ``backends.py`` (FusedAttnFunc.backward, FlashAttention) and flash-attn 2.7.4.post1
``csrc/flash_attn/flash_api.cpp`` (mha_bwd, lines 883-903: softmax_d, dq_accum, dk/dv_expanded)."""
from __future__ import annotations

import pytest

from megatron_memguard import layout_from_flags
from megatron_memguard.estimator.activations import layer_activations

from conftest import LLAMA2_7B, LLAMA31_70B

SEQ = 8192
T = SEQ // 2 * 8192 * 2               # G: the layer output's gradient, [s/TP, b, h] under SP, bf16
# Llama-3-70B at TP2, MBS 1, bf16: 32 heads and 4 query groups per rank, head dim 128
Q = SEQ * 32 * 128 * 2                # one query-sized tensor
KV1 = SEQ * 4 * 128 * 2               # one of K or V
STATS = 32 * SEQ * 4                  # fp32 [b, heads/TP, s]


def _core_step(shape: list[str], *extra: str) -> int:
    L = layout_from_flags([*shape, "--seq-length", str(SEQ), "--max-position-embeddings", str(SEQ),
                           "--micro-batch-size", "1", "--global-batch-size", "8", "--tensor-model-parallel-size", "2",
                           "--sequence-parallel", *extra], world_size=2, megatron_version="0.19")
    la = layer_activations(L, True)
    # the core attention's step: linear_proj's input released, the attention's saved tensors not yet
    steps = [w for names, w in la.bwd_steps if "proj_input" in names and "softmax_stats" not in names]
    assert steps
    return steps[0]


def test_fused_backward_counts_the_handed_gradient_and_gqa_shaped_dk_dv():
    # FusedAttnFunc.backward: d_out (linear_proj's input gradient, contiguous: .contiguous() copies nothing) is
    # alive through fused_attn_bwd, which returns dq, dk, dv shaped like q, k, v (K/V: 4 groups, not 32 heads),
    # with the kernel's fp32 softmax sum [b, a/t, s]
    assert _core_step(LLAMA31_70B) == T + Q + (Q + 2 * KV1) + STATS


def test_fused_backward_without_gqa():
    # Llama-2-7B at TP2: 16 heads per rank, head dim 128; dq, dk, dv all query-sized, and d_out
    q = SEQ * 16 * 128 * 2
    g = SEQ // 2 * 4096 * 2
    assert _core_step(LLAMA2_7B) == g + q + 3 * q + 16 * SEQ * 4


@pytest.mark.parametrize("shape, heads, expanded", [(LLAMA31_70B, 32, True), (LLAMA2_7B, 16, False)])
def test_flash_backward_adds_the_fp32_dq_accumulator_and_gqa_expanded_dk_dv(shape, heads, expanded):
    # flash-attn 2's mha_bwd: dq, dk, dv (empty_like q, k, v in FlashAttnFunc.backward), dq_accum fp32
    # [b, s, a/t, d] (twice a bf16 q), softmax_d fp32 [b, a/t, s], under GQA dk/dv_expanded [b, s, a/t, d] each; the
    # handed gradient is a transposed view with last stride 1 (maybe_contiguous copies nothing)
    h = 8192 if heads == 32 else 4096
    q = SEQ * heads * 128 * 2
    kv = KV1 if expanded else q
    by_hand = q + (q + 2 * kv) + 2 * q + heads * SEQ * 4 + (2 * q if expanded else 0)
    assert _core_step(shape, "--attention-backend", "flash") == SEQ // 2 * h * 2 + by_hand


def test_fused_backward_under_core_attn_recompute():
    # megatron-core tensor_parallel CheckpointFunction.backward (0.16.1 / 0.19.2) replays the core attention and
    # hands its gradient (the same d_out) to the replay's FusedAttnFunc.backward: it holds the recomputed output,
    # and the replay saved its softmax statistics again
    core = _core_step(LLAMA31_70B, "--recompute-granularity", "selective", "--recompute-modules", "core_attn")
    assert core == T + Q + (Q + 2 * KV1) + STATS + Q + STATS


MLA_CI = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--multi-latent-attention",
          "--q-lora-rank", "192", "--kv-lora-rank", "64", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
          "--v-head-dim", "16", "--seq-length", "1024", "--max-position-embeddings", "1024", "--micro-batch-size", "4",
          "--global-batch-size", "32", "--bf16", "--vocab-size", "50257"]


def _mla_core_step(backend: str) -> int:
    la = layer_activations(layout_from_flags([*MLA_CI, "--attention-backend", backend], world_size=1,
                                             megatron_version="0.19"), True)
    core = [w for names, w in la.bwd_steps if "proj_input" in names and "softmax_stats" not in names]
    assert core
    return core[0]


def test_multi_latent_flash_backward():
    # TE 2.20.2 pads v to q/k's head dim 24 for flash-attn (_pad_qkv_head_dim): the output is sliced back to 16, so
    # the gradient flash-attn gets is the slice's backward's new [s, b, 8 x 24] tensor (a transposed view, not
    # copied); then dq, dk, dv at 24, the fp32 dq accumulator (twice a bf16 q) and softmax_d [b, 8, s] fp32
    g, p, stats = 4 * 1024 * 512 * 2, 4 * 1024 * 8 * 24 * 2, 4 * 8 * 1024 * 4
    assert _mla_core_step("flash") == g + p + 3 * p + 2 * p + stats


def test_multi_latent_fused_backward():
    # Megatron CI's MLA shape (gpt3_mcore_te_tp2_pp2_mla at TP 1): 8 heads, q/k head dim 16 + 8, v head dim 16,
    # seq 1024, MBS 4. FusedAttnFunc.backward: d_out [s, b, 8 x 16], dq and dk [s, b, 8, 24], dv [s, b, 8, 16], and
    # the fp32 softmax sum [b, 8, s]
    g, q_b, v_b, stats = 4 * 1024 * 512 * 2, 4 * 1024 * 8 * 24 * 2, 4 * 1024 * 8 * 16 * 2, 4 * 8 * 1024 * 4
    assert _mla_core_step("fused") == g + v_b + (2 * q_b + v_b) + stats
