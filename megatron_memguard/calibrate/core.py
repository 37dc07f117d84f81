"""``memguard calibrate``: fit the site constants from a site's own runs, openly and safely.

Per level (allocated, reserved, device; :mod:`.model`), for the constants the runs can show:

1. a constant is fitted only when at least ``MIN_RUNS`` runs show it (a coefficient that is not zero:
   a TE workspace needs Transformer Engine runs, the cuBLAS default runs without CUBLAS_WORKSPACE_CONFIG,
   NCCL buffers runs with communicators) and when it can be told apart from the level's other constant
   (NCCL buffers need runs with different communicator counts, else the CUDA context absorbs them) and
   from the modelling error of a setting only the runs that show it have on (``_confounded``);
2. the fit minimises the runs' relative absolute errors, each capped at ``GAP``, within the constant's
   physical bounds, and no run the defaults predict within ``GAP`` may get worse by more than ``GUARD``
   (:func:`.fit.guarded_fit`). A run the defaults miss by more than ``GAP`` and that no admissible constant
   brings within it is a modelling gap: capped, it neither drags the constants nor vetoes them. A fit that
   would need a value beyond a bound is a modelling gap too, reported with the runs that ask for it. A fitted
   shift within ``SIGNIFICANCE`` bootstrap standard errors of the default is noise: the default stays;
3. leave-one-out (above ``LOO_MAX`` runs, ``FOLDS``-fold): each run is predicted by the constants fitted on the
   others. The fitted constants
   replace the defaults only when this held-out error improves the median run and makes no run (modelling
   gaps aside) worse by more than ``GUARD``. Runs that ask for values the guard refuses (two groups a fixed
   offset apart) are reported as inconsistent when nothing better survives.

Modelled terms (weights, gradients, optimizer states, activations) are never fitted: runs whose error
stays large after calibration are listed as modelling gaps, by level.
"""
from __future__ import annotations

import random
import statistics
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Sequence

from ..errors import MemguardError
from ..estimator.site import DEFAULT_SITE, SPEC, SiteConstants
from ..layout import Layout
from .fit import Row, guarded_fit, identifiable, unbounded, within_guard
from .model import (LEVEL_CONSTANTS, LEVEL_METRIC, METRIC_LABELS, METRICS, CalibrationRun, allocated_rows, device_rows,
                    errors, explicit, reserved_rows, with_values)

MIN_RUNS = 3            # runs that must show a constant before it is fitted
# No run's error may grow by more than GUARD (absolute, in fractions of its own measurement). Runs memguard
# cannot tell apart (the same resolved layout) differ by up to 0.41% on H100, 0.74% on GB200 and 0.12% on A100
# in Megatron's CI records (shared/groundtruth, docs/calibrate.md): a change below a quarter point is within
# what such runs resolve about a constant; a larger one trades one run's accuracy for another's.
GUARD = 0.0025
GAP = 0.05              # error after calibration that makes a run a modelling gap (the monitor's tolerance)
GAP_WHAT = {
    "steady": "model state and persistent buffers (weights, gradients, optimizer states: modelled, not fitted)",
    "peak_allocated": "activations and transients at the peak (modelled, not fitted)",
    "peak_reserved": "the caching allocator's slack is not a constant fraction for these runs",
    "device_used": "memory outside PyTorch beyond a CUDA context and per-communicator NCCL buffers",
}


class TooLittleData(MemguardError):
    """Not enough runs for any constant: calibrate refuses to fit."""


@dataclass
class ConstantResult:
    name: str
    level: str
    default: Any
    value: Any = None                 # the fitted value (None: not fitted)
    status: str = "not fitted"        # fitted | too little data | not identifiable | inconsistent | within noise | at bound
    #                                   | kept | not asked
    runs: int = 0                     # runs that show it
    reason: str = ""
    wanted: float | None = None       # the unbounded fit, where it lies outside the bounds

    @property
    def fitted(self) -> bool:
        return self.status == "fitted"

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "level": self.level, "default": self.default, "value": self.value,
                "status": self.status, "runs": self.runs, "reason": self.reason, "wanted": self.wanted}


