"""Watching a chunked map: typed events and a small observer protocol.

Everything that watches a map — the Prefect artifacts (:mod:`memchunk_prefect.run.report`),
``ChunkedResult.decisions`` / ``.events`` / ``.summary()``, the demo's summary,
a user's own progress bar — implements :class:`MapObserver` and receives the
same typed events. One map's events arrive in order, from that map's own thread
in the flow's process (a chunked ``.map`` returns at once and runs in the
background). Maps run side by side, so an observer given to the runner
(``MemoryAwareRunner(observers=...)``) is one object called for every map, from
several threads at once: keep state per map (a map's events all come from the
thread its ``on_map_start`` came from; ``MapStart.output_path`` names the map),
and guard what the maps share with a lock. The runner's own observers are made per map.
The events, in order:

1. :meth:`~MapObserver.on_map_start` with a :class:`MapStart` (what the map
   computes, the budget and slots read from the cluster, and a read-only
   ``predict`` over the learned model);
2. :meth:`~MapObserver.on_decision` with a :class:`Decision` each time the runner
   decides (probe, continue, rechunk, retry-smaller, resume, restart);
3. :meth:`~MapObserver.on_submit` with a :class:`TaskSubmitted` per task run (the
   chunk, its block's extents, the model's figures for it);
4. :meth:`~MapObserver.on_chunk_end` with a :class:`TaskEnded` per finished task run
   (outcome, observation, progress);
5. :meth:`~MapObserver.on_map_end` with a :class:`MapEnd`, once, also when the map fails.

Observers never see the executor or the state machine, so either can change
without breaking them (as cubed's ``Callback.on_task_end(TaskEndEvent)``): the
events are this module's own, made from the machine's instructions in one place,
:func:`observer_event`. An
observer that raises is logged and dropped for the rest of the map: watching
must never stop a run.

>>> log = MapLog()
>>> log.on_decision(Decision("rechunk", "why", "envelope", "envelope|float32|cpu"))
>>> [d["decision"] for d in log.decisions]
['rechunk']
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from memchunk_prefect.core.chunks import Chunk, Shape
from memchunk_prefect.core.energy import energy_by_source
from memchunk_prefect.core.messages import KILLED, MEMORY_ERROR, OK, ChunkEnded, Decided, Instruction, Submit
from memchunk_prefect.core.records import Observation, Prediction, Reward, first_use_bytes
from memchunk_prefect.core.stragglers import SlowWorker

logger = logging.getLogger("memchunk_prefect.run.observe")

__all__ = ["MapStart", "Decision", "TaskSubmitted", "TaskEnded", "MapEnd", "MapObserver", "MapLog", "Observers",
           "observer_event"]


@dataclass(frozen=True)
class MapStart:
    """A chunked map begins: what it computes and what it may use.

    ``predict(extents)`` is a read-only view of the operator's learned model (the
    same the runner plans with), for observers that want figures of their own.
    """

    operator: str
    operator_key: str
    shape: Shape
    halo: Shape
    output_path: str
    budget_bytes: int
    slots: int
    predict: Callable[[Shape], Prediction] | None = None
    budget_reason: str = ""  # how the budget was derived, in words
    at: float = 0.0
    #: Learned wall seconds of one block of n elements (halo included), per-task overhead included; None while
    #: the time model has too little.
    block_seconds: Callable[[int], float | None] | None = None


@dataclass(frozen=True)
class Decision:
    """A decision taken, with why: for the log, the report and ``ChunkedResult.decisions``.

    ``chunk_shape``: the largest chunk of the plan (no halo); ``predicted_peak_bytes`` /
    ``upper_bound_bytes``: the model's mean and upper bound for it with its halo, bytes;
    ``at``: seconds since the epoch.
    """

    decision: str
    reason: str
    operator: str
    operator_key: str
    n_chunks: int | None = None
    chunk_shape: Shape | None = None
    predicted_peak_bytes: float | None = None
    upper_bound_bytes: float | None = None
    at: float = 0.0
    region: str | None = None  # Chunk.key() of the box planned
    chunk: str | None = None  # Chunk.key() of the chunk split
    arm: str | None = None  # the learned policy's arm the plan was fitted under
    warning: str | None = None  # what the user should hear about this plan (logged as a warning)

    def to_dict(self) -> dict[str, Any]:
        """The plain form kept in ``ChunkedResult.decisions``."""
        d: dict[str, Any] = {
            "decision": self.decision, "reason": self.reason, "operator": self.operator,
            "operator_key": self.operator_key, "n_chunks": self.n_chunks,
            "chunk_shape": list(self.chunk_shape) if self.chunk_shape else None,
            "predicted_peak_bytes": self.predicted_peak_bytes, "upper_bound_bytes": self.upper_bound_bytes,
            "time": self.at}
        for name in ("region", "arm", "chunk", "warning"):
            if getattr(self, name) is not None:
                d[name] = getattr(self, name)
        return d


@dataclass(frozen=True)
class TaskSubmitted:
    """A chunk was submitted as task run ``id`` (the map's own numbering).

    ``read_extents``: the block it reads (halo included); ``predicted_bytes`` / ``upper_bytes``: the
    model's mean and upper bound for that block when submitted, bytes (None while the model is not ready).
    """

    id: int
    chunk: Chunk
    decision: str
    attempt: int
    label: str
    read_extents: Shape
    predicted_bytes: float | None = None
    upper_bytes: float | None = None
    at: float = 0.0


@dataclass(frozen=True)
class TaskEnded:
    """Task run ``id`` ended (``outcome``: ok, memory_error, killed, lost), and the map's progress after it.

    ``kept``: its worker was lost after writing it; ``queued_chunks``: chunks in flight or planned after it
    ended (boxes not planned yet are not counted).
    """

    id: int
    chunk: Chunk
    outcome: str
    decision: str
    observation: Observation | None = None
    kept: bool = False
    done_chunks: int = 0
    done_elements: int = 0
    at: float = 0.0
    queued_chunks: int = 0

    def to_dict(self) -> dict[str, Any]:
        """The plain form kept in ``ChunkedResult.events``."""
        d: dict[str, Any] = {"event": self.outcome, "chunk": self.chunk.key(), "decision": self.decision}
        o = self.observation
        if self.outcome == OK and o is not None:
            d.update(peak_bytes=o.peak_bytes, seconds=o.seconds, worker=o.worker)
        elif self.outcome in (MEMORY_ERROR, KILLED) and o is not None:
            d.update(peak_bytes=o.peak_bytes, worker=o.worker)
        if self.kept:
            d["kept"] = True
        return d


def _copy(cls: type, source: Any) -> Any:
    return cls(**{f.name: getattr(source, f.name) for f in dataclasses.fields(cls)})


def observer_event(instruction: Instruction) -> tuple[str, Any] | None:
    """The observer call and event an instruction of the map machine stands for (None: observers don't see it).

    The one place where the machine's vocabulary becomes the observers'.

    >>> from memchunk_prefect.core.messages import DecisionRecord
    >>> method, event = observer_event(Decided(DecisionRecord("probe", "no history", "envelope", "k")))
    >>> method, type(event).__name__, event.decision
    ('on_decision', 'Decision', 'probe')
    """
    if isinstance(instruction, Decided):
        return "on_decision", _copy(Decision, instruction.record)
    if isinstance(instruction, Submit):
        return "on_submit", _copy(TaskSubmitted, instruction)
    if isinstance(instruction, ChunkEnded):
        return "on_chunk_end", _copy(TaskEnded, instruction)
    return None


@dataclass(frozen=True)
class MapEnd:
    """The map ended: ``error`` is None when every chunk was written and the output finalized."""

    error: BaseException | None
    done_chunks: int
    done_elements: int
    at: float = 0.0
    reward: Reward | None = None  # what the learned policy's arm earned (a finished map with a real plan)
    pauses: int = 0  # times a worker paused (Dask's pause line) during the map
    paused_seconds: float = 0.0  # worker-seconds those pauses lasted


class MapObserver:
    """Base class of map observers: override the calls you need (every default does nothing)."""

    def on_map_start(self, event: MapStart) -> None:
        """The map begins (budget and slots read, output opened)."""

    def on_decision(self, event: Decision) -> None:
        """A decision was taken (and why)."""

    def on_submit(self, event: TaskSubmitted) -> None:
        """A chunk was submitted as a task run."""

    def on_chunk_end(self, event: TaskEnded) -> None:
        """A task run of the map ended (ok, out of memory, its worker killed or lost)."""

    def on_slow_worker(self, event: SlowWorker) -> None:
        """A worker was found slow rather than dead (named once per map; the map goes on as before)."""

    def on_map_end(self, event: MapEnd) -> None:
        """The map ended (finished or failed); called once."""


class Observers:
    """Fan one event out to many observers; one that raises is logged and dropped, the others go on."""

    def __init__(self, observers: Iterable[MapObserver] = ()):
        self.observers = list(observers)

    def emit(self, method: str, event: Any) -> None:
        for obs in list(self.observers):
            try:
                getattr(obs, method)(event)
            except Exception as exc:  # watching must never stop a run
                logger.warning("memchunk: observer %r failed on %s (%r); it is dropped for this map",
                               obs, method, exc)
                self.observers.remove(obs)


@dataclass
class MapLog(MapObserver):
    """The plain-data account of one map that ``ChunkedResult`` keeps: decisions, chunk events, observations.

    ``decisions`` and ``events`` are lists of dicts (see
    :meth:`Decision.to_dict` and :meth:`TaskEnded.to_dict`); ``observations``
    the measured records of finished task runs, in the order they ended.
    """

    decisions: list[dict] = field(default_factory=list)
    events: list[dict] = field(default_factory=list)
    observations: list[Observation] = field(default_factory=list)
    budget_bytes: int = 0
    budget_reason: str = ""  # how the budget was derived, in words (the map's start)
    done: list[Chunk] = field(default_factory=list)
    #: (predicted mean, upper bound, measured peak) in bytes of every chunk that finished with a ready prediction
    #: made when it was submitted: how close the model was at the chunks the runner chose.
    predicted: list[tuple[float, float, int]] = field(default_factory=list)
    #: Workers found slow during the map (``SlowWorker.to_dict()`` of each), in the order they were found.
    slow_workers: list[dict] = field(default_factory=list)
    _submitted: dict[int, tuple[float, float]] = field(default_factory=dict, repr=False)

    def on_map_start(self, event: MapStart) -> None:
        self.budget_bytes = event.budget_bytes
        self.budget_reason = event.budget_reason

    def on_decision(self, event: Decision) -> None:
        self.decisions.append(event.to_dict())

    def on_submit(self, event: TaskSubmitted) -> None:
        if event.predicted_bytes is not None and event.upper_bytes is not None:
            self._submitted[event.id] = (float(event.predicted_bytes), float(event.upper_bytes))

    def on_chunk_end(self, event: TaskEnded) -> None:
        self.events.append(event.to_dict())
        if event.observation is not None:
            self.observations.append(event.observation)
        figures = self._submitted.pop(event.id, None)
        o = event.observation
        if figures is not None and event.outcome == OK and o is not None and o.peak_bytes > 0:
            # The block's own peak: a first use's memory is the worker's, budgeted apart (model.first_use_bytes).
            self.predicted.append((*figures, max(1, int(o.peak_bytes) - first_use_bytes(o))))

    def on_slow_worker(self, event: SlowWorker) -> None:
        self.slow_workers.append(event.to_dict())

    @property
    def oom_events(self) -> int:
        return sum(1 for e in self.events if e.get("event") in ("memory_error", "killed"))

    def summary(self, *, operator: str, operator_key: str, chunks: Sequence[Chunk], output: str) -> dict:
        """Plain-data account of the map, for logs, artifacts and the demo."""
        peaks = [o.peak_bytes for o in self.observations if o.outcome == OK]
        return {
            "operator": operator,
            "operator_key": operator_key,
            "decisions": [d["decision"] for d in self.decisions],
            "reasons": [d["reason"] for d in self.decisions],
            "tasks": len(self.observations),
            "chunks": len(chunks),
            "oom_events": self.oom_events,
            "recovered": self.oom_events,
            "peak_bytes": max(peaks) if peaks else None,
            "budget_bytes": self.budget_bytes,
            "budget_reason": self.budget_reason,
            # On the GPU: the largest GPU peak of a chunk that finished, and the GPU budget its runs had (bytes).
            "gpu_peak_bytes": max((o.gpu_peak_bytes for o in self.observations
                                   if o.outcome == OK and o.gpu_peak_bytes is not None), default=None),
            "gpu_budget_bytes": next((o.gpu_budget_bytes for o in self.observations if o.gpu_budget_bytes), None),
            # Every task run's energy (failed attempts too), joules per source (a counter, or "estimate").
            "energy": energy_by_source((o.energy_joules, o.energy_source) for o in self.observations),
            "output": output,
            "slow_workers": list(self.slow_workers),
            # At the chunks run with a ready prediction: the mean of upper bound / measured peak, and the mean
            # absolute error of the predicted mean (None where every chunk ran without one: probes).
            "bound_over_peak": (sum(u / p for _, u, p in self.predicted) / len(self.predicted)
                                if self.predicted else None),
            "mean_error": (sum(abs(m / p - 1) for m, _, p in self.predicted) / len(self.predicted)
                           if self.predicted else None),
        }
