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
    # the default estimate (dp_rank "max": what `memguard estimate` reports for the stage) against the
    # largest measured rank of the same stage
    after_default_err: float = 0.0
    peak_default_err: float = 0.0

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
        if abs(self.after_default_err) > BOUNDS["after_step"]:
            out.append(f"default (largest shard) after-step error {self.after_default_err:+.2%}")
        if abs(self.peak_default_err) > BOUNDS["peak"]:
            out.append(f"default (largest shard) peak error {self.peak_default_err:+.2%}")
        return out


def default_estimator(layout: Any, dp_rank: int) -> Any:
    from megatron_memguard import estimate
    return estimate(layout, profile="local", device="cpu", dp_rank=dp_rank)


def compare_entry(entry: dict[str, Any], estimator: Callable = default_estimator) -> list[RankComparison]:
    """One grid entry (flags + per-rank measurements) against the estimate."""
    from .grids.dense import resolve_config

    layout, _ = resolve_config(entry["flags"], entry["world_size"])
    cache: dict[int | str, Any] = {}
    default = estimator(layout, "max")
    stage_after: dict[int, int] = {}
    stage_peak: dict[int, int] = {}
    for r in entry["ranks"]:
        p = r["pp_rank"]
        stage_after[p] = max(stage_after.get(p, 0), r["live_bytes_after_step"])
        stage_peak[p] = max(stage_peak.get(p, 0), r["peak_bytes"])
    out = []
    for r in entry["ranks"]:
        # the rank's index in the optimizer's DP x CP group of one instance (consecutive DP ranks)
        shard = r["dp_rank"] % layout.dp_shard_size
        est = cache.get(shard) or cache.setdefault(shard, estimator(layout, shard))
        st = est.stages[r["pp_rank"]]
        dst = default.stages[r["pp_rank"]]
        out.append(RankComparison(
            config=entry["name"], rank=r["rank"], pp_rank=r["pp_rank"],
            params_measured=r["num_params"], params_predicted=st.parameters,
            after_measured=r["live_bytes_after_step"], after_predicted=st.persistent_bytes,
            peak_measured=r["peak_bytes"], peak_predicted=st.peak_allocated_bytes,
            peak_phase_measured=r.get("peak_phase", ""), peak_phase_predicted=st.peak_phase,
            after_default_err=dst.persistent_bytes / stage_after[r["pp_rank"]] - 1,
            peak_default_err=dst.peak_allocated_bytes / stage_peak[r["pp_rank"]] - 1,
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
        "default_after_max": max(abs(r.after_default_err) for r in rows),
        "default_peak_max": max(abs(r.peak_default_err) for r in rows),
        "params_exact": sum(r.params_predicted == r.params_measured for r in rows),
        "failures": sum(bool(r.failures) for r in rows),
    }
