"""Plan before you run: a discrete-event simulation of chunked maps on a cluster, from what was learned.

"How long will tonight's run take on 40 workers of 8 GiB, and will anything
die?" The simulator answers from the store: each chunk's peak memory and
compute seconds are drawn from the operator's learned models, chunks run on
simulated worker slots, a worker whose tasks cross its nanny's kill line dies
(and restarts), and the runner's decisions are the runner's own: the
``memchunk`` strategy drives the real map state machine
(:class:`~memchunk_prefect.core.machine.MapMachine`, the same object the executor
drives on Dask), so probes, continue / rechunk, re-plans, retry-smaller and the
learned policy's arm behave as in a real run. Baselines: ``static-N`` (N iline
slabs per operator, a run fails at the first worker killed, as Dask reports
``KilledWorker``), ``split`` (split-on-failure: the whole volume first, a killed
chunk split in two and resubmitted, and chunks as large as one that failed
halved before they run) and ``dask-auto`` (Dask's ``chunks="auto"``; fails like static).

What is drawn, per chunk (``rng``: numpy's Generator, seeded per run):

- peak memory above the worker's resting level: the model's mean for the
  block it reads (halo included) times a log-normal factor whose 95th percentile
  is the operator's learned margin (the conformal quantile of needed /
  predicted; see :meth:`Draws.margin` before it is learned);
- compute seconds: the learned time (``seconds_for``, or seconds per element x
  elements) times a log-normal factor of ``time_sigma`` (default 0.1, a stated
  figure: the time model keeps no spread), plus the per-task overhead; a task that
  takes its worker above the most that worker process has held runs longer by the
  growth at the operator's learned kernel seconds per byte (a first touch, paid once
  per worker process: :meth:`SimulatedCluster._dispatch`), and the simulated map
  plans knowing each worker's mark, as the runner does;
- energy: the operator's learned joules for the block (scaled by the same time
  factor: a slower run draws power longer), else its compute seconds x
  ``watts_per_core``; the overhead at ``watts_per_core``; a killed task's share by
  the time it ran. A run's energy adds the slots it held idle at
  ``idle_watts_per_core`` (:mod:`memchunk_prefect.core.energy`).

An HPC allocation (:class:`ClusterShape` ``queue_wait`` / ``walltime_seconds``): each worker
is a batch job that joins after a wait drawn from the queue-wait distribution and leaves at its
walltime (the tasks running there are lost and rerun; a job that leaves is not replaced);
makespans count from submission and core-hours from each job's start. The allocation's
utilisation over a window, simulated and by the model of :mod:`memchunk_prefect.sim.allocation`:
:func:`allocation_check`.

A warm run is simulated: the models are read from the store and not taught by
simulated chunks (no observation or reward is written to the store). An operator with no
usable history cannot be simulated (:class:`SimulationInputError`); run it once.

Pure apart from reading the store: no Prefect, no Dask, no clock. Units: bytes,
seconds (simulated, from 0), elements.
"""

from __future__ import annotations

import bisect
import functools
import heapq
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from memchunk_prefect.core.chunks import Chunk, Shape, balanced_grid, split, with_halo
from memchunk_prefect.core.errors import SimulationInputError, format_bytes
from memchunk_prefect.core.machine import (
    ChunkDone,
    Decided,
    Fail,
    Knowledge,
    MapMachine,
    MapSpec,
    PausesRead,
    ReadPauses,
    Record,
    SlotsChanged,
    Start,
    Submit,
    WorkerDied,
)
from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE, PolicySettings
from memchunk_prefect.learn.model import BankKnowledge, ModelBank
from memchunk_prefect.sim.allocation import AllocationCheck, QueueWait, held_fraction

MiB = 2**20
#: z of the 95th percentile of a standard normal: the learned margin is a 95% quantile of needed / predicted.
Z95 = 1.6448536269514722
#: The 95% quantile of needed / predicted memory where the model has not learned its own (a stated figure: the
#: largest recent error this project's models are held to).
DEFAULT_MARGIN = 1.25
#: Seconds a killed worker is away before its nanny's new process takes tasks (a stated figure).
RESTART_SECONDS = 3.0


# =========================================================================== inputs


@dataclass(frozen=True)
class ClusterShape:
    """The cluster to simulate: ``workers`` processes of ``threads_per_worker`` threads and ``memory_limit_bytes``.

    ``resting_bytes``: a worker's memory before a task (after the runner's
    imports; ~250 MiB measured on the demo's workers); ``kill_fraction``: the
    nanny's ``distributed.worker.memory.terminate``; ``per_task_overhead_seconds``:
    slot time a task costs beyond its compute (Prefect + Dask); ``map_start_seconds`` /
    ``map_end_seconds``: the runner's own work in the flow before a chunked map's first task
    (reading the budget from the workers, opening the output, the decision) and after its last
    (finalizing the output, the artifacts, reading pauses), while the slots wait: measured from a
    store's runs by :func:`measured_map_work` (0 when not given; a chained map's wait for its upstream
    is not in it). Only the ``memchunk``
    strategy pays them: the baselines are plain flows without that work.

    An HPC allocation: ``queue_wait`` (a :class:`~memchunk_prefect.sim.allocation.QueueWait`), each
    worker a batch job joining after its own wait; ``walltime_seconds``, each job leaving that long
    after it joined (None: no limit). Makespans then count from the jobs' submission. The runner
    plans each map for the workers requested when it started the cluster itself (``cluster_class``
    with ``scale`` or ``adapt``: it reads the cluster's plan); ``external``: the workers join a
    scheduler started elsewhere, so a map plans for the workers that have joined and follows them
    as more join or leave (``machine.SlotsChanged``).
    """

    workers: int
    memory_limit_bytes: int
    threads_per_worker: int = 1
    resting_bytes: int = 256 * MiB
    kill_fraction: float = 0.95
    per_task_overhead_seconds: float = DEFAULT_SETTINGS.per_task_overhead_seconds
    restart_seconds: float = RESTART_SECONDS
    map_start_seconds: float = 0.0
    map_end_seconds: float = 0.0
    queue_wait: QueueWait | None = None
    walltime_seconds: float | None = None
    external: bool = False

    def __post_init__(self) -> None:
        if self.walltime_seconds is not None and not (float(self.walltime_seconds) > 0
                                                      and math.isfinite(float(self.walltime_seconds))):
            raise SimulationInputError(f"a walltime is a positive, finite number of seconds, got "
                                       f"{self.walltime_seconds}")
        if int(self.workers) < 1 or int(self.threads_per_worker) < 1:
            raise SimulationInputError(f"a cluster needs at least one worker and one thread per worker, got "
                                       f"workers={self.workers}, threads_per_worker={self.threads_per_worker}")
        if min(float(self.map_start_seconds), float(self.map_end_seconds)) < 0:
            raise SimulationInputError(f"a map's own work takes zero seconds or more, got map_start_seconds="
                                       f"{self.map_start_seconds}, map_end_seconds={self.map_end_seconds}")
        if not 0 < float(self.kill_fraction) <= 1:
            raise SimulationInputError(f"kill_fraction must be in (0, 1], got {self.kill_fraction}")
        if self.headroom_bytes <= 0:
            raise SimulationInputError(
                f"a worker of {format_bytes(self.memory_limit_bytes)} killed at {self.kill_fraction:g} of it has no "
                f"room above its resting {format_bytes(self.resting_bytes)}: give workers more memory")

    @property
    def slots(self) -> int:
        return int(self.workers) * int(self.threads_per_worker)

    @property
    def headroom_bytes(self) -> int:
        """What a worker's tasks together may use above its resting memory before the nanny kills it."""
        return int(self.kill_fraction * self.memory_limit_bytes) - int(self.resting_bytes)

    @property
    def budget_bytes(self) -> int:
        """The runner's budget per task: the headroom split among the worker's threads."""
        return self.headroom_bytes // int(self.threads_per_worker)


