"""Will the allocation be used? Queue waits, walltime, and the chance of using an allocation by a deadline.

An HPC allocation here is ``N`` batch jobs of ``c`` cores, one Dask worker per job (dask-jobqueue with
``processes=1``), all submitted at time 0. Job ``i`` waits ``Q_i`` seconds in the queue, then its worker
holds its cores until the walltime ``W`` after it started (or until the work is done and the cluster is
closed). Over a window ``[0, T0]`` (tonight's deadline, the end of the grant) the allocation's utilisation is

    U(T0) = sum_i busy_i(T0) / (N c min(W, T0))

``busy_i(T0)``: the core-seconds job ``i``'s worker spent running tasks within the window. ``N c min(W, T0)``
is what the allocation could have done in the window had every job started at once: U is lowered by
queue waits (cores not yet granted), by idle slots while jobs hold them (a map's tail, the runner's own
work between maps), and by work finishing before the window ends. Writing ``u_i`` for job ``i``'s own
utilisation (busy over the core-seconds it could hold in the window), ``busy_i = c u_i min(W, (T0 - Q_i)^+)``
and

    U(T0) = (1/N) sum_i X_i,    X_i = u_i a(Q_i),    a(q) = min(W, (T0 - q)^+) / min(W, T0)

so ``X_i`` is in ``[0, 1]``. **The model** (:func:`p_utilisation`): the ``Q_i`` drawn independently from a
queue-wait distribution ``F_Q`` and the ``u_i`` independently from a per-job utilisation distribution ``G``;
then ``P(U(T0) >= U0)`` is the upper tail of the ``N``-fold convolution of the distribution of ``X``.
This is the question one of this project's reference papers (modelling execution strategies against
allocation utilisation) answers from those two distributions; its own formula was not available to us,
so the derivation above is ours, computed two ways:

- *exact* up to a grid: the distribution of ``X`` by midpoint integration over ``F_Q``'s quantiles and
  ``G``'s samples, binned on ``bins`` points of ``[0, 1]`` (each ``X`` rounded by at most half a bin, so
  ``U`` by at most ``1 / (2 bins)``), its ``N``-fold convolution by FFT;
- *normal*: ``1 - Phi(sqrt(N) (U0 - mu) / sigma)`` with ``mu``, ``sigma`` the mean and spread of ``X``
  (the central limit theorem; poor in the tails and for few jobs).

What the independence assumption leaves out, and the discrete-event simulator
(:mod:`memchunk_prefect.sim.simulate`) keeps: one run's jobs share one finite piece of work, so a job that starts
late finds less of it left (its ``u`` is lower), and every job of a run sees the same chunking. The
simulator's runs measure ``U(T0)`` directly; :func:`check` sets the model beside them on the same queue
waits and the per-job utilisation the simulator measured, which is how far the assumption can be trusted
for a given flow (``python -m benchmarks.allocation``).

Pure: numpy and scipy, no clock. Units: seconds, fractions.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from numpy.typing import ArrayLike

from memchunk_prefect.core.errors import SimulationInputError

#: Queue-wait forms :meth:`QueueWait.parse` reads, for messages.
QUEUE_WAIT_FORMS = ("0 (no wait), a fixed wait (20min), exp:MEAN (exponential, e.g. exp:20min), "
                    "lognormal:MEDIAN,P90 (e.g. lognormal:10min,2h), or file:PATH (one measured wait in seconds "
                    "per line, e.g. from `sacct --format=Submit,Start`)")


@dataclass(frozen=True)
class QueueWait:
    """How long each job waits in the batch queue before its worker joins, seconds.

    ``kind``: ``"fixed"`` (``a`` seconds), ``"exponential"`` (mean ``a``), ``"lognormal"`` (median ``a``,
    90th percentile ``b``: queue waits are heavy-tailed, and a median and a p90 are what a site's
    statistics page or ``sacct`` gives) or ``"empirical"`` (``samples``: measured waits, drawn from with
    replacement). Jobs' waits are independent draws (a stated assumption: a site's queue can start an
    array of jobs together).
    """

    kind: str = "fixed"
    a: float = 0.0
    b: float = 0.0
    samples: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "exponential", "lognormal", "empirical"):
            raise SimulationInputError(f"unknown queue-wait kind {self.kind!r}: give {QUEUE_WAIT_FORMS}")
        if self.kind == "empirical":
            s = np.asarray(self.samples, dtype=float)
            if not len(s) or not np.all(np.isfinite(s)) or s.min() < 0:
                raise SimulationInputError(f"measured queue waits must be finite seconds >= 0, at least one; "
                                           f"got {len(s)} values (min {s.min() if len(s) else None})")
        elif not (math.isfinite(self.a) and self.a >= 0):
            raise SimulationInputError(f"a queue wait must be a finite number of seconds >= 0, got {self.a}")
        if self.kind == "exponential" and self.a <= 0:
            raise SimulationInputError(f"an exponential queue wait needs a positive mean, got {self.a}")
        if self.kind == "lognormal" and not 0 < self.a < self.b:
            raise SimulationInputError(f"a log-normal queue wait needs 0 < median < p90, got median {self.a} s, "
                                       f"p90 {self.b} s: the 90th percentile of a wait is above its median")

    @classmethod
    def parse(cls, text: str) -> "QueueWait":
        """One of :data:`QUEUE_WAIT_FORMS`; durations as :func:`~memchunk_prefect.core.units.parse_seconds` reads
        them."""
        from memchunk_prefect.core.units import parse_seconds

        t = str(text).strip()
        low = t.lower()
        try:
            if low in ("0", "none", "0s"):
                return cls("fixed", 0.0)
            if low.startswith("exp:"):
                return cls("exponential", parse_seconds(t[4:]))
            if low.startswith("lognormal:"):
                median, _, p90 = t[10:].partition(",")
                return cls("lognormal", parse_seconds(median), parse_seconds(p90))
            if low.startswith("file:"):
                return cls.from_file(t[5:])
            return cls("fixed", parse_seconds(t))
        except SimulationInputError:
            raise
        except Exception as exc:  # a duration that does not parse: say which forms there are
            raise SimulationInputError(f"cannot read the queue wait {text!r} ({exc}); give {QUEUE_WAIT_FORMS}") \
                from None

    @classmethod
    def from_file(cls, path: str | Path) -> "QueueWait":
        """Measured waits, one number of seconds per line (blank lines and ``#`` comments skipped)."""
        p = Path(path).expanduser()
        try:
            lines = p.read_text(encoding="utf-8").splitlines()
        except OSError as exc:
            raise SimulationInputError(f"cannot read queue waits from {p}: {exc}") from None
        values = []
        for n, line in enumerate(lines, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            try:
                values.append(float(line))
            except ValueError:
                raise SimulationInputError(f"{p}:{n}: {line!r} is not a number of seconds; give one wait in "
                                           "seconds per line") from None
        return cls("empirical", samples=tuple(values))

    @property
    def _sigma(self) -> float:
        return math.log(self.b / self.a) / 1.2815515655446004  # z of the 90th percentile

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """``n`` independent waits, seconds."""
        if self.kind == "fixed":
            return np.full(int(n), float(self.a))
        if self.kind == "exponential":
            return rng.exponential(self.a, int(n))
        if self.kind == "lognormal":
            return self.a * np.exp(self._sigma * rng.standard_normal(int(n)))
        return rng.choice(np.asarray(self.samples, dtype=float), int(n), replace=True)

    def quantiles(self, k: int) -> np.ndarray:
        """The waits at probabilities ``(j + 1/2) / k``, ``j < k``: ``k`` equally likely points of the
        distribution, for midpoint integration over it."""
        p = (np.arange(int(k)) + 0.5) / int(k)
        if self.kind == "fixed":
            return np.full(int(k), float(self.a))
        if self.kind == "exponential":
            return -self.a * np.log1p(-p)
        if self.kind == "lognormal":
            from scipy.special import ndtri

            return self.a * np.exp(self._sigma * ndtri(p))
        return np.quantile(np.asarray(self.samples, dtype=float), p, method="inverted_cdf")

    def describe(self) -> str:
        if self.kind == "fixed":
            return "no queue wait" if self.a == 0 else f"a fixed {self.a:g} s queue wait"
        if self.kind == "exponential":
            return f"exponential queue waits, mean {self.a:g} s"
        if self.kind == "lognormal":
            return f"log-normal queue waits, median {self.a:g} s, p90 {self.b:g} s"
        s = np.asarray(self.samples)
        return f"{len(s)} measured queue waits (median {np.median(s):g} s, max {s.max():g} s)"


def _check_window(workers: int, window: float, walltime: float | None, target: float | None = None) -> None:
    if int(workers) < 1:
        raise SimulationInputError(f"an allocation has at least one job, got {workers}")
    if not (window > 0 and math.isfinite(window)):
        raise SimulationInputError(f"the window must be a positive, finite number of seconds, got {window}")
    if walltime is not None and not walltime > 0:
        raise SimulationInputError(f"the walltime must be a positive number of seconds, got {walltime}")
    if target is not None and not 0 < target <= 1:
        raise SimulationInputError(f"the target utilisation is a fraction in (0, 1], got {target}")


def held_fraction(waits: np.ndarray, window: float, walltime: float | None) -> np.ndarray:
    """``a(q)``: the part of ``min(W, T0)`` a job that waited ``q`` seconds can hold within the window."""
    w = math.inf if walltime is None else float(walltime)
    return np.minimum(w, np.maximum(0.0, window - np.asarray(waits, dtype=float))) / min(w, window)


@dataclass(frozen=True)
class UtilisationModel:
    """``P(U(T0) >= U0)`` two ways (see the module docstring), with what it was computed from."""

    target: float
    window_seconds: float
    jobs: int
    p_exact: float
    p_normal: float
    mean: float  # E[U(T0)] = E[X]
    sd: float  # the spread of U(T0): sd(X) / sqrt(N)
    bins: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def p_utilisation(queue_wait: QueueWait, utilisation: ArrayLike, *, jobs: int, window: float,
                  target: float, walltime: float | None = None, bins: int = 2000,
                  quantiles: int = 2000) -> UtilisationModel:
    """The model: ``P(U(T0) >= U0)`` for ``jobs`` jobs whose waits follow ``queue_wait`` and whose own
    utilisation is drawn from ``utilisation`` (samples, or one value), over ``window`` seconds with each job
    holding its cores at most ``walltime`` seconds. ``bins`` is capped so the convolution has at most
    2^24 points (``jobs x bins``)."""
    _check_window(jobs, window, walltime, target)
    u = np.atleast_1d(np.asarray(utilisation, dtype=float))
    if not len(u) or not np.all(np.isfinite(u)) or u.min() < 0 or u.max() > 1 + 1e-9:
        raise SimulationInputError(f"per-job utilisation must be fractions in [0, 1], at least one; got {len(u)} "
                                   f"values in [{u.min() if len(u) else None}, {u.max() if len(u) else None}]")
    u = np.clip(u, 0.0, 1.0)
    n = int(jobs)
    m = int(max(16, min(int(bins), 2**24 // n)))
    a = held_fraction(queue_wait.quantiles(quantiles), window, walltime)
    x = np.multiply.outer(a, u).ravel()  # equally likely values of X
    mean, var = float(x.mean()), float(x.var())
    pmf = np.bincount(np.rint(x * m).astype(np.int64), minlength=m + 1).astype(float)
    pmf /= pmf.sum()
    size = n * m + 1
    length = 1 << (size - 1).bit_length()
    total = np.fft.irfft(np.fft.rfft(pmf, length) ** n, length)[:size]
    total[total < 1e-13] = 0.0  # FFT round-off (~1e-15 here), not probability
    total /= total.sum()
    # U >= U0  <=>  sum of the binned X >= N U0 m (in grid units; a hair below for values exactly on it)
    first = int(math.ceil(n * target * m - 1e-9))
    p_exact = float(total[first:].sum()) if first < size else 0.0
    sd = math.sqrt(var / n)
    if sd > 0:
        from scipy.special import ndtr

        p_normal = float(ndtr((mean - target) / sd))
    else:
        p_normal = 1.0 if mean >= target else 0.0
    return UtilisationModel(float(target), float(window), n, min(1.0, p_exact), p_normal, mean, sd, m)


def monte_carlo(queue_wait: QueueWait, utilisation: ArrayLike, *, jobs: int, window: float,
                target: float, walltime: float | None = None, draws: int = 20000, seed: int = 0) -> float:
    """``P(U(T0) >= U0)`` by drawing the model's own assumptions ``draws`` times (independent waits and
    utilisations): what :func:`p_utilisation` computes, by brute force, to test it."""
    _check_window(jobs, window, walltime, target)
    rng = np.random.default_rng(seed)
    u = np.atleast_1d(np.asarray(utilisation, dtype=float))
    waits = queue_wait.sample(rng, int(draws) * int(jobs)).reshape(int(draws), int(jobs))
    x = held_fraction(waits, window, walltime) * rng.choice(u, size=waits.shape, replace=True)
    return float(np.mean(x.mean(axis=1) >= target))


@dataclass
class AllocationCheck:
    """The model beside the simulator on the same inputs: the simulated runs' ``U(T0)`` and per-job
    utilisations, and the model's probability computed from those per-job utilisations and the queue waits."""

    target: float
    window_seconds: float
    runs: int
    p_simulated: float  # the fraction of simulated runs whose U(T0) reached the target
    utilisation_p50: float  # of the simulated runs' U(T0)
    job_utilisation_p50: float  # of the per-job u pooled over runs (jobs that held cores in the window)
    model: UtilisationModel
    queue_wait: str = ""
    u_samples: list[float] = field(default_factory=list, repr=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("u_samples")
        return d


def check(queue_wait: QueueWait, runs: Sequence[tuple[float, Sequence[float]]], *, jobs: int, window: float,
          target: float, walltime: float | None = None) -> AllocationCheck:
    """Set the model beside simulated runs: ``runs`` is each run's ``(U(T0), per-job u)``
    (:func:`memchunk_prefect.sim.simulate.window_utilisation`)."""
    _check_window(jobs, window, walltime, target)
    if not runs:
        raise SimulationInputError("no simulated runs to check the model against")
    us = np.array([r[0] for r in runs], dtype=float)
    pooled = np.concatenate([np.asarray(r[1], dtype=float) for r in runs])
    if not len(pooled):
        raise SimulationInputError(f"no job held cores within the {window:g} s window in any simulated run "
                                   f"({queue_wait.describe()}): widen the window")
    model = p_utilisation(queue_wait, pooled, jobs=jobs, window=window, target=target, walltime=walltime)
    return AllocationCheck(float(target), float(window), len(runs), float(np.mean(us >= target - 1e-12)),
                           float(np.median(us)), float(np.median(pooled)), model, queue_wait.describe(),
                           pooled.tolist())
