"""The fit behind ``memguard calibrate``: a few bounded constants of a linear model, robust to outliers.

Each observation ``i`` predicts a measured value ``y_i`` as ``b_i + sum_j a_ij * theta_j``: ``b_i`` is
what the site constants do not touch, ``a_ij`` how many times constant ``j`` counts there (two cuBLAS
workspaces, one TE workspace, three NCCL communicators, ...). The constants minimise the sum of relative
absolute errors ``|prediction - y| / y`` (a median-type fit: a few runs far off move it little), each
within its physical bounds; iteratively reweighted least squares, with every combination of constants
at a bound tried (at most three constants per level, so 27 combinations at most).

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
    w = [1.0] * len(rows)
    for _ in range(IRLS_STEPS):
        sol = _wls(rows, w, lower, upper, scale)
        if sol is None:
            return list(start)
        if all(abs(a - b) <= 1e-9 * s for a, b, s in zip(sol, theta, scale)):
            theta = sol
            break
        theta = sol
        w = [1.0 / max(abs(r.error(theta)), EPS) for r in rows]
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


def median_abs(errors: Sequence[float]) -> float | None:
    return statistics.median(abs(e) for e in errors) if errors else None


__all__ = ["Row", "fit", "unbounded", "identifiable", "median_abs"]