@dataclass(frozen=True)
class Step:
    """One operator of the flow: its name, model key, halo and whether it keeps traces whole."""

    operator: str
    key: str
    halo: Shape
    whole_traces: bool = True

    @classmethod
    def of(cls, step: str | dict[str, Any]) -> "Step":
        """From a built-in operator's name or ``{"name": ..., **params}`` (as ``attribute_pipeline`` takes)."""
        from memchunk_prefect.operators.registry import OPERATORS
        from memchunk_prefect.operators.spec import operator_key, spec_of

        d = {"name": step} if isinstance(step, str) else dict(step)
        name = str(d.pop("name", ""))
        if name not in OPERATORS:
            raise SimulationInputError(f"unknown operator {name!r}: choose from {', '.join(sorted(OPERATORS))}")
        task = OPERATORS[name]
        params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        spec = spec_of(task)
        return cls(name, operator_key(task, params, dtype="float32"), spec.halo_for(params), spec.whole_traces)


class Draws:
    """Memory and seconds of one chunk, drawn from one operator's learned models (see the module docstring)."""

    def __init__(self, knowledge: Knowledge, key: str, per_task_overhead: float, time_sigma: float = 0.1,
                 watts_per_core: float = DEFAULT_SETTINGS.watts_per_core):
        self.knowledge = knowledge
        self.key = key
        self.per_task_overhead = float(per_task_overhead)
        self.time_sigma = float(time_sigma)
        self.watts_per_core = float(watts_per_core)
        self._predictions: dict[Shape, Prediction] = {}
        self.learned_energy = False  # whether any block's energy came from a learned figure

    def prediction(self, extents: Shape) -> Prediction:
        p = self._predictions.get(extents)
        if p is None:
            p = self._predictions[extents] = self.knowledge.predict(extents)
            if not p.ready:
                raise SimulationInputError(
                    f"{self.key} has too little history to simulate ({p.reason}); run it once on a small survey "
                    "(or `memchunk demo` for the demo's operators) so its memory and time are learned")
        return p

    def margin(self, p: Prediction) -> float:
        """The 95% quantile of needed / predicted mean: the learned margin (a property of the operator, not of the
        block's size); before it is learned, the tight bound's ratio where the block is within what was measured,
        else :data:`DEFAULT_MARGIN`. (The upper bound beyond the measured sizes widens for what the model does not
        know, not for how runs vary: drawn from, it would make every extrapolated chunk a gamble.)"""
        learned = getattr(self.knowledge, "margin", None)
        factor = learned() if callable(learned) else None
        if factor is None and p.tight_bytes is not None and p.tight_bytes < p.upper_bytes:
            factor = p.tight_bytes / max(p.mean_bytes, 1.0)
        return max(1.0, float(factor if factor is not None else DEFAULT_MARGIN))

    def memory(self, extents: Shape, rng: np.random.Generator) -> int:
        p = self.prediction(extents)
        sigma = math.log(self.margin(p)) / Z95
        return int(p.mean_bytes * math.exp(sigma * rng.standard_normal()))

    def compute_seconds(self, elements: int) -> float:
        """The learned compute seconds of a block (no spread, no overhead)."""
        compute = self.knowledge.seconds_for(elements)
        if compute is None:
            spe = self.knowledge.seconds_per_element()
            if spe is None:
                raise SimulationInputError(f"{self.key} has no measured compute time; run it once")
            compute = elements * spe
        return float(compute)

    def seconds(self, elements: int, rng: np.random.Generator) -> float:
        return self.compute_seconds(elements) * math.exp(self.time_sigma * rng.standard_normal()) + \
            self.per_task_overhead

    def joules(self, elements: int, seconds: float) -> float:
        """Energy of a block that took ``seconds`` (drawn, overhead included), joules: see the module docstring."""
        compute = max(0.0, seconds - self.per_task_overhead)
        jf = self.knowledge.joules_for(elements)
        expected = self.compute_seconds(elements)
        if jf is not None and expected > 0:
            self.learned_energy = True
            busy = float(jf) * compute / expected
        else:
            busy = compute * self.watts_per_core
        return busy + self.per_task_overhead * self.watts_per_core

    def task(self, sid: int, chunk: Chunk, extents: Shape, rng: np.random.Generator) -> "_Task":
        """A simulated task of ``chunk`` reading a block of ``extents``, its memory, seconds and energy drawn."""
        elements = math.prod(extents)
        memory = self.memory(extents, rng)  # drawn first, as before energy was simulated: the same seeds, the same runs
        seconds = self.seconds(elements, rng)
        return _Task(sid, chunk, extents, memory, seconds, joules=self.joules(elements, seconds), operator_key=self.key,
                     touch_seconds_per_byte=self.touch_seconds_per_byte)

    @functools.cached_property
    def touch_seconds_per_byte(self) -> float:
        """Kernel seconds per byte a task pays where it takes its worker above the most it has held (the learned
        figure, :meth:`memchunk_prefect.learn.model.OperatorModel.touch_seconds_per_byte`; 0 where none is)."""
        return float(self.knowledge.touch_seconds_per_byte() or 0.0)


class PriorKnowledge:
    """A stated prior for an operator with no history: peak = ``multiple`` x its input bytes, ``seconds_per_element``
    compute; a margin of :data:`DEFAULT_MARGIN`. What chunks are drawn from when nothing was learned (flagged)."""

    def __init__(self, multiple: float, seconds_per_element: float, itemsize: int = ITEMSIZE):
        if not multiple > 0 or not seconds_per_element > 0:
            raise SimulationInputError(f"a prior needs a positive memory multiple and seconds per element, got "
                                       f"{multiple} and {seconds_per_element}")
        self.multiple, self.spe, self.itemsize = float(multiple), float(seconds_per_element), int(itemsize)

    def predict(self, extents: Shape) -> Prediction:
        mean = self.multiple * math.prod(extents) * self.itemsize
        return Prediction(mean, mean * DEFAULT_MARGIN, 0, True, f"prior: {self.multiple:g}x the input",
                          tight_bytes=mean * DEFAULT_MARGIN)

    def predict_gpu(self, extents: Shape) -> Prediction:
        raise SimulationInputError("a prior multiple is of host memory; the simulator plans host memory only "
                                   "(a map on the GPU is simulated without its GPU budget)")

    def seconds_per_element(self) -> float | None:
        return self.spe

    def seconds_for(self, elements: int) -> float | None:
        return None

    def joules_for(self, elements: int) -> float | None:
        return None  # no energy is learned for a prior: the planner counts its seconds at watts_per_core

    def touch_seconds_per_byte(self) -> float | None:
        return None  # the simulated workers pay nothing for memory they never held: a plan counts none

    def margin(self) -> float:
        return DEFAULT_MARGIN

    def choose_arm(self, groups: list[tuple[str, ...]]) -> Any:
        raise SimulationInputError("internal: a prior is what chunks are drawn from, not what the runner plans with")


# =========================================================================== the cluster, simulated


@dataclass
class _Task:
    sid: int  # the submitter's id (a map's submission id)
    chunk: Chunk
    extents: Shape
    memory: int
    seconds: float
    joules: float = 0.0  # energy of the whole run, joules (a killed task is charged for the share it ran)
    started: float = 0.0
    worker: int = -1
    key: int = 0  # the simulated cluster's own, unique over the whole run
    operator_key: str = ""  # whose task it is (for traces of a simulated run)
    touch_seconds_per_byte: float = 0.0  # what taking its worker above the most it has held costs it, s per byte


#: The pseudo-task :meth:`SimulatedCluster.next` returns when a worker comes (back) and tasks wait for it.
_WAKE = _Task(-1, Chunk((0, 0, 0), (1, 1, 1)), (1, 1, 1), 0, 0.0, key=-1)
# Kinds of event, in the order events at the same time are handled: a task ends, a worker comes (back), a
# worker leaves at its walltime. How a task ends: done, killed with its worker, lost with a worker that left.
_END, _COME, _LEAVE = 0, 1, 2
_DONE, _KILLED, _LOST = 0, 1, 2


