"""One chunked map, executed: the state machine's instructions carried out on Prefect and Dask.

Every decision is the state machine's (:mod:`memchunk_prefect.core.machine`); this
module only turns the world into its events and its instructions into actions:

- events: the budget and slots read from the cluster, the output opened or
  resumed (:mod:`memchunk_prefect.io.identity`), each finished Dask future
  classified (``ChunkDone``, ``ChunkOutOfMemory``, ``ChunkFailed``,
  ``WorkerDied``, ``ClusterLost``), an exception that stops the map (``Stop``);
- instructions: submit a chunk as a Prefect task run on Dask, persist and learn
  an observation, tell the observers, mark task runs (:mod:`memchunk_prefect.run.taskruns`),
  cancel, read completion markers, raise, finalize the output.

Lives in a thread of the flow's process, one per map (the runner starts it; see
:meth:`memchunk_prefect.run.runner.MemoryAwareRunner.map`). What runs on the workers is in
:mod:`memchunk_prefect.run.worker`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
import threading
import time
import uuid
from typing import Any, Callable, Iterable

import dask
from distributed import as_completed
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.states import State
from prefect_dask.task_runners import PrefectDaskFuture

from memchunk_prefect.core.budget import Budget
from memchunk_prefect.core.chunks import Chunk, Shape, with_halo
from memchunk_prefect.core.drive import drive, execute
from memchunk_prefect.core.energy import ESTIMATE, estimate_joules
from memchunk_prefect.core.errors import (
    GpuContextError,
    MemchunkError,
    UpstreamMapError,
    WorkersPausedError,
)
from memchunk_prefect.core.machine import MapMachine
from memchunk_prefect.core.messages import (
    KILLED,
    Cancel,
    ChunkDone,
    ChunkEnded,
    ClusterLost,
    Decided,
    Event,
    Fail,
    Finalize,
    Instruction,
    MapSpec,
    MarkersRecovered,
    MarkRuns,
    PausesRead,
    ReadPauses,
    Record,
    RecoverMarkers,
    RestartWorker,
    Rewarded,
    SlotsChanged,
    Start,
    Stop,
    Stopped,
    Submit,
    UpstreamWritten,
    WorkerDied,
)
from memchunk_prefect.core.records import (
    Observation,
    Reward,
    first_use_bytes,
    paused_idle_since,
    paused_within,
    pauses_from,
    stop_deaths,
    stuck_paused,
    stuck_paused_message,
)
from memchunk_prefect.core.settings import DTYPE, RUNNER_SETTINGS, PolicySettings
from memchunk_prefect.core.sharing import SLOT_RESOURCE, least_busy_worker, slot_request
from memchunk_prefect.core.stragglers import SlowWorker, slow_workers
from memchunk_prefect.io.identity import (
    MDIO,
    RESTART,
    ZARR,
    OutputIdentity,
    code_digest,
    open_output,
    params_digest,
)
from memchunk_prefect.io.mdio import MdioSource
from memchunk_prefect.io.volume import as_source
from memchunk_prefect.operators.device import CUDA
from memchunk_prefect.operators.spec import operator_key, operator_name, spec_of
from memchunk_prefect.run import cluster as _cluster
from memchunk_prefect.run import taskruns
from memchunk_prefect.run.hydration import settings_serialized_once
from memchunk_prefect.run.map_records import map_record
from memchunk_prefect.run.observe import MapEnd, MapObserver, MapStart, Observers, observer_event
from memchunk_prefect.run.outcomes import failure_event
from memchunk_prefect.run.prefect_api import flow_logger, flow_run_id, keep_final_state
from memchunk_prefect.run.standings import Inbox, standing_of, told_event
from memchunk_prefect.run.worker import BlockFunction, BlockJob, chunk_task_run_name

logger = logging.getLogger("memchunk_prefect.run.runner")

#: Seconds a map's thread waits at most between looks at its stop flag and its upstream map (its own chunks'
#: completions and the upstream's writes wake it at once).
_WAIT_SECONDS = 0.1


class MapInterrupted(BaseException):
    """Raised in a map's thread when the flow run around it was interrupted or cancelled: not an ``Exception``,
    so the map stops as an interrupted one (its task runs in flight are marked Cancelled)."""


@dataclasses.dataclass(frozen=True)
class MapContext:
    """What a chunked map needs from the runner that started it, and nothing more.

    ``cluster``: the view of the live cluster (budgets, slots, kill headroom, device, the client);
    ``bank``: returns the model bank over the flow run's store (opened once, on first use);
    ``policy``: the settings the decision core weighs; ``device``: the runner's device for operators
    that take one (None: each operator's own default); ``stop``: what the map's thread should raise
    to stop (the flow run stopped around it), or None; ``output_path``: a fresh default output path
    for an operator, ending in the suffix given (``.zarr``, ``.mdio``); ``submit``: submits a task run on
    Dask (prefect-dask's own ``submit``).
    """

    cluster: _cluster.ClusterView
    bank: Callable[[], Any]
    policy: PolicySettings
    device: str | None
    stop: Callable[[], BaseException | None]
    output_path: Callable[[str, str], str]
    submit: Callable[..., PrefectDaskFuture]


@dataclasses.dataclass
class _SlowWatch:
    """What a map keeps to tell slow workers from the others: its ok runs, the workers found slow (each said
    once) and when it last looked (``time.monotonic()`` seconds)."""

    finished_runs: list[Observation] = dataclasses.field(default_factory=list)
    slow: dict[str, SlowWorker] = dataclasses.field(default_factory=dict)
    slow_checked: float = 0.0


@dataclasses.dataclass
class _PauseWatch:
    """What a map keeps to tell workers stuck at Dask's pause line: since when each has been paused with nothing
    running (monotonic seconds), those said (each once), when it last looked, whether the scheduler answers,
    its transition count then, and the stuck workers' pause line (a fraction of ``memory_limit``)."""

    idle: dict[str, float] = dataclasses.field(default_factory=dict)
    said: set[str] = dataclasses.field(default_factory=set)
    checked: float = 0.0
    checkable: bool = True
    transitions_seen: int | None = None
    fraction: float | None = None


class ChunkedMap:
    """One chunked ``.map`` from decision to finished output: a thin executor of a :class:`MapMachine`.

    ``source``: anything :func:`~memchunk_prefect.io.volume.as_source` reads;
    ``incoming``: the upstream map's chunks when the source is its result (else the
    source's own storage chunks where it has chunks worth keeping: an MDIO survey's);
    ``halo``: None for the operator's own; ``output_path``: where the output store
    goes, written as ``output_format`` (``zarr`` or ``mdio``); ``replace_any``: the
    caller owns that path (see :mod:`memchunk_prefect.io.identity`).
    """

    def __init__(self, ctx: MapContext, task: Any, param: str, *, source: Any,
                 incoming: Iterable[Chunk] | None, halo: Shape | None, output_path: str | None,
                 replace_any: bool, static: dict[str, Any], wait_for: Iterable[PrefectFuture] | None,
                 observers: Iterable[MapObserver] = (), upstream: "ChunkedMap | None" = None,
                 source_identity: dict | None = None, output_format: str = ZARR):
        self.ctx = ctx
        self.task = task
        self.param = param
        self.static = static
        self.wait_for = list(wait_for) if wait_for else None
        self.spec = spec_of(task)
        self.name = operator_name(task)
        self.source = as_source(source)
        if incoming is None:
            incoming = self.source.chunking()
        self.incoming = tuple(incoming) if incoming is not None else None
        self.shape: Shape = tuple(int(s) for s in self.source.shape)  # type: ignore[assignment]
        if "sample_interval_ms" in inspect.signature(task.fn).parameters and "sample_interval_ms" not in static:
            # Operators that need the sample interval get the volume's own, from its headers.
            interval = self.source.coords().get("sample_interval_ms")
            if interval:
                static["sample_interval_ms"] = float(interval)
        self.halo: Shape = halo if halo is not None else self.spec.halo_for(static)
        self.device = self.spec.device
        if "device" in inspect.signature(task.fn).parameters:
            # One map runs on one device, resolved here from what the workers have ("auto": the GPU where every
            # worker has one); the chunks get the resolved name, and the key carries it (CPU and GPU memory are
            # learned apart).
            requested = static.get("device", ctx.device) or self.spec.defaults.get("device") or self.spec.device
            self.device = static["device"] = ctx.cluster.map_device(requested)
        self.key = operator_key(task, static, dtype=DTYPE, device=self.device)
        self.output_format = output_format
        self.output_path = output_path or ctx.output_path(self.name, ".mdio" if output_format == MDIO else ".zarr")
        self.replace_any = replace_any
        # What an existing output must have been computed from to be resumed rather than recomputed: the
        # operator key holds only memory parameters, so every parameter and the halo are added here.
        self.upstream = upstream
        self.identity = OutputIdentity(self.key, source_identity if source_identity is not None
                                       else self.source.identity(), code_digest(task.fn), params_digest(static),
                                       self.halo)
        self.observers = Observers(observers)
        self._init_run_state()

    def _init_run_state(self) -> None:
        """What the map holds while it runs: its futures, the machine, the cluster's figures it planned with, and
        what other threads read of it."""
        self.futures: list[PrefectDaskFuture] = []
        self.by_id: dict[int, PrefectDaskFuture] = {}
        self.ids: dict[Any, int] = {}  # Dask key -> submission id
        self.pins: dict[int, str] = {}  # submission id -> the worker it was placed on (a map that runs alone)
        self.submitted_at: dict[int, float] = {}  # submission id -> when it was submitted (epoch s)
        self.pinned_to: str | None = None  # the worker the submission being made is placed on
        self.slot_units: float | None = None  # the slot resource each worker offers (None: not offered)
        self.states: dict[int, Any] = {}  # what each collected future gave
        self.machine: MapMachine | None = None
        self.out: Any = None
        self.budget = 0
        self.gpu_budget: int | None = None  # on the GPU: what one task may use of the device's memory, bytes
        self.slots = 0
        self.budget_read: Budget | None = None  # what the cluster said when the map started (its MapRun records it)
        self.resting: dict[str, int] = {}  # each worker's resting memory the budget assumed
        self.headroom: dict[str, int] = {}  # each worker's kill line less that, per thread
        self.reward: Reward | None = None  # what the learned policy's arm earned, once the map is finalized
        self.paused: tuple[int, float] = (0, 0.0)  # workers' pauses over the map and their worker-seconds
        self.started_at: float | None = None  # when the map began (epoch seconds), for its MapRun record
        self.flow_run_id = flow_run_id()
        self.map_id = uuid.uuid4().hex  # ties the map's observations to its MapRun record (traces)
        self.slow_watch = _SlowWatch()
        self.pause_watch = _PauseWatch()
        # What other threads read of a map that runs in the background (runner.MemoryAwareRunner.map): set once
        # its first decision is made (a downstream map plans from this one's plan) and once it ended; the error
        # it ended with; who wrote which chunk (the task run ids a downstream chunk's task run depends on).
        self.planned = threading.Event()
        self.standings_inbox: Inbox | None = None  # what other maps tell this one of their workers (while it runs)
        self.ended = threading.Event()
        self.error: BaseException | None = None
        self.error_seen = False  # the error reached the user: .result(), a downstream map's error, the flow's end
        self.lock = threading.RLock()  # held while the machine changes (plan_snapshot reads it from other threads)
        self.writers: list[tuple[Chunk, Any]] = []  # (chunk, task run id) of every chunk this map's runs wrote
        self.listeners: list[threading.Condition] = []  # told after every event (downstream maps wait on them)
        self.upstream_seen = 0  # upstream chunks passed on as UpstreamWritten
        self.upstream_complete = False

    # ---------------------------------------------------------------- the loop

    def run(self) -> None:
        """Run the map to its finished output; on any exception, settle what is in flight and re-raise."""
        try:
            try:
                with settings_serialized_once():
                    self._run()
            except BaseException as exc:  # Ctrl-C, a Prefect cancellation (TerminationSignal), a lost cluster, ...
                self.error = exc
                with self.lock:
                    self.abandon(exc)
                self._end(exc)
                raise
            self._end(None)
        finally:
            if self.standings_inbox is not None:
                self.ctx.cluster.standings.leave(self.standings_inbox, at=time.time())
            self.planned.set()
            self.ended.set()
            self.tell_listeners()

    def tell_listeners(self) -> None:
        for cond in list(self.listeners):
            with cond:
                cond.notify_all()

    def plan_snapshot(self) -> tuple[Chunk, ...]:
        """The chunking this map has planned so far, for a downstream map's decision: chunks written, in flight and
        queued, in submission order, then the boxes not planned yet (a cold start's probes leave the rest as
        boxes). Read from another thread once :attr:`planned` is set."""
        with self.lock:
            m = self.machine
            if m is None:
                return ()
            return m.chunking()

    def _run(self) -> None:
        budget = self.ctx.cluster.budget([getattr(self.task.fn, "__module__", "") or "tasks"])
        self.slots, self.budget, self.resting = budget.slots, budget.budget_bytes, budget.resting_bytes
        self.headroom = budget.headroom_bytes
        self.budget_read = budget
        self.slot_units = _cluster.read_slot_units(self.ctx.cluster.client) if (budget.threads_per_worker or 1) > 1 \
            else None
        self.started_at = time.time()
        logger.info("%s: %s", self.name, budget.reason)
        if self.device == CUDA:
            gpu = self.ctx.cluster.gpu_budget()
            self.gpu_budget = gpu.budget_bytes
            logger.info("%s: %s", self.name, gpu.reason)
        self.out, completed, action = open_output(
            self.output_path, self.identity, self.shape, self.source.coords(), operator=self.name,
            replace_any=self.replace_any, output_format=self.output_format, dims=self.source.dims,
            carry_from=self.source.path if isinstance(self.source, MdioSource) else None)
        from memchunk_prefect.learn.bank import (
            BankKnowledge,  # flow process only (River): see the note at the top of runner.py
        )

        bank = self.ctx.bank()
        self.ctx.cluster.record_machines(bank.store)
        knowledge = BankKnowledge(bank, self.key, self.ctx.policy)
        self.standings_inbox = self.ctx.cluster.standings.join(self.map_id)
        self.ac = as_completed(loop=self.ctx.cluster.client.loop)
        up = self.upstream
        gated = up is not None and not (up.ended.is_set() and up.error is None)
        self.upstream_complete = not gated
        self.machine = MapMachine(
            MapSpec(operator=self.name, operator_key=self.key, shape=self.shape, halo=self.halo,
                    whole_traces=self.spec.whole_traces, output_path=self.output_path, incoming=self.incoming,
                    settings=self.ctx.policy, gated=gated), knowledge)
        if up is not None and gated:
            up.listeners.append(self.ac.thread_condition)
        self.observers.emit("on_map_start", MapStart(
            operator=self.name, operator_key=self.key, shape=self.shape, halo=self.halo,
            output_path=self.output_path, budget_bytes=self.budget, slots=self.slots,
            predict=self.machine.predict, budget_reason=budget.reason, at=time.time(),
            block_seconds=knowledge.block_seconds))
        # A chunk's effect is its write: never serve it from a cache.
        self.wrapped = self.task.with_options(task_run_name=chunk_task_run_name, cache_policy=NO_CACHE)
        self.wrapped.fn = BlockFunction(self.task.fn, self.param)
        restarted = action.reason if action.action == RESTART else None
        with self.lock:
            self.execute(self.machine.handle(Start(
                self.slots, self.budget, tuple(completed), restarted, at=time.time(),
                headroom_bytes=min(self.headroom.values()) if self.headroom else None,
                drift_bytes=int(max(bank.model(self.key).unseen_bytes(), bank.model(self.key).first_use_bytes())),
                gpu_budget_bytes=self.gpu_budget, touched_bytes=budget.touched_bytes or None,
                threads_per_worker=budget.threads_per_worker or 1, worker_budget_bytes=budget.worker_budget_bytes,
                threads_per_core=budget.threads_per_core)))
        self.planned.set()
        self.slots_polled, self.slots_seen = time.monotonic(), self.slots
        drive(self.machine, self)

    # ---------------------------------------------------------------- the world the machine is driven in

    def now(self) -> float:
        return time.time()

    def halted(self) -> bool:
        return False  # a real map stops by raising (Fail, a stop, a lost upstream)

    def guard(self) -> Any:
        return self.lock

    def handled(self) -> None:
        self.tell_listeners()

    def next_events(self, machine: MapMachine) -> list[Event]:
        """The next finished submission (or what the upstream wrote), and, at most every
        ``slots_poll_seconds``, a change in the slots to plan for (workers joined a scheduler started
        elsewhere, or left; on the runner's own cluster, more than were requested)."""
        events: list[Event] = [self.next_event()]
        # Where other maps' runs left the workers, heard with this map's own event: handled together, the budget
        # has followed before the machine submits again.
        if self.standings_inbox is not None:
            events.extend(told_event(t, self.resting) for t in self.standings_inbox.take() if t.worker in self.resting)
        if time.monotonic() - self.slots_polled >= RUNNER_SETTINGS.slots_poll_seconds:
            self.slots_polled = time.monotonic()
            slots = self.ctx.cluster.slots_now()
            if slots and slots != self.slots_seen:  # (the machine's own slots count workers where it runs alone)
                logger.info("%s: the cluster now has %d worker threads (%d when the map started)", self.name, slots,
                            self.slots)
                self.slots_seen = slots
                events.append(SlotsChanged(slots, at=time.time()))
        return events

    def next_event(self) -> Event:
        """Wait for the next finished submission and say what happened to it; for a map over a map still running,
        also what the upstream wrote since last asked (:class:`UpstreamWritten`). Raises what stops the map: the
        runner's stop (the flow was interrupted or cancelled), the upstream map's failure."""
        while not self.ac.has_ready():
            upstream = self.upstream_event()
            if upstream is not None:
                return upstream
            stop = self.ctx.stop()
            if stop is not None:
                raise type(stop)(*stop.args)  # one per map's thread: a raised exception's traceback is its own
            if self.ac.is_empty() and not self.machine.waiting_upstream:  # type: ignore[union-attr]
                raise MemchunkError(f"internal: {self.name} waits with nothing in flight and nothing to wait for")
            self.look_for_stuck_pauses()
            with self.ac.thread_condition:  # notified by our futures' completions and by the upstream map
                self.ac.thread_condition.wait(timeout=_WAIT_SECONDS)
        self.pause_watch.idle.clear()  # a chunk came back: the workers are not stuck, whatever the polls between saw
        dask_future = next(self.ac)
        sid = self.ids[dask_future.key]
        fut = self.by_id[sid]
        try:
            state = dask_future.result()
        except Exception as exc:  # the worker died (KilledWorker), or the cluster went away
            client = self.ctx.cluster.client
            if dask_future.status == "cancelled" or client.status not in ("running", "connecting"):
                # No worker death: the scheduler forgot the task (it was killed, restarted, or unreachable).
                return ClusterLost(sid, exc, address=str(client.scheduler.address),
                                   written_chunks=len(self.out.completed_chunks()), at=time.time())
            chunk = self.machine.in_flight[sid].chunk  # type: ignore[union-attr]
            written = self.out.is_done(chunk)
            last = getattr(exc, "last_worker", None)
            worker = str(getattr(last, "address", "") or "")
            evidence = None if written else self.ctx.cluster.death_evidence(
                worker, getattr(last, "nanny", None), getattr(last, "name", None))
            return WorkerDied(sid, type(exc).__name__, written=written,
                              kill_headroom_bytes=None if written else self.headroom_of(exc), at=time.time(),
                              worker=worker, evidence=evidence, started=None if written else self.began(sid, fut))
        finally:
            with contextlib.suppress(Exception):
                dask_future.release()  # completed results must not be recomputed if a worker dies later
        self.states[sid] = state
        if isinstance(state, State):
            keep_final_state(fut, state)
        if isinstance(state, State) and state.is_completed():
            self.writers.append((self.machine.in_flight[sid].chunk, fut.task_run_id))  # type: ignore[union-attr]
            return self.chunk_done(sid, state.result().observation)
        raised = state.result(raise_on_failure=False) if isinstance(state, State) else state
        label = self.machine.in_flight[sid].chunk.label(self.shape)  # type: ignore[union-attr]
        return failure_event(sid, raised, f"{self.name}[{label}] ended in state {state!r}", self.observed,
                             self.resting, at=time.time())

    def chunk_done(self, sid: int, record: dict) -> ChunkDone:
        """A chunk written: what its run measured, and where it left its worker, told to the flow run's other
        maps (:mod:`memchunk_prefect.run.standings`)."""
        done = self.observed(record)
        if done.submitted_at is None and sid in self.submitted_at:
            done = dataclasses.replace(done, submitted_at=self.submitted_at[sid])
        standing = standing_of(done)
        if standing is not None and self.standings_inbox is not None:
            self.ctx.cluster.standings.tell(self.standings_inbox, done.worker, standing,
                                            first_use=first_use_bytes(done), at=time.time())
        return ChunkDone(sid, done, at=time.time())

    def upstream_event(self) -> UpstreamWritten | None:
        """What the upstream map wrote since last asked (None: nothing new, or no upstream still running); raises
        :class:`~memchunk_prefect.core.errors.UpstreamMapError` when it stopped without finishing its output."""
        up = self.upstream
        if up is None or self.upstream_complete:
            return None
        ended = up.ended.is_set()  # read first: what it wrote before ending is then all in ``done``
        done = up.machine.done if up.machine is not None else []
        new = tuple(done[self.upstream_seen:])
        self.upstream_seen += len(new)
        if ended and up.error is not None:
            up.error_seen = True  # said in this map's error
            raise UpstreamMapError(
                f"{self.name} stopped: the map it reads, {up.name}, did not finish ({type(up.error).__name__}: "
                f"{up.error}); the {len(self.out.completed_chunks()) if self.out is not None else 0} chunks of "
                f"{self.name} written to {self.output_path} are kept, and a rerun of the flow resumes both maps")
        complete = ended
        if complete:
            self.upstream_complete = True
        return UpstreamWritten(new, complete, at=time.time()) if new or complete else None

    def began(self, sid: int, fut: PrefectFuture) -> bool | None:
        """Whether submission ``sid``'s chunk had begun on its worker (its start reached the scheduler's log);
        None where that cannot be told."""
        runs = _cluster.read_started(self.ctx.cluster.client, self.submitted_at.get(sid, 0.0))
        return None if runs is None or not fut.task_run_id else str(fut.task_run_id) in runs

    def headroom_of(self, exc: BaseException) -> int | None:
        """What a task killed with ``exc`` had before the kill line: its worker's, as the budget read it.

        ``KilledWorker`` names the worker it last ran on; the kill line less that
        worker's resting memory at the map's start is what the task needed more
        than. (Read now, the workers' memory would include the tasks running there.)
        """
        address = getattr(getattr(exc, "last_worker", None), "address", None)
        if address in self.headroom:
            return self.headroom[address]
        return self.ctx.cluster.kill_headroom_bytes()

    def observed(self, record: dict) -> Observation:
        """A worker's record, completed with what the flow knows: the resting memory the budget assumed for
        that worker (what it did not see), the flow run, and an energy estimate where no counter measured it
        (CPU seconds x ``policy.watts_per_core``, labelled ``energy_source="estimate"``)."""
        obs = Observation.from_dict(record)
        changes: dict[str, Any] = {}
        if obs.resting_bytes is None and obs.worker in self.resting:
            changes["resting_bytes"] = int(self.resting[obs.worker])
        if obs.energy_joules is None and obs.cpu_seconds is not None:
            changes["energy_joules"] = estimate_joules(obs.cpu_seconds, self.ctx.policy.watts_per_core)
            changes["energy_source"] = ESTIMATE
        return dataclasses.replace(obs, **changes) if changes else obs

    # ---------------------------------------------------------------- instructions

    def execute(self, instructions: list[Instruction]) -> None:
        """Carry out instructions in order; answers they produce (recovered markers) go back to the machine."""
        execute(self.machine, self, instructions)

    def carry_out(self, ins: Instruction) -> Event | None:
        """Carry out one instruction (its handler by type, :data:`_CARRY_OUT`); an answer goes back to the machine."""
        handler = _CARRY_OUT.get(type(ins))
        if handler is None:  # pragma: no cover - a new instruction type without an executor
            raise MemchunkError(f"internal: no executor for {ins!r}")
        return handler(self, ins)

    def decided(self, ins: Decided) -> None:
        r = ins.record
        logger.info("%s: %s — %s", self.name, r.decision, r.reason)
        flow_logger(logger).info("memchunk %s: %s — %s", self.name, r.decision, r.reason)
        if r.warning:
            logger.warning("%s: %s", self.name, r.warning)
            flow_logger(logger).warning("memchunk %s: %s", self.name, r.warning)
        self.tell_observers(ins)

    def mark_runs(self, ins: MarkRuns) -> None:
        # A submission interrupted before it reached Dask (Ctrl-C or a cancellation during submit) has no
        # future and no task run: nothing to mark or cancel.
        marks = [(self.by_id[sid].task_run_id, state, msg) for sid, state, msg in ins.marks if sid in self.by_id]
        taskruns.mark_runs(marks, look_again_seconds=RUNNER_SETTINGS.settle_missing_seconds if ins.look_again
                           else 0.0)

    def cancel(self, ins: Cancel) -> None:
        for sid in ins.ids:
            with contextlib.suppress(BaseException):
                if sid in self.by_id:
                    self.by_id[sid].wrapped_future.cancel()

    def stopped(self, ins: Stopped) -> None:
        with contextlib.suppress(BaseException):
            logger.warning("%s: stopped early (%s); %d chunks are marked written in %s (kept: a rerun resumes "
                           "there); %d were collected while stopping", self.name, ins.error,
                           len(self.out.completed_chunks()) if self.out is not None else 0, self.output_path,
                           ins.kept)

    def tell_observers(self, ins: Instruction) -> None:
        told = observer_event(ins)
        if told is not None:
            self.observers.emit(*told)

    def restart_worker(self, ins: RestartWorker) -> None:
        """Restart a worker whose GPU context is unusable (its nanny starts a new process), and say so.

        A worker that does not come back (its nanny was closed meanwhile, or it is late) is said loudly and the map
        goes on with the workers left; with none left it fails with GpuContextError (the chunks written are kept).
        """
        msg = f"restarting worker {ins.address}: {ins.reason}"
        logger.warning("%s: %s", self.name, msg)
        flow_logger(logger).warning("memchunk %s: %s", self.name, msg)
        client = self.ctx.cluster.client
        if ins.address not in _cluster.scheduler_info(client).get("workers", {}):
            logger.warning("%s: worker %s is gone already (its nanny restarted it, or it left)", self.name,
                           ins.address)
            return
        limit = RUNNER_SETTINGS.worker_restart_seconds
        try:
            done = _cluster.restart_worker(client, ins.address, limit)
        except Exception as exc:  # noqa: BLE001 - no nanny to restart it, or the scheduler refused
            raise GpuContextError(
                f"{self.name}: worker {ins.address} has an unusable GPU context and could not be restarted "
                f"({type(exc).__name__}: {exc}). Restart it (or its cluster) and rerun: the chunks written are kept",
                ins.address) from exc
        if done.outcome == "back":
            logger.info("%s: worker %s restarted as %s in %.1f s", self.name, ins.address, done.address, done.seconds)
            return
        why = ("its nanny no longer answers (closed by its cluster or deployment, or its host lost)"
               if done.outcome == "gone" else f"no new process registered within {limit:g} s "
                                              "(RUNNER_SETTINGS.worker_restart_seconds)")
        if done.workers_left == 0:
            raise GpuContextError(
                f"{self.name}: worker {ins.address} has an unusable GPU context and did not come back after its "
                f"restart ({why}), and no worker is left. Restart the cluster and rerun: the chunks written are kept",
                ins.address)
        msg = (f"worker {ins.address} did not come back after its restart ({why}); the map goes on with the "
               f"{done.workers_left} worker(s) left")
        logger.warning("%s: %s", self.name, msg)
        flow_logger(logger).warning("memchunk %s: %s", self.name, msg)

    def submit(self, ins: Submit) -> None:
        job = BlockJob(source=self.source, chunk=ins.chunk, halo=self.halo, volume_shape=self.shape,
                       output_path=self.output_path, operator=self.name, operator_key=self.key,
                       budget_bytes=self.budget, label=ins.label, device=self.device,
                       gpu_budget_bytes=self.gpu_budget,
                       upper_bytes=None if ins.upper_bytes is None or not ins.check_room else int(ins.upper_bytes))
        params = dict(self.static)
        params[self.param] = job
        with dask.annotate(**self.placement(ins.per_worker)):
            fut = self.ctx.submit(self.wrapped, params,
                                  wait_for=self.wait_for,
                                  dependencies=self.dependencies(ins.chunk))
        if self.pinned_to:
            self.pins[ins.id], self.pinned_to = self.pinned_to, None
        self.futures.append(fut)
        self.by_id[ins.id] = fut
        self.submitted_at[ins.id] = time.time()
        self.ids[fut.wrapped_future.key] = ins.id
        self.ac.add(fut.wrapped_future)
        self.tell_observers(ins)

    def placement(self, per_worker: int | None) -> dict[str, Any]:
        """Where a chunk may run, as Dask annotations (:mod:`memchunk_prefect.core.sharing`): its share of the
        workers' slot resource where they offer one; else, for a map that runs alone, the least busy worker
        (loosely: anywhere if that worker is gone); else anywhere."""
        if self.slot_units:
            threads = (self.budget_read.threads_per_worker if self.budget_read else None) or 1
            return {"resources": {SLOT_RESOURCE: slot_request(per_worker, self.slot_units, threads)}}
        if per_worker:
            self.pinned_to = self.place_alone()
            if self.pinned_to:
                return {"workers": [self.pinned_to], "allow_other_workers": True}
        return {}

    def place_alone(self) -> str | None:
        """The worker with the fewest tasks processing (the scheduler's count, plus this map's submissions it
        has not seen yet; :func:`memchunk_prefect.core.sharing.least_busy_worker`); None where the scheduler
        cannot be asked."""
        try:
            processing = self.ctx.cluster.client.processing()
        except Exception as exc:  # noqa: BLE001 - Dask then places it, as for any task
            logger.debug("%s: could not read the tasks processing on the workers: %r", self.name, exc)
            return None
        running = {str(w): len(keys) for w, keys in processing.items()}
        seen = {k for keys in processing.values() for k in keys}
        for sid, address in list(self.pins.items()):
            fut = self.by_id.get(sid)
            if fut is None or fut.wrapped_future.done():
                self.pins.pop(sid, None)
            elif fut.wrapped_future.key not in seen and address in running:
                running[address] += 1
        return least_busy_worker(running, sorted(processing))  # the workers there now, never one that left

    def dependencies(self, chunk: Chunk) -> dict[str, set] | None:
        """The upstream task runs that wrote what ``chunk``'s block reads, as Prefect task inputs of its task run
        (the UI's graph then shows which chunks fed which); None over a source that is not a map's result."""
        up = self.upstream
        if up is None:
            return None
        from prefect.client.schemas.objects import TaskRunResult

        block = with_halo(chunk, self.halo, self.shape)[0]
        ids = {tid for c, tid in list(up.writers) if tid is not None and c.intersect(block) is not None}
        return {self.param: {TaskRunResult(id=tid) for tid in ids}} if ids else None

    def record(self, obs: Observation) -> None:
        """Persist the observation and teach the model (a failing store is said loudly, never stops the run).

        Every observation of the map passes here (a finished chunk's, a censored one's, one the flow wrote
        for a killed worker): it is stamped with the flow run and the map it belongs to.
        """
        if (not obs.flow_run_id and self.flow_run_id) or not obs.map_id:
            obs = dataclasses.replace(obs, flow_run_id=obs.flow_run_id or self.flow_run_id,
                                      map_id=obs.map_id or self.map_id)
        if (obs.outcome == KILLED and obs.method == "flow" and isinstance(self.ctx.stop(), MapInterrupted)
                and stop_deaths([obs], time.time(), _cluster.read_memory_kills(self.ctx.cluster.client) or ())):
            logger.warning("%s: the worker running %s died as the flow run stopped: not learned as out of memory",
                           self.name, obs.chunk)
            return
        try:
            self.ctx.bank().learn(obs)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not record an observation for %s: %r", self.key, exc)
        if obs.outcome == "ok":
            self.slow_watch.finished_runs.append(obs)
            self.look_for_slow_workers()

    def look_for_slow_workers(self, *, final: bool = False) -> None:
        """Find workers slow rather than dead (at most once a second) and say so, naming each once per map.

        ``final``: the map has ended, so look whatever the last look's time. A slow worker's chunks are often the
        map's last to finish, so the run that gives it its second vote can land within a second of the previous
        look with no run after it; without a last look the summary would leave the worker out.

        Only said, not acted on: steering the map's later chunks to the other workers (a loose Dask worker
        restriction) was measured no better (``python -m benchmarks.studies.straggler``): Dask's work stealing hands a
        chunk queued behind a busy worker to the idle slow one, which a loose restriction allows, and a strict
        one would leave chunks waiting for ever once the other workers leave.
        """
        s = self.ctx.policy
        if s.slow_worker_factor is None or (not final and time.monotonic() - self.slow_watch.slow_checked < 1.0):
            return
        self.slow_watch.slow_checked = time.monotonic()
        found = [dataclasses.replace(w, at=time.time())
                 for w in slow_workers(self.slow_watch.finished_runs, factor=s.slow_worker_factor,
                                       min_runs=s.slow_worker_runs, min_seconds=s.slow_worker_seconds)
                 if w.worker not in self.slow_watch.slow]
        for w in found:
            self.slow_watch.slow[w.worker] = w
            self.observers.emit("on_slow_worker", w)
            msg = (f"{w.describe()}: a node slow rather than dead (CPU throttled, swapping, a busy neighbour); "
                   "the map waits on each chunk it holds. Look at that machine, or leave it out of the cluster")
            logger.warning("%s: %s", self.name, msg)
            flow_logger(logger).warning("memchunk %s: %s", self.name, msg)

    def look_for_stuck_pauses(self) -> None:
        """While the map waits: say the workers paused with no task running for ``paused_stall_seconds`` (each
        once per map), and stop the map with :class:`WorkersPausedError` when every worker is: nothing would ever
        run again. On an adaptive cluster, which may add workers while tasks wait (a batch queue can take longer
        than any patience), only said. Asks the scheduler at most every ``pause_poll_seconds``; a scheduler that
        refuses turns the check off for the map; the rule is ``records.paused_idle_since`` / ``stuck_paused``."""
        s = RUNNER_SETTINGS
        if not self.pause_watch.checkable or time.monotonic() - self.pause_watch.checked < s.pause_poll_seconds:
            return
        self.pause_watch.checked = time.monotonic()
        read = _cluster.read_paused_idle(self.ctx.cluster.client)
        if read is None:
            self.pause_watch.checkable = False
            return
        now = time.monotonic()
        self.pause_watch.idle = paused_idle_since(self.pause_watch.idle, read, self.pause_watch.transitions_seen, now)
        self.pause_watch.transitions_seen = read.transitions
        stuck, every = stuck_paused(self.pause_watch.idle, read, now, s.paused_stall_seconds)
        new = [w for w in stuck if w.address not in self.pause_watch.said]
        adaptive = self.ctx.cluster.adaptive
        if not (every and not adaptive) and not new:
            return
        if self.pause_watch.fraction is None:
            self.pause_watch.fraction = _cluster.read_pause_fraction(self.ctx.cluster.client, stuck[0].address)
        if every and not adaptive and not self.ac.has_ready():  # a chunk that came back meanwhile: not stuck
            raise WorkersPausedError(stuck_paused_message(self.name, stuck, read.n_workers, self.pause_watch.fraction,
                                                          s.paused_stall_seconds, self.budget or 0))
        if new:
            self.pause_watch.said.update(w.address for w in new)
            msg = stuck_paused_message(self.name, new, read.n_workers, self.pause_watch.fraction,
                                       s.paused_stall_seconds, self.budget or 0)
            logger.warning("%s", msg)
            flow_logger(logger).warning("memchunk %s", msg)

    def rewarded(self, reward: Reward) -> None:
        """Persist and learn what the map's arm earned (a failing store is said loudly, never stops the run)."""
        reward = dataclasses.replace(reward, flow_run_id=flow_run_id())
        self.reward = reward
        logger.info("%s: arm %s earned %.3f (slot efficiency %.3f over %.2f s on %d slots, %d out of memory)",
                    self.name, reward.arm, reward.reward, reward.efficiency, reward.wall_seconds, reward.slots,
                    reward.out_of_memory)
        try:
            self.ctx.bank().reward(reward)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not record the policy's reward for %s: %r", self.key, exc)

    def read_pauses(self, since: float, until: float) -> PausesRead:
        """The workers' pauses over the map, from the scheduler's log (none when it cannot be read)."""
        changes = _cluster.read_status_changes(self.ctx.cluster.client)
        pauses = pauses_from(changes or [], time.time())
        self.paused = paused_within(pauses, since, until)
        if self.paused[0]:
            logger.info("%s: workers paused %d time(s) for %.1f worker-seconds (Dask's pause line, "
                        "distributed.worker.memory.pause)", self.name, *self.paused)
        return PausesRead(pauses, at=time.time())

    def recover_markers(self, chunks: Iterable[Chunk]) -> MarkersRecovered | None:
        """The observations that written chunks' completion markers carry and the store lacks.

        A run stopped between a chunk's write and the flow collecting its receipt
        (Ctrl-C, a cancelled or killed flow process, a lost scheduler, a worker
        killed after writing) left the measurement only in the marker. Matched by
        (chunk, created_at), so nothing is stored twice.
        """
        try:
            written = [c for c in chunks if self.out.is_done(c)]
            records = [Observation.from_dict(r) for r in self.out.done_records(written)]
            records = [o for o in records if o.operator_key == self.key]
            if not records:
                return None
            store = self.ctx.bank().store
            have = {(o.chunk, o.created_at) for o in (store.observations(self.key) if store is not None else [])}
        except Exception as exc:  # noqa: BLE001 - a measurement lost is logged, never fatal
            logger.warning("%s: could not read measurements from completion markers: %r", self.name, exc)
            return None
        new = tuple(o for o in records if (o.chunk, o.created_at) not in have)
        if not new:
            return None
        # A marker written while this map ran is this map's (a worker killed after writing); an older one is
        # an earlier run's, whose flow run and map are unknown: marked so, it is not stamped as this run's.
        since = self.started_at or 0.0
        new = tuple(o if o.created_at >= since else dataclasses.replace(o, map_id=o.map_id or "earlier-run")
                    for o in new)
        logger.info("%s: storing %d observations recovered from completion markers", self.name, len(new))
        return MarkersRecovered(new, at=time.time())

    def finalize(self, settle_runs: bool) -> None:
        self.out.finalize()  # raises IncompleteOutputError unless every element was written
        if settle_runs:
            taskruns.settle_completed(self.by_id[sid].task_run_id for sid, state in self.states.items()
                                      if sid in self.by_id and isinstance(state, State) and state.is_completed())
        for f in self.futures:
            with contextlib.suppress(Exception):
                f.wrapped_future.release()

    # ---------------------------------------------------------------- stopping early

    def abandon(self, exc: BaseException) -> None:
        """The map stops early: keep what finished, stop what did not, leave no task run RUNNING.

        Chunks whose task already returned are learned from (their observation is
        stored, their completion marker is on disk); the others are cancelled on the
        cluster and their Prefect task runs marked Cancelled (interrupted) or Crashed
        (an error). Nothing is finalized: the output stays resumable.
        """
        m = self.machine
        if m is None:
            return
        interrupted = not isinstance(exc, Exception)  # KeyboardInterrupt, TerminationSignal, SystemExit
        finished = []
        for sid in list(m.in_flight):
            state = self.states.get(sid)
            if state is None:
                fut = self.by_id.get(sid)
                with contextlib.suppress(BaseException):
                    if fut is not None and fut.wrapped_future.status == "finished":
                        state = fut.wrapped_future.result(timeout=RUNNER_SETTINGS.harvest_timeout_seconds)
            if isinstance(state, State) and state.is_completed():
                with contextlib.suppress(Exception):
                    finished.append((sid, self.observed(state.result().observation)))
        instructions = m.handle(Stop(type(exc).__name__, interrupted, tuple(finished), at=time.time()))
        for ins in instructions:
            with contextlib.suppress(BaseException):
                self.execute([ins])

    def _end(self, error: BaseException | None) -> None:
        m = self.machine
        self.look_for_slow_workers(final=True)
        self.record_map(error)
        self.compact_store()
        self.observers.emit("on_map_end", MapEnd(error, len(m.done) if m else 0, m.done_elements if m else 0,
                                                 at=time.time(), reward=self.reward if error is None else None,
                                                 pauses=self.paused[0], paused_seconds=self.paused[1]))


    def record_map(self, error: BaseException | None) -> None:
        """Keep what a trace of this flow run needs about the map (a failing store is logged, never raised)."""
        if self.started_at is None:
            return  # it never started: nothing ran
        outcome = "ok" if error is None else ("failed" if isinstance(error, Exception) else "interrupted")
        run = map_record(self, outcome)
        try:
            store = self.ctx.bank().store
            if store is not None:
                store.add_map(run)
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not record the map %s for traces: %r", self.name, exc)

    def compact_store(self) -> None:
        """Trim this key's history to ``RunnerSettings.store_keep_per_key`` rows once it is past it (a failing
        store is logged, never raised): see ``Store.compact``."""
        keep = RUNNER_SETTINGS.store_keep_per_key
        try:
            store = self.ctx.bank().store
            if store is not None and self.started_at is not None and store.count(self.key) > keep:
                deleted = store.compact(keep, self.key)
                logger.info("%s: the store keeps the newest %d observations of %s; deleted %s", self.name, keep,
                            self.key, ", ".join(f"{n} {t}" for t, n in deleted.items()))
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not compact the store for %s: %r", self.key, exc)



def _fail(_: ChunkedMap, ins: Fail) -> None:
    raise ins.error


#: How the executor carries out each instruction of the map machine (:mod:`memchunk_prefect.core.messages`).
_CARRY_OUT: dict[type, Callable[[ChunkedMap, Any], Event | None]] = {
    Submit: ChunkedMap.submit,
    Record: lambda m, ins: m.record(ins.observation),
    Decided: ChunkedMap.decided,
    ChunkEnded: ChunkedMap.tell_observers,
    MarkRuns: ChunkedMap.mark_runs,
    Cancel: ChunkedMap.cancel,
    RecoverMarkers: lambda m, ins: m.recover_markers(ins.chunks),
    Fail: _fail,
    Finalize: lambda m, ins: m.finalize(ins.settle_runs),
    Rewarded: lambda m, ins: m.rewarded(ins.reward),
    ReadPauses: lambda m, ins: m.read_pauses(ins.since, ins.until),
    RestartWorker: ChunkedMap.restart_worker,
    Stopped: ChunkedMap.stopped,
}