@dataclass
class LevelResult:
    level: str
    metric: str
    constants: list[ConstantResult]
    runs: list[str] = field(default_factory=list)
    before: dict[str, float] = field(default_factory=dict)      # run -> median |relative error| with the defaults
    fitted: dict[str, float] = field(default_factory=dict)      # ... with the constants fitted on every run
    held_out: dict[str, float] = field(default_factory=dict)    # ... with the constants fitted on the other runs
    accepted: bool = False

    @staticmethod
    def _med(d: dict[str, float]) -> float | None:
        return statistics.median(d.values()) if d else None

    def summary(self) -> dict[str, Any]:
        return {"level": self.level, "metric": self.metric, "runs": len(self.runs), "accepted": self.accepted,
                "median_error_before": self._med(self.before), "median_error_fitted": self._med(self.fitted),
                "median_error_held_out": self._med(self.held_out), "held_out_by": held_out_scheme(len(self.runs)),
                "max_error_before": max(self.before.values(), default=None),
                "max_error_held_out": max(self.held_out.values(), default=None)}


@dataclass
class Gap:
    metric: str
    runs: list[tuple[str, float]]
    what: str

    def text(self) -> str:
        shown = ", ".join(f"{n} {e:+.1%}" for n, e in self.runs[:6]) + (" ..." if len(self.runs) > 6 else "")
        return (f"{METRIC_LABELS[self.metric]}: {len(self.runs)} run(s) off by more than {GAP:.0%} after calibration "
                f"({shown}) - {self.what}")


@dataclass
class CalibrationResult:
    base: SiteConstants
    site: SiteConstants
    constants: list[ConstantResult]
    levels: list[LevelResult]
    runs: list[CalibrationRun]
    before: dict[str, dict[str, float | None]]      # run -> metric -> median signed error
    after: dict[str, dict[str, float | None]]
    gaps: list[Gap]
    notes: list[str] = field(default_factory=list)

    @property
    def fitted(self) -> dict[str, Any]:
        return {c.name: c.value for c in self.constants if c.fitted}

    def to_dict(self) -> dict[str, Any]:
        return {"schema": "memguard.calibrate/1", "fitted": self.fitted, "site": self.site.to_dict(),
                "constants": [c.to_dict() for c in self.constants], "levels": [lv.summary() for lv in self.levels],
                "runs": [{"name": r.name, "source": r.source, "ranks": len(r.observations), "gpu": r.gpu.name if r.gpu else None,
                          "notes": list(r.notes),
                          "before": self.before[r.name], "after": self.after[r.name]} for r in self.runs],
                "gaps": [{"metric": g.metric, "runs": [{"run": n, "error": e} for n, e in g.runs], "what": g.what}
                         for g in self.gaps],
                "notes": self.notes}


# ---- helpers --------------------------------------------------------------------------------------------
def _median_signed(errs: Sequence[float]) -> float | None:
    return statistics.median(errs) if errs else None


def _run_errors(rows: Sequence[Row], theta: Sequence[float]) -> dict[str, float]:
    """Per run: the median absolute relative error of its rows."""
    by: dict[str, list[float]] = {}
    for r in rows:
        by.setdefault(r.run, []).append(abs(r.error(theta)))
    return {k: statistics.median(v) for k, v in by.items()}


def _scales(names: Sequence[str]) -> list[float]:
    return [1.0 if SPEC[n].unit == "ratio" else float(2**20) * 64 for n in names]


def _level_rows(level: str, runs: Sequence[CalibrationRun], base: SiteConstants) -> list[Row]:
    if level == "allocated":
        return allocated_rows(runs, base)
    if level == "reserved":
        return reserved_rows(runs)
    return device_rows(runs)


def _start(level: str, names: Sequence[str], base: SiteConstants, runs: Sequence[CalibrationRun]) -> list[float]:
    if level == "allocated":
        gpu = next((r.gpu for r in runs if r.gpu is not None), None)
        s = explicit(base, gpu)
        return [float(getattr(s, n)) for n in names]
    return [float(getattr(base, n)) for n in names]


@dataclass
class _Trial:
    """One set of constants fitted on all runs and, leaving each run out, on the others."""

    candidates: list[int]
    theta: list[float]
    wanted: list[float]
    fitted: dict[str, float]
    held_out: dict[str, float]
    at_bound: list[int]
    worse: dict[str, tuple[float, float]]        # run -> (error with the defaults, held-out error)
    improves: bool
    refused: dict[str, tuple[float, float]]      # runs the unguarded fit would make worse by more than GUARD
    gaps: list[str]                              # runs beyond GAP with the defaults and held out
    raw: list[float]                             # the guarded fit before the significance test
    se: list[float]                              # its bootstrap standard errors
    start: list[float]                           # the defaults
    outvoted: dict[int, tuple[int, int]] = field(default_factory=dict)   # constant -> (runs explained, runs showing it)

    def noise(self, q: int) -> bool:
        """Whether constant ``q``'s fitted shift lay within its uncertainty (the default kept)."""
        return self.theta[q] == self.start[q] and self.raw[q] != self.start[q]

    @property
    def accepted(self) -> bool:
        moved = any(t != s0 for t, s0 in zip(self.theta, self.start))
        return moved and self.improves and not self.worse and not self.at_bound and not self.outvoted