@dataclass
class _Ended:
    task: _Task
    at: float
    killed: bool
    lost: bool = False  # its worker left at walltime (not killed: nothing to learn about memory)


class SimulatedCluster:
    """Worker slots running tasks first come, first served; a worker whose tasks cross its kill line dies.

    A task's memory is taken to rise through its run: a worker is killed when the
    tasks running on it together need more than its headroom, at the moment the
    newest of them has used half its time (every task on it then ends killed; no
    task is placed on a worker due to die), and is back after ``restart_seconds``.
    Each placed task gets its own key, so the events of one map never end another
    map's task that reuses a submission id. A task that takes its worker above the
    most it has held (``marks``: the most its tasks together held since the worker
    started, 0 for a fresh or restarted one) runs longer by that growth at its
    operator's learned kernel seconds per byte (``_Task.touch_seconds_per_byte``),
    as a real worker faults that memory in. A task goes to the free worker of
    lowest number (kept in a heap: O(log workers) per placement).

    An HPC allocation (``ClusterShape.queue_wait`` / ``walltime_seconds``): each
    worker is one batch job that joins after its queue wait (drawn from ``rng``
    when the cluster is made) and leaves at its walltime, the tasks running on it
    then lost (``_Ended.lost``: Dask reschedules them; nothing was learned about
    their memory). Without them every worker is there from 0 to the end.
    """

    def __init__(self, shape: ClusterShape, rng: np.random.Generator | None = None):
        self.shape = shape
        self.now = 0.0
        self.last_end = 0.0  # when the latest task ended: the makespan so far
        self.pending: list[_Task] = []
        self.running: dict[int, list[_Task]] = {w: [] for w in range(shape.workers)}
        self.away_until: dict[int, float] = {}
        self.dies_at: dict[int, float] = {}  # a worker over its kill line, and when it dies
        self._events: list[tuple[float, int, int, int, int]] = []  # (time, kind, seq, task key or worker, how)
        self._live: dict[int, _Task] = {}  # task key -> task, while it runs
        self._keys = 0
        self._seq = 0
        self.busy_slot_seconds = 0.0
        self.busy_joules = 0.0
        self.lost_worker_seconds = 0.0
        self.peak_bytes: dict[int, int] = {w: 0 for w in range(shape.workers)}
        self.marks: dict[int, int] = {w: 0 for w in range(shape.workers)}  # each worker process's high-water mark
        self.kills = 0
        self.walltime_losses = 0  # tasks lost with a worker that left at its walltime
        self.ended: list[_Ended] = []  # every task that ended, in order (what a trace of the run is made of)
        if shape.queue_wait is not None:
            if rng is None:
                raise SimulationInputError("internal: a cluster with queue waits needs a random generator")
            self.joins = [float(t) for t in shape.queue_wait.sample(rng, shape.workers)]
        else:
            self.joins = [0.0] * shape.workers
        wall = shape.walltime_seconds
        self.leaves = [j + float(wall) if wall is not None else math.inf for j in self.joins]
        self.gone: set[int] = set()  # workers past their walltime
        self._ready: list[int] = []  # heap of workers that may have a free slot (checked when taken)
        self._in_ready: set[int] = set()
        self._sorted_joins = sorted(self.joins)
        for w in range(shape.workers):
            if self.joins[w] <= 0.0:
                self._offer(w)
            else:
                self._push(self.joins[w], _COME, w)
            if math.isfinite(self.leaves[w]):
                self._push(self.leaves[w], _LEAVE, w)

    def submit(self, task: _Task) -> None:
        self.pending.append(task)
        self._dispatch()

    def wait(self, seconds: float) -> None:
        """The flow works for ``seconds`` while nothing runs (a map's own work): the clock and the makespan move,
        the slots stay held (idle)."""
        if seconds > 0:
            self.now += float(seconds)
            self.last_end = max(self.last_end, self.now)

    def present_slots(self) -> int:
        """Slots of the workers that have joined and not left: what the runner reads at a map's start."""
        joined = bisect.bisect_right(self._sorted_joins, self.now)  # by the clock (await_worker moves it)
        return (joined - len(self.gone)) * self.shape.threads_per_worker

    def await_worker(self) -> bool:
        """Move the clock to the first worker's arrival when none is there (the runner waits for one before a
        map); False when none is there and none will come (every job past its walltime)."""
        if self.present_slots():
            return True
        coming = [j for w, j in enumerate(self.joins) if j > self.now and w not in self.gone]
        if not coming:
            return False
        self.now = min(coming)
        return True

    @property
    def stranded(self) -> bool:
        """Tasks wait and no worker is left to run them: every job has reached its walltime."""
        return bool(self.pending) and len(self.gone) == self.shape.workers

    def allocated_slot_seconds(self, end: float | None = None) -> float:
        """Slot-seconds the allocation held until ``end`` (default: the makespan): each worker's slots from its
        arrival until it left or the run ended (then the cluster is closed and queued jobs cancelled)."""
        end = self.last_end if end is None else float(end)
        return self.shape.threads_per_worker * sum(max(0.0, min(lv, end) - j)
                                                   for j, lv in zip(self.joins, self.leaves))

    def _available(self, w: int) -> bool:
        return (len(self.running[w]) < self.shape.threads_per_worker and self.joins[w] <= self.now
                and w not in self.gone and self.away_until.get(w, 0.0) <= self.now and w not in self.dies_at)

    def _offer(self, w: int) -> None:
        if w not in self._in_ready:
            self._in_ready.add(w)
            heapq.heappush(self._ready, w)

    def _free_worker(self) -> int | None:
        # Every available worker is in the heap (offered when it joins, comes back, or a task on it ends);
        # one that is not available when it reaches the top is dropped until it is offered again.
        while self._ready:
            w = self._ready[0]
            if self._available(w):
                return w
            heapq.heappop(self._ready)
            self._in_ready.discard(w)
        return None

    def _dispatch(self) -> None:
        while self.pending:
            w = self._free_worker()
            if w is None:
                return
            task = self.pending.pop(0)
            self._keys += 1
            task.key, task.started, task.worker = self._keys, self.now, w
            self.running[w].append(task)
            self._live[task.key] = task
            load = sum(t.memory for t in self.running[w])
            self.peak_bytes[w] = max(self.peak_bytes[w], load)
            if load > self.marks[w]:
                grow_seconds = (load - self.marks[w]) * task.touch_seconds_per_byte
                if grow_seconds > 0 and task.seconds > 0:
                    task.joules *= (task.seconds + grow_seconds) / task.seconds  # busy longer, at the same power
                task.seconds += grow_seconds
                self.marks[w] = load
            if load > self.shape.headroom_bytes:
                # The worker dies when the newest task is half way through; everything on it dies with it.
                die = self.now + 0.5 * task.seconds
                self.dies_at[w] = die
                for t in self.running[w]:
                    end = t.started + t.seconds
                    self._push(min(die, end), _END, t.key, _KILLED if end > die else _DONE)
            else:
                self._push(self.now + task.seconds, _END, task.key, _DONE)

    def _push(self, at: float, kind: int, ident: int, how: int = _DONE) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, ident, how))

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits (a pending restart alone does not count)."""
        return not self._live and not self.pending

    def next(self) -> _Ended:
        """Advance to the next task end (or to a worker's arrival or return, when tasks wait for it)."""
        while self._events:
            at, kind, _, ident, how = heapq.heappop(self._events)
            if kind == _COME:  # a worker joined or is back from a restart: start what waits
                self.now = max(self.now, at)
                self._offer(ident)
                if not self.pending:
                    continue
                self._dispatch()
                return _Ended(_WAKE, self.now, False)
            if kind == _LEAVE:  # its job reached the walltime: what runs there is lost now
                self.gone.add(ident)
                self.now = max(self.now, at)
                for t in self.running[ident]:
                    self._push(self.now, _END, t.key, _LOST)
                continue
            task = self._live.pop(ident, None)
            if task is None:  # already ended (its first event, or killed or lost with its worker)
                continue
            self.now = max(self.now, at)
            self.last_end = max(self.last_end, self.now)
            w = task.worker
            self.running[w] = [t for t in self.running[w] if t.key != ident]
            spent = self.now - task.started
            self.busy_slot_seconds += spent
            self.busy_joules += task.joules * (min(1.0, spent / task.seconds) if task.seconds > 0 else 1.0)
            if how == _KILLED:
                self.lost_worker_seconds += spent
                if self.dies_at.pop(w, None) is not None:
                    self.kills += 1
                    self.marks[w] = 0  # the nanny starts a new process: it has held nothing
                    self.away_until[w] = self.now + self.shape.restart_seconds
                    self._push(self.away_until[w], _COME, w)  # back then
            elif how == _LOST:
                self.lost_worker_seconds += spent
                self.walltime_losses += 1
            self._offer(w)
            self._dispatch()
            ended = _Ended(task, self.now, how == _KILLED, how == _LOST)
            self.ended.append(ended)
            return ended
        raise SimulationInputError("internal: the simulated cluster has nothing running")


# =========================================================================== results


@dataclass
class MapResult:
    operator: str
    chunks: int
    tasks: int
    out_of_memory: int
    seconds: float
    decisions: list[str] = field(default_factory=list)


@dataclass
class SimResult:
    """One simulated run of a flow's maps with one strategy."""

    strategy: str
    completed: bool
    makespan_seconds: float
    out_of_memory: int
    lost_worker_seconds: float
    busy_slot_seconds: float
    slots: int
    workers: int
    peak_bytes: int
    maps: list[MapResult] = field(default_factory=list)
    failure: str = ""
    busy_joules: float = 0.0  # the tasks' energy (see the module docstring), joules
    #: Every task that ended, in order (not in ``to_dict``): what :func:`trace_records` turns into a trace.
    ended: list = field(default_factory=list, repr=False)
    idle_watts_per_core: float = DEFAULT_SETTINGS.idle_watts_per_core
    #: What the tasks' energy rests on: "learned" (every operator's joules per element) or "estimated from
    #: seconds" (compute seconds x watts_per_core for at least one operator), or "mixed".
    energy_basis: str = ""
    #: Slot-seconds the workers were held (:meth:`SimulatedCluster.allocated_slot_seconds`); None: slots x makespan.
    allocated_slot_seconds: float | None = None
    walltime_losses: int = 0  # tasks lost with a worker that reached its walltime (rerun, not out of memory)
    #: When each worker joined, seconds (not in ``to_dict``): with ``ended``, what :func:`window_utilisation` reads.
    joins: list = field(default_factory=list, repr=False)

    @property
    def held_slot_seconds(self) -> float:
        return self.slots * self.makespan_seconds if self.allocated_slot_seconds is None \
            else self.allocated_slot_seconds

    @property
    def energy_joules(self) -> float:
        """The run's energy: its tasks' plus the slots it held idle (held slot-seconds less busy ones)."""
        idle = max(0.0, self.held_slot_seconds - self.busy_slot_seconds)
        return self.busy_joules + idle * self.idle_watts_per_core

    @property
    def slot_utilisation(self) -> float:
        """Busy slot-seconds over held slot-seconds (slots x makespan, or from each worker's arrival)."""
        held = self.held_slot_seconds
        return self.busy_slot_seconds / held if held > 0 else 0.0

    @property
    def core_hours(self) -> float:
        """Allocated core-hours: one core per slot for as long as its worker was held."""
        return self.held_slot_seconds / 3600.0

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("ended", "joins")}
        d["maps"] = [asdict(m) for m in self.maps]
        d.update(slot_utilisation=self.slot_utilisation, core_hours=self.core_hours, energy_joules=self.energy_joules)
        return d


