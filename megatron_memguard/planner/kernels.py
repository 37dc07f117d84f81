"""How long one GPU takes for one kernel: GEMMs, fused attention, memory-bound element-wise work.

Pure functions of the kernel's sizes and the GPU's numbers (``megatron_memguard.gpus``); the constants
and their sources are in docs/planner.md section 3.

GEMM efficiency follows NVIDIA's *Matrix Multiplication Background User's Guide* (tile and wave
quantisation): the GPU's large-GEMM efficiency, times the share of its SMs kept busy by the output
tiles (a GEMM fills the SMs in waves of one tile per SM; over the shapes of a model the last wave is on
average half full, so W waves run at W / (W + 1/2) of the full rate), times a factor for a short
reduction dimension (the fixed prologue and epilogue of each tile). Fused attention is treated the same
way, its tiles being query blocks of one head, with a factor for short key ranges (FlashAttention-2's
throughput falls at short sequences; Dao 2023, figures 4-5).
"""
from __future__ import annotations

import math

from ..gpus import GpuSpec

GEMM_TILE = (256, 128)       # output tile of the large-GEMM kernels of cuBLAS / CUTLASS on Ampere and Hopper
GEMM_HALF_K = 128            # a reduction this long reaches half the efficiency of a very long one
ATTN_BLOCK_Q = 128           # query rows per thread block of FlashAttention-2 / cuDNN fused attention
ATTN_HALF_KV = 256           # keys a query sees at which fused attention reaches half its long-sequence rate
ATTN_BWD_FLOPS = 2.5         # attention backward / forward FLOPs (5 matmuls to 2, FlashAttention-2)
HBM_EFFICIENCY = 0.80        # fraction of HBM bandwidth memory-bound kernels reach


def wave_efficiency(blocks: float, sms: int) -> float:
    """Average share of busy SMs for ``blocks`` independent tiles on ``sms`` SMs: W / (W + 1/2) waves
    (the expected last-wave loss), and W itself below one wave (idle SMs)."""
    w = blocks / sms
    return w if w <= 0.5 else w / (w + 0.5)


def gemm_efficiency(M: int, N: int, K: int, gpu: GpuSpec) -> float:
    """Achieved fraction of peak bf16 FLOP/s of an M x N x K GEMM (output M x N, reduction K)."""
    big, small = max(M, N), min(M, N)
    tiles = math.ceil(big / GEMM_TILE[0]) * math.ceil(small / GEMM_TILE[1])
    fill = (big * small) / (tiles * GEMM_TILE[0] * GEMM_TILE[1])      # partly filled edge tiles
    return gpu.gemm_efficiency * wave_efficiency(tiles, gpu.sms) * fill * K / (K + GEMM_HALF_K)


def gemm_seconds(M: int, N: int, K: int, gpu: GpuSpec, c_bytes: float = 2.0) -> float:
    """One GEMM: its FLOPs at :func:`gemm_efficiency`, or its HBM traffic (bf16 inputs, an output of
    ``c_bytes`` per element read and written when accumulating) if that takes longer. A GEMM with an empty
    dimension (an FFN narrower than the tensor-parallel size: 1 // 2 columns per rank) does no work."""
    if min(M, N, K) <= 0:
        return 0.0
    t = 2.0 * M * N * K / (gpu.bf16_flops * gemm_efficiency(M, N, K, gpu))
    mem = (2.0 * (M * K + K * N) + c_bytes * M * N) / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
    return max(t, mem)


def attention_efficiency(batch_heads: int, q_len: int, kv_per_query: float, gpu: GpuSpec) -> float:
    """Achieved fraction of peak of fused attention over ``batch_heads`` (micro-batch x heads on the
    rank) query blocks of ``q_len`` rows, each query seeing ``kv_per_query`` keys on average."""
    blocks = batch_heads * math.ceil(q_len / ATTN_BLOCK_Q)
    return gpu.attention_efficiency * wave_efficiency(blocks, gpu.sms) * kv_per_query / (kv_per_query + ATTN_HALF_KV)


def attention_seconds(batch: int, heads: int, q_len: int, kv_len: int, causal: bool, qk_dim: int, v_dim: int,
                      gpu: GpuSpec) -> tuple[float, float, float]:
    """(forward s, backward s, forward FLOPs) of one fused attention kernel: ``q_len`` queries against
    ``kv_len`` keys (causal: each query sees half of them on average, the masked blocks are skipped)."""
    kv = kv_len / 2 if causal else kv_len
    flops = 2.0 * batch * heads * q_len * kv * (qk_dim + v_dim)
    fwd = flops / (gpu.bf16_flops * attention_efficiency(batch * heads, q_len, kv, gpu))
    return fwd, ATTN_BWD_FLOPS * fwd, flops


def memory_seconds(nbytes: float, gpu: GpuSpec) -> float:
    """A memory-bound kernel moving ``nbytes`` through HBM."""
    return nbytes / (gpu.hbm_bytes_per_s * HBM_EFFICIENCY)
