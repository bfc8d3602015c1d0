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

>>> from memchunk_prefect.core.records import Prediction
>>> linear = lambda ext: Prediction(mean_bytes=8.0 * ext[0] * ext[1] * ext[2],
...                                 upper_bytes=10.0 * ext[0] * ext[1] * ext[2],
...                                 n_observations=10, ready=True)
>>> p = plan((64, 64, 100), budget_bytes=10 * 32 * 64 * 100, estimates=linear, slots=2)
>>> p.chunk_shape, p.n_chunks, p.probe
((32, 64, 100), 2, False)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

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
from memchunk_prefect.core.errors import BudgetTooSmallError, format_bytes
from memchunk_prefect.core.estimates import (
    Estimates,
    FirstTouch,
    GpuLimit,
    Prediction,
    Predictor,
    ReadRange,
    late,
    objective_value,
)
from memchunk_prefect.core.plans import (
    CONTINUE,
    PROBE,
    RECHUNK,
    NoPlanInRangeError,
    Plan,
    check_budget,
    check_region,
    chunks_of,
    positive,
)
from memchunk_prefect.core.probe import probe_budget, probe_plan
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE, PolicySettings

__all__ = ["Decision", "plan", "decide", "split_chunk"]


# --------------------------------------------------------------------------- checks


# --------------------------------------------------------------------------- budget


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


# --------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class _Candidate:
    """One chunking the planner weighed: its piece counts per axis, its largest chunk (no halo) and block read
    (halo included), the model's figures for that block, its estimated seconds and joules, and its rank."""

    counts: tuple[int, int, int]
    chunk_shape: Shape
    extents: Shape
    prediction: Prediction
    seconds: float
    joules: float
    score: tuple


@dataclass
class _Search:
    """What a search over chunkings found: the best that fits, and why none did where none fits."""

    best: _Candidate | None = None
    smallest_over: tuple[float, Shape] | None = None  # (upper bytes, chunk shape) of the least over the budget
    out_of_range: int = 0  # chunkings that fit but read a block outside ``read_range``


class _Grid:
    """Near-equal grids of a region: the largest block a grid's chunks read, halos clipped at the volume's
    edges (cached per axis and count: the planner asks for thousands)."""

    def __init__(self, region: Chunk, halo: Shape, vol: Shape):
        self.region, self.halo, self.vol = region, halo, vol
        self._extent: dict[tuple[int, int], int] = {}

    def read_extents(self, counts: tuple[int, int, int]) -> Shape:
        out = []
        for axis, c in enumerate(counts):
            e = self._extent.get((axis, c))
            if e is None:
                one = [1, 1, 1]
                one[axis] = c
                e = self._extent[(axis, c)] = largest_read_extents(self.region, one, self.halo, self.vol)[axis]
            out.append(e)
        return tuple(out)  # type: ignore[return-value]