# =========================================================================== strategies


KnowledgeFor = Callable[[str], Knowledge]


def _observation(step: Step, task: _Task, killed: bool, budget: int, at: float) -> Observation:
    elements = math.prod(task.extents)
    return Observation(operator_key=step.key, elements=elements, extents=task.extents, bytes_in=elements * ITEMSIZE,
                       peak_bytes=int(task.memory), seconds=0.0 if killed else task.seconds,
                       outcome="killed" if killed else "ok", censored=killed, worker=f"sim-{task.worker}",
                       chunk=task.chunk.key(), budget_bytes=budget, created_at=at)


def run_memchunk(steps: Sequence[Step], shape: Shape, cluster: ClusterShape, knowledge_for: KnowledgeFor,
                 rng: np.random.Generator, *, settings: PolicySettings = DEFAULT_SETTINGS,
                 time_sigma: float = 0.1, truth_for: KnowledgeFor | None = None,
                 stop_after: float | None = None) -> SimResult:
    """The runner's own state machine over the steps, chained (each map's chunking is the next one's incoming).

    ``truth_for``: where chunks' memory and time are drawn from, when it is not
    what the runner plans with (what if the model is 30% low?); default the same.
    ``stop_after``: give up (a failed run) once the simulated clock passes it: a
    run that cannot meet a deadline need not be simulated to its end.
    """
    sim = SimulatedCluster(cluster, rng.spawn(1)[0])  # queue waits from their own stream: the same chunks' draws
    maps: list[MapResult] = []
    incoming: tuple[Chunk, ...] | None = None
    failure = ""
    draws: list[Draws] = []
    for step in steps:
        knowledge = knowledge_for(step.key)
        truth = truth_for(step.key) if truth_for is not None else knowledge
        run = _MachineRun(step, shape, cluster, knowledge, truth, sim, rng, incoming, settings, time_sigma)
        run.stop_after = stop_after
        maps.append(run.run())
        draws.append(run.draws)
        failure = run.failure
        if failure:
            break
        incoming = tuple(run.machine.done)
    return _result("memchunk", sim, cluster, maps, failure, draws, settings)


