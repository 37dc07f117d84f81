"""The fit behind ``memguard calibrate`` as it was before issue hostile21 (megatron_memguard/calibrate/fit.py at
main 067b363): every pass over the rows a Python loop calling :meth:`Row.error`, one row at a time. The reference
tests/test_hostile21.py compares the column form of fit.py with (the fitted constants, the held-out errors and the
printed report of ``memguard calibrate``). Kept for that comparison only; nothing imports it otherwise.
"""
from __future__ import annotations

import itertools
from typing import Sequence

from megatron_memguard.calibrate.fit import EPS, IRLS_STEPS, Guarded, Row, _solve, capped_loss, run_weights


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