def plan(
    shape: Sequence[int],
    *,
    budget_bytes: int,
    estimates: Estimates | Predictor,
    halo: int | Sequence[int] | None = None,
    slots: int = 1,
    whole_traces: bool = True,
    region: Chunk | None = None,
    itemsize: int = ITEMSIZE,
    settings: PolicySettings = DEFAULT_SETTINGS,
    read_range: ReadRange | None = None,
) -> Plan:
    """The best chunking of ``region`` (default: the whole volume of ``shape``) for one operator.

    ``estimates``: the operator's learned figures (:class:`~memchunk_prefect.core.estimates.Estimates`), or
    only its memory predictor ``predict(extents) -> Prediction`` for a block of ``extents`` (halo included).
    When the memory model is not ``ready`` this returns a probe plan
    (:func:`~memchunk_prefect.core.probe.probe_plan`). Raises :class:`BudgetTooSmallError` when even the
    smallest chunk allowed (one trace for whole-trace operators) does not fit. ``estimates.gpu``: on a GPU,
    the device's budget, which every chunk must fit as well. ``read_range``: ``(least, most)`` elements the
    largest block a plan reads may hold (halo included); the learned policy's granularity arms plan within
    one (:mod:`memchunk_prefect.core.bandit`). Raises :class:`NoPlanInRangeError` when chunkings fit the
    budget but none reads a block in that range.

    The steps: candidates (near-equal grids, :func:`_search`), each scored by its estimated makespan or
    energy (:func:`_score`), the best chosen; where none fits, why (:func:`_no_plan`).
    """
    est = Estimates.of(estimates)
    vol = check_shape(shape)
    h = normalize_halo(halo)
    region = check_region(region, vol)
    budget_bytes = check_budget(budget_bytes)
    slots = int(positive(slots, "slots"))
    itemsize = int(positive(itemsize, "itemsize"))
    smallest = extents_with_halo((1, 1, region.shape[2] if whole_traces else 1), h, vol)
    probe_pred = est.predict(smallest)
    if not probe_pred.ready:
        return probe_plan(vol, budget_bytes=probe_budget(budget_bytes, est.gpu), halo=h, slots=slots,
                          whole_traces=whole_traces, region=region, itemsize=itemsize, settings=settings,
                          reason=getattr(probe_pred, "reason", "") or "too little history",
                          fits=lambda ext: _fits_both(est, ext, budget_bytes))
    grid = _Grid(region, h, vol)
    found = _search(grid, est, budget_bytes, slots, whole_traces, settings, read_range)
    if found.best is None:
        return _no_plan(found, est, vol, h, region, smallest, probe_pred, budget_bytes, slots, whole_traces,
                        itemsize, settings, read_range)
    return _plan_of(found.best, grid, est, budget_bytes, slots, settings)


def _fits_both(est: Estimates, extents: Shape, budget_bytes: int) -> bool:
    """Whether the model's bounds (raised where blocks as large ran out of memory) fit both budgets."""
    return est.predict(extents).upper_bytes <= budget_bytes and (est.gpu is None or est.gpu.over(extents) is None)


def _score(n: int, ct: int, cx: int, secs: float, joules: float, settings: PolicySettings) -> tuple:
    """A chunking's rank (lower is better): the objective (shortest makespan, or least energy among the plans
    that meet the deadline, then the fastest late one), then fewest chunks, uncut traces, cutting ilines first."""
    is_late = late(secs, settings)
    value = secs if is_late else objective_value(secs, joules, settings)
    return (is_late, round(value, 9), round(secs, 9), n, ct, cx)


def _search(grid: _Grid, est: Estimates, budget_bytes: int, slots: int, whole_traces: bool,
            settings: PolicySettings, read_range: ReadRange | None) -> _Search:
    """Every near-equal grid worth weighing, scored; the best that fits both budgets and ``read_range``."""
    rshape = grid.region.shape
    found = _Search()
    t_counts = [1] if whole_traces else _count_candidates(rshape[2], min(settings.max_counts, 64))
    for ct in t_counts:
        if found.best is not None and ct > 1:
            break  # whole traces fit: keep them (contiguous reads, no halo along time)
        for ci in _count_candidates(rshape[0], settings.max_counts):
            for cx in _count_candidates(rshape[1], settings.max_counts):
                cshape = (_largest_piece(rshape[0], ci), _largest_piece(rshape[1], cx), _largest_piece(rshape[2], ct))
                ext = grid.read_extents((ci, cx, ct))
                pred = est.predict(ext)
                if pred.upper_bytes > budget_bytes:
                    if found.smallest_over is None or pred.upper_bytes < found.smallest_over[0]:
                        found.smallest_over = (pred.upper_bytes, cshape)
                    continue
                if est.gpu is not None and est.gpu.over(ext) is not None:
                    continue
                if read_range is not None and not read_range[0] <= math.prod(ext) <= read_range[1]:
                    found.out_of_range += 1
                    continue
                n = ci * cx * ct
                secs = est.seconds(n, ext, slots, settings, pred.mean_bytes)
                joules = est.joules(n, ext, slots, settings, pred.mean_bytes)
                score = _score(n, ct, cx, secs, joules, settings)
                if found.best is None or score < found.best.score:
                    found.best = _Candidate((ci, cx, ct), cshape, ext, pred, secs, joules, score)
                # Larger cx only makes chunks smaller along xline: once it fits, more cuts only add overhead
                # unless they fill slots; keep scanning a little for balance but stop at many waves.
                if n >= 4 * slots:
                    break
    return found


