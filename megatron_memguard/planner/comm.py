"""How long a collective or a point-to-point transfer takes: bandwidth and latency per step of a ring.

Pure functions of the bytes, the group and where its members sit (how many share an NVLink domain),
and the GPU's link numbers (``megatron_memguard.gpus``; per GPU and direction). Constants and sources
in docs/planner.md section 3.

A ring over ``n`` ranks, ``k`` of them in one NVLink domain, runs hierarchically: (k - 1) steps on
NVLink among the k, then n/k - 1 steps across domains on 1/k of the data per GPU, each GPU using its
own NIC (a group with one member per node sees the bare NIC; eight members of a node share the node's
eight NICs). An all-gather or reduce-scatter passes the data once, an all-reduce twice.
"""
from __future__ import annotations

from ..gpus import GpuSpec

NVLINK_EFFICIENCY = 0.80     # NCCL bus bandwidth / NVLink bandwidth
NETWORK_EFFICIENCY = 0.85    # NCCL bus bandwidth / NIC bandwidth
NVLINK_STEP_LATENCY = 3e-6   # seconds per ring step on NVLink
NETWORK_STEP_LATENCY = 8e-6  # seconds per ring step across nodes
P2P_LATENCY = 10e-6          # seconds per send/receive pair (pipeline stages, context-parallel ring)

PASSES = {"ag": 1, "rs": 1, "ar": 2}


def collective_seconds(kind: str, nbytes: float, n: int, per_domain: int, gpu: GpuSpec) -> float:
    """Ring collective of ``nbytes`` (the full tensor of one rank's view: the gathered output, the
    reduced input) over ``n`` ranks, ``per_domain`` of them sharing an NVLink domain. ``kind``: ag | rs
    (one pass) or ar (two)."""
    if n <= 1:
        return 0.0
    f = PASSES[kind]
    k = max(1, min(n, per_domain))
    t = 0.0
    if k > 1:
        t += f * (k - 1) / k * nbytes / (gpu.nvlink_bytes_per_s * NVLINK_EFFICIENCY) + f * (k - 1) * NVLINK_STEP_LATENCY
    nodes = n // k
    if nodes > 1:
        t += (f * (nodes - 1) / nodes * (nbytes / k) / (gpu.network_bytes_per_s * NETWORK_EFFICIENCY)
              + f * (nodes - 1) * NETWORK_STEP_LATENCY)
    return t


def p2p_seconds(nbytes: float, same_domain: bool, gpu: GpuSpec) -> float:
    """One send/receive between two GPUs, on NVLink or through the NIC."""
    bw = gpu.nvlink_bytes_per_s * NVLINK_EFFICIENCY if same_domain else gpu.network_bytes_per_s * NETWORK_EFFICIENCY
    return P2P_LATENCY + nbytes / bw
