"""The fit behind ``memguard calibrate``: a few bounded constants of a linear model, robust to outliers.

Each observation ``i`` predicts a measured value ``y_i`` as ``b_i + sum_j a_ij * theta_j``: ``b_i`` is
what the site constants do not touch, ``a_ij`` how many times constant ``j`` counts there (two cuBLAS
workspaces, one TE workspace, three NCCL communicators, ...). The constants minimise the sum of relative
absolute errors ``|prediction - y| / y``, each run weighing one however many ranks it logged (a median-type
fit: a few runs far off move it little), each within its physical bounds; iteratively reweighted least
squares, with every combination of constants at a bound tried (at most three constants per level, so 27 combinations at most).

``guarded_fit`` adds what a site's own, imperfect runs need: runs the defaults already predict within
``cap`` must not get worse by more than ``tol`` (the constants may not buy one run's accuracy with
another's), and each run's loss is capped at ``cap`` so that a run no admissible constant brings within
``cap`` (a modelling gap) neither drags nor vetoes the fit.

Pure Python, deterministic.
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from typing import Sequence

IRLS_STEPS = 60
EPS = 1e-5          # relative residual below which an observation's weight stops growing


@dataclass(frozen=True)
class Row:
    """One observation: measured ``y``, the part ``b`` no fitted constant touches, coefficients ``a``."""

    run: str
    y: float
    b: float
    a: tuple[float, ...]

    def predict(self, theta: Sequence[float]) -> float:
        return self.b + sum(a * t for a, t in zip(self.a, theta))

    def error(self, theta: Sequence[float]) -> float:
        """Relative error of the prediction: predicted / measured - 1."""
        return self.predict(theta) / self.y - 1


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    a = [row[:] + [v[i]] for i, row in enumerate(m)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(a[r][c]))
        if abs(a[p][c]) < 1e-12 * max(1.0, max(abs(x) for row in m for x in row)):
            return None
        a[c], a[p] = a[p], a[c]
        for r in range(n):
            if r != c and a[r][c]:
                f = a[r][c] / a[c][c]
                a[r] = [x - f * y for x, y in zip(a[r], a[c])]
    return [a[i][n] / a[i][i] for i in range(n)]


def _wls(rows: Sequence[Row], w: Sequence[float], lower: Sequence[float], upper: Sequence[float],
         scale: Sequence[float]) -> list[float] | None:
    """Weighted least squares of relative residuals within bounds (every clamp pattern tried)."""
    k = len(lower)
    best, best_obj = None, float("inf")
    for pattern in itertools.product((None, "lo", "hi"), repeat=k):
        fixed = {j: (lower[j] if p == "lo" else upper[j]) for j, p in enumerate(pattern) if p}
        free = [j for j in range(k) if j not in fixed]
        theta = [fixed.get(j, 0.0) for j in range(k)]
        if free:
            m = [[0.0] * len(free) for _ in free]
            v = [0.0] * len(free)
            for r, wi in zip(rows, w):
                rest = r.b + sum(r.a[j] * theta[j] for j in fixed) - r.y
                x = [r.a[j] * scale[j] / r.y for j in free]
                for p, xp in enumerate(x):
                    v[p] -= wi * xp * rest / r.y
                    for q, xq in enumerate(x):
                        m[p][q] += wi * xp * xq
            sol = _solve(m, v)
            if sol is None:
                continue
            for p, j in enumerate(free):
                theta[j] = sol[p] * scale[j]
            if any(not lower[j] - 1e-9 * scale[j] <= theta[j] <= upper[j] + 1e-9 * scale[j] for j in free):
                continue
            if not fixed:
                return theta      # the unclamped minimum lies within the bounds: it is the bounded one (convex)
        obj = sum(wi * r.error(theta) ** 2 for r, wi in zip(rows, w))
        if obj < best_obj:
            best, best_obj = theta, obj
    return best


def fit(rows: Sequence[Row], lower: Sequence[float], upper: Sequence[float], start: Sequence[float],
        scale: Sequence[float] | None = None) -> list[float]:
    """The constants minimising the summed relative absolute error within [lower, upper]; ``start`` when
    the rows cannot determine them. ``scale``: a typical size per constant (conditioning)."""
    k = len(lower)
    scale = list(scale or [max(abs(u), abs(lo), 1e-12) for lo, u in zip(lower, upper)])
    if not rows or not k:
        return list(start)
    theta = list(start)
    rw = run_weights(rows)
    w = list(rw)
    for _ in range(IRLS_STEPS):
        sol = _wls(rows, w, lower, upper, scale)
        if sol is None:
            return list(start)
        if all(abs(a - b) <= 1e-9 * s for a, b, s in zip(sol, theta, scale)):
            theta = sol
            break
        theta = sol
        w = [c / max(abs(r.error(theta)), EPS) for r, c in zip(rows, rw)]
    return theta


def unbounded(rows: Sequence[Row], start: Sequence[float], scale: Sequence[float]) -> list[float]:
    """The same fit with no bounds at all (what the data alone asks for)."""
    big = [1e6 * s for s in scale]
    return fit(rows, [-b for b in big], big, start, scale)


def identifiable(rows: Sequence[Row], j: int, others: Sequence[int]) -> bool:
    """Whether constant ``j`` is separable from the constants ``others`` in ``rows``: its coefficients are
    not a fixed multiple of theirs (e.g. NCCL buffers when every run has the same communicators, next to
    the CUDA context which every run has once)."""
    cols = [j, *others]
    xs = [[r.a[c] for c in cols] for r in rows]
    m = [[sum(x[p] * x[q] for x in xs) for q in range(len(cols))] for p in range(len(cols))]
    return _solve(m, [1.0] * len(cols)) is not None


def run_weights(rows: Sequence[Row]) -> list[float]:
    """1 / (the rows of its run) for each row: every run one vote, however many of its ranks logged."""
    n: dict[str, int] = {}
    for r in rows:
        n[r.run] = n.get(r.run, 0) + 1
    return [1.0 / n[r.run] for r in rows]


def capped_loss(rows: Sequence[Row], theta: Sequence[float], cap: float, weights: Sequence[float] | None = None) -> float:
    """Sum of the relative absolute errors, each capped at ``cap`` (a run beyond ``cap`` costs the same
    wherever the constants go, so it cannot pull them), each run weighing one."""
    w = weights if weights is not None else run_weights(rows)
    return sum(c * min(abs(r.error(theta)), cap) for r, c in zip(rows, w))


@dataclass(frozen=True)
class Guarded:
    """A guarded fit: the constants, and what the same loss would choose with no guard (``free``)."""

    theta: tuple[float, ...]
    free: tuple[float, ...]
    guarded: tuple[int, ...]          # indices of the rows the guard protects (within ``cap`` at the start)


def within_guard(rows: Sequence[Row], start: Sequence[float], target: Sequence[float], tol: float,
                 cap: float) -> list[float]:
    """The point nearest ``target`` on the segment from ``start`` that keeps every row predicted within ``cap`` at
    ``start`` no more than ``tol`` worse (bisection: the set of such points is convex and holds ``start``)."""
    room = [(r, abs(r.error(start)) + tol) for r in rows if abs(r.error(start)) <= cap]

    def ok(t: float) -> bool:
        p = [s + t * (x - s) for s, x in zip(start, target)]
        return all(abs(r.error(p)) <= e + 1e-12 for r, e in room)
    if ok(1.0):
        return list(target)
    lo, hi = 0.0, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return [s + lo * (x - s) for s, x in zip(start, target)]


def guarded_fit(rows: Sequence[Row], lower: Sequence[float], upper: Sequence[float], start: Sequence[float],
                scale: Sequence[float], tol: float, cap: float) -> Guarded:
    """Minimise ``capped_loss`` within the bounds such that no row predicted within ``cap`` at ``start`` (the
    defaults) gets an absolute error more than ``tol`` above its error at ``start``. ``start`` is returned
    unless a feasible point is strictly better.

    The loss is piecewise linear and not convex (the caps), so the search is explicit: candidates are the
    median-type fit on all rows, on the guarded rows, and refits on the rows each candidate brings within
    ``cap`` (trimming steps); from ``start`` towards each candidate the feasible stretch of the segment is
    found by bisection (the feasible set is convex and holds ``start``) and scanned; the best point is then
    polished by a pattern search over the axes and diagonals, halving the step down to 1e-5 of ``scale``."""
    k = len(lower)
    start = [float(x) for x in start]
    if not rows or not k:
        return Guarded(tuple(start), tuple(start), ())
    e0 = [abs(r.error(start)) for r in rows]
    guarded = tuple(i for i, e in enumerate(e0) if e <= cap)
    room = {i: e0[i] + tol for i in guarded}

    def inside(theta: Sequence[float]) -> bool:
        if any(not lower[j] - 1e-9 * scale[j] <= theta[j] <= upper[j] + 1e-9 * scale[j] for j in range(k)):
            return False
        return all(abs(rows[i].error(theta)) <= room[i] + 1e-12 for i in guarded)

    rw = run_weights(rows)

    def loss(theta: Sequence[float]) -> float:
        return capped_loss(rows, theta, cap, rw)

    cands = [fit(rows, lower, upper, start, scale)]
    if guarded and len(guarded) < len(rows):
        cands.append(fit([rows[i] for i in guarded], lower, upper, start, scale))
    for c in list(cands):
        for _ in range(5):                        # trimming: refit on the rows the candidate explains
            inl = [r for r in rows if abs(r.error(c)) <= cap]
            if not inl:
                break
            nxt = fit(inl, lower, upper, c, scale)
            if all(abs(a - b) <= 1e-9 * s for a, b, s in zip(nxt, c, scale)):
                break
            c = nxt
            cands.append(c)
    free = min(cands, key=loss)
    best, best_loss = list(start), loss(start)
    for c in cands:
        lo_t, hi_t = 0.0, 1.0
        if not inside(c):
            for _ in range(40):
                mid = (lo_t + hi_t) / 2
                if inside([s + mid * (x - s) for s, x in zip(start, c)]):
                    lo_t = mid
                else:
                    hi_t = mid
            hi_t = lo_t
        for q in range(1, 17):
            t = hi_t * q / 16
            p = [s + t * (x - s) for s, x in zip(start, c)]
            v = loss(p)
            if v < best_loss - 1e-12 and inside(p):
                best, best_loss = p, v
    dirs = [tuple(1.0 if j == a else 0.0 for j in range(k)) for a in range(k)]
    dirs += [tuple((1.0 if j == a else (sg if j == b else 0.0)) for j in range(k))
             for a in range(k) for b in range(a + 1, k) for sg in (1.0, -1.0)]
    dirs += [tuple(-x for x in d) for d in dirs]
    step = 1 / 16
    while step > 1e-5:
        moved = False
        for d in dirs:
            p = [b + step * s * x for b, s, x in zip(best, scale, d)]
            v = loss(p)
            if v < best_loss - 1e-12 and inside(p):
                best, best_loss, moved = p, v, True
                break
        if not moved:
            step /= 2
    return Guarded(tuple(best), tuple(free), guarded)


def median_abs(errors: Sequence[float]) -> float | None:
    return statistics.median(abs(e) for e in errors) if errors else None


__all__ = ["Row", "fit", "unbounded", "identifiable", "median_abs", "capped_loss", "run_weights", "Guarded", "guarded_fit", "within_guard"]
