"""Growth exponents of a sweep: ``y = F + c * x**k`` fitted to measured points, with a 95% interval.

Memory: the fixed part ``F`` (runtime, weights, optimizer state: what does not grow with ``x``) is fitted
together with ``c`` and ``k``: a grid over ``k`` and, at each ``k``, least squares for ``F >= 0`` and
``c >= 0`` in absolute bytes (peak-RSS noise is a few MiB whatever the size, so relative weights would
let the smallest, noisiest points decide). The exponent's 95% interval is the profile-likelihood one
(F-test on the residual sum of squares, ``n - 3`` degrees of freedom), so it includes the uncertainty of
``F``; with four or five points it is honestly wide. Three points give no interval.
Time is fitted without a fixed part (plain log-log), as a step's cost has no floor worth
subtracting once attention dominates. An exponent above `QUADRATIC_EXPONENT` is called quadratic.

`predict_limit` inverts the memory fit: the ``x`` at which ``F + c * x**k`` reaches a budget.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pydantic import model_validator

from nsa_diag.records import Record

QUADRATIC_EXPONENT = 1.3
_K_GRID = [0.1 + 0.0025 * i for i in range(1561)]  # 0.1 .. 4.0


class GrowthFit(Record):
    """``y ≈ fixed + coef * x**exponent`` over ``n`` points; interval `ci95` on the exponent; quadratic
    when the exponent passes `QUADRATIC_EXPONENT` (scale.json's ``memory_fit`` and ``time_fit``)."""

    exponent: float
    ci95: tuple[float, float] | None = None
    fixed: float
    coef: float
    n: int
    r2: float | None = None
    quadratic: bool  # from the exponent, when not read back from a file

    @model_validator(mode="before")
    @classmethod
    def _quadratic(cls, data: object) -> object:
        if (
            isinstance(data, dict)
            and "quadratic" not in data
            and isinstance(data.get("exponent"), int | float)
        ):
            return {**data, "quadratic": data["exponent"] > QUADRATIC_EXPONENT}
        return data

    def predict(self, x: float) -> float:
        return self.fixed + self.coef * x**self.exponent


# Two-sided 95% Student-t quantiles for 1..10 degrees of freedom; beyond, the Cornish-Fisher expansion
# around the normal quantile (error < 3e-3 there), so no scipy is needed.
_T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281)
_Z975 = 1.959964


def t_quantile_975(dof: int) -> float:
    """Two-sided 95% Student-t quantile (``t.ppf(0.975, dof)``)."""
    if dof < 1:
        raise ValueError(f"dof={dof}: needs at least one degree of freedom")
    if dof <= len(_T975):
        return _T975[dof - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * dof) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * dof**2)


def _ols(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float, float | None, float | None]:
    """slope, intercept, slope standard error (None for n < 3), r² of y on x."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    intercept = my - slope * mx
    residuals = [y - intercept - slope * x for x, y in zip(xs, ys, strict=True)]
    syy = sum((y - my) ** 2 for y in ys)
    r2 = 1 - sum(r * r for r in residuals) / syy if syy > 0 else None
    if n < 3:
        return slope, intercept, None, r2
    se = math.sqrt(sum(r * r for r in residuals) / (n - 2) / sxx)
    return slope, intercept, se, r2


def _fixed_and_coef(xs: Sequence[float], ys: Sequence[float], k: float) -> tuple[float, float, float]:
    """Least squares of y = F + c x^k at a given k, with 0 <= F < min(y) and c >= 0; returns F, c, RSS."""
    n = len(xs)
    u = [x**k for x in xs]
    mu, my = sum(u) / n, sum(ys) / n
    suu = sum((ui - mu) ** 2 for ui in u)
    coef = sum((ui - mu) * (yi - my) for ui, yi in zip(u, ys, strict=True)) / suu if suu else 0.0
    fixed = min(max(my - coef * mu, 0.0), (1 - 1e-6) * min(ys))
    coef = max(sum(ui * (yi - fixed) for ui, yi in zip(u, ys, strict=True)) / sum(ui * ui for ui in u), 0.0)
    rss = sum((yi - fixed - coef * ui) ** 2 for ui, yi in zip(u, ys, strict=True))
    return fixed, coef, rss


def _fit_with_fixed(xs: list[float], ys: list[float]) -> GrowthFit:
    """Grid over k; the 95% interval is the profile-likelihood one: every k whose best RSS stays within
    the F-test bound RSS_min * (1 + F(1, n-3) / (n-3)), so the uncertainty of F is included."""
    fits = [(k, *_fixed_and_coef(xs, ys, k)) for k in _K_GRID]
    k, fixed, coef, rss = min(fits, key=lambda r: r[3])
    n = len(xs)
    ci = None
    if n > 3:
        bound = rss * (1 + t_quantile_975(n - 3) ** 2 / (n - 3))  # F(1, n-3) at 95% is t² at 97.5%
        inside = [kk for kk, _, _, r in fits if r <= bound]
        ci = (min(inside), max(inside))
    my = sum(ys) / n
    syy = sum((y - my) ** 2 for y in ys)
    return GrowthFit(exponent=k, ci95=ci, fixed=fixed, coef=coef, n=n, r2=1 - rss / syy if syy else None)


def fit_growth(xs: Sequence[float], ys: Sequence[float], *, with_fixed: bool = True) -> GrowthFit | None:
    """Fit ``ys ≈ F + c * xs**k`` (``F = 0`` unless `with_fixed`); None with too few distinct xs
    (2 without a fixed part, 3 with one)."""
    points = [(float(x), float(y)) for x, y in zip(xs, ys, strict=True) if x > 0 and y > 0]
    if len({x for x, _ in points}) < (3 if with_fixed else 2):
        return None
    xs_, ys_ = [x for x, _ in points], [y for _, y in points]
    if with_fixed:
        return _fit_with_fixed(xs_, ys_)
    slope, intercept, se, r2 = _ols([math.log(x) for x in xs_], [math.log(y) for y in ys_])
    ci = None
    if se is not None:
        half = t_quantile_975(len(points) - 2) * se
        ci = (slope - half, slope + half)
    return GrowthFit(exponent=slope, ci95=ci, fixed=0.0, coef=math.exp(intercept), n=len(points), r2=r2)


def predict_limit(fit: GrowthFit, budget: float) -> float | None:
    """The x at which the fitted memory reaches `budget` bytes; None when it never does or already has."""
    if fit.coef <= 0 or fit.exponent <= 0 or budget <= fit.fixed:
        return None
    return ((budget - fit.fixed) / fit.coef) ** (1.0 / fit.exponent)


def describe_fit(what: str, fit: GrowthFit | None) -> str:
    """``"memory ~ S^1.98 [1.90, 2.06] (quadratic)"``."""
    if fit is None:
        return f"{what}: too few points to fit"
    ci = f" [{fit.ci95[0]:.2f}, {fit.ci95[1]:.2f}]" if fit.ci95 else ""
    return f"{what} ~ x^{fit.exponent:.2f}{ci}" + (" (quadratic)" if fit.quadratic else "")
