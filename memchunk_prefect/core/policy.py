"""Pure decisions: how to cut a volume for an operator, and what to do at a map boundary.

Nothing here touches Prefect, Dask, files or clocks: every function takes plain
data (shapes, chunks, budgets in bytes, a prediction function) and returns plain
data, so each decision is tested with tables and no cluster
(as distributed's worker state machine is: event in, instructions out).

The three decisions at a chunked map boundary (:func:`decide`):

- ``continue`` — the incoming chunking (from the upstream map) fits this
  operator's upper bound and its estimated run time is within
  ``continue_tolerance`` of the best plan's;
- ``rechunk`` — re-cut for this operator (:func:`plan`);
- ``retry-smaller`` — a chunk ran out of memory: :func:`split_chunk` halves it
  and the pieces are resubmitted (the runner records the censored observation).

Cold start: when the model is not ``ready`` the plan is a *probe*
(:func:`probe_plan`): a few small real chunks of different sizes, cut from one
end of the volume, whose results are kept; the remaining box is planned once
they have been measured.

How :func:`plan` chooses. Candidates are near-equal grids (sizes differ by at
most one element per axis, so chunks are balanced). For each candidate the
largest block its chunks read (each chunk's halo clipped at the volume's
edges: what the operator really holds) is bounded by the model; candidates whose upper bound exceeds the budget are out.
Among the rest the estimated makespan is minimised::

    makespan = ceil(n_chunks / slots) * (elements_with_halo * seconds_per_element
                                         + per_task_overhead_seconds)

(with the learned compute seconds of a chunk in place of ``elements x
seconds_per_element`` when the model found time growing faster than size:
such an operator is cheaper per element in smaller chunks)
so one large chunk per slot wins unless the per-task overhead is small and
the volume large; halos cost because they are paid per chunk; fewer chunks
break ties. Whole traces (no cut along ``twt``) are kept for operators that
need them, and for the rest whenever some whole-trace chunking fits (reads of
whole traces are contiguous in SEG-Y and zarr, and pay no halo along time).

>>> from memchunk_prefect.core.policy import plan, Prediction
>>> linear = lambda ext: Prediction(mean_bytes=8.0 * ext[0] * ext[1] * ext[2],
...                                 upper_bytes=10.0 * ext[0] * ext[1] * ext[2],
...                                 n_observations=10, ready=True)
>>> p = plan((64, 64, 100), budget_bytes=10 * 32 * 64 * 100, predict=linear, slots=2)
>>> p.chunk_shape, p.n_chunks, p.probe
((32, 64, 100), 2, False)
"""

from __future__ import annotations

import itertools
import math
import numbers
from dataclasses import dataclass, field
from typing import Callable, Iterable, Sequence

from memchunk_prefect.core.chunks import (
    Chunk,
    Shape,
    balanced_grid,
    check_shape,
    extents_with_halo,
    largest_read_extents,
    normalize_halo,
    split,
    with_halo,
)
from memchunk_prefect.core.energy import plan_energy_joules
from memchunk_prefect.core.errors import BudgetError, BudgetTooSmallError, VolumeError, format_bytes
from memchunk_prefect.core.records import Prediction
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE, PolicySettings

__all__ = [
    "CONTINUE", "RECHUNK", "RETRY_SMALLER", "PROBE", "DECISIONS", "Prediction", "PolicySettings", "Plan", "Decision",
    "Predictor", "plan", "probe_plan", "decide", "split_chunk", "bound_moved", "remaining_boxes", "task_budget_bytes",
    "allowed_failures_warning", "estimate_seconds", "estimate_joules", "objective_value", "check_budget", "SecondsFor",
    "JoulesFor", "GpuLimit", "gpu_task_budget_bytes", "GPU_TARGET_FRACTION", "probe_budget", "ReadRange",
    "NoPlanInRangeError", "FirstTouch",
]

CONTINUE = "continue"
RECHUNK = "rechunk"
RETRY_SMALLER = "retry-smaller"
PROBE = "probe"
DECISIONS = (CONTINUE, RECHUNK, RETRY_SMALLER, PROBE)


Predictor = Callable[[Shape], Prediction]

ReadRange = tuple[float, float]
"""``(least, most)`` elements of the largest block a plan's chunks read (halo included)."""


class NoPlanInRangeError(BudgetError):
    """Chunkings fit the budget but none reads a block of the size asked (a granularity arm has no plan here)."""


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


