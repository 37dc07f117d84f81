"""Fit the planner's step-time constants (GEMM efficiency, attention efficiency, network Gb/s per GPU) to a
site's measured step times.

Each run gives a measured step time and a predictor: the planner's step-time model of the run's layout as a
function of the three constants (``calibrate/timeruns.py`` builds it; this module never imports the planner).
The residual of a run is ``log(measured / predicted)``; the fit minimises the sum of their absolute values (a
median-type fit: a run the model misses for another reason moves it little), each constant within the bounds
``memguard plan`` accepts for its option (``time_constants.py``).

A constant is fitted only when

* at least ``min_runs`` runs **show** it: at least ``SHOW`` (5%) of their predicted step scales with it (its
  elasticity, measured by slowing the constant by ``STEP``: the network counts only where transfers are exposed);
* the runs **tell it apart** from the other fitted constants: fitted together with them (least squares on the
  model linearised at the defaults), its log is pinned to within ``SE_MAX`` (one standard error, from the runs'
  own scatter about the model, ``scatter``: at the defaults or after that linearised fit, whichever is smaller,
  so that runs whose shares of a constant differ do not count its offset from the default as noise). Two constants whose shares of every run's step keep nearly the
  same ratio shift all predictions alike: only their product is known (as the CUDA context absorbs the NCCL
  buffers in the memory fit when every run has the same communicators). Constants are taken largest share first,
  so the one with the larger share is fitted and the other keeps its value, with the reason;
* the fit lands inside the bounds (a constant driven to a bound is a modelling gap, not a constant: it keeps its
  value) and lowers the median residual.

Runs still off by more than ``GAP`` after the fit are listed as modelling gaps. Pure Python, deterministic.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..time_constants import TIME_SPEC
from .fit import _solve

SHOW = 0.05          # elasticity from which a run shows a constant (5% of its step scales with it)
STEP = 0.25          # the constant is slowed by this factor (1 + STEP) to read its elasticity
# one standard error of log(constant) above which the runs do not pin a constant: a constant known to worse than 5%
# would move rankings on noise (the planner's tie window is 4%, docs/planner.md section 4)
SE_MAX = 0.05
GAP = 0.10           # |log(measured / predicted)| after the fit above which a run is a modelling gap
ITERATIONS = 40


@dataclass(frozen=True)
class TimedRun:
    """One run: its measured step time (seconds) and the model's prediction as a function of the constants."""

    name: str
    measured: float
    predict: Callable[[Mapping[str, float]], float] = field(compare=False)
    label: str = ""                     # the layout, for the output


@dataclass(frozen=True)
class TimeConstantResult:
    name: str
    default: float
    value: float
    fitted: bool
    runs: int                           # runs that show it
    status: str                         # fitted | too little data | not identifiable | at bound | defaults hold | not asked
    reason: str = ""


@dataclass(frozen=True)
class TimeFit:
    constants: tuple[TimeConstantResult, ...]
    before: Mapping[str, float]          # run -> log(measured / predicted) with the defaults
    after: Mapping[str, float]           # the same with the fitted constants
    labels: Mapping[str, str]
    gaps: tuple[str, ...]                # runs off by more than GAP after the fit

    @property
    def fitted(self) -> dict[str, float]:
        return {c.name: c.value for c in self.constants if c.fitted}

    @property
    def median_before(self) -> float:
        return statistics.median(abs(v) for v in self.before.values())

    @property
    def median_after(self) -> float:
        return statistics.median(abs(v) for v in self.after.values())

    def to_dict(self) -> dict:
        return {"constants": [{"name": c.name, "default": c.default, "value": c.value, "fitted": c.fitted,
                               "runs": c.runs, "status": c.status, "reason": c.reason} for c in self.constants],
                "runs": [{"run": n, "layout": self.labels.get(n, ""), "log_error_before": round(self.before[n], 5),
                          "log_error_after": round(self.after[n], 5)} for n in self.before],
                "median_abs_log_error_before": round(self.median_before, 5),
                "median_abs_log_error_after": round(self.median_after, 5),
                "modelling_gaps": list(self.gaps)}


def residuals(runs: Sequence[TimedRun], values: Mapping[str, float]) -> list[float]:
    """log(measured / predicted) of each run at these constants."""
    return [math.log(r.measured / r.predict(values)) for r in runs]


