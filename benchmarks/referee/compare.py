"""Compare the referee's measurements with memguard's estimate of the same run (``--device cpu``).

Per rank: the parameter count must be exact, live bytes after the optimizer step within 1%, the
peak of live bytes during the iterations within 3% (issue 3's bounds). The estimate is memguard's
for the rank's pipeline stage and its distributed-optimizer shard, with the implementation profile
of the run (``local``) and no GPU-only terms.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Callable, Iterable

BOUNDS = {"params": 0.0, "after_step": 0.01, "peak": 0.03}


@dataclass(frozen=True)
class RankComparison:
    config: str
    rank: int
    pp_rank: int
    params_measured: int
    params_predicted: int
    after_measured: int
    after_predicted: int
    peak_measured: int
    peak_predicted: int
    peak_phase_measured: str
    peak_phase_predicted: str

    @property
    def after_err(self) -> float:
        return (self.after_predicted - self.after_measured) / self.after_measured

    @property
    def peak_err(self) -> float:
        return (self.peak_predicted - self.peak_measured) / self.peak_measured

    @property
    def failures(self) -> list[str]:
        out = []
        if self.params_predicted != self.params_measured:
            out.append(f"parameters {self.params_predicted:,} != {self.params_measured:,}")
        if abs(self.after_err) > BOUNDS["after_step"]:
            out.append(f"after-step error {self.after_err:+.2%}")
        if abs(self.peak_err) > BOUNDS["peak"]:
            out.append(f"peak error {self.peak_err:+.2%}")
        return out


def default_estimator(layout: Any, dp_rank: int) -> Any:
    from megatron_memguard import estimate
    return estimate(layout, profile="local", device="cpu", dp_rank=dp_rank)


def compare_entry(entry: dict[str, Any], estimator: Callable = default_estimator) -> list[RankComparison]:
    """One grid entry (flags + per-rank measurements) against the estimate."""
    from .grid import resolve_config

    layout, _ = resolve_config(entry["flags"], entry["world_size"])
    cache: dict[int, Any] = {}
    out = []
    for r in entry["ranks"]:
        shard = r["dp_rank"] % layout.dp_shard_size
        est = cache.get(shard) or cache.setdefault(shard, estimator(layout, shard))
        st = est.stages[r["pp_rank"]]
        out.append(RankComparison(
            config=entry["name"], rank=r["rank"], pp_rank=r["pp_rank"],
            params_measured=r["num_params"], params_predicted=st.parameters,
            after_measured=r["live_bytes_after_step"], after_predicted=st.persistent_bytes,
            peak_measured=r["peak_bytes"], peak_predicted=st.peak_allocated_bytes,
            peak_phase_measured=r.get("peak_phase", ""), peak_phase_predicted=st.peak_phase,
        ))
    return out


def summary(rows: Iterable[RankComparison]) -> dict[str, float]:
    rows = list(rows)
    pe = [abs(r.peak_err) for r in rows]
    ae = [abs(r.after_err) for r in rows]
    return {
        "ranks": len(rows),
        "configs": len({r.config for r in rows}),
        "peak_max": max(pe), "peak_median": statistics.median(pe),
        "after_max": max(ae), "after_median": statistics.median(ae),
        "params_exact": sum(r.params_predicted == r.params_measured for r in rows),
        "failures": sum(bool(r.failures) for r in rows),
    }