def _plan_of(best: _Candidate, grid: _Grid, est: Estimates, budget_bytes: int, slots: int,
             settings: PolicySettings) -> Plan:
    """The plan of the chunking chosen, with its reason in words."""
    chunks = _offset(balanced_grid(grid.region.shape, best.counts), grid.region.start)
    gpu_words, gpu_fields = _gpu_fit(est.gpu, grid.read_extents(best.counts))
    pred = best.prediction
    return Plan(
        chunks=chunks,
        chunk_shape=best.chunk_shape,
        predicted_peak_bytes=float(pred.mean_bytes),
        upper_bound_bytes=float(pred.upper_bytes),
        budget_bytes=int(budget_bytes),
        estimated_seconds=best.seconds,
        estimated_joules=best.joules,
        decision=RECHUNK,
        reason=(f"{chunks_of(len(chunks), best.chunk_shape)}: upper bound {format_bytes(pred.upper_bytes)} "
                f"fits the budget {format_bytes(budget_bytes)}{gpu_words} with {slots} slot(s)"
                + _growth_words(est.first_touch, pred.mean_bytes)
                + _objective_words(best.seconds, best.joules, settings)),
        **gpu_fields,
    )


def _no_plan(found: _Search, est: Estimates, vol: Shape, h: Shape, region: Chunk, smallest: Shape,
             probe_pred: Prediction, budget_bytes: int, slots: int, whole_traces: bool, itemsize: int,
             settings: PolicySettings, read_range: ReadRange | None) -> Plan:
    """No chunking fits: a probe where the GPU model knows too little to plan, else the error that says why."""
    unit = "one trace" if whole_traces else "one element"
    traces = "" if not whole_traces else "; this operator needs whole traces, so traces cannot be cut"
    gpu = est.gpu
    least = gpu.over(smallest) if gpu is not None else None
    if gpu is not None and least is not None and est.predict(smallest).upper_bytes <= budget_bytes:
        # The host fits the smallest chunk and the GPU does not: the GPU is what stops every plan.
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
            "sharing it), or on the CPU (device='cpu')" + traces)
    if found.out_of_range:
        raise NoPlanInRangeError(
            f"{found.out_of_range} chunking(s) of {region.shape} fit the budget of {format_bytes(budget_bytes)} but "
            f"none reads a block of {read_range[0]:,.0f} to {read_range[1]:,.0f} elements")  # type: ignore[index]
    if found.out_of_range == 0 and probe_pred.mean_bytes < budget_bytes and (
            gpu is None or gpu.predict(smallest).mean_bytes < gpu.budget_bytes):
        # The bound is over the budget for even the smallest chunk while the mean fits: that is too little known
        # (few runs, noisy ones: a worker of several threads measures its tasks' peaks mixed), not too little
        # memory. Probe with chunks sized for the budget (kept), which is how the bound narrows; fail only on
        # the mean, or when the probes themselves run out of memory.
        return probe_plan(vol, budget_bytes=probe_budget(budget_bytes, gpu), halo=h, slots=slots,
                          whole_traces=whole_traces, region=region, itemsize=itemsize, settings=settings,
                          reason=(f"the model's bound for {unit} ({format_bytes(probe_pred.upper_bytes)}) is over "
                                  f"the budget {format_bytes(budget_bytes)} though its mean "
                                  f"({format_bytes(probe_pred.mean_bytes)}) fits: too little known to plan with"))
    worst_case = found.smallest_over[0] if found.smallest_over else probe_pred.upper_bytes
    raise BudgetTooSmallError(
        f"even the smallest chunk allowed ({unit} column with halo {h}, extents {smallest}) is predicted to "
        f"need up to {format_bytes(worst_case)}, more than the budget of {format_bytes(budget_bytes)}. "
        "Give workers more memory (memory_limit), fewer threads per worker, or raise a "
        "memory_budget/target_fraction cap if you set one" + traces)


