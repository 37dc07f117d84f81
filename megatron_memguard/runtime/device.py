"""The GPU this rank will train on, read before Megatron selects a device.

At the pre-allocation point no device is selected yet and every rank would default to GPU 0, so the
device is ``LOCAL_RANK`` (the one ``_initialize_distributed`` will pick; GPU 0 when the launcher
shows each process a single GPU). ``torch.cuda.get_device_properties(i)`` reads its total memory
without creating a context; NVML is the fallback. ``torch.cuda.mem_get_info`` is avoided: without a
selected device it creates a context on GPU 0 for every local rank.
"""
from __future__ import annotations

import os
import re
from typing import Mapping

from ..gpus import GPUS, GpuSpec


def local_device_index(environ: Mapping[str, str] | None = None, device_count: int | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        local = int(environ.get("LOCAL_RANK", "0"))
    except ValueError:
        local = 0
    if device_count and local >= device_count:
        return local % device_count if device_count > 1 else 0
    return local


def device_properties(environ: Mapping[str, str] | None = None) -> tuple[str | None, int | None, str]:
    """(device name, total memory in bytes, where it came from) of this rank's GPU; (None, None, why) if unknown."""
    why = []
    try:
        import torch
        try:
            count = torch.cuda.device_count()
        except Exception:
            count = 0
        idx = local_device_index(environ, count)
        props = torch.cuda.get_device_properties(idx)
        return str(props.name), int(props.total_memory), f"torch.cuda.get_device_properties({idx})"
    except Exception as e:  # no CUDA, no driver
        why.append(f"torch: {type(e).__name__}: {e}")
    try:
        import pynvml  # type: ignore
        pynvml.nvmlInit()
        idx = local_device_index(environ)
        visible = (environ or os.environ).get("CUDA_VISIBLE_DEVICES")
        if visible:
            ids = [v.strip() for v in visible.split(",") if v.strip()]
            if idx < len(ids) and ids[idx].isdigit():
                idx = int(ids[idx])
        h = pynvml.nvmlDeviceGetHandleByIndex(idx)
        name = pynvml.nvmlDeviceGetName(h)
        name = name.decode() if isinstance(name, bytes) else str(name)
        return name, int(pynvml.nvmlDeviceGetMemoryInfo(h).total), f"NVML device {idx}"
    except Exception as e:
        why.append(f"NVML: {type(e).__name__}: {e}")
    return None, None, "; ".join(why)


def gpu_spec_for(name: str | None, total: int | None) -> GpuSpec | None:
    """The table entry of a device name such as 'NVIDIA H100 80GB HBM3' (for GPU-specific workspaces)."""
    if not name:
        return None
    key = re.sub(r"[^A-Z0-9]", "", name.upper())
    best = None
    bases = [(re.sub(r"[^A-Z0-9]", "", spec.name.split("-")[0].upper()), spec) for spec in GPUS.values()]
    for base, spec in sorted(bases, key=lambda bs: -len(bs[0])):  # GB200 before B200
        if base and base in key:
            if total and abs(spec.memory_bytes - total) <= 0.06 * total:
                return spec
            best = best or spec
    return best