def elasticities(runs: Sequence[TimedRun], values: Mapping[str, float], names: Sequence[str],
                 step: float = STEP) -> list[list[float]]:
    """[run][constant]: d log(predicted step) / d log(1 / constant), read by slowing the constant by ``step``
    (a slower network exposes transfers the model hides at its own speed)."""
    base = [math.log(r.predict(values)) for r in runs]
    cols = []
    for n in names:
        slow = {**values, n: values[n] / (1 + step)}
        cols.append([(math.log(r.predict(slow)) - b) / math.log(1 + step) for r, b in zip(runs, base)])
    return [list(row) for row in zip(*cols)]


def _sine(a: Sequence[float], b: Sequence[float]) -> float:
    na, nb = math.sqrt(sum(x * x for x in a)), math.sqrt(sum(x * x for x in b))
    if not na or not nb:
        return 1.0
    cos = sum(x * y for x, y in zip(a, b)) / (na * nb)
    return math.sqrt(max(0.0, 1 - cos * cos))


def robust_scale(errors: Sequence[float], floor: float = 0.01) -> float:
    """The runs' scatter about the model: 1.4826 x the median absolute deviation of their residuals (the standard
    deviation for a normal scatter, unmoved by a few modelling gaps), at least ``floor`` (1%)."""
    if len(errors) < 2:
        return 1.0
    m = statistics.median(errors)
    return max(floor, 1.4826 * statistics.median(abs(e - m) for e in errors))


def linear_residuals(E: Sequence[Sequence[float]], cols: Sequence[int], errors: Sequence[float]) -> list[float] | None:
    """The runs' residuals left by the least-squares fit of ``errors`` (log(measured / predicted) at the defaults)
    on the elasticity columns ``cols`` of ``E``: the fit of the model linearised at the defaults, which costs no
    prediction. None when the columns are linearly dependent."""
    m = [[sum(row[p] * row[q] for row in E) for q in cols] for p in cols]
    x = _solve(m, [sum(row[p] * e for row, e in zip(E, errors)) for p in cols])
    if x is None:
        return None
    return [e - sum(xj * row[c] for xj, c in zip(x, cols)) for row, e in zip(E, errors)]


def scatter(E: Sequence[Sequence[float]], cols: Sequence[int], errors: Sequence[float]) -> float:
    """The runs' scatter about the model for the standard errors of ``cols``: ``robust_scale`` of the residuals at
    the defaults, or of those left by the linearised fit on ``cols`` (scaled by sqrt(n / (n - k)) for the k
    constants it took: n residuals fitted with k constants are k degrees of freedom tighter) when smaller. A
    constant away from its default spreads the defaults' residuals of runs whose shares of it differ; that spread
    is the offset being fitted, not noise, and the linearised fit takes it out. Noise the columns cannot follow
    stays in both."""
    base = robust_scale(errors)
    n, k = len(errors), len(cols)
    if n - k < 2:                   # (too few runs left over to read a scatter from)
        return base
    left = linear_residuals(E, cols, errors)
    if left is None:
        return base
    return min(base, max(0.01, robust_scale(left, floor=0.0) * math.sqrt(n / (n - k))))


def standard_errors(E: Sequence[Sequence[float]], cols: Sequence[int], sigma: float) -> list[float]:
    """The standard error of each log(constant) of ``cols`` fitted together by least squares on the model
    linearised at the defaults (elasticities ``E``), for a scatter ``sigma`` per run: sigma x sqrt of the
    diagonal of (J^T J)^-1. Infinite when the columns are linearly dependent."""
    k = len(cols)
    m = [[sum(row[p] * row[q] for row in E) for q in cols] for p in cols]
    out = []
    for j in range(k):
        x = _solve(m, [1.0 if i == j else 0.0 for i in range(k)])
        out.append(math.inf if x is None or x[j] <= 0 else sigma * math.sqrt(x[j]))
    return out


def _l1(runs: Sequence[TimedRun], values: Mapping[str, float]) -> float:
    return sum(abs(e) for e in residuals(runs, values))


def _clamp(name: str, v: float) -> float:
    c = TIME_SPEC[name]
    return min(c.upper, max(c.lower, v))


