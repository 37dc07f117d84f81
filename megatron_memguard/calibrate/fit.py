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

Pure Python, deterministic. The passes over the rows run in C (``map`` / ``sum`` over columns, :class:`_Cols`) on the
rows' relative form (error = ``b / y - 1 + sum_j (a_j / y) theta_j``), rows alike merged with their weights summed:
a guarded fit of 290 runs of 8 ranks (2,320 rows) takes about 70 ms instead of 0.4 s. The results equal the per-row
path of before (tests/fit_reference.py) to within rounding (tests/test_hostile21.py).
"""
from __future__ import annotations

import itertools
import statistics
from dataclasses import dataclass
from itertools import compress, repeat
from operator import add, le, mul, sub, truediv
from typing import Iterable, Iterator, Sequence

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


@dataclass(frozen=True)
class _Cols:
    """Rows in relative form, as columns: a row's error at ``theta`` is ``r0 + sum_j q_j theta_j`` (``r0 = b / y - 1``,
    ``q_j = a_j / y``); rows of the same form merged, their weights summed (a merged row's error, IRLS weight and loss
    are its copies' together). A pass over them runs in C (``map`` / ``sum``), once per distinct row."""

    r0: tuple[float, ...]
    q: tuple[tuple[float, ...], ...]      # per constant: its relative coefficient in each merged row
    w: tuple[float, ...]
    where: tuple[int, ...]                # per row given: the merged row that holds it


def _columns(rows: Sequence[Row], weights: Iterable[float]) -> _Cols:
    ys = [r.y for r in rows]
    k = len(rows[0].a) if rows else 0
    r0 = map(sub, map(truediv, [r.b for r in rows], ys), repeat(1))
    qs = [map(truediv, [r.a[j] for r in rows], ys) for j in range(k)]
    index: dict[tuple, int] = {}
    keys: list[tuple] = []
    ws: list[float] = []
    where = []
    for key, c in zip(zip(r0, *qs), weights):
        i = index.get(key)
        if i is None:
            i = index[key] = len(keys)
            keys.append(key)
            ws.append(c)
        else:
            ws[i] += c
        where.append(i)
    cols = tuple(zip(*keys)) if keys else ((),) * (k + 1)
    return _Cols(cols[0], cols[1:], tuple(ws), tuple(where))


def _subset(c: _Cols, idx: Sequence[int]) -> _Cols:
    return _Cols(tuple(c.r0[i] for i in idx), tuple(tuple(qj[i] for i in idx) for qj in c.q),
                 tuple(c.w[i] for i in idx), tuple(range(len(idx))))


def _errors(c: _Cols, theta: Sequence[float]) -> Iterator[float]:
    """Each merged row's relative error at ``theta`` (:meth:`Row.error`), lazily."""
    e: Iterable[float] = c.r0
    for qj, t in zip(c.q, theta):
        e = map(add, e, map(mul, qj, repeat(t)))
    return iter(e)


def _solve(m: list[list[float]], v: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting; None when singular."""
    n = len(v)
    if n == 1:      # (the same test and division as below, without building the tableau: one constant per IRLS step)
        return None if abs(m[0][0]) < 1e-12 * max(1.0, abs(m[0][0])) else [v[0] / m[0][0]]
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


def _wls(c: _Cols, mm: list[list[float]], g: list[float], d: Sequence[float] | None, lower: Sequence[float],
         upper: Sequence[float], scale: Sequence[float]) -> list[float] | None:
    """Weighted least squares of relative residuals within bounds (every clamp pattern tried). ``mm``, ``g``: the
    normal equations in scaled units (``x_j = q_j * scale_j``): ``sum w x_p x_q``, ``sum w x_p r0``; with constant ``j``
    held at ``t_j`` its column moves to the right-hand side as ``mm[p][j] * t_j / scale_j``. The rows' weights are
    ``c.w / d`` (``d`` None: ``c.w``), needed here only for the objective of a clamped pattern."""
    k = len(lower)
    best, best_obj = None, float("inf")
    for pattern in itertools.product((None, "lo", "hi"), repeat=k):
        fixed = {j: (lower[j] if p == "lo" else upper[j]) for j, p in enumerate(pattern) if p}
        free = [j for j in range(k) if j not in fixed]
        theta = [fixed.get(j, 0.0) for j in range(k)]
        if free:
            m = [[mm[p][q] for q in free] for p in free]
            v = [-(g[p] + sum(mm[p][j] * t / scale[j] for j, t in fixed.items())) for p in free]
            sol = _solve(m, v)
            if sol is None:
                continue
            for p, j in enumerate(free):
                theta[j] = sol[p] * scale[j]
            if any(not lower[j] - 1e-9 * scale[j] <= theta[j] <= upper[j] + 1e-9 * scale[j] for j in free):
                continue
            if not fixed:
                return theta      # the unclamped minimum lies within the bounds: it is the bounded one (convex)
        w = c.w if d is None else map(truediv, c.w, d)
        obj = sum(map(mul, w, map(pow, _errors(c, theta), repeat(2))))
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
    return _fit(_columns(rows, run_weights(rows)), lower, upper, start, scale)


def _fit(c: _Cols, lower: Sequence[float], upper: Sequence[float], start: Sequence[float],
         scale: Sequence[float]) -> list[float]:
    """:func:`fit` on merged rows (``c.w``: each one's run weight): iteratively reweighted least squares, the weight
    ``c.w / max(|error|, EPS)``. The products of the normal equations that do not change (``c.w x_p x_q``,
    ``c.w x_p r0``) are formed once: a step is one pass for the errors and one per sum."""
    k = len(lower)
    x = [list(map(mul, qj, repeat(s))) for qj, s in zip(c.q, scale)]
    cx = [list(map(mul, c.w, xj)) for xj in x]
    cxx = [[list(map(mul, cx[p], x[q])) for q in range(k)] for p in range(k)]
    cxr = [list(map(mul, cxp, c.r0)) for cxp in cx]
    theta = list(start)
    d: list[float] | None = None            # max(|error|, EPS) per row (None: the first step, weights c.w)
    for _ in range(IRLS_STEPS):
        if d is None:
            mm = [[sum(cxx[p][q]) for q in range(k)] for p in range(k)]
            g = [sum(v) for v in cxr]
        else:
            mm = [[sum(map(truediv, cxx[p][q], d)) for q in range(k)] for p in range(k)]
            g = [sum(map(truediv, v, d)) for v in cxr]
        sol = _wls(c, mm, g, d, lower, upper, scale)
        if sol is None:
            return list(start)
        if all(abs(a - b) <= 1e-9 * s for a, b, s in zip(sol, theta, scale)):
            theta = sol
            break
        theta = sol
        d = list(map(abs, _errors(c, theta)))
        if not min(d) >= EPS:
            d = [EPS if v < EPS else v for v in d]     # max(v, EPS), NaN kept
    return theta


def unbounded(rows: Sequence[Row], start: Sequence[float], scale: Sequence[float]) -> list[float]:
    """The same fit with no bounds at all (what the data alone asks for)."""
    big = [1e6 * s for s in scale]
    return fit(rows, [-b for b in big], big, start, scale)


def identifiable(rows: Sequence[Row], j: int, others: Sequence[int]) -> bool:
    """Whether constant ``j`` is separable from the constants ``others`` in ``rows``: its coefficients are
    not a fixed multiple of theirs (e.g. NCCL buffers when every run has the same communicators, next to
    the CUDA context which every run has once)."""
    xs = [[r.a[c] for r in rows] for c in (j, *others)]
    m = [[sum(map(mul, p, q)) for q in xs] for p in xs]
    return _solve(m, [1.0] * len(xs)) is not None


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


def _guard(c: _Cols, start: Sequence[float], tol: float, cap: float) -> tuple[_Cols, list[float]]:
    """The rows predicted within ``cap`` at ``start``, and how far each may go: its error there + ``tol`` (+ 1e-12)."""
    e0 = [abs(e) for e in _errors(c, start)]
    idx = [i for i, e in enumerate(e0) if e <= cap]
    return _subset(c, idx), [e0[i] + tol + 1e-12 for i in idx]


def within_guard(rows: Sequence[Row], start: Sequence[float], target: Sequence[float], tol: float,
                 cap: float) -> list[float]:
    """The point nearest ``target`` on the segment from ``start`` that keeps every row predicted within ``cap`` at
    ``start`` no more than ``tol`` worse (bisection: the set of such points is convex and holds ``start``)."""
    gc, room = _guard(_columns(rows, repeat(0.0)), start, tol, cap)

    def ok(t: float) -> bool:
        p = [s + t * (x - s) for s, x in zip(start, target)]
        return all(map(le, map(abs, _errors(gc, p)), room))
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
    cols = _columns(rows, run_weights(rows))
    e0 = [abs(e) for e in _errors(cols, start)]
    guarded = tuple(i for i, m in enumerate(cols.where) if e0[m] <= cap)
    gc, room = _guard(cols, start, tol, cap)

    def inside(theta: Sequence[float]) -> bool:
        if any(not lower[j] - 1e-9 * scale[j] <= theta[j] <= upper[j] + 1e-9 * scale[j] for j in range(k)):
            return False
        return all(map(le, map(abs, _errors(gc, theta)), room))

    def loss(theta: Sequence[float]) -> float:      # capped_loss, over the merged rows
        return sum(map(mul, cols.w, map(min, map(abs, _errors(cols, theta)), repeat(cap))))

    cands = [_fit(cols, lower, upper, start, scale)]
    if guarded and len(guarded) < len(rows):
        cands.append(fit([rows[i] for i in guarded], lower, upper, start, scale))
    for c in list(cands):
        for _ in range(5):                        # trimming: refit on the rows the candidate explains
            near = [abs(e) <= cap for e in _errors(cols, c)]
            inl = list(compress(rows, (near[m] for m in cols.where)))
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