class _MachineRun:
    """One map: the machine's instructions carried out on the simulated cluster, its events fed back."""

    def __init__(self, step: Step, shape: Shape, cluster: ClusterShape, knowledge: Knowledge, truth: Knowledge,
                 sim: SimulatedCluster, rng: np.random.Generator, incoming: tuple[Chunk, ...] | None,
                 settings: PolicySettings, time_sigma: float):
        self.step, self.cluster, self.sim, self.rng = step, cluster, sim, rng
        self.draws = Draws(truth, step.key, cluster.per_task_overhead_seconds, time_sigma, settings.watts_per_core)
        # An operator with no history (LearningKnowledge) learns as the runner would, from this run's own chunks.
        self.knowledge = knowledge
        spec = MapSpec(operator=step.operator, operator_key=step.key, shape=tuple(shape),  # type: ignore[arg-type]
                       halo=step.halo, whole_traces=step.whole_traces, incoming=incoming, settings=settings)
        self.machine = MapMachine(spec, knowledge)
        self.record = MapResult(step.operator, 0, 0, 0, 0.0)
        self.failure = ""
        self.stop_after: float | None = None

    def run(self) -> MapResult:
        m, sim, started = self.machine, self.sim, self.sim.now
        if not sim.await_worker():  # the runner waits for a worker, then reads the slots there are
            self.failure = f"{self.step.operator}: {_walltime_failure(self.cluster, len(m.done))}"
            self.record.seconds = sim.now - started
            return self.record
        sim.wait(self.cluster.map_start_seconds)  # the runner's work before the map's first task
        threads = int(self.cluster.threads_per_worker)
        touched = {f"sim-{w}": mark // threads for w, mark in sim.marks.items() if w not in sim.gone}
        self.carry_out(m.handle(Start(self.planned_slots(), self.cluster.budget_bytes, at=sim.now,
                                      touched_bytes=touched)))
        while not m.finished and not self.failure:
            self.carry_out(m.advance(sim.now))
            if m.finished or self.failure:
                break
            if sim.idle:
                self.failure = f"{self.step.operator}: internal: nothing in flight and the map is not finished"
                break
            if sim.stranded:
                self.failure = f"{self.step.operator}: {_walltime_failure(self.cluster, len(m.done))}"
                break
            if self.stop_after is not None and sim.now > self.stop_after:
                self.failure = (f"{self.step.operator}: still running at {self.stop_after:g} s (the deadline); the "
                                "simulation stopped there")
                break
            ended = sim.next()
            slots = self.planned_slots()  # what the executor's follow_slots reads between events
            if slots and slots != m.slots:
                self.carry_out(m.handle(SlotsChanged(slots, at=sim.now)))
            if ended.task.sid < 0:
                continue
            if ended.lost:  # Dask sees a worker leave with the task on it: the runner's own death handling
                event: Any = WorkerDied(ended.task.sid, "worker left at its walltime", written=False,
                                        kill_headroom_bytes=self.cluster.budget_bytes, at=ended.at)
            elif ended.killed:
                self.record.out_of_memory += 1
                # What the executor passes: the worker's kill line less its resting memory, per thread.
                event = WorkerDied(ended.task.sid, "KilledWorker", written=False,
                                        kill_headroom_bytes=self.cluster.budget_bytes, at=ended.at)
            else:
                obs = _observation(self.step, ended.task, False, self.cluster.budget_bytes, ended.at)
                event = ChunkDone(ended.task.sid, obs, at=ended.at)
            self.carry_out(m.handle(event))
        if not self.failure:
            sim.wait(self.cluster.map_end_seconds)  # and after its last
        self.record.chunks, self.record.seconds = len(m.done), sim.now - started
        return self.record

    def planned_slots(self) -> int:
        """The slots the runner plans a map for (see :class:`ClusterShape`): the requested workers' on its own
        cluster, the joined workers' on a scheduler started elsewhere."""
        return self.sim.present_slots() if self.cluster.external else self.cluster.slots

    def carry_out(self, instructions: Iterable[Any]) -> None:
        for ins in instructions:
            if isinstance(ins, Submit):
                extents: Shape = tuple(ins.read_extents)  # type: ignore[assignment]
                self.sim.submit(self.draws.task(ins.id, ins.chunk, extents, self.rng))
                self.record.tasks += 1
            elif isinstance(ins, Decided):
                self.record.decisions.append(ins.record.decision)
            elif isinstance(ins, ReadPauses):
                self.carry_out(self.machine.handle(PausesRead((), at=self.sim.now)))
            elif isinstance(ins, Fail):
                self.failure = f"{self.step.operator}: {ins.error}"
            elif isinstance(ins, Record) and isinstance(self.knowledge, LearningKnowledge):
                self.knowledge.learn(ins.observation)
            # Rewarded / Finalize / MarkRuns / Cancel / RecoverMarkers / ChunkEnded, and Record for an operator
            # with history: nothing to simulate (a warm run: its models are not taught by simulated chunks).


def _static_boxes(shape: Shape, n: int) -> list[Chunk]:
    return balanced_grid(tuple(shape), (min(int(n), shape[0]), 1, 1))


def _auto_boxes(shape: Shape) -> list[Chunk]:
    from dask.array.core import normalize_chunks

    chunks = normalize_chunks("auto", tuple(shape), dtype="float32")
    starts = [[sum(c[:i]) for i in range(len(c))] for c in chunks]
    return [Chunk((a, b, c), (a + x, b + y, c + z)) for a, x in zip(starts[0], chunks[0])
            for b, y in zip(starts[1], chunks[1]) for c, z in zip(starts[2], chunks[2])]


def run_fixed(name: str, steps: Sequence[Step], shape: Shape, cluster: ClusterShape, knowledge_for: KnowledgeFor,
              rng: np.random.Generator, boxes: Callable[[Step], list[Chunk]], *, split_on_failure: bool = False,
              time_sigma: float = 0.1, truth_for: KnowledgeFor | None = None,
              settings: PolicySettings = DEFAULT_SETTINGS) -> SimResult:
    """A fixed chunking per step, every chunk submitted at once; a killed chunk fails the run, or is split in two
    and resubmitted (``split_on_failure``)."""
    sim = SimulatedCluster(cluster, rng.spawn(1)[0])
    maps: list[MapResult] = []
    failure = ""
    ids = iter(range(10**12))
    all_draws: list[Draws] = []
    for step in steps:
        draws = Draws((truth_for or knowledge_for)(step.key), step.key, cluster.per_task_overhead_seconds,
                      time_sigma, settings.watts_per_core)
        all_draws.append(draws)
        record = MapResult(step.operator, 0, 0, 0, 0.0)
        started = sim.now
        queue = list(boxes(step))
        limit: int | None = None  # split on failure: elements of the largest piece of the smallest failed chunk
        axes = (0, 1) if step.whole_traces else (0, 1, 2)
        while queue or not sim.idle:
            while queue:
                chunk = queue.pop(0)
                if limit is not None and chunk.elements > limit and split(chunk, axes=axes):
                    queue[:0] = split(chunk, axes=axes)  # as large as one that failed: halve it before it runs
                    continue
                extents: Shape = with_halo(chunk, step.halo, shape)[0].shape
                sim.submit(draws.task(next(ids), chunk, extents, rng))
                record.tasks += 1
            if sim.stranded:
                failure = f"{step.operator}: {_walltime_failure(cluster, record.chunks)}"
                break
            ended = sim.next()
            if ended.task.sid < 0:
                continue
            if ended.lost:  # its worker reached its walltime: Dask reruns the task elsewhere
                queue.insert(0, ended.task.chunk)
                continue
            if not ended.killed:
                record.chunks += 1
                continue
            record.out_of_memory += 1
            pieces = split(ended.task.chunk, axes=axes)
            if not split_on_failure or not pieces:
                failure = (f"{step.operator}: a chunk of {ended.task.chunk.shape} needed "
                           f"{format_bytes(ended.task.memory)}, over the {format_bytes(cluster.headroom_bytes)} a "
                           "worker has below its kill line (KilledWorker)")
                break
            limit = min(limit or ended.task.chunk.elements, max(p.elements for p in pieces))
            queue = pieces + queue
        record.seconds = sim.now - started
        maps.append(record)
        if failure:
            break
    return _result(name, sim, cluster, maps, failure, all_draws, settings)


def _result(name: str, sim: SimulatedCluster, cluster: ClusterShape, maps: list[MapResult], failure: str,
            draws: Sequence[Draws], settings: PolicySettings) -> SimResult:
    learned = {d.learned_energy for d in draws}
    basis = "learned" if learned == {True} else "estimated from seconds" if learned == {False} else "mixed"
    hpc = cluster.queue_wait is not None or cluster.walltime_seconds is not None
    return SimResult(strategy=name, completed=not failure, makespan_seconds=sim.last_end,
                     out_of_memory=sum(m.out_of_memory for m in maps), lost_worker_seconds=sim.lost_worker_seconds,
                     busy_slot_seconds=sim.busy_slot_seconds, slots=cluster.slots, workers=cluster.workers,
                     peak_bytes=max(sim.peak_bytes.values(), default=0), maps=maps, failure=failure,
                     busy_joules=sim.busy_joules, idle_watts_per_core=settings.idle_watts_per_core,
                     energy_basis=basis if draws else "", ended=list(sim.ended),
                     allocated_slot_seconds=sim.allocated_slot_seconds() if hpc else None,
                     walltime_losses=sim.walltime_losses, joins=list(sim.joins))


STRATEGIES = ("memchunk", "split", "dask-auto", "static-N")


def _walltime_failure(cluster: ClusterShape, done: int) -> str:
    return (f"every worker reached its {cluster.walltime_seconds:g} s walltime with work left ({done} chunks of this "
            "map written): ask for a longer walltime or more workers (`memchunk recommend --walltime`)")


def run_strategy(strategy: str, steps: Sequence[Step], shape: Shape, cluster: ClusterShape,
                 knowledge_for: KnowledgeFor, rng: np.random.Generator, **kw: Any) -> SimResult:
    """One simulated run of ``strategy``: ``memchunk``, ``split``, ``dask-auto`` or ``static-<N>``."""
    shape = tuple(int(s) for s in shape)  # type: ignore[assignment]
    if len(shape) != 3 or min(shape) < 1:
        raise SimulationInputError(f"a survey shape is three positive extents (iline, xline, twt), got {shape}")
    if strategy == "memchunk":
        return run_memchunk(steps, shape, cluster, knowledge_for, rng, **kw)
    if strategy == "split":
        return run_fixed(strategy, steps, shape, cluster, knowledge_for, rng,
                         lambda s: [Chunk.whole(shape)], split_on_failure=True, **kw)
    if strategy == "dask-auto":
        return run_fixed(strategy, steps, shape, cluster, knowledge_for, rng, lambda s: _auto_boxes(shape), **kw)
    if strategy.startswith("static-") and strategy[7:].isdigit() and int(strategy[7:]) >= 1:
        n = int(strategy[7:])
        return run_fixed(strategy, steps, shape, cluster, knowledge_for, rng, lambda s: _static_boxes(shape, n), **kw)
    raise SimulationInputError(f"unknown strategy {strategy!r}: use memchunk, split, dask-auto or static-N "
                               "(N iline slabs, e.g. static-4)")


@dataclass(frozen=True)
class MapWork:
    """The runner's own work per chunked map, seconds (medians over ``maps`` maps of a store): before its
    first task starts and after its last ends (see :class:`ClusterShape`)."""

    start_seconds: float
    end_seconds: float
    maps: int


def measured_map_work(store: Any) -> MapWork | None:
    """The runner's per-map work as a store's runs measured it: for every finished map whose observations
    name it (``map_id``), its first task's start less the time it could start, and the map's end less its last
    task's end; the medians. None when the store has no such map (runs before store v5).

    A map over another map's result in the same flow run (its ``source`` is that map's ``output_path``) is
    called while the upstream map still runs and waits for its writes: its time "before its first task" counts
    from the upstream map's end, not from its own start, or the upstream's remaining work would be counted a
    second time, as the runner's (the simulator runs chained maps one after another, so the upstream's work is
    already in the makespan). A first task that started before the upstream ended (the maps overlapped) counts
    0. On a store of three demo runs the median was 0.87 s per map with the upstream waits and 0.12 s without
    (``memchunk simulate`` prints it)."""
    maps = [m for m in store.maps() if m.map_id]
    writers: dict[tuple[str, str], list[Any]] = {}  # (flow run, output path): the maps that wrote it
    for m in maps:
        writers.setdefault((m.flow_run_id, m.output_path), []).append(m)
    before, after = [], []
    for m in maps:
        if m.outcome != "ok":
            continue
        obs = [o for o in store.run_observations(m.flow_run_id) if o.map_id == m.map_id and o.started_at]
        if not obs:
            continue
        upstream = [u.ended_at for u in writers.get((m.flow_run_id, m.source), ())
                    if u.map_id != m.map_id and u.started_at <= m.started_at] if m.source else []
        could_start = max([m.started_at, *upstream])
        before.append(max(0.0, min(float(o.started_at) for o in obs) - could_start))
        after.append(max(0.0, m.ended_at - max(o.created_at for o in obs)))
    if not before:
        return None
    return MapWork(float(np.median(before)), float(np.median(after)), len(before))


# =========================================================================== traces of simulated runs


def trace_records(result: SimResult, steps: Sequence[Step], shape: Shape, cluster: ClusterShape, *,
                  started_at: float = 0.0, run_id: str = "simulated") -> tuple[list[Any], list[Observation],
                                                                                dict[str, dict[str, Any]],
                                                                                dict[str, Any]]:
    """One simulated run as the records a real run leaves in the store, for :func:`memchunk_prefect.sim.trace.
    build_instance`: ``(maps, observations, machines, flow_run)``.

    Each simulated task becomes an observation (its drawn peak, seconds and energy, labelled an estimate;
    a killed task ``killed`` and censored), each step a map reading the previous step's output (the first
    reads ``survey``), each simulated worker a machine ``sim-worker-N`` with the cluster's memory and
    threads. Times are ``started_at`` plus simulated seconds. A simulated run and a real one then export to
    the same WfFormat and compare task by task (``memchunk trace-compare``).
    """
    from memchunk_prefect.core.records import MapRun

    t0 = float(started_at)
    by_key = {s.key: i for i, s in enumerate(steps)}
    outputs = [f"simulated/{i + 1:02d}-{s.operator}.zarr" for i, s in enumerate(steps)]
    observations: list[Observation] = []
    spans: dict[int, list[float]] = {}
    for e in result.ended:
        t = e.task
        if t.sid < 0 or t.operator_key not in by_key:
            continue
        i = by_key[t.operator_key]
        spent = e.at - t.started
        share = min(1.0, spent / t.seconds) if t.seconds > 0 else 1.0
        elements = math.prod(t.extents)
        observations.append(Observation(
            operator_key=t.operator_key, elements=elements, extents=t.extents, bytes_in=elements * ITEMSIZE,
            peak_bytes=int(t.memory), seconds=spent, outcome="killed" if e.killed else "error" if e.lost else "ok",
            censored=e.killed,
            cpu_seconds=spent, worker=f"sim-{t.worker}", chunk=t.chunk.key(), budget_bytes=cluster.budget_bytes,
            energy_joules=t.joules * share, energy_source="estimate", started_at=t0 + t.started,
            created_at=t0 + e.at, host=f"sim-worker-{t.worker}", flow_run_id=run_id, method="simulated"))
        lo_hi = spans.setdefault(i, [math.inf, 0.0])
        lo_hi[0], lo_hi[1] = min(lo_hi[0], t.started), max(lo_hi[1], e.at)
    maps = []
    for i, step in enumerate(steps):
        if i not in spans:
            continue
        maps.append(MapRun(flow_run_id=run_id, operator=step.operator, operator_key=step.key,
                           source="survey" if i == 0 else outputs[i - 1], output_path=outputs[i], shape=shape,
                           halo=step.halo, itemsize=ITEMSIZE, slots=cluster.slots, budget_bytes=cluster.budget_bytes,
                           started_at=t0 + spans[i][0], ended_at=t0 + spans[i][1],
                           outcome="ok" if result.completed or i < len(spans) - 1 else "failed",
                           source_bytes=math.prod(shape) * ITEMSIZE if i == 0 else None))
    machines = {f"sim-worker-{w}": {"nodeName": f"sim-worker-{w}", "memoryInBytes": int(cluster.memory_limit_bytes),
                                    "cpu": {"coreCount": int(cluster.threads_per_worker)}}
                for w in sorted({int(o.host.rsplit("-", 1)[1]) for o in observations})}
    flow_run = {"id": run_id, "name": f"{result.strategy} (simulated)", "flow_name": "simulation",
                "start_time": t0, "end_time": t0 + result.makespan_seconds, "state": "COMPLETED"
                if result.completed else "FAILED"}
    return maps, observations, machines, flow_run


# =========================================================================== Monte Carlo


@dataclass
class Summary:
    """Repeated runs of one strategy: completion, makespan percentiles, the chance of meeting a deadline."""

    strategy: str
    runs: int
    completed: int
    makespan_p50: float | None
    makespan_p90: float | None
    p_deadline: float | None  # P(completed and makespan <= deadline); None without a deadline
    out_of_memory_mean: float
    lost_worker_seconds_mean: float
    slot_utilisation_p50: float | None
    core_hours_p50: float | None
    peak_bytes_max: int
    failure: str = ""  # the first failure's reason, if any run failed
    energy_joules_p50: float | None = None  # completed runs' energy (tasks and idle slots), joules
    energy_basis: str = ""  # "learned", "estimated from seconds" or "mixed" (see SimResult.energy_basis)
    walltime_losses_mean: float = 0.0  # tasks lost per run with a worker that reached its walltime
    #: The allocation's utilisation over a window, simulated and by the model (:func:`allocation_check`).
    allocation: AllocationCheck | None = None

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "allocation"}
        d["allocation"] = self.allocation.to_dict() if self.allocation is not None else None
        return d


