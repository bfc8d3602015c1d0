"""What a plan is estimated with: the model's memory figures, and where learned its time, energy, growth and GPU.

:class:`Estimates` bundles the callables the planner asks of the learned models (all pure reads), so
:func:`memchunk_prefect.core.policy.plan` and :func:`~memchunk_prefect.core.policy.decide` take one argument
for them. :func:`estimate_seconds` and :func:`estimate_joules` are a plan's makespan (seconds) and energy
(joules) on a number of slots. Units: bytes, seconds, joules, elements (halo included).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from memchunk_prefect.core.bandit import ArmChoice
from memchunk_prefect.core.chunks import (
    Shape,
)
from memchunk_prefect.core.energy import plan_energy_joules
from memchunk_prefect.core.errors import format_bytes
from memchunk_prefect.core.records import Prediction
from memchunk_prefect.core.settings import PolicySettings

Predictor = Callable[[Shape], Prediction]


ReadRange = tuple[float, float]
"""``(least, most)`` elements of the largest block a plan's chunks read (halo included)."""


@dataclass(frozen=True)
class GpuLimit:
    """The second budget of a map that computes on a GPU: every chunk must fit the host's budget *and* this.

    ``predict(extents)`` gives the GPU-memory figures of a block of ``extents`` (halo included: the operator
    holds the whole block on the device), learned apart from the host's (``model.gpu_view``);
    ``budget_bytes`` is what one task may use of the device's memory above the worker's resting GPU memory
    (its CUDA context and CuPy's pool), bytes.
    """

    predict: Predictor
    budget_bytes: int

    def over(self, extents: Shape) -> Prediction | None:
        """The GPU prediction of a block of ``extents`` when its upper bound exceeds the GPU budget, else None."""
        pred = self.predict(extents)
        return pred if pred.upper_bytes > self.budget_bytes else None

    def why_over(self, extents: Shape) -> str | None:
        """Why a block of ``extents`` does not fit the GPU budget, in words; None when it does."""
        over = self.over(extents)
        if over is None:
            return None
        return (f"{format_bytes(over.upper_bytes)} of GPU memory over the GPU budget "
                f"{format_bytes(self.budget_bytes)}")


@dataclass(frozen=True)
class FirstTouch:
    """What a plan pays for taking its workers above the most memory they have held.

    Memory a worker process holds for the first time is faulted in and zeroed by the kernel during the task that
    first uses it: one trace_correlation block of 545 MiB took 0.8-1.4 s the first time in a process and 0.3 s
    the next (``python -m benchmarks.studies.first_touch``), ~1.2-1.5 s of kernel time per GiB grown. Paid once per
    worker, not per chunk, so a time model per element cannot carry it, and a plan of a few large chunks on
    fresh workers is slower than its compute alone says.

    ``touched_bytes``: what a task may use above its worker's resting memory without growing it, on the least
    touched worker, per thread (:attr:`memchunk_prefect.core.budget.WorkerMemory.touched_bytes`), bytes;
    ``seconds_per_byte``: the kernel seconds this operator's runs paid per byte they grew their worker
    (:meth:`memchunk_prefect.learn.time.TimeModel.touch_seconds_per_byte`).
    """

    touched_bytes: int
    seconds_per_byte: float

    def seconds(self, peak_bytes: float | None) -> float:
        """Seconds the first wave of chunks peaking at ``peak_bytes`` (above the resting memory) adds to a
        makespan: every worker grows at once, so the least touched one's growth is what the plan waits for.

        >>> FirstTouch(touched_bytes=100 * 2**20, seconds_per_byte=1.0 / 2**30).seconds(612 * 2**20)
        0.5
        >>> FirstTouch(touched_bytes=100 * 2**20, seconds_per_byte=1.0 / 2**30).seconds(50 * 2**20)
        0.0
        """
        if peak_bytes is None:
            return 0.0
        return max(0.0, float(peak_bytes) - self.touched_bytes) * self.seconds_per_byte


SecondsFor = Callable[[int], "float | None"]
"""Compute seconds for a block of that many elements (halo included), or None where time is proportional to size."""


JoulesFor = Callable[[int], "float | None"]
"""Learned energy (joules) of a block of that many elements (halo included), or None where none was learned."""