def least_absolute(runs: Sequence[TimedRun], start: Mapping[str, float], free: Sequence[str]) -> dict[str, float]:
    """The constants ``free`` minimising the summed |log(measured / predicted)| within their bounds, from ``start``
    (the others fixed): iteratively reweighted least squares on the model linearised in log(constant), linearised
    again at each step, each step halved until the loss falls."""
    vals = dict(start)
    if not free:
        return vals
    loss = _l1(runs, vals)
    for _ in range(ITERATIONS):
        r = residuals(runs, vals)
        # d r / d log(c_j) = elasticity of the step in 1 / c_j (slowing c_j raises the prediction)
        J = elasticities(runs, vals, free, step=0.02)
        w = [1 / max(abs(e), 1e-3) for e in r]
        k = len(free)
        m = [[sum(wi * J[i][p] * J[i][q] for i, wi in enumerate(w)) for q in range(k)] for p in range(k)]
        v = [sum(wi * J[i][p] * r[i] for i, wi in enumerate(w)) for p in range(k)]
        sol = _solve(m, v)
        if sol is None:
            break
        # a step of +dx in d log(1/c) raises the prediction: log(c) moves by -dx
        scale, improved = 1.0, False
        for _ in range(8):
            trial = {**vals, **{n: _clamp(n, vals[n] * math.exp(-scale * sol[j])) for j, n in enumerate(free)}}
            new = _l1(runs, trial)
            if new < loss - 1e-12:
                moved = max(abs(math.log(trial[n] / vals[n])) for n in free)
                vals, loss, improved = trial, new, True
                break
            scale /= 2
        if not improved or moved < 1e-5:
            break
    return vals


def fit_time_constants(runs: Sequence[TimedRun], defaults: Mapping[str, float], min_runs: int = 3,
                       fit_only: Sequence[str] | None = None) -> TimeFit:
    """Fit the time constants (names of ``defaults``) to the runs; see the module's docstring for the rules."""
    names = [n for n in TIME_SPEC if n in defaults]
    before = residuals(runs, defaults)
    E = elasticities(runs, defaults, names) if runs else []
    shows = {n: sum(1 for row in E if row[j] >= SHOW) for j, n in enumerate(names)}
    share = {n: sum(row[j] for row in E) for j, n in enumerate(names)}
    status: dict[str, tuple[str, str]] = {}
    free: list[str] = []
    for n in sorted(names, key=lambda n: -share[n]):       # the largest share first: it is kept when two confound
        c = TIME_SPEC[n]
        if fit_only is not None and n not in fit_only:
            status[n] = ("not asked", "kept (not in --fit)")
            continue
        if shows[n] < min_runs:
            status[n] = ("too little data", f"{shows[n]} run(s) have {SHOW:.0%} or more of their step on it (at least "
                                            f"{min_runs} needed)" + (" - network: runs whose data-parallel or pipeline "
                                                                     "traffic crosses nodes" if n == "network_gbps"
                                                                     else ""))
            continue
        cols = [names.index(f) for f in free + [n]]
        se = standard_errors(E, cols, scatter(E, cols, before))
        if se[-1] > SE_MAX:
            col = [row[names.index(n)] for row in E]
            twin = max(free, key=lambda f: 1 - _sine(col, [row[names.index(f)] for row in E]), default=None)
            why = (f"its share of each run's step follows {twin}'s (sine of their angle "
                   f"{_sine(col, [row[names.index(twin)] for row in E]):.3f}), so the runs cannot tell them apart"
                   if twin else "its share of the runs' steps is too small")
            status[n] = ("not identifiable", f"the runs pin it only to +-{se[-1]:.0%} (need {SE_MAX:.0%}): {why}"
                                             + (f"; {twin} is fitted and absorbs it" if twin else ""))
            continue
        free.append(n)
        status[n] = ("fitted", f"{c.flag}")
    vals = least_absolute(runs, defaults, free)
    at_bound = [n for n in free if not TIME_SPEC[n].lower * 1.001 < vals[n] < TIME_SPEC[n].upper / 1.001]
    for n in at_bound:
        c = TIME_SPEC[n]
        status[n] = ("at bound", f"the runs ask for {c.format(vals[n])}, at the bound of {c.flag}: a modelling "
                                 f"gap, not a constant")
        free.remove(n)
    if at_bound:
        vals = least_absolute(runs, defaults, free)
    after = residuals(runs, vals)
    if free and statistics.median(abs(e) for e in after) >= statistics.median(abs(e) for e in before):
        for n in free:
            status[n] = ("defaults hold", "the fit does not lower the median run's error")
        free, vals, after = [], dict(defaults), before
    results = tuple(TimeConstantResult(n, defaults[n], vals[n] if n in free else defaults[n], n in free, shows[n],
                                       status[n][0], "" if n in free else status[n][1]) for n in names)
    gaps = tuple(r.name for r, e in zip(runs, after) if abs(e) > GAP)
    return TimeFit(results, {r.name: e for r, e in zip(runs, before)}, {r.name: e for r, e in zip(runs, after)},
                   {r.name: r.label for r in runs}, gaps)


__all__ = ["TimedRun", "TimeFit", "TimeConstantResult", "fit_time_constants", "least_absolute", "elasticities",
           "residuals", "robust_scale", "linear_residuals", "scatter", "standard_errors", "SHOW", "SE_MAX", "GAP"]
