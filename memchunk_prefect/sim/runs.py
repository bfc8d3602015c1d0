"""One simulated run of a pipeline under one strategy: the runner's own state machine, or a baseline.

``memchunk`` drives the real :class:`~memchunk_prefect.core.machine.MapMachine` of each map, side by side, in
the loop the executor runs on Dask (:mod:`memchunk_prefect.core.drive`), so probes, continue / rechunk, chained
maps gated on their upstream's writes, re-plans, retry-smaller and the learned policy behave as in a real run.
Baselines: ``static-N`` (N iline slabs per operator; a run fails at the first worker killed, as Dask reports
``KilledWorker``), ``split`` (split-on-failure: the whole volume first, a killed chunk split in two and
resubmitted) and ``dask-auto`` (Dask's ``chunks="auto"``; fails like static).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Sequence

import numpy as np

from memchunk_prefect.core.chunks import Chunk, Shape, balanced_grid, split, with_halo
from memchunk_prefect.core.drive import execute
from memchunk_prefect.core.errors import SimulationInputError, format_bytes
from memchunk_prefect.core.estimates import Knowledge
from memchunk_prefect.core.machine import MapMachine
from memchunk_prefect.core.messages import (
    ChunkDone,
    Decided,
    Fail,
    MapSpec,
    PausesRead,
    ReadPauses,
    Record,
    SlotsChanged,
    Start,
    Submit,
    UpstreamWritten,
    WorkerDied,
)
from memchunk_prefect.core.records import Observation
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE, PolicySettings
from memchunk_prefect.sim.cluster import SimulatedCluster
from memchunk_prefect.sim.inputs import (
    ClusterShape,
    Draws,
    KnowledgeFor,
    LearningKnowledge,
    Step,
    _Task,
    run_factor,
)


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


def _observation(step: Step, task: _Task, killed: bool, budget: int, at: float) -> Observation:
    """What the runner records of a simulated chunk, as it records a real one (:mod:`memchunk_prefect.run.monitor`):
    the block function's seconds (the task's, less its per-task overhead), whether it was its worker process's
    first call of the operator, how far it grew its worker and the kernel seconds that cost (``sys_seconds``).
    A simulated cold run's planner then learns from its chunks what the real runner's learns from its own: first
    calls and first touches apart from the rates (:class:`memchunk_prefect.learn.time.TimeModel`)."""
    elements = math.prod(task.extents)
    seconds = 0.0 if killed else max(0.0, task.seconds - task.overhead_seconds * task.overhead_share)
    return Observation(operator_key=step.key, elements=elements, extents=task.extents, bytes_in=elements * ITEMSIZE,
                       peak_bytes=int(task.memory), seconds=seconds,
                       outcome="killed" if killed else "ok", censored=killed, worker=f"sim-{task.worker}",
                       chunk=task.chunk.key(), budget_bytes=budget, created_at=at, first_call=task.first_call,
                       grew_bytes=int(task.grew_bytes), sys_seconds=float(task.touch_seconds))


def run_memchunk(steps: Sequence[Step], shape: Shape, cluster: ClusterShape, knowledge_for: KnowledgeFor,
                 rng: np.random.Generator, *, settings: PolicySettings = DEFAULT_SETTINGS,
                 time_sigma: float = 0.1, truth_for: KnowledgeFor | None = None,
                 stop_after: float | None = None, run_quantile: float | None = None) -> SimResult:
    """The runner's own state machine for every step, the maps running side by side on one cluster as the
    runner's do (:class:`_SimulatedFlow`).

    ``truth_for``: where chunks' memory and time are drawn from, when it is not
    what the runner plans with (what if the model is 30% low?); default the same.
    ``stop_after``: give up (a failed run) once the simulated clock passes it: a
    run that cannot meet a deadline need not be simulated to its end.
    ``run_quantile``: which run of the factor every block's compute seconds share
    (:func:`~memchunk_prefect.sim.inputs.run_factor`; None: the median run).
    """
    truth = truth_for or knowledge_for
    factor = run_factor([truth(step.key) for step in steps], run_quantile)
    sim = SimulatedCluster(cluster, rng.spawn(1)[0])  # queue waits from their own stream: the same chunks' draws
    flow = _SimulatedFlow(steps, shape, cluster, knowledge_for, truth, sim, rng, settings, (time_sigma, factor),
                          stop_after)
    flow.run()
    for run in flow.runs:
        if not run.closed:
            run.finish(failed=True)
    return _result("memchunk", sim, cluster, [r.record for r in flow.runs], flow.failure,
                   [r.draws for r in flow.runs], settings)


class _SimulatedFlow:
    """A flow's chunked maps on one simulated cluster, as the runner runs them: the flow's body calls each
    ``.map`` as the one before returns (``ClusterShape.chained_map_offset_seconds`` apart, as the store records
    the maps' starts), each map makes its first decision once called and once the map called before it made
    its own (the first ``map_start_seconds`` after the flow's start), and runs from then on, beside the others.

    A step that reads another's output (:attr:`Step.upstream`) starts no earlier than that map's first decision
    (the runner's chained ``.map`` waits for it), plans from that map's chunking so far
    (:meth:`MapMachine.chunking`), and, while that map runs, is gated: a chunk is submitted once the upstream has
    written the chunk's whole block (:class:`UpstreamWritten`, which the executor sends from the upstream's
    completions). The loop is :func:`memchunk_prefect.core.drive.drive`'s for several machines: every map
    advances, then the next event (a task's end, a map's start) goes to the map it belongs to.
    """

    def __init__(self, steps: Sequence[Step], shape: Shape, cluster: ClusterShape, knowledge_for: KnowledgeFor,
                 truth_for: KnowledgeFor, sim: SimulatedCluster, rng: np.random.Generator, settings: PolicySettings,
                 time: tuple[float, float], stop_after: float | None):
        self.steps, self.shape, self.cluster, self.sim, self.rng = steps, shape, cluster, sim, rng
        self.knowledge_for, self.truth_for, self.settings = knowledge_for, truth_for, settings
        self.time = time  # (time_sigma, run factor): how each block's seconds stray, and what all of them share
        self.stop_after = stop_after
        self.runs: list[_MachineRun] = []
        self.failure = ""
        self.due: float | None = None  # when the next step's map decides first (None: every step's did)
        self.called = 0.0
        self.told: dict[int, int] = {}  # a gated map's position -> its upstream's chunks passed on to it

    def run(self) -> None:
        sim, c = self.sim, self.cluster
        if not self.steps:
            return
        if not sim.await_worker():  # the runner waits for a worker, then reads the slots there are
            self.failure = f"{self.steps[0].operator}: {_walltime_failure(c, 0)}"
            return
        self.called = sim.now  # when the flow's body called the latest map (its start, as the store records it)
        self.due = sim.now + c.map_start_seconds
        while not self.failure:
            self._start_due()
            self._advance()
            if self.failure or (self.due is None and all(r.machine.finished for r in self.runs)):
                return
            if self.due is not None and sim.idle:
                sim.wait(max(0.0, self.due - sim.now))  # nothing runs until the flow calls its next map
                continue
            if self._halted():
                return
            ended = sim.next_before(math.inf if self.due is None else self.due)
            if ended is None:  # the flow calls its next map first
                continue
            for run in self.runs:
                if run.machine.finished:
                    continue
                events = run.events_of(ended if ended.task.owner == run.position else None)
                with run.guard():
                    for event in events:
                        execute(run.machine, run, run.machine.handle(event))
                        if run.failure:
                            self.failure = run.failure
                            return

    def _start_due(self) -> None:
        """Start the step whose ``.map`` has been called, once its upstream has made its first decision."""
        sim = self.sim
        while self.due is not None and self.due <= sim.now:
            i = len(self.runs)
            step = self.steps[i]
            j = step.upstream_index(i)
            up = self.runs[j] if j is not None else None
            gated = up is not None and not up.machine.finished
            run = _MachineRun(step, self.shape, self.cluster, self.knowledge_for(step.key),
                              self.truth_for(step.key), sim, self.rng, up.machine.chunking() if up else None,
                              self.settings, self.time, position=i, upstream=j if gated else None)
            self.runs.append(run)
            if gated:
                self.told[i] = 0
            # The next .map is called `offset` after this one was, and decides once this one has: a chained .map
            # waits for its upstream's first decision, and the body calls the maps in order.
            offset = self.cluster.chained_map_offset_seconds
            self.called += self.cluster.map_start_seconds if offset is None else offset
            self.due = max(self.called, sim.now) if i + 1 < len(self.steps) else None
            run.begin()
            if run.failure:
                self.failure = run.failure
                return

    def _advance(self) -> None:
        """Every running map submits what it can; a map that finished pays its end work and tells the maps gated
        on it; repeated until no map has more to say (a map's writes can open another's gate)."""
        moved = True
        while moved and not self.failure:
            moved = False
            for run in self.runs:
                if not run.machine.finished:
                    with run.guard():
                        execute(run.machine, run, run.machine.advance(self.sim.now))
                    if run.failure:
                        self.failure = run.failure
                        return
                if run.machine.finished and not run.closed:
                    run.finish()
                    moved = True  # the maps gated on it are told below
            for i, seen in list(self.told.items()):
                down, up = self.runs[i], self.runs[self.runs[i].upstream]  # type: ignore[index]
                new = tuple(up.machine.done[seen:])
                complete = up.machine.finished
                if not new and not complete:
                    continue
                self.told[i] = seen + len(new)
                if complete:
                    del self.told[i]
                if down.machine.finished:
                    continue
                with down.guard():
                    execute(down.machine, down, down.machine.handle(UpstreamWritten(new, complete, at=self.sim.now)))
                moved = True

    def _halted(self) -> bool:
        sim = self.sim
        first = next((r for r in self.runs if not r.machine.finished), None)
        name = first.step.operator if first is not None else self.steps[-1].operator
        done = len(first.machine.done) if first is not None else 0
        if sim.idle:
            self.failure = f"{name}: internal: nothing in flight and the map is not finished"
        elif sim.stranded:
            self.failure = f"{name}: {_walltime_failure(self.cluster, done)}"
        elif self.stop_after is not None and sim.now > self.stop_after:
            self.failure = (f"{name}: still running at {self.stop_after:g} s (the deadline); the simulation stopped "
                            "there")
        return bool(self.failure)


class _MachineRun:
    """One map: the machine's instructions carried out on the simulated cluster, its events fed back."""

    def __init__(self, step: Step, shape: Shape, cluster: ClusterShape, knowledge: Knowledge, truth: Knowledge,
                 sim: SimulatedCluster, rng: np.random.Generator, incoming: tuple[Chunk, ...] | None,
                 settings: PolicySettings, time: tuple[float, float], *, position: int = 0,
                 upstream: int | None = None):
        self.step, self.cluster, self.sim, self.rng = step, cluster, sim, rng
        self.position, self.upstream = position, upstream
        time_sigma, factor = time
        self.draws = Draws(truth, step.key, cluster.runner_task_overhead_seconds, time_sigma, settings.watts_per_core,
                           factor)
        # An operator with no history (LearningKnowledge) learns as the runner would, from this run's own chunks.
        self.knowledge = knowledge
        spec = MapSpec(operator=step.operator, operator_key=step.key, shape=tuple(shape),  # type: ignore[arg-type]
                       halo=step.halo, whole_traces=step.whole_traces, incoming=incoming, settings=settings,
                       gated=upstream is not None)
        self.machine = MapMachine(spec, knowledge)
        self.record = MapResult(step.operator, 0, 0, 0, 0.0)
        self.slots_seen = 0  # the slots last read (what a SlotsChanged is against)
        self.failure = ""
        self.started = sim.now
        self.closed = False  # its end is counted (finish)

    def begin(self) -> None:
        """The map's first decision, from the slots and what the workers hold now."""
        m, sim = self.machine, self.sim
        threads = int(self.cluster.threads_per_worker)
        touched = {f"sim-{w}": mark // threads for w, mark in sim.marks.items() if w not in sim.gone}
        self.slots_seen = self.planned_slots()
        execute(m, self, m.handle(Start(self.slots_seen, self.cluster.budget_bytes, at=sim.now,
                                        touched_bytes=touched, threads_per_worker=threads,
                                        worker_budget_bytes=self.cluster.headroom_bytes,
                                        threads_per_core=self.cluster.threads_per_core)))

    def finish(self, failed: bool = False) -> None:
        """The map's last task ended: the runner's work after it (finalizing the output) ends the map. A map the
        run stopped in (``failed``) ends now."""
        end = self.sim.now + (0.0 if failed else self.cluster.map_end_seconds)
        self.sim.last_end = max(self.sim.last_end, end)
        self.record.chunks, self.record.seconds = len(self.machine.done), end - self.started
        self.closed = True

    # ---------------------------------------------------------------- the world the machine is driven in

    def now(self) -> float:
        return self.sim.now

    def halted(self) -> bool:
        return bool(self.failure)

    def guard(self) -> Any:
        return contextlib.nullcontext()

    def handled(self) -> None:
        pass

    def events_of(self, ended: Any) -> list[Any]:
        """What the executor would report after a simulated task ended: this map's task as its event (``ended``;
        None: another map's, or a worker's return), and the slots where they changed."""
        events: list[Any] = []
        slots = self.planned_slots()  # what the executor reads between events
        if slots and slots != self.slots_seen:
            self.slots_seen = slots
            events.append(SlotsChanged(slots, at=self.sim.now))
        if ended is None or ended.task.sid < 0:
            return events
        if ended.lost:  # Dask sees a worker leave with the task on it: the runner's own death handling
            events.append(WorkerDied(ended.task.sid, "worker left at its walltime", written=False,
                                     kill_headroom_bytes=self.cluster.budget_bytes, at=ended.at))
        elif ended.killed:
            self.record.out_of_memory += 1
            # What the executor passes: the worker's kill line less its resting memory, per thread.
            events.append(WorkerDied(ended.task.sid, "KilledWorker", written=False,
                                     kill_headroom_bytes=self.cluster.budget_bytes, at=ended.at))
        else:
            obs = _observation(self.step, ended.task, False, self.cluster.budget_bytes, ended.at)
            events.append(ChunkDone(ended.task.sid, obs, at=ended.at))
        return events

    def planned_slots(self) -> int:
        """The slots the runner plans a map for (see :class:`ClusterShape`): the requested workers' on its own
        cluster, the joined workers' on a scheduler started elsewhere."""
        return self.sim.present_slots() if self.cluster.external else self.cluster.slots

    def carry_out(self, ins: Any) -> Any:
        """What a simulated run does with an instruction: submit draws a task; a decision, a failure and a
        learned observation are kept; the workers' pauses read none. Rewarded / Finalize / MarkRuns / Cancel /
        RecoverMarkers / ChunkEnded, and Record for an operator with history: nothing to simulate (a warm run's
        models are not taught by simulated chunks)."""
        if isinstance(ins, Submit):
            extents: Shape = tuple(ins.read_extents)  # type: ignore[assignment]
            task = self.draws.task(ins.id, ins.chunk, extents, self.rng)
            task.per_worker = int(ins.per_worker or 0)
            task.owner = self.position
            self.sim.submit(task)
            self.record.tasks += 1
        elif isinstance(ins, Decided):
            self.record.decisions.append(ins.record.decision)
        elif isinstance(ins, ReadPauses):
            return PausesRead((), at=self.sim.now)
        elif isinstance(ins, Fail):
            self.failure = f"{self.step.operator}: {ins.error}"
        elif isinstance(ins, Record) and isinstance(self.knowledge, LearningKnowledge):
            self.knowledge.learn(ins.observation)
        return None


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
              settings: PolicySettings = DEFAULT_SETTINGS, run_quantile: float | None = None) -> SimResult:
    """A fixed chunking per step, every chunk submitted at once; a killed chunk fails the run, or is split in two
    and resubmitted (``split_on_failure``). ``run_quantile``: as :func:`run_memchunk`'s."""
    truth = truth_for or knowledge_for
    factor = run_factor([truth(step.key) for step in steps], run_quantile)
    sim = SimulatedCluster(cluster, rng.spawn(1)[0])
    maps: list[MapResult] = []
    failure = ""
    ids = iter(range(10**12))
    all_draws: list[Draws] = []
    for step in steps:
        draws = Draws(truth(step.key), step.key, cluster.per_task_overhead_seconds, time_sigma,
                      settings.watts_per_core, factor)
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
        j = step.upstream_index(i)
        maps.append(MapRun(flow_run_id=run_id, operator=step.operator, operator_key=step.key,
                           source="survey" if j is None else outputs[j], output_path=outputs[i], shape=shape,
                           halo=step.halo, itemsize=ITEMSIZE, slots=cluster.slots, budget_bytes=cluster.budget_bytes,
                           started_at=t0 + spans[i][0], ended_at=t0 + spans[i][1],
                           outcome="ok" if result.completed or i < len(spans) - 1 else "failed",
                           source_bytes=math.prod(shape) * ITEMSIZE if j is None else None))
    machines = {f"sim-worker-{w}": {"nodeName": f"sim-worker-{w}", "memoryInBytes": int(cluster.memory_limit_bytes),
                                    "cpu": {"coreCount": int(cluster.threads_per_worker)}}
                for w in sorted({int(o.host.rsplit("-", 1)[1]) for o in observations})}
    flow_run = {"id": run_id, "name": f"{result.strategy} (simulated)", "flow_name": "simulation",
                "start_time": t0, "end_time": t0 + result.makespan_seconds, "state": "COMPLETED"
                if result.completed else "FAILED"}
    return maps, observations, machines, flow_run
