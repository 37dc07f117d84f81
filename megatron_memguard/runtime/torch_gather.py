"""The monitor's ``gather`` over torch.distributed (the only part of the monitor that needs torch).

Apart from ``monitor.py`` so that importing ``megatron_memguard.runtime`` reaches no torch import in its source.
"""
from __future__ import annotations

from typing import Any, Callable


def torch_stage_gather(group: Any = None, device: Any = None) -> Callable[[list[float]], list[list[float]] | None]:
    """An all-gather of each rank's sample vector over ``group`` (e.g. the pipeline group of rank 0).

    Every member must call it at the same iterations. Returns the rows on every member.
    """
    import torch
    import torch.distributed as dist

    def gather(vec: list[float]) -> list[list[float]]:
        t = torch.tensor(vec, dtype=torch.float64, device=device)
        n = dist.get_world_size(group=group)
        out = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(out, t, group=group)
        return [o.cpu().tolist() for o in out]

    return gather
