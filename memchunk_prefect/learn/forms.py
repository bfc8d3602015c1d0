"""The regression forms that memory and time are fitted with, and the few statistics both use.

A block's cost (peak MiB, or compute seconds) is fitted against its size ``u``
(elements halo included, in Mi-elements) by three forms: ``linear`` (``a + b*u``:
a fixed part and a cost per element), ``superlinear`` (``+ c*u**1.5``) and
``quadratic`` (``+ c*u**2``, e.g. all pairs of traces). A line extrapolates
sensibly to blocks larger than any seen (a tree model under-predicted such a
chunk 3x in the memory-aware-chunking study, and the run failed); the curves are
there for operators whose cost grows faster than their size.

Each form is River's :class:`river.linear_model.BayesianLinearRegression`
(:class:`_Form`), fitted on relative residuals (each row divided by its own
scale: noise that is a few percent of the cost), so weighted least squares. The
forms are compared by their leave-one-out error (PRESS), and a curve beside the
line is weighed by their leave-one-out likelihood ratio (:func:`_loo_weight`).

Units: Mi-elements and MiB (or seconds) inside the fit; ``MIB`` converts.

>>> f = _Form(LINEAR, prior_variance=1e6, curvature_sd=2.5)
>>> for u in (0.25, 0.5, 1.0, 2.0):
...     f.learn(u, 50.0 + 28.0 * u, 50.0 + 28.0 * u)
>>> [round(float(c), 3) for c in f.coefficients(f.fit(prior_s=0.05, prior_dof=1.0, min_s=0.01))]
[50.0, 28.0]
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
from river import linear_model

MIB = 2**20
"""Scale of features (elements per Mi-element) and targets (bytes per MiB) inside the models."""
RATE_HISTORY = 256
"""Latest ``ok`` runs whose rate (seconds or joules per element) a model keeps: more than any median window needs."""
PRESS_WINDOW = 1000
"""Latest rows over which a form's leave-one-out error is computed: every row up to this many, a window beyond,
so that each refit stays O(1) in the rows learned."""

LINEAR = "linear"
SUPERLINEAR = "superlinear"
QUADRATIC = "quadratic"
CURVED = (SUPERLINEAR, QUADRATIC)
_POWERS = {LINEAR: (0.0, 1.0), SUPERLINEAR: (0.0, 1.0, 1.5), QUADRATIC: (0.0, 1.0, 2.0)}
_FEATURE_NAMES = {0.0: "const", 1.0: "u", 1.5: "u^1.5", 2.0: "u^2"}
REFIT_GROWTH = 1.25
"""A form is refitted in new units when a block this many times its unit (the largest block learned) arrives."""
MIN_WEIGHT_RATIO = 0.01
"""Blocks under this fraction of the largest learned count as one of this size in the fit (:meth:`_Form.weight`):
the noise a bound reads for a tiny block stays within ``MIN_WEIGHT_RATIO ** -size_weight`` of the largest's."""

# The defaults of the tunables that more than one model takes (``__init__`` arguments of the same names).
PRIOR_VARIANCE = 1e6
"""Prior variance of the fixed and per-element coefficients, in the forms' units (order one): weak, so their
posterior mean is least squares."""
PRIOR_NOISE = 0.05
"""Prior relative noise scale (one pseudo-observation): a few percent run to run before the residuals say."""
MIN_NOISE = 0.01
"""The least relative noise scale a fit admits: repeats that agree to 0.05% do not make a bound of 0.05%."""
SUPERLINEAR_GAIN = 0.9
"""A curved form is chosen only when its leave-one-out error is below this fraction of the line's."""
MIN_SIZE_RATIO = 1.5
"""Sizes this many times apart are what tell a fixed part from a per-element cost (memory's readiness) and the
largest blocks' rate from the smallest's (time's rate ratio)."""
METRIC_WINDOW = 20
"""Latest scored runs in a model's rolling error figures (memory's and energy's), and the first uses and drift
memory keeps: the model as it is now, not as it was after its first probes."""


@dataclass
class _Fit:
    """The posterior of one form read back from River, plus the learned noise scale."""

    coef: np.ndarray  # (p,) per feature, in the form's units
    cov: np.ndarray  # (p, p) posterior covariance in the scaled (relative) space, beta = 1
    s: float  # relative noise scale
    dof: float  # Student-t degrees of freedom of the bound
    press: float  # mean squared leave-one-out relative residual
    n: int