# A fitted shift counts only beyond this many standard errors (the usual two): the defaults come from the libraries'
# sources, and a shift a site's runs cannot tell from their own scatter is not evidence against them.
SIGNIFICANCE = 2.0
BOOTSTRAP = 64          # resamples of the runs behind each standard error (fixed seed: deterministic)
# Each refit costs in proportion to the runs, so leave-one-out (a refit per run) and the bootstrap grow with their
# square. Up to LOO_MAX runs every run is held out alone and BOOTSTRAP resamples are drawn; beyond it the runs are
# held out FOLDS at a time (k-fold: run i of the sorted names in fold i mod FOLDS) and the resamples are cut so
# that they draw about BOOTSTRAP x LOO_MAX runs in all (at least BOOTSTRAP_MIN): a 1 MB input (about 290 runs) stays
# within seconds. The output names the scheme (held_out_scheme).
LOO_MAX = 30
FOLDS = 10
BOOTSTRAP_MIN = 8


def bootstrap_resamples(n_runs: int) -> int:
    """The resamples behind each standard error for ``n_runs`` runs: BOOTSTRAP up to LOO_MAX runs, then fewer."""
    if n_runs <= LOO_MAX:
        return BOOTSTRAP
    return max(BOOTSTRAP_MIN, BOOTSTRAP * LOO_MAX // n_runs)


def held_out_scheme(n_runs: int) -> str:
    """How each run's held-out error is taken: 'leave-one-out' up to LOO_MAX runs, else FOLDS-fold."""
    return "leave-one-out" if n_runs <= LOO_MAX else f"{FOLDS}-fold"


def _folds(names: Sequence[str]) -> list[list[str]]:
    """The groups of runs held out together (sorted names): one run each up to LOO_MAX runs, else FOLDS folds."""
    if len(names) <= LOO_MAX:
        return [[n] for n in names]
    return [list(names[i::FOLDS]) for i in range(FOLDS)]


def _bootstrap_se(rows: Sequence[Row], fit_one: Callable[[list[Row]], Sequence[float]], k: int) -> list[float]:
    """The standard error of each constant, by refitting on runs drawn with replacement (Efron 1979; not the
    jackknife, which underestimates it for median-type fits). ``rows``: the runs the fit explains (modelling
    gaps, capped out of the fit, would only make resamples where they outnumber the others flip to them).
    ``fit_one(rows)`` returns the constants."""
    by: dict[str, list[Row]] = {}
    for r in rows:
        by.setdefault(r.run, []).append(r)
    names = sorted(by)
    if len(names) < 2:
        return [0.0] * k
    rng = random.Random(19)
    thetas = []
    want = bootstrap_resamples(len(names))
    while len(thetas) < want:
        draw = [rng.choice(names) for _ in names]
        drawn = [r for n in draw for r in by[n]]
        if not identifiable(drawn, 0, list(range(1, k))):
            continue          # a resample that cannot tell the constants apart (or lacks one) says nothing about them
        thetas.append(fit_one([Row(f"{n}#{i}", r.y, r.b, r.a) for i, n in enumerate(draw) for r in by[n]]))
    means = [sum(t[q] for t in thetas) / len(thetas) for q in range(k)]
    return [(sum((t[q] - means[q]) ** 2 for t in thetas) / (len(thetas) - 1)) ** 0.5 for q in range(k)]


def _significant(theta: Sequence[float], start: Sequence[float], se: Sequence[float]) -> list[float]:
    """Each constant keeps its fitted value only when the shift from its default exceeds ``SIGNIFICANCE``
    standard errors; otherwise the default (from the libraries' sources) stays: the runs cannot tell the
    shift from their own scatter."""
    return [t if abs(t - s0) > SIGNIFICANCE * e else s0 for t, s0, e in zip(theta, start, se)]


def _trial(rows: Sequence[Row], names: Sequence[str], theta0: Sequence[float], candidates: list[int],
           before: dict[str, float]) -> _Trial:
    sub = [Row(r.run, r.y, r.b + sum(r.a[j] * theta0[j] for j in range(len(names)) if j not in candidates),
               tuple(r.a[j] for j in candidates)) for r in rows]
    lo = [SPEC[names[j]].lower for j in candidates]
    hi = [SPEC[names[j]].upper for j in candidates]
    sc = [_scales(names)[j] for j in candidates]
    st = [theta0[j] for j in candidates]
    g = guarded_fit(sub, lo, hi, st, sc, GUARD, GAP)
    names_run = sorted({r.run for r in sub})
    folds = [f for f in _folds(names_run) if any(r.run not in f for r in sub)]
    loo = [(f, guarded_fit([r for r in sub if r.run not in f], lo, hi, st, sc, GUARD, GAP).theta) for f in folds]
    inliers = {r.run for r in sub if abs(r.error(g.theta)) <= GAP}      # the runs the fit explains
    se = _bootstrap_se([r for r in sub if r.run in inliers], lambda rs: guarded_fit(rs, lo, hi, st, sc, GUARD, GAP).theta,
                       len(candidates))
    theta = within_guard(sub, st, _significant(g.theta, st, se), GUARD, GAP)
    wanted = unbounded(sub, st, sc)
    full = list(theta0)
    for p, j in enumerate(candidates):
        full[j] = theta[p]
    held: dict[str, float] = {}
    for fold, t in loo:
        out = set(fold)
        others = [r for r in sub if r.run not in out]
        t = within_guard(others, st, _significant(t, st, se), GUARD, GAP)
        for name in fold:
            held[name] = statistics.median(abs(r.error(t)) for r in sub if r.run == name)
    held = {name: held[name] for name in names_run if name in held}     # (in the runs' order, as before)
    at_bound = [p for p in range(len(candidates))
                if abs(wanted[p] - theta[p]) > 1e-6 * sc[p] and (wanted[p] < lo[p] or wanted[p] > hi[p])]
    gaps = sorted(n for n, e in held.items() if before[n] > GAP and e > GAP)
    worse = {n: (before[n], e) for n, e in held.items() if e > before[n] + GUARD and n not in gaps}
    free = _run_errors(sub, g.free)
    refused = {n: (before[n], e) for n, e in free.items() if before[n] <= GAP and e > before[n] + GUARD}
    improves = bool(held) and statistics.median(held.values()) < statistics.median(before[n] for n in held) - 1e-12
    # a robust fit holds only while the runs it explains are the majority of those that show a constant
    outvoted = {}
    for q in range(len(candidates)):
        shows = {r.run for r in sub if r.a[q]}
        if 2 * len(shows & inliers) <= len(shows):
            outvoted[q] = (len(shows & inliers), len(shows))
    return _Trial(list(candidates), theta, wanted, _run_errors(rows, full), held, at_bound, worse, improves, refused,
                  gaps, list(g.theta), se, st, outvoted)


# Settings that add modelled terms when on (above 1, or set): a constant could absorb their modelling error if
# only the runs that show it had them on.
CONFOUNDERS = (("TP", "tensor_model_parallel_size"), ("PP", "pipeline_model_parallel_size"),
               ("VPP", "virtual_pipeline_model_parallel_size"), ("CP", "context_parallel_size"),
               ("sequence parallel", "sequence_parallel"), ("distributed optimizer", "use_distributed_optimizer"),
               ("recompute", "recompute_granularity"), ("fp16", "fp16"), ("MLA", "multi_latent_attention"))


def _confounded(rows: Sequence[Row], j: int, layouts: dict[str, Layout]) -> tuple[str, Any] | None:
    """(setting, value) when every run that shows constant ``j`` has a setting on at the same value that none of the
    runs without it has (as CP 2 and the cuBLAS default do in half of Megatron's H100 records): the fit could not tell
    the constant from that setting's modelling error. None when they are told apart (or every run shows it)."""
    shown = {r.run for r in rows if r.a[j]}
    rest = {r.run for r in rows} - shown
    if not shown or not rest:
        return None
    for label, attr in CONFOUNDERS:
        values = {getattr(layouts[n], attr, None) for n in shown}
        if len(values) == 1:
            v = next(iter(values))
            baseline = v is None or v is False or (not isinstance(v, bool) and v == 1)   # the setting is off
            if not baseline and all(getattr(layouts[n], attr, None) != v for n in rest):
                return label, v
    return None


def _fit_level(level: str, runs: Sequence[CalibrationRun], base: SiteConstants, asked: set[str],
               min_runs: int) -> tuple[LevelResult, dict[str, float]]:
    names = list(LEVEL_CONSTANTS[level])
    rows = _level_rows(level, runs, base)
    results = [ConstantResult(n, level, getattr(base, n)) for n in names]
    res = LevelResult(level, LEVEL_METRIC[level], results, runs=sorted({r.run for r in rows}))
    if not rows:
        cpu = level == "allocated" and all(r.device != "gpu" for r in runs)
        for c in results:
            c.status = "too little data"
            c.reason = "the runs ran on CPU: no GPU workspaces" if cpu else \
                f"no run logged {METRIC_LABELS[LEVEL_METRIC[level]]}"
        return res, {}
    start = _start(level, names, base, runs)
    # the level's rows measure the constants at this base; ``theta0`` is what the defaults give
    theta0 = list(start)
    res.before = _run_errors(rows, theta0)
    candidates = []
    for j, c in enumerate(results):
        c.runs = len({r.run for r in rows if r.a[j]})
        if c.name not in asked:
            c.status, c.reason = "not asked", "kept (not in --fit)"
        elif c.runs < min_runs:
            shows = {"cublas_workspace": "runs without CUBLAS_WORKSPACE_CONFIG", "te_workspace": "Transformer Engine runs",
                     "nccl_per_communicator": "runs with NCCL communicators"}.get(c.name, "runs")
            c.status, c.reason = "too little data", f"{c.runs} of the {shows} needed (at least {min_runs})"
        else:
            candidates.append(j)
    layouts = {r.name: r.layout for r in runs}
    for j in list(candidates):
        hit = _confounded(rows, j, layouts)
        if hit:
            candidates.remove(j)
            label, value = hit
            results[j].status = "not identifiable"
            results[j].reason = (f"every run that shows it has {label} {value} and no other run does: its shift cannot be "
                                 f"told from memguard's modelling error of {label} {value}; give runs that tell them apart")
    if len(candidates) == 2 and not identifiable(rows, candidates[1], [candidates[0]]):
        j = candidates.pop()
        other = results[candidates[0]].name
        results[j].status = "not identifiable"
        results[j].reason = (f"every run has it in the same proportion to {other} (e.g. the same communicators); "
                             f"{other} is fitted and absorbs it")
    if not candidates:
        return res, {}
    trials = [_trial(rows, names, theta0, candidates, res.before)]
    if not trials[0].accepted and len(candidates) > 1:   # each constant alone: one may hold where both do not
        trials += [_trial(rows, names, theta0, [j], res.before) for j in candidates]
    chosen = min((t for t in trials if t.accepted), key=lambda t: statistics.median(t.held_out.values()), default=None)
    shown_trial = chosen or trials[0]
    res.fitted, res.held_out = shown_trial.fitted, shown_trial.held_out
    values: dict[str, float] = {}
    first = trials[0]
    for j in candidates:
        c = results[j]
        if chosen is not None and j in chosen.candidates and \
                chosen.theta[chosen.candidates.index(j)] != chosen.start[chosen.candidates.index(j)]:
            q = chosen.candidates.index(j)
            c.status, c.value = "fitted", chosen.theta[q]
            values[c.name] = chosen.theta[q]
            continue
        t = chosen if chosen is not None and j in chosen.candidates else \
            next((t for t in trials[1:] if t.candidates == [j]), first)   # its own trial where there is one
        q = t.candidates.index(j)
        if q in t.at_bound:
            c.status, c.wanted = "at bound", t.wanted[q]
            s_ = SPEC[c.name]
            c.reason = (f"the runs ask for {s_.format(t.wanted[q])}, outside its bounds "
                        f"[{s_.format(s_.lower)}, {s_.format(s_.upper)}]: a modelling gap, not a site constant")
        elif q in t.outvoted:
            c.status = "inconsistent"
            ok, n = t.outvoted[q]
            c.reason = (f"the runs disagree: {n - ok} of the {n} runs that show it are off by more than {GAP:.0%} at the "
                        f"fit (modelling gaps, or another value): a robust fit needs most runs on its side; defaults kept")
        elif t.worse or t.refused:
            c.status = "inconsistent"
            if t.worse:
                what, bad = "predicted from the others", t.worse
            else:
                what, bad = "fitted without the guard", t.refused
            shown = ", ".join(f"{n} {b:.2%} -> {a:.2%}" for n, (b, a) in sorted(bad.items(), key=lambda kv: -kv[1][1])[:4])
            c.reason = (f"the runs disagree: {what}, {len(bad)} run(s) get more than {GUARD:.2%} worse ({shown}); "
                        "within that guard the held-out error does not improve; defaults kept")
        elif t.noise(q):
            s_ = SPEC[c.name]
            shift = t.raw[q] - t.start[q]
            c.status = "within noise"
            c.reason = (f"the runs ask for {'+' if shift > 0 else '-'}{s_.format(abs(shift))} with a standard error of "
                        f"{s_.format(t.se[q])} (bootstrap): not beyond {SIGNIFICANCE:g} standard errors; defaults kept")
        else:
            c.status = "kept"
            c.reason = "the held-out error does not improve on the defaults; defaults kept"
    res.accepted = bool(values)
    return res, values


def calibrate(runs: Sequence[CalibrationRun], base: SiteConstants = DEFAULT_SITE, fit_only: Sequence[str] | None = None,
              min_runs: int = MIN_RUNS) -> CalibrationResult:
    """Fit the site constants from ``runs``; TooLittleData when no constant has enough runs."""
    # runs of one layout share one Layout object: the estimator's caches (model._stage) then find it by identity
    # instead of comparing every setting (290 runs of 16 layouts: 28,000 comparisons)
    same: dict[Layout, Layout] = {}
    runs = [replace(r, layout=same.setdefault(r.layout, r.layout)) for r in runs]
    asked = set(fit_only) if fit_only else set(SPEC)
    unknown = asked - set(SPEC)
    if unknown:
        raise MemguardError(f"--fit: unknown constant(s) {', '.join(sorted(unknown))} (known: {', '.join(SPEC)})")
    names = [r.name for r in runs]
    if len(set(names)) != len(names):
        raise MemguardError("two runs have the same name: " + ", ".join(sorted(n for n, k in Counter(names).items() if k > 1)))
    notes: list[str] = []
    gpus = sorted({r.gpu.name for r in runs if r.gpu is not None})
    if len(gpus) > 1:
        raise MemguardError(f"the runs used {len(gpus)} GPU types ({', '.join(gpus)}): a site profile holds one GPU "
                            "type's constants; calibrate each type's runs on their own")
    if len(runs) < min_runs:
        raise TooLittleData(f"too little data: {len(runs)} run(s); calibrate fits a constant only from at least "
                            f"{min_runs} runs that show it (give more runs, or --min-runs)")
    levels, values = [], {}
    for level in LEVEL_CONSTANTS:
        lr, v = _fit_level(level, runs, base, asked, min_runs)
        levels.append(lr)
        values.update(v)
    constants = [c for lv in levels for c in lv.constants]
    if not any(c.status not in ("too little data", "not asked") for c in constants):
        why = "; ".join(f"{c.name}: {c.reason}" for c in constants if c.status == "too little data")
        raise TooLittleData(f"too little data in {len(runs)} run(s) to fit any constant ({why})")
    site = with_values(base, values)
    for c in constants:
        if c.fitted:
            c.value = getattr(site, c.name)
    before = {r.name: {m: _median_signed(errors(r, base, m)) for m in METRICS} for r in runs}
    after = {r.name: {m: _median_signed(errors(r, site, m)) for m in METRICS} for r in runs}
    gaps = []
    for m in METRICS:
        off = sorted(((n, e[m]) for n, e in after.items() if e[m] is not None and abs(e[m]) > GAP), key=lambda x: -abs(x[1]))
        if off:
            gaps.append(Gap(m, off, GAP_WHAT[m]))
    for c in constants:
        if c.status == "at bound":
            lv = next(lv for lv in levels if lv.level == c.level)
            worst = sorted(lv.before.items(), key=lambda kv: -kv[1])[:6]
            gaps.append(Gap(LEVEL_METRIC[c.level], [(n, e) for n, e in worst], c.reason))
    return CalibrationResult(base=base, site=site, constants=constants, levels=levels, runs=runs, before=before,
                             after=after, gaps=gaps, notes=notes)


__all__ = ["calibrate", "CalibrationResult", "ConstantResult", "LevelResult", "Gap", "TooLittleData", "MIN_RUNS", "GUARD"]