def window_utilisation(result: SimResult, cluster: ClusterShape, window: float) -> tuple[float, list[float]]:
    """One simulated run's allocation utilisation over ``[0, window]`` and its jobs' own (see
    :mod:`memchunk_prefect.sim.allocation`): ``U(T0)``, busy slot-seconds within the window over
    ``slots x min(W, T0)``; and for each worker that joined within the window, its busy slot-seconds there
    over ``threads x min(W, T0 - its wait)``."""
    joins = result.joins or [0.0] * cluster.workers
    busy = [0.0] * cluster.workers
    for e in result.ended:
        t = e.task
        if t.sid >= 0 and 0 <= t.worker < cluster.workers:
            busy[t.worker] += max(0.0, min(e.at, window) - min(t.started, window))
    c, wall = cluster.threads_per_worker, cluster.walltime_seconds
    full = min(math.inf if wall is None else float(wall), float(window))
    held = held_fraction(np.asarray(joins), window, wall) * full * c
    u = [min(1.0, b / h) for b, h in zip(busy, held) if h > 0]
    return sum(busy) / (cluster.slots * full), u


def allocation_check(results: Sequence[SimResult], cluster: ClusterShape, *, window: float,
                     target: float) -> AllocationCheck:
    """The simulated runs' ``U(T0)`` beside the model's ``P(U(T0) >= U0)`` from the cluster's queue waits and
    the per-job utilisation those runs measured (:func:`memchunk_prefect.sim.allocation.check`)."""
    from memchunk_prefect.sim.allocation import check

    wait = cluster.queue_wait if cluster.queue_wait is not None else QueueWait("fixed", 0.0)
    return check(wait, [window_utilisation(r, cluster, window) for r in results], jobs=cluster.workers,
                 window=window, target=target, walltime=cluster.walltime_seconds)