@dataclass(frozen=True)
class FirstTouch:
    """What a plan pays for taking its workers above the most memory they have held.

    Memory a worker process holds for the first time is faulted in and zeroed by the kernel during the task that
    first uses it: one trace_correlation block of 545 MiB took 0.8-1.4 s the first time in a process and 0.3 s
    the next (``python -m benchmarks.first_touch``), ~1.2-1.5 s of kernel time per GiB grown. Paid once per
    worker, not per chunk, so a time model per element cannot carry it, and a plan of a few large chunks on
    fresh workers is slower than its compute alone says.

    ``touched_bytes``: what a task may use above its worker's resting memory without growing it, on the least
    touched worker, per thread (:attr:`memchunk_prefect.core.budget.WorkerMemory.touched_bytes`), bytes;
    ``seconds_per_byte``: the kernel seconds this operator's runs paid per byte they grew their worker
    (:meth:`memchunk_prefect.learn.model.OperatorModel.touch_seconds_per_byte`).
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


@dataclass
class Plan:
    """How to cut a region for one operator, and why.

    ``chunk_shape`` is the shape of the largest chunk (output elements, no halo);
    ``predicted_peak_bytes`` / ``upper_bound_bytes`` are the model's mean and
    upper bound for that chunk *with* its halo. ``probe`` is True for a cold
    start probe, which covers only ``chunks`` and leaves the boxes in
    ``remainder`` to plan.
    """

    chunks: list[Chunk]
    chunk_shape: Shape
    predicted_peak_bytes: float | None
    upper_bound_bytes: float | None
    budget_bytes: int
    estimated_seconds: float | None = None
    estimated_joules: float | None = None
    probe: bool = False
    remainder: list[Chunk] = field(default_factory=list)
    decision: str = RECHUNK
    reason: str = ""
    probe_reason: str = ""  # a probe's: why the model could not plan (the reason without the probe's own words)
    #: On a GPU (a :class:`GpuLimit` given): the GPU model's upper bound for the largest chunk and the GPU
    #: budget, bytes; None on the CPU.
    gpu_upper_bound_bytes: float | None = None
    gpu_budget_bytes: int | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def to_dict(self) -> dict:
        return {
            "decision": self.decision,
            "chunk_shape": list(self.chunk_shape),
            "n_chunks": self.n_chunks,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "upper_bound_bytes": self.upper_bound_bytes,
            "budget_bytes": self.budget_bytes,
            "estimated_seconds": self.estimated_seconds,
            "estimated_joules": self.estimated_joules,
            "probe": self.probe,
            "too_little_history": self.probe,
            "remainder": [[list(c.start), list(c.stop)] for c in self.remainder],
            "reason": self.reason,
            "gpu_upper_bound_bytes": self.gpu_upper_bound_bytes,
            "gpu_budget_bytes": self.gpu_budget_bytes,
        }


# --------------------------------------------------------------------------- checks


def check_budget(budget_bytes: object) -> int:
    """A memory budget as a positive int of bytes, or a BudgetError quoting what was given."""
    if (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real)
            or not math.isfinite(budget_bytes) or budget_bytes <= 0):
        raise BudgetError(f"the memory budget must be a positive number of bytes, got {budget_bytes!r}")
    return int(float(budget_bytes))


def _positive(value: object, what: str, *, integer: bool = True) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
            or (integer and int(float(value)) != value)):
        kind = "a positive whole number" if integer else "a positive number"
        raise VolumeError(f"{what} must be {kind}, got {value!r}")
    return int(float(value)) if integer else float(value)


# --------------------------------------------------------------------------- budget


def task_budget_bytes(memory_limit_bytes: int, threads: int = 1, *, target_fraction: float = 0.75,
                      resting_bytes: int = 0, kill_fraction: float | None = None) -> int:
    """Memory one task may use above the worker's resting level, in bytes.

    ``target_fraction`` of the worker's ``memory_limit`` shared among its threads,
    minus what the idle worker process already holds. ``kill_fraction`` is the
    fraction of the limit at which the worker's nanny kills it (Dask's
    ``distributed.worker.memory.terminate``, read from the cluster; None when the
    nanny does not kill): a target at or above it is refused. With Dask's defaults
    (pause 0.80, terminate 0.95) the default 0.75 stays below both.

    >>> task_budget_bytes(4 * 2**30, 1, target_fraction=0.75, resting_bytes=2**30)
    2147483648
    """
    if not memory_limit_bytes or memory_limit_bytes <= 0:
        raise BudgetError(
            f"the workers have no memory limit (memory_limit={memory_limit_bytes!r}), so there is no budget to "
            "plan for: give the cluster a memory_limit, or pass memory_budget= to MemoryAwareRunner"
        )
    ceiling = 1.0 if kill_fraction is None else float(kill_fraction)
    if not 0 < target_fraction <= ceiling:
        raise BudgetError(
            f"target_fraction must be in (0, {ceiling:g}], got {target_fraction}"
            + (f": the workers' nanny kills a worker at {ceiling:g} of its memory_limit "
               "(distributed.worker.memory.terminate)" if kill_fraction is not None else ""))
    threads = max(1, int(threads))
    budget = int(memory_limit_bytes * target_fraction / threads) - int(resting_bytes)
    if budget <= 0:
        raise BudgetTooSmallError(
            f"a worker's memory_limit of {format_bytes(memory_limit_bytes)} x target_fraction {target_fraction} "
            f"/ {threads} threads leaves nothing above its resting {format_bytes(resting_bytes)}: give workers "
            "more memory or fewer threads"
        )
    return budget


#: The share of a GPU's free memory one worker's tasks may plan for when no ``target_fraction`` is set: the rest
#: is left for what the model does not see (cuFFT plans and cuSOLVER workspaces made inside a call, the pool's
#: fragmentation). A GPU has no nanny killing at a line, so the fraction is the only margin besides the model's.
GPU_TARGET_FRACTION = 0.9


def gpu_task_budget_bytes(free_bytes: int, threads: int = 1, *, target_fraction: float | None = None) -> int:
    """What one task may use of a GPU's memory, bytes: ``target_fraction`` (default :data:`GPU_TARGET_FRACTION`)
    of what the worker could allocate there (``free_bytes``: free memory plus its own pool, so its CUDA context
    and other processes' use are left out), shared by the worker's ``threads``.

    >>> gpu_task_budget_bytes(80 * 2**30) / 2**30
    72.0
    >>> gpu_task_budget_bytes(80 * 2**30, 2, target_fraction=0.5) / 2**30
    20.0
    """
    fraction = GPU_TARGET_FRACTION if target_fraction is None else target_fraction
    if (isinstance(fraction, bool) or not isinstance(fraction, numbers.Real) or not 0 < fraction <= 1):
        raise BudgetError(f"target_fraction must be a number in (0, 1], got {target_fraction!r}")
    return int(fraction * max(0, int(free_bytes)) / max(1, int(threads)))


def allowed_failures_warning(allowed_failures: int | None, address: str) -> str | None:
    """What to tell the user about the scheduler's ``allowed-failures`` setting, or None when it is fine.

    Dask retries a task whose worker died on another worker up to ``allowed-failures``
    times (default 3) before reporting ``KilledWorker``. For a task killed for memory
    each retry kills another worker, and the runner only learns of it (and splits the
    chunk) after the last one. The runner sets 0 on clusters it starts; a scheduler
    started elsewhere is a shared setting it reads but never changes.

    >>> allowed_failures_warning(0, "tcp://s:8786") is None
    True
    """
    if allowed_failures is None or allowed_failures <= 0:
        return None
    return (f"the Dask scheduler at {address} retries a task whose worker died up to {allowed_failures} times "
            f"(allowed-failures={allowed_failures}): a chunk that runs out of memory kills up to "
            f"{allowed_failures + 1} workers before memchunk can split it. Start that scheduler with "
            "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES=0")


# --------------------------------------------------------------------------- candidates


def _count_candidates(n: int, max_counts: int) -> list[int]:
    """Piece counts worth considering along an axis of ``n`` elements.

    Every count up to 16, then a geometric ladder (ratio ~1.19), then ``n`` itself:
    fine where it matters (few chunks per slot) and cheap for long axes.
    """
    n = int(n)
    top = min(n, max_counts)
    out = set(range(1, min(top, 16) + 1))
    c = 16.0
    while c < top:
        c *= 1.19
        out.add(min(top, int(round(c))))
    out.add(top)
    return sorted(out)


def _largest_piece(n: int, count: int) -> int:
    return -(-int(n) // int(count))


def _offset(chunks: Iterable[Chunk], origin: Sequence[int]) -> list[Chunk]:
    return [Chunk(tuple(a + o for a, o in zip(c.start, origin)), tuple(b + o for b, o in zip(c.stop, origin)))  # type: ignore[arg-type]
            for c in chunks]


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
                     first_touch: FirstTouch | None = None, peak_bytes: float | None = None) -> float:
    """Estimated makespan in seconds of ``n_chunks`` equal chunks of ``extents`` (halo included) on ``slots``.

    A chunk's compute time is ``seconds_for(elements)`` where the model learned
    that time grows faster than size, else ``elements x seconds_per_element``.
    ``first_touch``: what growing the workers past their high-water mark costs, once, for chunks peaking at
    ``peak_bytes`` (the model's mean; see :class:`FirstTouch`).
    """
    compute = _compute_seconds(extents, settings, seconds_per_element, seconds_for)
    waves = math.ceil(n_chunks / max(1, slots))
    grow = first_touch.seconds(peak_bytes) if first_touch is not None else 0.0
    return waves * (compute + settings.per_task_overhead_seconds) + grow


# --------------------------------------------------------------------------- plan


def plan(
    shape: Sequence[int],
    *,
    budget_bytes: int,
    predict: Predictor,
    halo: int | Sequence[int] | None = None,
    slots: int = 1,
    whole_traces: bool = True,
    region: Chunk | None = None,
    itemsize: int = ITEMSIZE,
    seconds_per_element: float | None = None,
    settings: PolicySettings = DEFAULT_SETTINGS,
    seconds_for: SecondsFor | None = None,
    joules_for: JoulesFor | None = None,
    gpu: GpuLimit | None = None,
    read_range: ReadRange | None = None,
    first_touch: FirstTouch | None = None,
) -> Plan:
    """The best chunking of ``region`` (default: the whole volume of ``shape``) for one operator.

    ``predict(extents) -> Prediction`` gives the model's figures for a block of
    ``extents`` (halo included). When it is not ``ready`` this returns a probe
    plan (:func:`probe_plan`). Raises :class:`BudgetTooSmallError` when even the
    smallest chunk allowed (one trace for whole-trace operators) does not fit.
    ``gpu``: on a GPU, the device's budget, which every chunk must fit as well.
    ``read_range``: ``(least, most)`` elements the largest block a plan reads may
    hold (halo included); the learned policy's granularity arms plan within one
    (:mod:`memchunk_prefect.core.bandit`). Raises :class:`NoPlanInRangeError` when
    chunkings fit the budget but none reads a block in that range.
    ``first_touch``: what growing the workers' memory past what they have held costs (:class:`FirstTouch`),
    counted once in each plan's estimate; None: nothing.
    """
    vol = check_shape(shape)
    h = normalize_halo(halo)
    region = _check_region(region, vol)
    rshape = region.shape
    budget_bytes = check_budget(budget_bytes)
    slots = int(_positive(slots, "slots"))
    itemsize = int(_positive(itemsize, "itemsize"))

    smallest = extents_with_halo((1, 1, rshape[2] if whole_traces else 1), h, vol)
    probe_pred = predict(smallest)

    def probe_fits(extents: Shape) -> bool:
        """Whether the model's bounds (raised where blocks as large ran out of memory) fit both budgets."""
        return predict(extents).upper_bytes <= budget_bytes and (gpu is None or gpu.over(extents) is None)

    if not probe_pred.ready:
        return probe_plan(vol, budget_bytes=probe_budget(budget_bytes, gpu), halo=h, slots=slots,
                          whole_traces=whole_traces,
                          region=region, itemsize=itemsize, settings=settings,
                          reason=getattr(probe_pred, "reason", "") or "too little history", fits=probe_fits)

    axis_extent: dict[tuple[int, int], int] = {}

    def read_extents(counts: tuple[int, int, int]) -> Shape:
        """The largest block the grid's chunks read, halos clipped at the volume's edges (cached per axis)."""
        out = []
        for axis, c in enumerate(counts):
            e = axis_extent.get((axis, c))
            if e is None:
                one = [1, 1, 1]
                one[axis] = c
                e = axis_extent[(axis, c)] = largest_read_extents(region, one, h, vol)[axis]
            out.append(e)
        return tuple(out)  # type: ignore[return-value]

    t_counts = [1] if whole_traces else _count_candidates(rshape[2], min(settings.max_counts, 64))
    best: tuple | None = None
    best_fit_smallest = None
    out_of_range = 0  # chunkings that fit but read a block outside ``read_range``
    for ct in t_counts:
        if best is not None and ct > 1:
            break  # whole traces fit: keep them (contiguous reads, no halo along time)
        for ci in _count_candidates(rshape[0], settings.max_counts):
            for cx in _count_candidates(rshape[1], settings.max_counts):
                cshape = (_largest_piece(rshape[0], ci), _largest_piece(rshape[1], cx), _largest_piece(rshape[2], ct))
                ext = read_extents((ci, cx, ct))
                pred = predict(ext)
                if pred.upper_bytes > budget_bytes:
                    if best_fit_smallest is None or pred.upper_bytes < best_fit_smallest[0]:
                        best_fit_smallest = (pred.upper_bytes, cshape)
                    continue
                if gpu is not None and gpu.over(ext) is not None:
                    continue
                if read_range is not None and not read_range[0] <= math.prod(ext) <= read_range[1]:
                    out_of_range += 1
                    continue
                n = ci * cx * ct
                secs = estimate_seconds(n, ext, slots, settings, seconds_per_element, seconds_for, first_touch,
                                        pred.mean_bytes)
                joules = estimate_joules(n, ext, slots, settings, seconds_per_element, seconds_for, joules_for,
                                         first_touch, pred.mean_bytes)
                # Prefer: the objective (shortest makespan, or least energy among the plans that meet the
                # deadline, then the fastest late one), then fewest chunks, uncut traces, cutting ilines first.
                is_late = late(secs, settings)
                value = secs if is_late else objective_value(secs, joules, settings)
                score = (is_late, round(value, 9), round(secs, 9), n, ct, cx)
                if best is None or score < best[0]:
                    best = (score, (ci, cx, ct), cshape, pred, secs, joules)
                # Larger cx only makes chunks smaller along xline: once it fits, more cuts only add overhead
                # unless they fill slots; keep scanning a little for balance but stop at many waves.
                if n >= 4 * slots and pred.upper_bytes <= budget_bytes:
                    break
    least = gpu.over(smallest) if best is None and gpu is not None else None
    if gpu is not None and least is not None and predict(smallest).upper_bytes <= budget_bytes:
        # The host fits the smallest chunk and the GPU does not: the GPU is what stops every plan.
        unit = "one trace" if whole_traces else "one element"
        if least.mean_bytes <= gpu.budget_bytes:
            # The host's model is ready but the GPU's bound, from few or scattered GPU runs, is too wide for even
            # the smallest chunk while its mean fits: that is too little known, not too little memory. Probe
            # (chunks sized for the GPU budget, kept), which is how the bound narrows; fail only on the mean.
            return probe_plan(vol, budget_bytes=probe_budget(budget_bytes, gpu), halo=h, slots=slots,
                              whole_traces=whole_traces, region=region, itemsize=itemsize, settings=settings,
                              reason=(f"the GPU model's bound for {unit} ({format_bytes(least.upper_bytes)}) is over "
                                      f"the GPU budget {format_bytes(gpu.budget_bytes)} though its mean "
                                      f"({format_bytes(least.mean_bytes)}) fits: too few GPU runs to plan with"))
        raise BudgetTooSmallError(
            f"even the smallest chunk allowed ({unit} column with halo {h}, extents {smallest}) is predicted to "
            f"need {format_bytes(least.mean_bytes)} of GPU memory, more than the GPU budget of "
            f"{format_bytes(gpu.budget_bytes)} per task. Run it on a GPU with more free memory (fewer processes "
            "sharing it), or on the CPU (device='cpu')"
            + ("" if not whole_traces else "; this operator needs whole traces, so traces cannot be cut"))
    if best is None and out_of_range:
        raise NoPlanInRangeError(
            f"{out_of_range} chunking(s) of {rshape} fit the budget of {format_bytes(budget_bytes)} but none reads a "
            f"block of {read_range[0]:,.0f} to {read_range[1]:,.0f} elements")  # type: ignore[index]
    if best is None:
        worst_case = best_fit_smallest[0] if best_fit_smallest else probe_pred.upper_bytes
        unit = "one trace" if whole_traces else "one element"
        raise BudgetTooSmallError(
            f"even the smallest chunk allowed ({unit} column with halo {h}, extents {smallest}) is predicted to "
            f"need up to {format_bytes(worst_case)}, more than the budget of {format_bytes(budget_bytes)}. "
            "Give workers more memory (memory_limit), fewer threads per worker, or raise a "
            "memory_budget/target_fraction cap if you set one"
            + ("" if not whole_traces else "; this operator needs whole traces, so traces cannot be cut")
        )
    (_, counts, cshape, pred, secs, joules) = best
    chunks = _offset(balanced_grid(rshape, counts), region.start)
    gpu_words, gpu_fields = _gpu_fit(gpu, read_extents(counts))
    return Plan(
        chunks=chunks,
        chunk_shape=cshape,
        predicted_peak_bytes=float(pred.mean_bytes),
        upper_bound_bytes=float(pred.upper_bytes),
        budget_bytes=int(budget_bytes),
        estimated_seconds=secs,
        estimated_joules=joules,
        decision=RECHUNK,
        reason=(f"{_chunks_of(len(chunks), cshape)}: upper bound {format_bytes(pred.upper_bytes)} "
                f"fits the budget {format_bytes(budget_bytes)}{gpu_words} with {slots} slot(s)"
                + _growth_words(first_touch, pred.mean_bytes) + _objective_words(secs, joules, settings)),
        **gpu_fields,
    )


def probe_budget(budget_bytes: int, gpu: GpuLimit | None) -> int:
    """The budget cold-start probes are sized for: the host's, or the GPU's where that is smaller (nothing is
    known of the operator's GPU memory either, and a probe that runs out of it is one more censored chunk)."""
    return budget_bytes if gpu is None else min(int(budget_bytes), int(gpu.budget_bytes))


def _gpu_fit(gpu: GpuLimit | None, extents: Shape) -> tuple[str, dict]:
    """The words and :class:`Plan` fields of a chunk of ``extents`` against the GPU budget (none on the CPU)."""
    if gpu is None:
        return "", {}
    upper = float(gpu.predict(extents).upper_bytes)
    return (f" ({format_bytes(upper)} of the GPU's {format_bytes(gpu.budget_bytes)})",
            {"gpu_upper_bound_bytes": upper, "gpu_budget_bytes": int(gpu.budget_bytes)})


def _chunks_of(n: int, shape: Sequence[int]) -> str:
    """``"3 chunks of up to (a, b, c)"``, or ``"1 chunk of (a, b, c)"`` (a reason names what the plan is).

    >>> _chunks_of(1, (1, 28, 400)), _chunks_of(2, (70, 64, 400))
    ('1 chunk of (1, 28, 400)', '2 chunks of up to (70, 64, 400)')
    """
    return f"1 chunk of {tuple(shape)}" if n == 1 else f"{n} chunks of up to {tuple(shape)}"


def _growth_words(first_touch: FirstTouch | None, peak_bytes: float) -> str:
    """What a plan's estimate counts for growing the workers' memory, in words ("" where nothing)."""
    if first_touch is None or first_touch.seconds(peak_bytes) < 0.01:
        return ""
    return (f"; {first_touch.seconds(peak_bytes):.2f} s counted for taking the workers "
            f"{format_bytes(peak_bytes - first_touch.touched_bytes)} above the most they have held")


def _objective_words(secs: float, joules: float, settings: PolicySettings) -> str:
    """What an energy-objective plan was chosen for, in words ("" for the time objective)."""
    if settings.objective != "energy":
        return ""
    words = f"; least energy: about {joules:.0f} J in {secs:.1f} s"
    if settings.deadline_seconds is not None:
        words += (f", misses the {settings.deadline_seconds:g} s deadline (the fastest plan)" if late(secs, settings)
                  else f" within the {settings.deadline_seconds:g} s deadline")
    return words


def probe_plan(
    shape: Sequence[int],
    *,
    budget_bytes: int,
    halo: int | Sequence[int] | None = None,
    slots: int = 1,
    whole_traces: bool = True,
    region: Chunk | None = None,
    itemsize: int = ITEMSIZE,
    settings: PolicySettings = DEFAULT_SETTINGS,
    scale: float | None = None,
    reason: str = "too little history",
    others_left: bool = False,
    fits: Callable[[Shape], bool] | None = None,
) -> Plan:
    """A cold-start probe wave: one chunk per slot (at least two), all of one size, from ``region``'s start.

    The largest probe an unknown operator can be given is the block that fits the
    budget if it needs ``settings.probe_multiple`` times its input; a wave's
    probes are ``scale`` times that (``settings.probe_first_share`` by default:
    the first wave). They lie side by side across the region's xlines in a strip
    of as many ilines as that allows, so they are real work of one size (equal
    probes keep every slot busy for the same time). The runner sizes its second
    wave from what the first measured (:mod:`memchunk_prefect.core.machine`): small
    first, because an operator whose memory grows faster than its size can
    outgrow any multiple of its input (a 100x-sized first probe of one quadratic
    in its traces was killed), then as large as that growth allows, because a
    light operator measured only at its memory floor is planned several times
    too cautiously. What is left (``remainder``) is at most three boxes. Probes
    are real work: their results are kept. A wave that takes all of ``region``
    when nothing else is left to plan teaches two sizes itself (else the next
    run would probe one size again); ``others_left``: boxes outside ``region``
    remain to be planned after it, so its probes may all be of one size. ``fits(extents)``: whether a probe
    may read a block of ``extents`` (halo included) at all; :func:`plan` passes the model's bounds, which a block
    at least as large as one that ran out of memory exceeds, so a probe is never a size known to fail.

    >>> p = probe_plan((10, 40, 100), budget_bytes=100 * 4 * 12_000, slots=2, scale=1.0)
    >>> [c.shape for c in p.chunks], [c.shape for c in p.remainder]
    ([(6, 20, 100), (6, 20, 100)], [(4, 40, 100)])
    """
    vol = check_shape(shape)
    h = normalize_halo(halo)
    region = _check_region(region, vol)
    r = region.shape
    budget_bytes = check_budget(budget_bytes)
    slots = int(_positive(slots, "slots"))
    itemsize = int(_positive(itemsize, "itemsize"))
    scale = float(_positive(settings.probe_first_share if scale is None else scale, "scale", integer=False))
    # Without history nothing is known of the operator but this: it holds at least its input block and
    # writes an output block as large. If even the smallest block allowed cannot do that, refuse now,
    # before anything is submitted.
    smallest = extents_with_halo((1, 1, r[2] if whole_traces else 1), h, vol)
    floor_bytes = 2 * itemsize * math.prod(smallest)
    if floor_bytes > budget_bytes:
        smallest_name = "one trace" if whole_traces else "one sample"
        raise BudgetTooSmallError(
            f"the memory budget of {format_bytes(budget_bytes)} per task cannot hold even {smallest_name} column "
            f"with its halo (extents {smallest}: {format_bytes(floor_bytes)} for its input and output alone). "
            "Give workers more memory (memory_limit), fewer threads per worker, or a larger memory_budget")
    n = min(max(slots, 2), r[1])  # (more probes than trace columns cannot be cut)
    # Elements (halo included) a probe may hold: scale x what an operator needing probe_multiple x its input fits.
    max_elems = max(1.0, budget_bytes * scale / (settings.probe_multiple * itemsize))
    i0, x0, t0 = region.start

    def read(rows: int, widths: Sequence[int], t_len: int) -> float:
        """Elements of the largest block the probes read, placed at the region's start (halos clipped at the
        volume's edges, as they are read: a probe in a corner holds half the halo an interior block would);
        infinite where one of them does not ``fits``."""
        out, x = 0, x0
        for w in widths:
            block = with_halo(Chunk((i0, x, t0), (i0 + rows, x + w, t0 + t_len)), h, vol)[0]
            if fits is not None and not fits(block.shape):
                return math.inf
            out = max(out, block.elements)
            x += w
        return out

    t_len = r[2]
    if not whole_traces:
        while t_len > 1 and read(1, [1], t_len) > max_elems:
            t_len = -(-t_len // 2)
    cuts = [round(r[1] * k / n) for k in range(1, n + 1)]
    widths = [b - a for a, b in zip([0] + cuts[:-1], cuts)]  # the probes across every xline, of one size
    rows = 1
    if read(1, widths, t_len) <= max_elems:  # a strip as thick as the probes allow
        rows = _largest(1, r[0], lambda k: read(k, widths, t_len) <= max_elems)
    else:  # even one iline across every xline is too much: the probes take part of the first iline
        widths = [_largest(1, max(1, r[1] // n), lambda k: read(1, [k] * n, t_len) <= max_elems)] * n
    if rows >= r[0] and t_len == r[2] and r[1] >= 3 and not others_left:
        # The wave takes the whole region and nothing else is left to plan, so it must teach two sizes itself:
        # 2 units on half the slots, 1 unit twice on the others, the larger first (every slot holds 2 units).
        sizes = [2] * -(-n // 2) + [1] * (2 * (n // 2))
        while sum(sizes) > r[1] and len(sizes) > 2:
            sizes.pop()
        cuts = [round(r[1] * k / sum(sizes)) for k in itertools.accumulate(sizes)]
        widths = [b - a for a, b in zip([0] + cuts[:-1], cuts)]
    x = x0
    chunks: list[Chunk] = []
    for w in widths:
        chunks.append(Chunk((i0, x, t0), (i0 + rows, x + w, t0 + t_len)))
        x += w
    remainder: list[Chunk] = []
    if t0 + t_len < region.stop[2]:
        remainder.append(Chunk((i0, region.start[1], t0 + t_len), (i0 + rows, x, region.stop[2])))
    if x < region.stop[1]:
        remainder.append(Chunk((i0, x, t0), (i0 + rows, region.stop[1], region.stop[2])))
    if i0 + rows < region.stop[0]:
        remainder.append(Chunk((i0 + rows, region.start[1], t0), region.stop))
    largest = max(chunks, key=lambda c: c.elements)
    return Plan(
        chunks=chunks,
        chunk_shape=largest.shape,
        predicted_peak_bytes=None,
        upper_bound_bytes=None,
        budget_bytes=int(budget_bytes),
        probe=True,
        remainder=remainder,
        decision=PROBE,
        reason=(f"{reason}: probing with {len(chunks)} chunks of {largest.shape} ({scale:.3g} of the largest block "
                f"an operator needing {settings.probe_multiple:g}x its input fits)"),
        probe_reason=reason,
    )


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] with ``ok(n)``, for ``ok`` true up to some n and false beyond (``lo`` if none):
    by bisection, so a survey of a million ilines costs twenty checks.

    >>> _largest(1, 1000, lambda n: n * n <= 200)
    14
    """
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _check_region(region: object, vol: Shape) -> Chunk:
    if region is None:
        return Chunk.whole(vol)
    if not isinstance(region, Chunk) or not Chunk.whole(vol).contains(region):
        raise VolumeError(f"region must be a Chunk inside the volume of shape {vol}, got {region!r}")
    return region


# --------------------------------------------------------------------------- decide and split


@dataclass
class Decision:
    """What the runner does at a map boundary, for the record and the UI."""

    decision: str
    plan: Plan
    reason: str
    incoming_n_chunks: int | None = None
    incoming_upper_bytes: float | None = None
    details: dict = field(default_factory=dict)


def decide(
    shape: Sequence[int],
    incoming: Sequence[Chunk] | None,
    *,
    budget_bytes: int,
    predict: Predictor,
    halo: int | Sequence[int] | None = None,
    slots: int = 1,
    whole_traces: bool = True,
    itemsize: int = ITEMSIZE,
    seconds_per_element: float | None = None,
    settings: PolicySettings = DEFAULT_SETTINGS,
    seconds_for: SecondsFor | None = None,
    joules_for: JoulesFor | None = None,
    gpu: GpuLimit | None = None,
    read_range: ReadRange | None = None,
    first_touch: FirstTouch | None = None,
) -> Decision:
    """Continue with the incoming chunking, rechunk, or probe (no history).

    ``incoming`` is the chunking of the upstream result (None for a source read
    from disk, which has no chunking worth keeping). ``gpu``: on a GPU, the
    device's budget, which the incoming chunks must fit as well to be kept.
    ``read_range``: as for :func:`plan`; incoming chunks whose largest block
    read is outside it are not kept. ``first_touch``: as for :func:`plan`.
    """
    vol = check_shape(shape)
    h = normalize_halo(halo)
    best = plan(vol, budget_bytes=budget_bytes, predict=predict, halo=h, slots=slots, whole_traces=whole_traces,
                itemsize=itemsize, seconds_per_element=seconds_per_element, settings=settings, seconds_for=seconds_for,
                joules_for=joules_for, gpu=gpu, read_range=read_range, first_touch=first_touch)
    if best.probe:
        return Decision(PROBE, best, best.reason, incoming_n_chunks=len(incoming) if incoming else None)
    if not incoming:
        return Decision(RECHUNK, best, "source has no chunking yet: " + best.reason)
    incoming = list(incoming)
    if whole_traces and any(c.shape[2] != vol[2] for c in incoming):
        return Decision(RECHUNK, best, "incoming chunks cut traces, which this operator needs whole: " + best.reason,
                        incoming_n_chunks=len(incoming))
    largest = max(incoming, key=lambda c: c.elements)
    ext = max((with_halo(c, h, vol)[0].shape for c in incoming), key=math.prod)  # the largest block read
    pred = predict(ext)
    if pred.upper_bytes > budget_bytes:
        return Decision(
            RECHUNK, best,
            f"incoming chunks of up to {largest.shape} need up to {format_bytes(pred.upper_bytes)} with this "
            f"operator, over the budget {format_bytes(budget_bytes)}: " + best.reason,
            incoming_n_chunks=len(incoming), incoming_upper_bytes=float(pred.upper_bytes))
    gpu_over = gpu.over(ext) if gpu is not None else None
    if gpu is not None and gpu_over is not None:
        return Decision(
            RECHUNK, best,
            f"incoming chunks of up to {largest.shape} need up to {format_bytes(gpu_over.upper_bytes)} of GPU "
            f"memory with this operator, over the GPU budget {format_bytes(gpu.budget_bytes)}: " + best.reason,
            incoming_n_chunks=len(incoming), incoming_upper_bytes=float(pred.upper_bytes))
    if read_range is not None and not read_range[0] <= math.prod(ext) <= read_range[1]:
        return Decision(
            RECHUNK, best,
            f"incoming chunks read blocks of up to {math.prod(ext):,} elements, outside the "
            f"{read_range[0]:,.0f} to {read_range[1]:,.0f} this plan is made for: " + best.reason,
            incoming_n_chunks=len(incoming), incoming_upper_bytes=float(pred.upper_bytes))
    secs = estimate_seconds(len(incoming), ext, slots, settings, seconds_per_element, seconds_for, first_touch,
                            pred.mean_bytes)
    joules = estimate_joules(len(incoming), ext, slots, settings, seconds_per_element, seconds_for, joules_for,
                             first_touch, pred.mean_bytes)
    worse = _worse_than(secs, joules, best, settings)
    if worse:
        return Decision(RECHUNK, best, f"incoming chunking fits but {worse}: " + best.reason,
                        incoming_n_chunks=len(incoming), incoming_upper_bytes=float(pred.upper_bytes))
    kept = Plan(chunks=incoming, chunk_shape=largest.shape, predicted_peak_bytes=float(pred.mean_bytes),
                upper_bound_bytes=float(pred.upper_bytes), budget_bytes=int(budget_bytes), estimated_seconds=secs,
                estimated_joules=joules, decision=CONTINUE, **_gpu_fit(gpu, ext)[1],
                reason=(f"incoming {_chunks_of(len(incoming), largest.shape)} fit (upper bound "
                        f"{format_bytes(pred.upper_bytes)} of {format_bytes(budget_bytes)}{_gpu_fit(gpu, ext)[0]}) "
                        "and are near the best"))
    return Decision(CONTINUE, kept, kept.reason, incoming_n_chunks=len(incoming),
                    incoming_upper_bytes=float(pred.upper_bytes))


def _worse_than(secs: float, joules: float, best: Plan, settings: PolicySettings) -> str | None:
    """Why a chunking estimated at ``secs`` / ``joules`` should give way to ``best`` (words), or None.

    Worse means: past the energy objective's deadline where ``best`` is not, or
    its objective (seconds or joules) more than ``continue_tolerance`` above
    ``best``'s.
    """
    if best.estimated_seconds is None:
        return None
    if late(secs, settings) and not late(best.estimated_seconds, settings):
        return f"is estimated {secs:.2f} s, past the {settings.deadline_seconds:g} s deadline"
    if settings.objective == "energy" and best.estimated_joules is not None:
        if joules > best.estimated_joules * (1 + settings.continue_tolerance):
            return f"is estimated {joules:.0f} J against {best.estimated_joules:.0f} J"
        return None
    if secs > best.estimated_seconds * (1 + settings.continue_tolerance):
        return f"is estimated {secs:.2f} s against {best.estimated_seconds:.2f} s"
    return None


def split_chunk(chunk: Chunk, *, whole_traces: bool = True) -> list[Chunk]:
    """Halve a chunk that ran out of memory; ``[]`` when it cannot be split any further.

    Whole-trace operators are split along iline/xline only.
    """
    return split(chunk, axes=(0, 1) if whole_traces else (0, 1, 2))


def bound_moved(old_upper: float | None, new_upper: float | None, settings: PolicySettings = DEFAULT_SETTINGS) -> bool:
    """Whether a new upper bound differs enough from the one a plan used to re-plan the remainder.

    >>> bound_moved(100.0, 130.0), bound_moved(100.0, 110.0), bound_moved(None, 5.0)
    (True, False, True)
    """
    if old_upper is None or new_upper is None:
        return old_upper is not new_upper
    if old_upper <= 0:
        return True
    return abs(new_upper - old_upper) / old_upper > settings.replan_threshold


def remaining_boxes(chunks: Sequence[Chunk]) -> tuple[list[Chunk], list[Chunk]]:
    """Group unsubmitted chunks into boxes that can be re-planned, and the chunks to keep as they are.

    Chunks are grouped in bands of equal iline range; a band whose chunks fill
    the whole xline/twt extent of all the chunks is a box, and adjacent full
    bands merge. Chunks of partial bands are kept unchanged.

    >>> cs = [Chunk((0, 5, 0), (2, 10, 4)), Chunk((2, 0, 0), (4, 5, 4)), Chunk((2, 5, 0), (4, 10, 4)),
    ...       Chunk((4, 0, 0), (6, 10, 4))]
    >>> boxes, kept = remaining_boxes(cs)
    >>> boxes, kept
    ([Chunk(start=(2, 0, 0), stop=(6, 10, 4))], [Chunk(start=(0, 5, 0), stop=(2, 10, 4))])
    """
    if not chunks:
        return [], []
    x0 = min(c.start[1] for c in chunks)
    x1 = max(c.stop[1] for c in chunks)
    t0 = min(c.start[2] for c in chunks)
    t1 = max(c.stop[2] for c in chunks)
    bands: dict[tuple[int, int], list[Chunk]] = {}
    for c in chunks:
        bands.setdefault((c.start[0], c.stop[0]), []).append(c)
    boxes: list[Chunk] = []
    kept: list[Chunk] = []
    current: list[int] | None = None
    for (i0, i1) in sorted(bands):
        members = bands[(i0, i1)]
        full = sum(c.elements for c in members) == (i1 - i0) * (x1 - x0) * (t1 - t0)
        if full and current is not None and current[1] == i0:
            current[1] = i1
        elif full:
            if current is not None:
                boxes.append(Chunk((current[0], x0, t0), (current[1], x1, t1)))
            current = [i0, i1]
        else:
            if current is not None:
                boxes.append(Chunk((current[0], x0, t0), (current[1], x1, t1)))
                current = None
            kept.extend(members)
    if current is not None:
        boxes.append(Chunk((current[0], x0, t0), (current[1], x1, t1)))
    return boxes, kept
