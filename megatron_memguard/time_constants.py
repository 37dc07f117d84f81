"""The planner's three cluster time constants: their bounds, and a GPU row with a site's values applied.

``memguard plan`` takes them as ``--gemm-efficiency``, ``--attention-efficiency`` and ``--network-gbps``;
``memguard calibrate`` fits them from a site's measured step times (``calibrate/timefit.py``) and writes them to
the site profile's ``time:`` section. One table of bounds serves all three places. Pure Python.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Mapping

from .errors import ConfigError

MIN_NETWORK_GBPS, MAX_NETWORK_GBPS = 1.0, 72_000.0
MIN_EFFICIENCY, MAX_EFFICIENCY = 0.01, 1.0


@dataclass(frozen=True)
class TimeConstant:
    name: str            # the site profile's key
    flag: str            # memguard plan's option
    lower: float
    upper: float
    what: str
    why_bounds: str

    def default(self, gpu: Any) -> float:
        """The GPU row's value."""
        if self.name == "network_gbps":
            return gpu.network_bytes_per_s * 8 / 1e9
        return float(getattr(gpu, self.name))

    def format(self, v: float) -> str:
        return f"{v:,.4g} Gb/s" if self.name == "network_gbps" else f"{v:.3f}"


TIME_CONSTANTS = (
    TimeConstant("gemm_efficiency", "--gemm-efficiency", MIN_EFFICIENCY, MAX_EFFICIENCY,
                 "fraction of peak bf16 FLOP/s a large GEMM sustains",
                 "an H100's fp32 CUDA cores alone reach 6.8% of its bf16 tensor-core peak"),
    TimeConstant("attention_efficiency", "--attention-efficiency", MIN_EFFICIENCY, MAX_EFFICIENCY,
                 "fraction of peak bf16 FLOP/s fused causal attention sustains at long sequences",
                 "an H100's fp32 CUDA cores alone reach 6.8% of its bf16 tensor-core peak"),
    TimeConstant("network_gbps", "--network-gbps", MIN_NETWORK_GBPS, MAX_NETWORK_GBPS,
                 "network bandwidth per GPU and direction, Gb/s",
                 "1 Gb/s Ethernet; 10 x NVLink 5's 7,200 Gb/s per GPU and direction"),
)
TIME_SPEC = {c.name: c for c in TIME_CONSTANTS}


def check_time_constant(name: str, value: Any, key: str) -> float:
    """``value`` as a float within the constant's bounds; ConfigError naming ``key`` otherwise."""
    c = TIME_SPEC[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(key, f"expects a number ({c.what}), got {value!r}")
    v = float(value)
    if not c.lower <= v <= c.upper:
        raise ConfigError(key, f"must be from {c.lower:g} to {c.upper:,g} ({c.what}; memguard's bounds: "
                               f"{c.why_bounds}), got {value!r}")
    return v


def with_speeds(gpu: Any, values: Mapping[str, float]) -> Any:
    """``gpu`` (a GpuSpec) with the given time constants (names of TIME_CONSTANTS) in place of its row's."""
    changes: dict[str, float] = {}
    for name, v in values.items():
        if name == "network_gbps":
            changes["network_bytes_per_s"] = v * 1e9 / 8
        else:
            changes[name] = v
    return dataclasses.replace(gpu, **changes) if changes else gpu


__all__ = ["TIME_CONSTANTS", "TIME_SPEC", "TimeConstant", "check_time_constant", "with_speeds",
           "MIN_NETWORK_GBPS", "MAX_NETWORK_GBPS", "MIN_EFFICIENCY", "MAX_EFFICIENCY"]