def _compute_seconds(extents: Sequence[int], settings: PolicySettings, seconds_per_element: float | None,
                     seconds_for: SecondsFor | None) -> float:
    spe = settings.seconds_per_element if seconds_per_element is None else seconds_per_element
    elements = math.prod(int(e) for e in extents)
    compute = seconds_for(elements) if seconds_for is not None else None
    return elements * spe if compute is None else compute


def estimate_joules(n_chunks: int, extents: Sequence[int], slots: int, settings: PolicySettings,
                    seconds_per_element: float | None = None, seconds_for: SecondsFor | None = None,
                    joules_for: JoulesFor | None = None, first_touch: FirstTouch | None = None,
                    peak_bytes: float | None = None) -> float:
    """Estimated energy in joules of ``n_chunks`` equal chunks of ``extents`` (halo included) on ``slots``.

    Busy slots at the operator's learned joules per block (``joules_for``), else at
    ``settings.watts_per_core`` x its compute seconds; per-task overhead at the busy
    figure; slots left idle by the last wave at ``settings.idle_watts_per_core``
    (:func:`memchunk_prefect.core.energy.plan_energy_joules`). ``first_touch``: the kernel's time growing the
    workers past their high-water marks for chunks peaking at ``peak_bytes`` (:class:`FirstTouch`), busy on
    each slot the first wave fills.
    """
    elements = math.prod(int(e) for e in extents)
    grow = first_touch.seconds(peak_bytes) if first_touch is not None else 0.0
    return min(max(1, n_chunks), max(1, slots)) * grow * settings.watts_per_core + plan_energy_joules(
        n_chunks=n_chunks, slots=slots,
        chunk_seconds=_compute_seconds(extents, settings, seconds_per_element, seconds_for),
        overhead_seconds=settings.per_task_overhead_seconds,
        chunk_joules=joules_for(elements) if joules_for is not None else None,
        watts_per_core=settings.watts_per_core, idle_watts_per_core=settings.idle_watts_per_core)


def objective_value(seconds: float, joules: float, settings: PolicySettings) -> float:
    """What the planner minimises for ``settings.objective``: seconds, or joules."""
    return joules if settings.objective == "energy" else seconds


def late(seconds: float, settings: PolicySettings) -> bool:
    """True when an energy-objective plan misses ``settings.deadline_seconds`` (never for the time objective)."""
    return (settings.objective == "energy" and settings.deadline_seconds is not None
            and seconds > settings.deadline_seconds)


def estimate_seconds(n_chunks: int, extents: Sequence[int], slots: int, settings: PolicySettings,
                     seconds_per_element: float | None = None, seconds_for: SecondsFor | None = None,
                     first_touch: FirstTouch | None = None, peak_bytes: float | None = None,
                     cores: float | None = None) -> float:
    """Estimated makespan in seconds of ``n_chunks`` equal chunks of ``extents`` (halo included) on ``slots``.

    A chunk's compute time is ``seconds_for(elements)`` where the model learned
    that time grows faster than size, else ``elements x seconds_per_element``.
    ``first_touch``: what growing the workers past their high-water mark costs, once, for chunks peaking at
    ``peak_bytes`` (the model's mean; see :class:`FirstTouch`). ``cores``: the CPU cores the slots run on
    (None: one each); chunks running at once beyond them share them, each taking longer by as much, their
    per-task overhead too (Prefect's task engine is Python on the same cores), so on 2 cores 4 chunks cost what
    2 twice their size cost, plus 4 tasks' overhead instead of 2.

    >>> s = PolicySettings(per_task_overhead_seconds=0.1)
    >>> [round(estimate_seconds(n, (1, 1, 400 // n), 4, s, 0.01, cores=2), 2) for n in (2, 4)]
    [2.1, 2.2]
    >>> round(estimate_seconds(4, (1, 1, 100), 4, s, 0.01), 2)
    1.1
    """
    compute = _compute_seconds(extents, settings, seconds_per_element, seconds_for)
    waves = math.ceil(n_chunks / max(1, slots))
    share = max(1.0, min(n_chunks, max(1, slots)) / cores) if cores else 1.0
    grow = first_touch.seconds(peak_bytes) if first_touch is not None else 0.0
    return waves * (compute + settings.per_task_overhead_seconds) * share + grow