def summarize(strategy: str, results: Sequence[SimResult], deadline: float | None = None) -> Summary:
    done = [r for r in results if r.completed]
    spans = np.array([r.makespan_seconds for r in done]) if done else None

    def pct(values: np.ndarray | None, q: float) -> float | None:
        return None if values is None or not len(values) else float(np.percentile(values, q))

    util = np.array([r.slot_utilisation for r in done]) if done else None
    hours = np.array([r.core_hours for r in done]) if done else None
    energy = np.array([r.energy_joules for r in done]) if done else None
    met = None if deadline is None else sum(r.makespan_seconds <= deadline for r in done) / len(results)
    return Summary(strategy, len(results), len(done), pct(spans, 50), pct(spans, 90), met,
                   float(np.mean([r.out_of_memory for r in results])),
                   float(np.mean([r.lost_worker_seconds for r in results])), pct(util, 50), pct(hours, 50),
                   max((r.peak_bytes for r in results), default=0),
                   next((r.failure for r in results if r.failure), ""), pct(energy, 50),
                   next((r.energy_basis for r in results if r.energy_basis), ""),
                   float(np.mean([r.walltime_losses for r in results])))


def simulate(strategies: Sequence[str], steps: Sequence[Step], shape: Shape, cluster: ClusterShape,
             knowledge_for: KnowledgeFor, *, runs: int = 20, seed: int = 0, deadline: float | None = None,
             window: float | None = None, target_utilisation: float | None = None, **kw: Any) -> list[Summary]:
    """``runs`` simulated runs of each strategy (run ``i`` draws from seed ``seed + i``, the same for every
    strategy), summarized; with ``window`` and ``target_utilisation``, each summary carries the allocation's
    utilisation over the window, simulated and by the model (:func:`allocation_check`)."""
    if int(runs) < 1:
        raise SimulationInputError(f"runs must be at least 1, got {runs}")
    if (window is None) != (target_utilisation is None):
        raise SimulationInputError(f"the allocation's utilisation needs both a window and a target, got window="
                                   f"{window}, target_utilisation={target_utilisation}")
    out = []
    for strategy in strategies:
        results = [run_strategy(strategy, steps, shape, cluster, knowledge_for, np.random.default_rng(seed + i), **kw)
                   for i in range(int(runs))]
        summary = summarize(strategy, results, deadline)
        if window is not None and target_utilisation is not None:
            summary.allocation = allocation_check(results, cluster, window=window, target=target_utilisation)
        out.append(summary)
    return out


class LearningKnowledge(BankKnowledge):
    """The knowledge of an operator with no history in a simulation: an in-memory bank taught by the simulated
    run's own chunks (the store is never written)."""

    def learn(self, obs: Observation) -> None:
        self.bank.learn(obs)


@dataclass
class StoreModels:
    """What a simulation reads from a store: each key's knowledge (what the runner plans with) and truth (what
    chunks are drawn from). A key with no usable history is simulated from a stated prior
    (:class:`PriorKnowledge`) when ``prior`` is given: the runner then starts cold (probes) and learns from the
    run's own chunks, as it would; such keys are listed in ``from_prior``. Without a prior it is an error."""

    bank: Any
    settings: PolicySettings = DEFAULT_SETTINGS
    prior: PriorKnowledge | None = None
    from_prior: set[str] = field(default_factory=set)

    def _has_history(self, key: str) -> bool:
        return bool(self.bank.predict(key, (1, 1, 1)).ready)

    def map_work(self) -> MapWork | None:
        """The runner's per-map work as this store's runs measured it (:func:`measured_map_work`)."""
        return measured_map_work(self.bank.store) if self.bank.store is not None else None

    def knowledge(self, key: str) -> Knowledge:
        if self.prior is None or self._has_history(key):
            return BankKnowledge(self.bank, key, self.settings)
        self.from_prior.add(key)
        return LearningKnowledge(ModelBank(None), key, self.settings)  # learns from this run's chunks only

    def truth(self, key: str) -> Knowledge:
        if self.prior is not None and not self._has_history(key):
            self.from_prior.add(key)
            return self.prior
        return self.knowledge(key)


def store_models(store_path: str | None = None, settings: PolicySettings = DEFAULT_SETTINGS,
                 prior: PriorKnowledge | None = None) -> StoreModels:
    """The models of the store at ``store_path`` (default: the runner's default store), read as the runner reads
    them. No observation or reward is written; opening the store is what a run does (an older schema is migrated,
    a foreign file moved aside). A store that does not exist is an error, not a new empty store."""
    from memchunk_prefect.learn.store import Store, default_store_path

    path = default_store_path() if store_path is None else Path(store_path).expanduser()
    if not path.is_file():
        raise SimulationInputError(f"no observation store at {path}: run your flow (or `memchunk demo`) once so "
                                   "there is something learned to simulate from, or pass --store")
    return StoreModels(ModelBank(Store(path)), settings, prior)


def store_knowledge(store_path: str | None = None, settings: PolicySettings = DEFAULT_SETTINGS) -> KnowledgeFor:
    """Each key's knowledge as the runner would read it from the store (see :func:`store_models`)."""
    return store_models(store_path, settings).knowledge


# =========================================================================== what cluster to ask for


@dataclass
class Candidate:
    """One cluster shape tried by :func:`recommend`, with what the simulator says of it."""

    workers: int
    memory_limit_bytes: int
    threads_per_worker: int
    summary: Summary
    screened: bool = False  # one run only, while searching (not a verdict on the shape)

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "memory_limit_bytes": self.memory_limit_bytes,
                "threads_per_worker": self.threads_per_worker, "screened": self.screened,
                **self.summary.to_dict()}