class _Form:
    """One form (``name``: linear or curved) fitted by a River ``BayesianLinearRegression``.

    Fitted in units of the largest block learned (``u_ref`` Mi-elements; ``y_ref``,
    that row's scale, in MiB or seconds), so every coefficient is of order one and
    the prior means the same for a light operator and a heavy one: in raw units a
    weak prior still shrank the slope of an operator measured only on small blocks
    (``test_a_heavy_operator_on_small_blocks_is_learned_as_measured_not_shrunk_by_the_prior``).
    A block more than ``REFIT_GROWTH`` x ``u_ref`` refits the form from its rows in
    the new units (O(log size range) refits over a key's life).

    The prior: weak (variance ``prior_variance``) on the fixed and per-element
    coefficients, so their posterior mean is least squares; on a curve's
    curvature, a normal of standard deviation ``curvature_sd`` in these units, in
    multiples of the cost at the largest block (2.5: a weakly informative prior on
    a standardized coefficient, Gelman et al., Ann. Appl. Stat. 2008), which keeps a
    curvature the noise hides from swinging a far bound by an order of magnitude.
    River's noise precision is fixed at ``beta = 1`` on relative targets, so every
    prior variance acts as a multiple of the noise variance (the conjugate prior).

    ``size_weight``: a row counts ``min(1, u / u_ref) ** size_weight`` (:meth:`weight`).
    ``nonnegative_constant``: the fixed part is held at 0 or above (:meth:`_without`).
    """

    def __init__(self, name: str, prior_variance: float, curvature_sd: float, size_weight: float = 0.0,
                 *, nonnegative_constant: bool = False):
        self.name = name
        self.size_weight = float(size_weight)
        self.nonnegative_constant = bool(nonnegative_constant)
        self.powers = _POWERS[name]
        self.names = [_FEATURE_NAMES[p] for p in self.powers]
        self.prior_variance = float(prior_variance)
        # River's prior is one variance for every coefficient; the curvature's own variance (curvature_sd^2)
        # comes from scaling its feature: a coefficient of a feature multiplied by k has k^2 times the variance.
        self._feature_scale = np.array([1.0 if k <= 1.0 else curvature_sd / math.sqrt(self.prior_variance)
                                        for k in self.powers])
        self._rows: list[tuple[float, float, float]] = []  # (u, target, scale) of every row, to refit in new units
        self.u_ref = 0.0
        self.y_ref = 0.0
        self.max_per_u = 0.0  # the largest target / u seen (MiB or seconds per Mi-element), for a not-ready guess
        self._reset()

    def _reset(self) -> None:
        # River's alpha is the prior *precision* (Bishop's notation): 1 / prior variance.
        self.regressor = linear_model.BayesianLinearRegression(alpha=1.0 / self.prior_variance, beta=1.0)
        self.n = 0  # rows learned
        # Sums over every row (scaled features x, scaled targets y): the residual sum of squares of any
        # coefficients follows from them in O(p^2), so a fit costs the same after 50,000 rows as after 5.
        self._xtx = np.zeros((self.p, self.p))
        self._xty = np.zeros(self.p)
        self._yty = 0.0
        # The latest PRESS_WINDOW rows (a ring), for leave-one-out residuals, which need each row's leverage.
        self._x = np.zeros((PRESS_WINDOW, self.p))
        self._y = np.zeros(PRESS_WINDOW)
        self._fit: _Fit | None = None

    @property
    def p(self) -> int:
        return len(self.powers)

    def raw(self, u: float) -> np.ndarray:
        """The form's features of a block of ``u`` Mi-elements, in the form's units."""
        v = u / self.u_ref if self.u_ref > 0 else u
        return np.array([v**k for k in self.powers]) * self._feature_scale

    def design(self, u: float, scale: float) -> np.ndarray:
        """The row a block of ``u`` Mi-elements with target scale ``scale`` (MiB or seconds) makes in the fit."""
        return self.raw(u) * (self.y_ref / scale)

    def weight(self, u: float) -> float:
        """How much a block of ``u`` Mi-elements counts in the fit, relative to the largest: ``min(1, u / u_ref)
        ** size_weight`` (1 with ``size_weight`` 0). Its noise scale is the row's scale over this weight."""
        if self.size_weight <= 0.0 or self.u_ref <= 0.0 or u >= self.u_ref:
            return 1.0
        return max(u / self.u_ref, MIN_WEIGHT_RATIO) ** self.size_weight

    def learn(self, u: float, y: float, scale: float) -> None:
        """Learn a block of ``u`` Mi-elements that cost ``y`` (MiB or seconds), its noise scale ``scale``."""
        self._rows.append((u, y, scale))
        if u > 0:
            self.max_per_u = max(self.max_per_u, y / u)
        if self.n == 0 or u > REFIT_GROWTH * self.u_ref:
            self.u_ref = u if u > 0 else 1.0
            self.y_ref = scale if scale > 0 else 1.0
            self._reset()
            for row in self._rows:
                self._learn_row(*row)
        else:
            self._learn_row(u, y, scale)

    def _learn_row(self, u: float, y: float, scale: float) -> None:
        scale = scale / self.weight(u)
        x = self.design(u, scale)
        y = y / scale
        self.regressor.learn_one(dict(zip(self.names, x)), y)
        self._xtx += np.outer(x, x)
        self._xty += x * y
        self._yty += y * y
        self._x[self.n % PRESS_WINDOW] = x
        self._y[self.n % PRESS_WINDOW] = y
        self.n += 1
        self._fit = None

    def mean(self, u: float, fit: "_Fit") -> float:
        """The fitted target (MiB or seconds) of a block of ``u`` Mi-elements."""
        return float(self.raw(u) @ fit.coef) * self.y_ref

    def coefficients(self, fit: "_Fit") -> np.ndarray:
        """The fitted coefficients in MiB (or seconds) per Mi-element to each power (``powers``)."""
        u_ref = self.u_ref if self.u_ref > 0 else 1.0
        return np.array([c * f * self.y_ref / u_ref**k for c, f, k in zip(fit.coef, self._feature_scale, self.powers)])

    def fit(self, prior_s: float, prior_dof: float, min_s: float) -> _Fit:
        """Read coefficients and covariance back from River through ``predict_one``, then residuals.

        The noise scale is learned from the relative residuals, ``s**2 = (prior_dof * prior_s**2 + RSS) /
        (prior_dof + n - p)``, at least ``min_s``; cached until the next row is learned."""
        if self._fit is not None:
            return self._fit
        coef, var = self._posterior()
        # Coefficients no operator has are held at 0 (the least-squares optimum under ``>= 0`` lies on the
        # boundary of each constraint the free fit breaks): a curve's per-element slope, and the constant where the
        # form asks (:meth:`_without`). Holding one can push the other below 0, so each is checked again.
        held: list[int] = []
        for _ in range(2):
            broken = [j for j in self._nonnegative() if j not in held and coef[j] < 0.0]
            if not broken:
                break
            held.append(broken[0])
            coef, var = self._without(held)
        n = self.n
        if n:
            # Over every row: sum (y - x.coef)^2 = y'y - 2 coef'X'y + coef'X'X coef (clamped: rounding).
            rss = max(float(self._yty - 2.0 * coef @ self._xty + coef @ self._xtx @ coef), 0.0)
            # Leave-one-out (PRESS) residuals of the latest rows, each with its leverage under the full fit:
            # exact while n <= PRESS_WINDOW, a sample of the same quantity beyond.
            m = min(n, PRESS_WINDOW)
            X, y = self._x[:m], self._y[:m]
            resid = y - X @ coef
            lev = np.einsum("ij,jk,ik->i", X, var, X)
            loo = resid / np.maximum(1.0 - lev, 1e-3)
            press = float(loo @ loo) / m
        else:
            rss, press = 0.0, math.inf
        dof = prior_dof + max(n - self.p, 0)
        s = math.sqrt((prior_dof * prior_s**2 + rss) / dof)
        self._fit = _Fit(coef=coef, cov=var, s=max(s, min_s), dof=dof, press=press, n=n)
        return self._fit

    def _posterior(self) -> tuple[np.ndarray, np.ndarray]:
        """River's posterior mean and covariance (beta = 1), read through ``predict_one`` on basis vectors."""
        p = self.p
        basis = [dict.fromkeys(self.names, 0.0) for _ in range(p)]
        for j in range(p):
            basis[j][self.names[j]] = 1.0
        coef = np.array([self.regressor.predict_one(e) for e in basis])
        var = np.empty((p, p))
        for j in range(p):
            var[j, j] = self.regressor.predict_one(basis[j], with_dist=True).sigma ** 2 - 1.0
        for j in range(p):
            for k in range(j + 1, p):
                e = {self.names[j]: 1.0, self.names[k]: 1.0}
                v = self.regressor.predict_one(e, with_dist=True).sigma ** 2 - 1.0
                var[j, k] = var[k, j] = (v - var[j, j] - var[k, k]) / 2.0
        return coef, var

    def _nonnegative(self) -> list[int]:
        """The features whose coefficient is held at 0 or above: a curved form's per-element slope (index 1), and
        the constant (index 0) where the form was made with ``nonnegative_constant``."""
        return ([0] if self.nonnegative_constant else []) + ([1] if self.p == 3 else [])

    def _without(self, held: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """The posterior with the coefficients of the features ``held`` at 0: (coef, covariance).

        A curve ``a + b u + c u^k`` with ``c > 0`` and ``b < 0`` falls before it
        rises: more bytes (or seconds) for a smaller block, which no operator does;
        such fits come from sizes close together whose costs differ by more than
        their sizes, the curvature following the noise and the slope compensating.
        Compute seconds with a negative constant are the same impossibility for
        time (a block that takes no time). The least-squares fit under ``>= 0``
        then has that coefficient at 0. This is the conjugate update River
        computes (prior precision ``1 / prior_variance`` on every scaled feature,
        ``beta = 1``), restricted to the features kept and read from this form's sums.
        """
        p = self.p
        keep = [j for j in range(p) if j not in held]
        precision = self._xtx[np.ix_(keep, keep)] + np.eye(len(keep)) / self.prior_variance
        cov_kept = np.linalg.inv(precision)
        coef = np.zeros(p)
        coef[keep] = cov_kept @ self._xty[keep]
        var = np.zeros((p, p))
        var[np.ix_(keep, keep)] = cov_kept
        return coef, var


def _loo_weight(press_curve: float, press_line: float, n: int) -> float:
    """How much a curved form counts beside the line (0..1), from their leave-one-out errors over ``n`` runs.

    The leave-one-out likelihood ratio of two Gaussian fits, ``1 / (1 + (PRESS_curved / PRESS_lin) ** (n / 2))``
    (pseudo-Bayesian model averaging, Yao et al. 2018, "Using stacking to average Bayesian predictive
    distributions", section 3.1): 1/2 while the runs cannot tell the forms apart, towards 1 as they show the
    curve, towards 0 as they show the line. 0 where the line's error is 0 (nothing left to explain).
    """
    if press_line <= 0 or not math.isfinite(press_curve):
        return 0.0
    exponent = min(n / 2.0 * math.log(max(press_curve / press_line, 1e-12)), 700.0)
    return 1.0 / (1.0 + math.exp(exponent))


_T_CACHE: dict[tuple[float, float], float] = {}


def _t_quantile(confidence: float, dof: float) -> float:
    """The Student-t quantile at ``confidence`` with ``dof`` degrees of freedom (cached: bounds ask it often)."""
    key = (confidence, dof)
    t = _T_CACHE.get(key)
    if t is None:
        from scipy.stats import t as student_t

        t = float(student_t.ppf(confidence, dof))
        _T_CACHE[key] = t
    return t


def _rate_ratio(runs: Iterable[tuple[int, float]], min_size_ratio: float) -> float | None:
    """The median value per element of the largest blocks of ``runs`` (``(elements, value)``, within
    ``min_size_ratio`` of the largest size) over the smallest blocks'; None before two sizes that far apart."""
    runs = list(runs)
    if not runs:
        return None
    smallest = min(e for e, _ in runs)
    largest = max(e for e, _ in runs)
    if largest < smallest * min_size_ratio:
        return None
    small = [v / e for e, v in runs if e <= smallest * min_size_ratio]
    large = [v / e for e, v in runs if e >= largest / min_size_ratio]
    low = statistics.median(small)
    return statistics.median(large) / low if low > 0 else None


def _rolling_count(rolling: Any) -> int:
    """How many values a River ``utils.Rolling`` metric holds now (0 if River's internals changed)."""
    try:
        return len(rolling.window)
    except Exception:  # pragma: no cover - river internals changed
        return 0