@dataclass(frozen=True)
class Estimates:
    """What the planner asks of an operator's learned models, bundled: one argument of :func:`plan` and
    :func:`decide` (:mod:`memchunk_prefect.core.policy`).

    ``predict(extents)``: the memory model's figures for a block of ``extents`` (halo included);
    ``seconds_per_element``: the learned compute seconds per element (None: the settings' default);
    ``seconds_for(elements)``: the learned compute seconds of a block where time grows faster than size;
    ``joules_for(elements)``: the learned energy of a block; ``first_touch``: what growing the workers' memory
    costs (:class:`FirstTouch`); ``gpu``: on a GPU, the device's budget and model (:class:`GpuLimit`);
    ``cores``: the CPU cores the map's slots run on (None: one each; :func:`estimate_seconds`).

    >>> from memchunk_prefect.core.records import Prediction
    >>> e = Estimates.of(lambda ext: Prediction(mean_bytes=1.0, upper_bytes=2.0, n_observations=3, ready=True))
    >>> e.predict((1, 1, 1)).upper_bytes, e.seconds_per_element is None
    (2.0, True)
    """

    predict: Predictor
    seconds_per_element: float | None = None
    seconds_for: SecondsFor | None = None
    joules_for: JoulesFor | None = None
    first_touch: FirstTouch | None = None
    gpu: GpuLimit | None = None
    cores: float | None = None

    @classmethod
    def of(cls, estimates: "Estimates | Predictor") -> "Estimates":
        """``estimates`` as given, or a bare predictor as estimates of memory alone."""
        return estimates if isinstance(estimates, Estimates) else cls(predict=estimates)

    def seconds(self, n_chunks: int, extents: Sequence[int], slots: int, settings: PolicySettings,
                peak_bytes: float | None) -> float:
        """:func:`estimate_seconds` of ``n_chunks`` chunks of ``extents`` with these estimates."""
        return estimate_seconds(n_chunks, extents, slots, settings, self.seconds_per_element, self.seconds_for,
                                self.first_touch, peak_bytes, self.cores)

    def joules(self, n_chunks: int, extents: Sequence[int], slots: int, settings: PolicySettings,
               peak_bytes: float | None) -> float:
        """:func:`estimate_joules` of ``n_chunks`` chunks of ``extents`` with these estimates."""
        return estimate_joules(n_chunks, extents, slots, settings, self.seconds_per_element, self.seconds_for,
                               self.joules_for, self.first_touch, peak_bytes)


class Knowledge(Protocol):
    """What the machine reads of the learned model for its operator (read-only).

    ``predict(extents)`` gives the memory figures for a block of ``extents``
    (halo included); ``seconds_per_element()`` the recent compute time per
    element, or None before any measurement; ``seconds_for(elements)`` a block's
    compute seconds where time grows faster than size (None where proportional); ``joules_for(elements)`` a
    block's learned energy in joules (None where none was learned: the planner then counts compute seconds at
    ``PolicySettings.watts_per_core``); ``touch_seconds_per_byte()`` the kernel seconds per byte a run pays to
    grow its worker past the most it has held (None before such a run: plans then count nothing for it);
    ``first_call_seconds()`` what a worker process's first call of the operator takes beyond a later one, seconds,
    paid once per process (None before it is learned);
    ``choose_arm(groups)`` the learned policy's arm among ``groups``
    (arms grouped by identical plans); ``predict_gpu(extents)`` the GPU-memory figures of a block (read only
    for maps on a GPU).
    """

    def predict(self, extents: Shape) -> Prediction: ...

    def predict_gpu(self, extents: Shape) -> Prediction: ...

    def seconds_per_element(self) -> float | None: ...

    def seconds_for(self, elements: int) -> float | None: ...

    def joules_for(self, elements: int) -> float | None: ...

    def touch_seconds_per_byte(self) -> float | None: ...

    def first_call_seconds(self) -> float | None: ...

    def choose_arm(self, groups: list[tuple[str, ...]]) -> ArmChoice: ...