def _gpu_fit(gpu: GpuLimit | None, extents: Shape) -> tuple[str, dict]:
    """The words and :class:`Plan` fields of a chunk of ``extents`` against the GPU budget (none on the CPU)."""
    if gpu is None:
        return "", {}
    upper = float(gpu.predict(extents).upper_bytes)
    return (f" ({format_bytes(upper)} of the GPU's {format_bytes(gpu.budget_bytes)})",
            {"gpu_upper_bound_bytes": upper, "gpu_budget_bytes": int(gpu.budget_bytes)})


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
    estimates: Estimates | Predictor,
    halo: int | Sequence[int] | None = None,
    slots: int = 1,
    whole_traces: bool = True,
    itemsize: int = ITEMSIZE,
    settings: PolicySettings = DEFAULT_SETTINGS,
    read_range: ReadRange | None = None,
) -> Decision:
    """Continue with the incoming chunking, rechunk, or probe (no history).

    ``incoming`` is the chunking of the upstream result (None for a source read
    from disk, which has no chunking worth keeping). ``estimates``, ``read_range``:
    as for :func:`plan`; incoming chunks are kept only where they fit the GPU's
    budget too and read blocks within ``read_range``.
    """
    est = Estimates.of(estimates)
    vol = check_shape(shape)
    h = normalize_halo(halo)
    best = plan(vol, budget_bytes=budget_bytes, estimates=est, halo=h, slots=slots, whole_traces=whole_traces,
                itemsize=itemsize, settings=settings, read_range=read_range)
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
    pred = est.predict(ext)
    why = _incoming_refused(largest.shape, ext, pred, est.gpu, budget_bytes, read_range)
    if why is None:
        secs = est.seconds(len(incoming), ext, slots, settings, pred.mean_bytes)
        joules = est.joules(len(incoming), ext, slots, settings, pred.mean_bytes)
        worse = _worse_than(secs, joules, best, settings)
        if not worse:
            return _kept(incoming, largest.shape, ext, pred, est.gpu, budget_bytes, secs, joules)
        why = f"incoming chunking fits but {worse}"
    return Decision(RECHUNK, best, f"{why}: " + best.reason, incoming_n_chunks=len(incoming),
                    incoming_upper_bytes=float(pred.upper_bytes))


def _incoming_refused(largest: Shape, ext: Shape, pred: Prediction, gpu: GpuLimit | None, budget_bytes: int,
                      read_range: ReadRange | None) -> str | None:
    """Why the incoming chunks (the largest ``largest``, reading blocks of up to ``ext``) cannot be kept as they
    are, in words; None where they fit both budgets and the read range."""
    if pred.upper_bytes > budget_bytes:
        return (f"incoming chunks of up to {largest} need up to {format_bytes(pred.upper_bytes)} with this "
                f"operator, over the budget {format_bytes(budget_bytes)}")
    gpu_over = gpu.over(ext) if gpu is not None else None
    if gpu is not None and gpu_over is not None:
        return (f"incoming chunks of up to {largest} need up to {format_bytes(gpu_over.upper_bytes)} of GPU "
                f"memory with this operator, over the GPU budget {format_bytes(gpu.budget_bytes)}")
    if read_range is not None and not read_range[0] <= math.prod(ext) <= read_range[1]:
        return (f"incoming chunks read blocks of up to {math.prod(ext):,} elements, outside the "
                f"{read_range[0]:,.0f} to {read_range[1]:,.0f} this plan is made for")
    return None


def _kept(incoming: list[Chunk], largest: Shape, ext: Shape, pred: Prediction, gpu: GpuLimit | None,
          budget_bytes: int, secs: float, joules: float) -> Decision:
    """The decision to keep the incoming chunking (``continue``)."""
    gpu_words, gpu_fields = _gpu_fit(gpu, ext)
    kept = Plan(chunks=incoming, chunk_shape=largest, predicted_peak_bytes=float(pred.mean_bytes),
                upper_bound_bytes=float(pred.upper_bytes), budget_bytes=int(budget_bytes), estimated_seconds=secs,
                estimated_joules=joules, decision=CONTINUE, **gpu_fields,
                reason=(f"incoming {chunks_of(len(incoming), largest)} fit (upper bound "
                        f"{format_bytes(pred.upper_bytes)} of {format_bytes(budget_bytes)}{gpu_words}) "
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


