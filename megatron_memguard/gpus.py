"""The GPU table: memory as PyTorch reports it, and the per-GPU numbers the planner's time model uses.

``memory_bytes`` is ``torch.cuda.get_device_properties(i).total_memory`` (what PyTorch can ever use,
after the driver's reservation), not the nominal size on the box. Sources: the "total capacity" that
PyTorch prints in CUDA out-of-memory messages on each part, and nvidia-smi/rocm-smi totals minus the
driver reservation; they vary by a few hundred MiB with driver and ECC settings, so ``--gpu-memory``
takes a reading of your own. Peak dense bf16 FLOP/s, HBM and link bandwidths are the vendors'
datasheet numbers (per GPU; link numbers per direction).

The planner's step-time model (``megatron_memguard/planner/timing.py``, docs/planner.md) also needs
what fraction of the peak real kernels reach:

* ``gemm_efficiency``: the fraction of peak dense bf16 FLOP/s that a large bf16 GEMM sustains in
  training (cuBLAS / hipBLASLt, all dimensions >= 4096, at the clocks a GPU holds under a long
  training load rather than its boost clock). Typical measured values, not datasheet numbers:
  A100 ~245 of 312 TFLOP/s (0.78); H100/H200 SXM ~640 of 989 (0.65: short benchmarks reach 700-750,
  sustained power-capped training less); B200/GB200 assumed 0.60 (younger software); MI300X ~590
  of 1307 (0.45, hipBLASLt, as public MI300X vs H100 comparisons report). Smaller GEMMs reach less
  (the planner scales this by the GEMM's size).
* ``attention_efficiency``: fraction of peak that fused causal attention (forward and backward)
  reaches at long sequences. A100: FlashAttention-2 reaches 50-73% (Dao 2023, arXiv 2307.08691,
  abstract), 0.55 taken (backward at the lower end). H100: FlashAttention-2 reaches 35% and
  FlashAttention-3 up to 75% (Shah et al. 2024, arXiv 2407.08608, abstract); Transformer Engine's
  cuDNN fused attention lies between, 0.45 taken; the same for H200 and assumed for B200/GB200.
  MI300X assumed 0.30.
* ``host_bytes_per_s``: the GPU's link to host memory, per direction (what Megatron's ``get_batch``
  crosses to copy each micro-batch to the GPU): PCIe 4.0 x16 on A100 (32 GB/s), PCIe 5.0 x16 on
  H100/H200/B200/MI300X (64 GB/s), NVLink-C2C on GB200 (900 GB/s bidirectional, 450 per direction);
  vendors' datasheets.

With these, the planner predicts 45-55% MFU for dense Llama models on H100 at the best layouts,
the range published for well-tuned Megatron runs (Megatron-LM's README reports up to 47% MFU on
H100 clusters; Meta's Llama 3 paper 38-43% at 16K GPUs).
Replace them with your own measurements where you have them: they shift predicted step times, not
the memory verdicts.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import ConfigError
from .units import GiB


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int          # total_memory as PyTorch reports it
    nominal: str               # what the vendor calls it
    gpus_per_node: int         # default node size for this part
    nvlink_domain: int         # GPUs reachable over NVLink/xGMI (>= gpus_per_node for NVL72)
    bf16_flops: float          # peak dense bf16 FLOP/s
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per GPU, per direction
    network_bytes_per_s: float  # per GPU, per direction (one NIC per GPU)
    note: str = ""
    gemm_efficiency: float = 0.70       # achieved / peak bf16 FLOP/s of a large GEMM (planner)
    attention_efficiency: float = 0.45  # achieved / peak of fused causal attention at long sequences (planner)
    sms: int = 132                      # streaming multiprocessors (AMD: compute units): the waves of a kernel's tiles
    host_bytes_per_s: float = 64e9      # host-to-device link per GPU and direction (PCIe 5.0 x16; NVLink-C2C on GB200)
    # CUDA compute capability (NVIDIA's CUDA GPU table): Transformer Engine picks its attention kernel by it
    # (estimator/attention_backend.py); None: not an NVIDIA part (ROCm's TE chooses otherwise)
    compute_capability: tuple[int, int] | None = None


def _gib(x: float) -> int:
    return int(round(x * GiB))


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in (
        GpuSpec("A100-40GB", _gib(39.59), "A100 SXM4 40GB", 8, 8, 312e12, 1.555e12, 300e9, 25e9,
                gemm_efficiency=0.78, attention_efficiency=0.55, sms=108, host_bytes_per_s=32e9, compute_capability=(8, 0)),
        GpuSpec("A100-80GB", _gib(79.35), "A100 SXM4 80GB", 8, 8, 312e12, 2.039e12, 300e9, 25e9,
                gemm_efficiency=0.78, attention_efficiency=0.55, sms=108, host_bytes_per_s=32e9, compute_capability=(8, 0)),
        GpuSpec("H100-80GB", _gib(79.11), "H100 SXM5 80GB HBM3", 8, 8, 989e12, 3.35e12, 450e9, 50e9,
                gemm_efficiency=0.65, attention_efficiency=0.45, compute_capability=(9, 0)),
        GpuSpec("H100-94GB", _gib(93.10), "H100 SXM5/NVL 94GB", 4, 4, 989e12, 3.9e12, 450e9, 50e9,
                "4 per node as on TSUBAME 4.0 (Fujii et al.); use --gpus-per-node for other systems",
                gemm_efficiency=0.65, attention_efficiency=0.45, compute_capability=(9, 0)),
        GpuSpec("H200-141GB", _gib(139.81), "H200 SXM 141GB", 8, 8, 989e12, 4.8e12, 450e9, 50e9,
                gemm_efficiency=0.65, attention_efficiency=0.45, compute_capability=(9, 0)),
        GpuSpec("B200", _gib(178.36), "B200 180GB (HGX/DGX B200)", 8, 8, 2.25e15, 8.0e12, 900e9, 50e9,
                gemm_efficiency=0.60, attention_efficiency=0.45, sms=148, compute_capability=(10, 0)),
        GpuSpec("GB200", _gib(184.0), "GB200 NVL72, 186GB HBM3e per GPU", 4, 72, 2.5e15, 8.0e12, 900e9, 50e9,
                "4 GPUs per compute tray, 72 in one NVLink domain", gemm_efficiency=0.60, attention_efficiency=0.45,
                sms=148, host_bytes_per_s=450e9, compute_capability=(10, 0)),
        GpuSpec("MI300X", _gib(191.98), "AMD Instinct MI300X 192GB", 8, 8, 1.307e15, 5.3e12, 448e9, 50e9,
                gemm_efficiency=0.45, attention_efficiency=0.30, sms=304),
    )
}

_ALIASES = {
    "a100": "A100-80GB", "a10040gb": "A100-40GB", "a10040": "A100-40GB", "a10080gb": "A100-80GB", "a10080": "A100-80GB",
    "h100": "H100-80GB", "h10080gb": "H100-80GB", "h10080": "H100-80GB", "h10094gb": "H100-94GB", "h10094": "H100-94GB",
    "h100nvl": "H100-94GB", "h200": "H200-141GB", "h200141gb": "H200-141GB", "h200141": "H200-141GB",
    "b200": "B200", "gb200": "GB200", "mi300x": "MI300X",
}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def lookup_gpu(name: str, key: str = "--gpu") -> GpuSpec:
    """Find a GPU by table name or a common spelling (``H100``, ``h100-80gb``, ``A100_40GB``)."""
    k = _key(name)
    for g in GPUS.values():
        if _key(g.name) == k:
            return g
    if k in _ALIASES:
        return GPUS[_ALIASES[k]]
    raise ConfigError(key, f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --gpu-memory)")