@dataclass
class Recommendation:
    """The cluster shape that meets the deadline with the asked confidence at the least core-hours (None: none
    of those tried), every candidate tried, and the dask-jobqueue arguments for the chosen one."""

    best: Candidate | None
    tried: list[Candidate]
    deadline_seconds: float
    confidence: float
    objective: str = "time"
    walltime_seconds: float | None = None  # the jobs' walltime as simulated (None: none was given)

    def jobqueue_kwargs(self) -> dict[str, Any] | None:
        """``cores``, ``processes``, ``memory``, ``walltime`` for a dask-jobqueue cluster of one worker per job,
        and the number of jobs to ``scale`` to (the walltime as simulated, else the deadline: a job outliving
        it is of no use)."""
        b = self.best
        if b is None:
            return None
        t = int(math.ceil(self.walltime_seconds if self.walltime_seconds is not None else self.deadline_seconds))
        return {"cores": b.threads_per_worker, "processes": 1,
                "memory": format_bytes(b.memory_limit_bytes).replace(" ", ""),
                "walltime": f"{t // 3600:02d}:{t % 3600 // 60:02d}:{t % 60:02d}", "jobs": b.workers}


def recommend(steps: Sequence[Step], shape: Shape, knowledge_for: KnowledgeFor, *, deadline_seconds: float,
              memory_options: Sequence[int], max_workers: int = 256, threads_per_worker: int = 1,
              confidence: float = 0.9, runs: int = 20, seed: int = 0, truth_for: KnowledgeFor | None = None,
              objective: str = "time", settings: PolicySettings = DEFAULT_SETTINGS,
              **cluster_kw: Any) -> Recommendation:
    """The cluster that finishes ``steps`` on ``shape`` within the deadline with probability at least
    ``confidence`` (memchunk strategy, ``runs`` simulated runs per shape) at the least core-hours
    (``objective="time"``) or the least energy (``objective="energy"``: the simulated runs' p50 joules, tasks and
    idle slots; learned per operator where it was, else seconds x ``settings.watts_per_core``).

    For each memory size, the fewest workers (up to ``max_workers``) that meet the deadline are found by
    a search on one run per shape (from the previous memory size's answer: galloping, then bisection;
    makespan falls as workers are added, up to the survey's parallelism), then confirmed with ``runs`` runs,
    adding a few percent of workers while the confidence is not met. No run is simulated past the
    deadline, and a shape's runs stop once more miss it than the confidence allows. With one thread per
    core, fewer workers meeting the deadline is fewer core-hours, and fewer slots left idle.
    """
    from memchunk_prefect.core.energy import check_objective

    check_objective(objective)
    if deadline_seconds <= 0:
        raise SimulationInputError(f"the deadline must be a positive number of seconds, got {deadline_seconds}")
    if not 0 < confidence <= 1:
        raise SimulationInputError(f"confidence must be in (0, 1], got {confidence}")
    if not memory_options:
        raise SimulationInputError("give at least one memory size per worker to try")
    tried: list[Candidate] = []

    # A shape fails once more runs miss the deadline than the confidence allows: its remaining runs are not
    # simulated, and no run is simulated past the deadline (what the search needs is only whether it is met).
    allowed_misses = int(math.floor((1.0 - confidence) * int(runs) + 1e-9))

    def trial(workers: int, memory: int, n: int = int(runs)) -> Candidate:
        cluster = ClusterShape(workers=workers, memory_limit_bytes=memory, threads_per_worker=threads_per_worker,
                               **cluster_kw)
        results: list[SimResult] = []
        for i in range(n):
            results.append(run_strategy("memchunk", steps, shape, cluster, knowledge_for,
                                        np.random.default_rng(seed + i), truth_for=truth_for, settings=settings,
                                        stop_after=deadline_seconds))
            if sum(not r.completed or r.makespan_seconds > deadline_seconds for r in results) > allowed_misses:
                break
        c = Candidate(workers, memory, threads_per_worker, summarize("memchunk", results, deadline_seconds),
                      screened=n < int(runs))
        tried.append(c)
        return c

    def ok(c: Candidate) -> bool:
        return c.summary.p_deadline is not None and c.summary.p_deadline >= confidence

    def screen(workers: int, memory: int) -> bool:
        """One run (seed ``seed``) meets the deadline: the search's cheap question."""
        s = trial(workers, memory, 1).summary
        return s.completed == 1 and s.p_deadline == 1.0

    best: Candidate | None = None
    start = 1  # where the search for the next memory size begins: the previous size's answer
    for memory in sorted(set(int(m) for m in memory_options)):
        try:
            ClusterShape(workers=1, memory_limit_bytes=memory, **cluster_kw)
        except SimulationInputError:
            continue  # no room above the resting memory: not a candidate
        # Bracket the fewest workers whose first run meets the deadline in (lo, hi]: gallop down from the start
        # while it passes, or up (doubling) while it fails; then bisect.
        hi: int | None
        if screen(start, memory):
            hi, lo = start, start // 2
            while lo >= 1 and screen(lo, memory):
                hi, lo = lo, lo // 2
        else:
            lo, hi = start, None
            while hi is None and lo < max_workers:
                nxt = min(max_workers, lo * 2)
                if screen(nxt, memory):
                    hi = nxt
                else:
                    lo = nxt
            if hi is None:
                continue
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if screen(mid, memory):
                hi = mid
            else:
                lo = mid
        # Confirm with every run (the asked confidence), a few percent more workers at a time where it falls short.
        found: Candidate | None = None
        while True:
            c = trial(hi, memory)
            if ok(c):
                found = c
                break
            if hi >= max_workers:
                break
            hi = min(max_workers, hi + max(1, hi // 20))
        if found is None:
            continue
        start = found.workers
        if best is None or _cost(found, objective) < _cost(best, objective):
            best = found
    return Recommendation(best, tried, float(deadline_seconds), float(confidence), objective,
                          cluster_kw.get("walltime_seconds"))


def frontier(rec: Recommendation) -> list[Candidate]:
    """Per memory size tried, the fewest workers that met the deadline (what :func:`recommend` chose among),
    by memory size: the trade-off a plot of makespan, core-hours and energy against memory per worker shows."""
    best: dict[int, Candidate] = {}
    for c in rec.tried:
        if c.screened:
            continue
        met = c.summary.p_deadline is not None and c.summary.p_deadline >= rec.confidence
        if met and (c.memory_limit_bytes not in best or c.workers < best[c.memory_limit_bytes].workers):
            best[c.memory_limit_bytes] = c
    return [best[m] for m in sorted(best)]


def plot_recommendation(rec: Recommendation, path: str | Path, title: str = "") -> Path:
    """A PNG of :func:`frontier`: makespan p50, core-hours and (where simulated) energy against memory per
    worker, the workers each needs written at its point, the recommended shape marked. Needs matplotlib
    (``pip install 'memchunk-prefect[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SimulationInputError(f"the plot needs matplotlib ({exc}): pip install 'memchunk-prefect[plot]'") from exc
    points = frontier(rec)
    if not points:
        raise SimulationInputError("no cluster shape met the deadline: nothing to plot")
    gib = [c.memory_limit_bytes / 2**30 for c in points]
    series = [("makespan p50 (s)", [c.summary.makespan_p50 for c in points]),
              ("core-hours", [c.summary.core_hours_p50 for c in points])]
    if all(c.summary.energy_joules_p50 is not None for c in points):
        series.append(("energy p50 (kJ)", [c.summary.energy_joules_p50 / 1e3 for c in points]))  # type: ignore
    fig, axes = plt.subplots(len(series), 1, sharex=True, figsize=(6, 2.2 * len(series)))
    for ax, (label, values) in zip(axes, series):
        ax.plot(gib, values, marker="o")
        for x, y, c in zip(gib, values, points):
            ax.annotate(f"{c.workers} w", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            if rec.best is not None and c is rec.best:
                ax.plot([x], [y], marker="*", markersize=14, color="tab:red")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("memory per worker (GiB)")
    axes[0].set_title(title or f"fewest workers meeting {rec.deadline_seconds:.0f} s "
                               f"(p >= {rec.confidence:g}); * = recommended ({rec.objective})", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _cost(c: Candidate, objective: str) -> float:
    """What :func:`recommend` minimises: core-hours, or joules (p50 of the simulated runs)."""
    value = c.summary.energy_joules_p50 if objective == "energy" else c.summary.core_hours_p50
    return math.inf if value is None else float(value)
