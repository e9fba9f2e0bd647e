"""Least-squares fit of the project's TTFT model (``ace_extproc/latency.py``) to measured
points, in plain Python (the project has no numpy):

    TTFT_ms = t0 + p*(n + c) + max(t_step, a*n + b*n*(c + n/2))

with ``n`` uncached and ``c`` cached prompt tokens. For a fixed ``t_step`` the model is
linear in ``(t0, p, a, b)`` once each point is known to sit on the floor (``t_step`` binds)
or above it, so: for every ``t_step`` on a grid, alternate between assigning points to
the floor and a non-negative linear least-squares solve (exact, by trying every subset
of free coefficients), and keep the ``t_step`` with the least error. Residuals are
relative (divided by the measured TTFT), so the 20 ms points weigh as much as the 1 s
ones.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Point:
    uncached: int
    cached: int
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class Fit:
    t0_ms: float
    a_ms: float
    b_ms: float
    t_step_ms: float
    token_ms: float  # p
    rel_rmse: float  # root mean square of (predicted - measured) / measured

    def predict(self, uncached: int, cached: int = 0) -> float:
        n = max(uncached, 0)
        server = self.t0_ms + self.token_ms * (n + cached)
        return server + max(self.t_step_ms, self.a_ms * n + self.b_ms * n * (cached + n / 2))


def _work(p: Point) -> tuple[float, float]:
    """The point's coefficients of ``a`` and ``b``."""
    n = p.uncached
    return float(n), n * (p.cached + n / 2)


def _solve(rows: list[list[float]], ys: list[float]) -> list[float] | None:
    """Least squares ``rows @ x ~ ys`` by the normal equations (a few columns)."""
    k = len(rows[0]) if rows else 0
    if k == 0:
        return []
    m = [[sum(r[i] * r[j] for r in rows) for j in range(k)] for i in range(k)]
    v = [sum(r[i] * y for r, y in zip(rows, ys, strict=True)) for i in range(k)]
    for col in range(k):  # Gaussian elimination with partial pivoting
        piv = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[piv][col]) < 1e-300:
            return None
        m[col], m[piv], v[col], v[piv] = m[piv], m[col], v[piv], v[col]
        for r in range(col + 1, k):
            f = m[r][col] / m[col][col]
            for c in range(col, k):
                m[r][c] -= f * m[col][c]
            v[r] -= f * v[col]
    x = [0.0] * k
    for r in reversed(range(k)):
        x[r] = (v[r] - sum(m[r][c] * x[c] for c in range(r + 1, k))) / m[r][r]
    return x


COLUMNS = 4  # t0, p, a, b


def _nnls(rows: list[list[float]], ys: list[float]) -> tuple[list[float], float]:
    """Non-negative least squares over the columns: the best feasible solution among all
    subsets of free columns (the others held at 0) is the exact optimum."""
    best: tuple[list[float], float] = ([0.0] * COLUMNS, math.inf)
    for free in itertools.chain.from_iterable(
        itertools.combinations(range(COLUMNS), k) for k in range(COLUMNS + 1)
    ):
        sub = [[r[i] for i in free] for r in rows]
        x = _solve(sub, ys) if free else []
        if x is None or any(v < 0 for v in x):
            continue
        full = [0.0] * COLUMNS
        for i, v in zip(free, x, strict=True):
            full[i] = v
        err = sum(
            (sum(r[i] * full[i] for i in range(COLUMNS)) - y) ** 2
            for r, y in zip(rows, ys, strict=True)
        )
        if err < best[1]:
            best = (full, err)
    return best


def _fit_at(points: Sequence[Point], t_step: float) -> tuple[list[float], float]:
    """``(t0, p, a, b)`` and the squared relative error for a fixed ``t_step``."""
    floor = [False] * len(points)
    coef = [0.0] * COLUMNS
    err = math.inf
    for _ in range(20):
        rows, ys = [], []
        for p, on_floor in zip(points, floor, strict=True):
            w = 1.0 / p.ttft_ms
            tokens = (p.uncached + p.cached) * w
            if on_floor:  # TTFT = t0 + p*(n + c) + t_step
                rows.append([w, tokens, 0.0, 0.0])
                ys.append((p.ttft_ms - t_step) * w)
            else:
                an, bn = _work(p)
                rows.append([w, tokens, an * w, bn * w])
                ys.append(p.ttft_ms * w)
        coef, err = _nnls(rows, ys)
        _, _, a, b = coef
        again = [a * _work(p)[0] + b * _work(p)[1] < t_step for p in points]
        if again == floor:
            break
        floor = again
    return coef, err


def fit(points: Sequence[Point], step_grid_ms: float = 0.25, t_step_ms: float | None = None) -> Fit:
    """The least-squares coefficients for ``points`` (``t_step`` searched on a grid up to
    the smallest measured TTFT, or held at ``t_step_ms`` where it was measured)."""
    if len(points) < 5:
        raise ValueError("need at least five points to fit five coefficients")
    top = min(p.ttft_ms for p in points)
    best: tuple[float, list[float], float] = (0.0, [0.0] * COLUMNS, math.inf)
    grid = [i * step_grid_ms for i in range(int(top / step_grid_ms) + 1)]
    for t_step in grid if t_step_ms is None else [t_step_ms]:
        coef, err = _fit_at(points, t_step)
        if err < best[2]:
            best = (t_step, coef, err)
    t_step, (t0, token, a, b), _ = best
    model = Fit(t0, a, b, t_step, token, 0.0)
    rel = [(model.predict(p.uncached, p.cached) - p.ttft_ms) / p.ttft_ms for p in points]
    return Fit(t0, a, b, t_step, token, math.sqrt(sum(r * r for r in rel) / len(rel)))
