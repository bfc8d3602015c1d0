"""A chunked map's control state as a pure state machine: events in, instructions out.

Every rule of a chunked ``.map`` lives here: what is submitted, in which order
and how much at once; when the cold-start probes are enlarged; when the
unsubmitted remainder is re-planned; whether a worker's death was a memory kill
or a lost worker; how a chunk that ran out of memory is split; what is recorded;
what happens to the chunks in flight when the map stops early; when the output
is complete. Nothing here touches Prefect, Dask, files or clocks: the executor
(:mod:`memchunk_prefect.run.executor` for real runs; a simulator for what-if runs)
turns the world into :data:`Event` objects, feeds them to :meth:`MapMachine.handle`,
and carries out the :data:`Instruction` objects it gets back. The same events give
the same instructions, so every rule is tested with a table and no cluster
(``tests/test_machine.py``), the way distributed tests its worker state machine.

The loop that drives it is :func:`memchunk_prefect.core.drive.drive`. A world must carry out
:class:`Record` (persist and learn the observation) before the next :meth:`~MapMachine.advance`: plans are
made from ``knowledge``, which reads what was learned, and the machine never writes to the model itself.

What happens when a chunk is lost (out of memory, its worker died or found no room for it, its GPU context
broke, the scheduler went away) is in :mod:`memchunk_prefect.core.losses`.

The learned policy (:mod:`memchunk_prefect.core.bandit`): the map's first plan that is not a probe picks an
arm (a risk level of the bound) through ``knowledge.choose_arm``; every later plan and split piece keeps it; a
finished map that did not probe ends with :class:`Rewarded`, what the arm earned, after :class:`ReadPauses`.
The rules are in the documentation's explanation of the learned policy.

Units: bytes, elements, seconds since the epoch (``at``, given by the executor).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

from memchunk_prefect.core import bandit, losses, policy
from memchunk_prefect.core.arms import choose_arm, probes
from memchunk_prefect.core.bandit import ArmChoice
from memchunk_prefect.core.chunks import Chunk, Shape, uncovered_boxes, with_halo
from memchunk_prefect.core.errors import (
    BudgetTooSmallError,
    MemchunkError,
    format_bytes,
)
from memchunk_prefect.core.estimates import (
    Estimates,
    FirstTouch,
    GpuLimit,
    Knowledge,
    ReadRange,
)
from memchunk_prefect.core.messages import (
    KILLED,
    MEMORY_ERROR,
    OK,
    RESTART,
    RESUME,
    Cancel,
    ChunkDeferred,
    ChunkDone,
    ChunkEnded,
    ChunkFailed,
    ChunkOutOfMemory,
    ClusterLost,
    Decided,
    DecisionRecord,
    Event,
    Fail,
    Finalize,
    FirstUseExpected,
    GpuContextLost,
    Instruction,
    MapSpec,
    MarkersRecovered,
    MarkRuns,
    PausesRead,
    ReadPauses,
    Record,
    RecoverMarkers,
    Rewarded,
    SlotsChanged,
    Start,
    Stop,
    Stopped,
    Submit,
    UpstreamWritten,
    WorkerDied,
    WorkerStands,
)
from memchunk_prefect.core.plan_queue import Gate, Pending, PlanQueue
from memchunk_prefect.core.plans import PROBE, RECHUNK, Plan, overhead_warning
from memchunk_prefect.core.probe import PROBE_SIZE_STEP, next_probe_scale, probe_budget, probe_plan
from memchunk_prefect.core.records import Observation, Pause, Prediction, Reward, first_use_bytes, paused_within
from memchunk_prefect.core.replan import bound_moved, remaining_boxes, replan_pays
from memchunk_prefect.core.settings import ITEMSIZE, PolicySettings
from memchunk_prefect.core.sharing import Sharing, choose_sharing, go_alone
from memchunk_prefect.core.standing import WorkerStanding

#: The machine's phases. ``failed``: a :class:`Fail` was issued and the executor is stopping.
NEW, RUNNING, FINISHED, FAILED, STOPPED = "new", "running", "finished", "failed", "stopped"


class MapStateError(RuntimeError):
    """An event the machine cannot take in its current state: a bug in the executor, not a user error."""


# =========================================================================== the machine


@dataclass
class MapMachine:
    """The control state of one chunked map. See the module docstring for the protocol."""

    spec: MapSpec
    knowledge: Knowledge
    phase: str = NEW
    slots: int = 0
    budget_bytes: int = 0  # what a plan must fit now: the cap, or the kill headroom less the workers' drift
    cap_bytes: int = 0  # Start.budget_bytes
    headroom_bytes: int | None = None  # Start.headroom_bytes
    gpu_budget_bytes: int | None = None  # Start.gpu_budget_bytes: on a GPU, the device's budget per task
    standing: WorkerStanding = field(default_factory=WorkerStanding)  # where each worker starts its tasks
    warm: bool = False  # the map's first plan came from history (no probe)
    surprised: bool = False  # a run of this map peaked past the bound it was submitted with (or had none)
    submitted_upper: dict[int, float] = field(default_factory=dict)  # each submission's upper bound, bytes
    # Each worker's high-water mark above its resting memory (Start.touched_bytes), raised by the peaks its runs
    # report; None: not read, so plans count nothing for growing the workers' memory.
    touched: dict[str, int] | None = None
    queue: PlanQueue = field(init=False)  # planned, not submitted (re-plannable)
    gate: Gate = field(init=False)  # which queued chunks the upstream has written enough of to run
    regions: list[Chunk] = field(default_factory=list)  # boxes still to plan (after probes, or a resume)
    in_flight: dict[int, Pending] = field(default_factory=dict)
    done: list[Chunk] = field(default_factory=list)
    planned_upper: float | None = None  # bound of the largest queued chunk when the queue was (re)planned
    planned_budget: int = 0  # the budget the queue was (re)planned for
    probe_scale: float = 0.0  # the last probe wave's blocks, as a share of the largest probe (0: none yet)
    probe_peak: int = 0  # the largest peak (bytes) a probe of the last wave measured
    probe_gpu_peak: int = 0  # on the GPU: the largest GPU peak (bytes) a probe of the last wave measured
    probe_smallest_read: int = 0  # elements (halo included) of the smallest block a probe of this map read
    region_reason: str = "after probing: "
    deaths: int = 0  # worker deaths seen (their task runs are settled at the end)
    gpu_restarts: int = 0  # workers restarted for a broken GPU context (GpuContextLost)
    restarted_workers: set[str] = field(default_factory=set)  # their addresses (a restarted one gets a new one)
    next_id: int = 0
    arm: ArmChoice | None = None  # the learned policy's arm, once the first real plan is made
    # Elements (halo included) of the largest block the safe arm's first plan reads: what the granularity arms'
    # plans are finer or coarser than, for every plan of the map (bandit.read_range).
    safe_read_elements: int | None = None
    arm_started: float | None = None  # first submission of a chunk planned under the arm
    arm_ended: float = 0.0  # last end of one
    arm_elements: int = 0  # output elements written under the arm
    # Seconds within the arm's time the map had nothing in flight and every queued chunk waited for the upstream
    # map's writes (a chained map): not the plan's doing, so not charged to its reward. upstream_wait_since: when
    # the current such wait began (None: not waiting).
    arm_upstream_wait: float = 0.0
    upstream_wait_since: float | None = None
    arm_chunks: int = 0
    arm_out_of_memory: int = 0
    probed: bool = False  # the map ran probes: its arm's plan was of a remainder, which teaches the policy nothing
    started_at: float = 0.0  # when the map started (Start.at)
    _check_replan: bool = False
    _summed: tuple[int, int] = (0, 0)  # (chunks of ``done`` summed, their elements): ``done`` only grows
    _slots_moved: tuple[int, int] | None = None  # (old, new) slots, until the next re-plan looks at them
    _overhead_warned: bool = False  # the many-chunks warning is said once a map, not at every re-plan
    sharing: Sharing = field(default_factory=Sharing)  # one task per thread, or one alone on each worker
    submitted_alone: set[int] = field(default_factory=set)  # submissions made while the map ran alone

    def __post_init__(self) -> None:
        self.queue = PlanQueue(self.spec)
        self.gate = Gate(self.spec)

    # ---------------------------------------------------------------- reading

    @property
    def finished(self) -> bool:
        """No more instructions will come from :meth:`advance` (finalized, failed or stopped)."""
        return self.phase in (FINISHED, FAILED, STOPPED)

    @property
    def settings(self) -> PolicySettings:
        return self.spec.settings

    @property
    def waiting_upstream(self) -> bool:
        """Nothing in flight and chunks queued that the upstream has not written enough of yet: the executor's
        next event can only be :class:`UpstreamWritten` (or a stop)."""
        return self.phase == RUNNING and not self.in_flight and bool(self.queue)

    def chunking(self) -> tuple[Chunk, ...]:
        """The chunking planned so far, what a map reading this one's output plans from: chunks written, in
        flight and queued, in submission order, then the boxes not planned yet (a cold start's probes leave the
        rest as boxes)."""
        return (*self.done, *(p.chunk for p in self.in_flight.values()), *(p.chunk for p in self.queue),
                *self.regions)

    @property
    def done_elements(self) -> int:
        """Output elements of the chunks done. Summed incrementally (``done`` is only appended to): a map of n
        chunks reports its progress n times, and summing the whole list each time made that O(n^2) -- 1.3 M chunk
        sizes computed for a map of 2,800 chunks."""
        counted, total = self._summed
        if counted > len(self.done):  # replaced by a shorter list: count afresh
            counted, total = 0, 0
        if counted != len(self.done):
            total += sum(c.elements for c in self.done[counted:])
            self._summed = (len(self.done), total)
        return total

    def predict(self, extents: Shape) -> Prediction:
        """What plans are fitted with: the model's prediction as the map's arm sees it (as is before one is chosen)."""
        pred = self.knowledge.predict(extents)
        return bandit.arm_view(pred, self.arm.arm) if self.arm is not None else pred

    def predict_gpu(self, extents: Shape) -> Prediction:
        """The GPU model's prediction as the map's arm sees it (the arm's risk applies to both budgets)."""
        pred = self.knowledge.predict_gpu(extents)
        return bandit.arm_view(pred, self.arm.arm) if self.arm is not None else pred

    @property
    def gpu_limit(self) -> GpuLimit | None:
        """The GPU budget plans fit besides the host's (None on the CPU)."""
        if self.gpu_budget_bytes is None:
            return None
        return GpuLimit(self.predict_gpu, self.gpu_budget_bytes)

    def _gpu_over(self, extents: Shape) -> str | None:
        """Why a block of ``extents`` does not fit the GPU budget, in words; None when it does (or on the CPU)."""
        limit = self.gpu_limit
        return limit.why_over(extents) if limit is not None else None

    def _read_range(self) -> ReadRange | None:
        """The block sizes the map's arm plans within (None: any)."""
        if self.arm is None or self.safe_read_elements is None:
            return None
        return bandit.read_range(self.arm.arm, self.safe_read_elements)

    # ---------------------------------------------------------------- events

    def handle(self, event: Event) -> list[Instruction]:
        """Take one event; return what to do about it (decisions of what to run next come from :meth:`advance`)."""
        handler = _HANDLERS.get(type(event))
        if handler is None:
            raise MapStateError(f"not a map event: {event!r}")
        return handler(self, event)

    def _on_start(self, ev: Start) -> list[Instruction]:
        if self.phase != NEW:
            raise MapStateError(f"Start in phase {self.phase}")
        self.phase = RUNNING
        self.started_at = ev.at
        self.slots, self.cap_bytes = int(ev.slots), int(ev.budget_bytes)
        self.headroom_bytes = None if ev.headroom_bytes is None else int(ev.headroom_bytes)
        self.standing.estimate = max(0, int(ev.drift_bytes))
        self.budget_bytes = self.planned_budget = self._budget()
        self.gpu_budget_bytes = None if ev.gpu_budget_bytes is None else int(ev.gpu_budget_bytes)
        self.touched = None if ev.touched_bytes is None else {str(a): int(b) for a, b in ev.touched_bytes.items()}
        self.sharing = Sharing(threads=max(1, int(ev.threads_per_worker)), alone_cap_bytes=ev.worker_budget_bytes,
                               threads_per_core=max(1.0, float(ev.threads_per_core)))
        out: list[Instruction] = []
        if ev.restarted:
            out.append(self._decided(RESTART, None, f"{self.spec.output_path} is replaced: {ev.restarted}", ev.at))
        if ev.completed:
            # Resume: keep every completed chunk (of whatever cut), plan only the boxes they leave.
            self.done.extend(ev.completed)
            out.append(RecoverMarkers(tuple(ev.completed)))
            self.regions = uncovered_boxes(self.spec.shape, ev.completed)
            self.region_reason = "the part a resumed output lacks: "
            left = f"{len(self.regions)} boxes left to compute" if self.regions else "nothing left"
            out.append(self._decided(RESUME, None, f"resuming {self.spec.output_path}: {len(ev.completed)} chunks "
                                                   f"already written; {left}", ev.at))
            return out
        def decide() -> policy.Decision:
            return policy.decide(self.spec.shape, self.spec.incoming, budget_bytes=self.budget_bytes,
                                 estimates=self._estimates(), halo=self.spec.halo, slots=self.slots,
                                 whole_traces=self.spec.whole_traces, itemsize=ITEMSIZE, settings=self.settings,
                                 read_range=self._read_range())

        try:
            choose_sharing(self, decide)
            d = choose_arm(self, decide) if not probes(decide) else decide()
        except MemchunkError as exc:
            return out + self._fail(exc)
        out.append(self._decided(d.decision, d.plan, self._alone_words() + d.reason, ev.at))
        self.warm = not d.plan.probe
        self.queue.extend(Pending(c, d.decision, armed=self.arm is not None) for c in d.plan.chunks)
        self.regions.extend(d.plan.remainder)
        if d.plan.probe:
            self.probe_smallest_read = self._smallest_read(d.plan.chunks)
        self.planned_upper = d.plan.upper_bound_bytes
        return out

    def _on_done(self, ev: ChunkDone) -> list[Instruction]:
        upper = self.submitted_upper.pop(ev.id, None)
        own = int(ev.observation.peak_bytes) - first_use_bytes(ev.observation)
        if upper is None or own > upper:
            self.surprised = True  # a run the model had no bound for, or one past its bound
        item = self._take(ev.id)
        self.done.append(item.chunk)
        self._check_replan = True
        self.standing.follow(ev.observation)
        self.budget_bytes = self._budget()
        if self.touched is not None and ev.observation.worker:
            w = ev.observation.worker
            self.touched[w] = max(self.touched.get(w, 0), int(ev.observation.peak_bytes))
        if item.decision == PROBE:
            # The block's own peak: what a first use left held is the worker's, and the budget already follows it.
            self.probe_peak = max(self.probe_peak, int(ev.observation.peak_bytes) - first_use_bytes(ev.observation))
            self.probe_gpu_peak = max(self.probe_gpu_peak, int(ev.observation.gpu_peak_bytes or 0))
        return [Record(ev.observation), self._ended(ev.id, item, OK, ev.observation, ev.at)]

    def _alone_words(self) -> str:
        """Why the map runs alone, said once (in the first decision after it began to)."""
        words, self.sharing.reason = self.sharing.reason, ""
        return words

    def _budget(self) -> int:
        """What a plan must fit now (bytes): the cap, or the kill headroom less the workers' standing above the
        resting memory read at the start, if smaller (:mod:`memchunk_prefect.core.standing`); a user's smaller
        cap on the task's own use is unaffected by it."""
        if self.headroom_bytes is None:
            return self.cap_bytes
        return max(1, min(self.cap_bytes, self.headroom_bytes - self.standing.worst()))

    def _on_worker_stands(self, ev: WorkerStands) -> list[Instruction]:
        """Another map's run says where a worker stands: the budget follows at once, and the queue is looked at
        again before the next submission (a re-plan when the budget moved enough)."""
        self.standing.heard(ev.worker, int(ev.above_bytes), ev.source)
        self.budget_bytes = self._budget()
        self._check_replan = True
        return []

    def _on_first_use_expected(self, ev: FirstUseExpected) -> list[Instruction]:
        """Another map's first use is still to come on a worker: the budget keeps room for it from now on."""
        self.standing.expect(ev.worker, ev.source, int(ev.nbytes))
        self.budget_bytes = self._budget()
        self._check_replan = True
        return []

    def _on_failed(self, ev: ChunkFailed) -> list[Instruction]:
        self._get(ev.id)  # stays in flight: Stop settles its task run
        return self._fail(ev.error)

    def _on_pauses(self, ev: PausesRead) -> list[Instruction]:
        if self.phase != FINISHED:
            raise MapStateError(f"PausesRead in phase {self.phase}")
        return self._rewarded(ev.pauses)

    def _on_slots(self, ev: SlotsChanged) -> list[Instruction]:
        new = int(ev.slots)
        if self.sharing.alone:
            new = self.sharing.slots_alone(new)
        if self.phase != RUNNING or new < 1 or new == self.slots:
            return []
        old = self._slots_moved[0] if self._slots_moved else self.slots
        self.slots, self._slots_moved, self._check_replan = new, (old, new), True
        return []

    def _on_upstream(self, ev: UpstreamWritten) -> list[Instruction]:
        self.gate.add(ev.chunks, ev.complete)
        return []

    def _on_markers(self, ev: MarkersRecovered) -> list[Instruction]:
        return [Record(o) for o in ev.observations if o.operator_key == self.spec.operator_key]

    def _on_stop(self, ev: Stop) -> list[Instruction]:
        """Keep what finished, cancel what did not, leave no task run RUNNING; never finalize."""
        if self.phase == STOPPED:
            return []
        self.phase = STOPPED
        out: list[Instruction] = []
        kept = 0
        for sid, obs in ev.finished:
            item = self.in_flight.pop(sid, None)
            if item is None:
                continue
            self.done.append(item.chunk)
            kept += 1
            out += [Record(obs), self._ended(sid, item, OK, obs, ev.at)]
        rest = list(self.in_flight.items())
        self.in_flight.clear()
        if rest:
            state = "Cancelled" if ev.interrupted else "Crashed"
            why = ("the flow run was interrupted or cancelled" if ev.interrupted
                   else f"the chunked map stopped ({ev.error})")
            out.append(Cancel(tuple(sid for sid, _ in rest)))
            out.append(MarkRuns(tuple(
                (sid, state, f"{why} before {self.spec.name(item.chunk)} finished; the chunk is not marked written "
                             "and is computed when the flow runs again") for sid, item in rest), look_again=True))
            # Chunks that finished on their worker after the last result was taken: keep their measurements too.
            out.append(RecoverMarkers(tuple(item.chunk for _, item in rest)))
        out.append(Stopped(ev.error, kept=kept))
        return out

    # ---------------------------------------------------------------- deciding what runs next

    def advance(self, at: float = 0.0) -> list[Instruction]:
        """What to run next: re-plan the remainder if the bound moved, submit up to the cap, plan what is left.

        Returns :class:`Finalize` once every box is written.
        """
        if self.phase != RUNNING:
            return []
        out: list[Instruction] = []
        try:
            if self._check_replan:
                self._check_replan = False
                out += self._maybe_replan(at)
            while True:
                cap = self.sharing.in_flight_cap(self.slots, self.settings.in_flight_cap(self.slots))
                while self.queue and len(self.in_flight) < cap:
                    item = self.queue.popleft() if self.gate.open else self.queue.pop_first(self.gate)
                    if item is None:
                        break  # the rest waits for the upstream map's writes
                    out.append(self._submit(item, at))
                if self.in_flight or self.queue:
                    if self.waiting_upstream and self.arm_started is not None and self.upstream_wait_since is None:
                        self.upstream_wait_since = at
                    return out
                if not self.regions:
                    self.phase = FINISHED
                    # The reward follows the finalize (a map whose output does not finalize teaches nothing), once
                    # the workers' pauses over the map are read (PausesRead).
                    return out + [Finalize(settle_runs=self.deaths > 0), ReadPauses(self.started_at, at)]
                out += self._plan_regions(at)
        except MemchunkError as exc:  # a plan that cannot fit the budget
            return out + self._fail(exc)

    def _plan_regions(self, at: float) -> list[Instruction]:
        """The probes are back (nothing in flight): plan every box left at once, or probe again.

        Planning every box at once keeps slots busy (no slot waits for a small box).
        While the history is too short, the next probe wave is sized by :meth:`_next_probe_scale`.
        """
        out: list[Instruction] = []
        pending, self.regions = self.regions, []
        # The boxes run side by side: the largest is planned for every slot, each other one for a slot of its own
        # (a sliver a probe wave left is one chunk, not one per slot).
        largest = max(pending, key=lambda c: c.elements) if pending else None
        slots: list[int | None] = [None if r is largest else 1 for r in pending]  # None: the map's slots
        chosen: list[Plan] | None = None  # the first real plans, made under the arm chosen for them
        if self.arm is None and pending and not probes(lambda: self._plan(pending[0], slots[0])):
            choose_sharing(self, lambda: [self._plan(r, n) for r, n in zip(pending, slots)])
            chosen = choose_arm(self, lambda: [self._plan(r, n) for r, n in zip(pending, slots)])
        for index, region in enumerate(pending):
            p = chosen[index] if chosen is not None else self._plan(region, slots[index])
            if p.probe:
                self.probe_scale = self._next_probe_scale()
                region, p = self._next_probe_wave(pending[index:], p.probe_reason)
                self.probe_peak = self.probe_gpu_peak = 0
                reads = [r for r in (self.probe_smallest_read, self._smallest_read(p.chunks)) if r]
                self.probe_smallest_read = min(reads, default=0)
                out.append(self._decided(PROBE, p, p.reason, at, region=region.key()))
                self.queue.extend(Pending(c, p.decision) for c in p.chunks)
                self.regions = list(p.remainder) + [r for r in pending[index:] if r is not region]
                break
            out.append(self._decided(RECHUNK, p, self._alone_words() + self.region_reason + p.reason, at,
                                     region=region.key()))
            self.queue.extend(Pending(c, p.decision, armed=self.arm is not None) for c in p.chunks)
        if not self.regions:
            self.planned_upper = self.queue_bound()
            self.planned_budget = self.budget_bytes
        return out

    def _next_probe_wave(self, boxes: list[Chunk], reason: str) -> tuple[Chunk, Plan]:
        """Where the next probe wave goes, and the wave: a box left that it takes whole, else the largest box.

        A box a wave takes whole is a sliver the last wave left (the rest of the first iline, where one iline
        across every xline was more than a probe may read). Taken now, it is work that had to be done anyway, in
        pieces a sliver is cut into anyway; left for after the probes, it is one more thin chunk whose halo is
        most of what it reads, and the largest box gives up a strip to a wave of small, halo-heavy probes (on a
        128 x 128 x 400 survey, gst3d_dip's halo of 12 traces each side made a 1 x 84-trace sliver read 13 x 96
        traces, 15x its output, and the second wave's 16 x 64-trace probes 2.2x). Taken only where its largest
        probe reads at least ``PROBE_SIZE_STEP`` x the smallest any probe of the map read (what a second wave is
        for: sizes that far apart separate a slope from a fixed overhead) and at least ``1 / PROBE_SIZE_STEP`` of
        what the wave's largest probe reads in the largest box (the size the last wave's peaks let it grow to):
        a sliver of one iline, most of it halo, can read little more than the last wave's probes did, and the
        model would then plan from sizes too close to tell a slope from a fixed part (on the same survey,
        ``python benchmarks/studies/cold_start.py`` reads gst3d_dip's cold map in 11 chunks with this test, 12-13
        without it). Else the wave goes into the largest box, sized by what the last wave measured (and so is a
        map's first wave here, after a resume).
        """

        def wave(box: Chunk) -> Plan:
            return probe_plan(self.spec.shape, budget_bytes=probe_budget(self.budget_bytes,
                                                                                       self.gpu_limit),
                                     halo=self.spec.halo, slots=self.slots, whole_traces=self.spec.whole_traces,
                                     region=box, itemsize=ITEMSIZE, settings=self.settings, scale=self.probe_scale,
                                     reason=reason, others_left=len(boxes) > 1)

        largest = max(boxes, key=lambda c: c.elements)
        in_largest = wave(largest)
        # A sliver teaches what the wave is for only where its probes read about what the wave's would in the largest
        # box (its scale's size): a halo-heavy operator's sliver reads little more than the last wave's probes did.
        wanted = self._largest_read(in_largest.chunks) / PROBE_SIZE_STEP
        for box in boxes:
            if box is largest:
                continue
            p = wave(box)
            read = self._largest_read(p.chunks)
            if (self.probe_smallest_read and not p.remainder and read >= PROBE_SIZE_STEP * self.probe_smallest_read
                    and read >= wanted):
                return box, p
        return largest, in_largest

    def _largest_read(self, chunks: Iterable[Chunk]) -> int:
        """Elements (halo included) of the largest block these chunks read."""
        return max((math.prod(self.spec.read_extents(c)) for c in chunks), default=0)

    def _smallest_read(self, chunks: Iterable[Chunk]) -> int:
        """Elements (halo included) of the smallest block these chunks read."""
        return min((math.prod(self.spec.read_extents(c)) for c in chunks), default=0)

    def _next_probe_scale(self) -> float:
        """The next probe wave's size (:func:`memchunk_prefect.core.probe.next_probe_scale`)."""
        return next_probe_scale(self.probe_scale or self.settings.probe_first_share, self.budget_bytes,
                                self.probe_peak, self.gpu_budget_bytes, self.probe_gpu_peak, self.settings)

    def _maybe_replan(self, at: float) -> list[Instruction]:
        """Mid-map: when the bound for what is queued moved enough, or the cluster's slots changed
        (:class:`SlotsChanged`), re-plan the unsubmitted remainder.

        Like is compared with like: the bound of the largest queued chunk now,
        against the same figure when the queue was (re)planned. Never while split
        pieces wait (they are sized by a measured failure, not by the model). A
        box's new plan replaces its queued chunks only when those no longer fit the
        budget, or when its estimated time is shorter by ``settings.replan_gain``:
        a bound that wanders within a plan's slack changes nothing, and a re-plan
        is never undone by the next observation. A map planned from history (not a
        cold start's probes) re-plans on a moved bound only once one of its runs
        peaked past the bound it was submitted with: the same survey and store then
        run the same plan unless the model was wrong about this one.
        """
        slots_moved, self._slots_moved = self._slots_moved, None
        if not self.queue or self.planned_upper is None or self.queue.has_split_pieces:
            return []
        new_upper = self.queue_bound()
        if new_upper is None:
            return []
        if bound_moved(self.planned_upper, new_upper, self.settings) and (
                self.surprised or not self.warm or new_upper > self.budget_bytes):
            # A map planned from history re-plans on its model only once a run fell outside its bound, or when
            # the queued chunks no longer fit: a bound that moves while every run stays inside it is the model
            # refining what the plan already allows.
            what = f"the upper bound moved from {format_bytes(self.planned_upper)} to {format_bytes(new_upper)}"
        elif bound_moved(self.planned_budget, self.budget_bytes, self.settings):
            what = (f"the budget moved from {format_bytes(self.planned_budget)} to {format_bytes(self.budget_bytes)} "
                    f"(the workers start tasks {format_bytes(self.standing.worst())} above the "
                    "resting memory read at the map's start)")
        elif new_upper > self.budget_bytes:
            what = (f"the largest queued chunk's bound, {format_bytes(new_upper)}, is over the budget "
                    f"{format_bytes(self.budget_bytes)}")
        elif slots_moved is not None:
            what = f"the cluster's slots went from {slots_moved[0]} to {slots_moved[1]}"
        elif (largest := self.queue.largest_read()) is not None and (gpu_over := self._gpu_over(largest)):
            what = f"the GPU model now puts the largest queued chunk at {gpu_over}"
        else:
            return []
        boxes, kept = remaining_boxes([q.chunk for q in self.queue])
        keep = set(kept)
        queue = [q for q in self.queue if q.chunk in keep]
        out: list[Instruction] = []
        for box in boxes:
            p = self._plan(box)
            queued = [q for q in self.queue if box.contains(q.chunk)]
            why = None if p.probe else self._replan_pays(queued, p)  # a probe cannot happen once ready
            if why is None:  # keep the queued cut
                queue.extend(dataclasses.replace(q, decision=RECHUNK) for q in queued)
                continue
            out.append(self._decided(RECHUNK, p, f"mid-map re-plan: {what}; {why}; " + p.reason, at,
                                     region=box.key()))
            queue.extend(Pending(c, RECHUNK, armed=self.arm is not None) for c in p.chunks)
        self.queue = PlanQueue(self.spec, queue)
        self.planned_upper = self.queue_bound()
        self.planned_budget = self.budget_bytes
        return out

    def _replan_pays(self, queued: list[Pending], new: Plan) -> str | None:
        """Why ``new`` should replace the ``queued`` chunks of its box (:func:`.replan.replan_pays`)."""
        largest = max(queued, key=lambda q: math.prod(self.spec.read_extents(q.chunk))).chunk
        return replan_pays(len(queued), largest.shape, self.spec.read_extents(largest), new,
                           budget_bytes=self.budget_bytes, estimates=self._estimates(), slots=self.slots,
                           settings=self.settings)

    def queue_bound(self) -> float | None:
        """The model's upper bound (bytes) for the largest block a queued chunk reads; None while not ready."""
        largest = self.queue.largest_read()
        if largest is None:
            return None
        pred = self.predict(largest)
        return float(pred.upper_bytes) if pred.ready else None

    # ---------------------------------------------------------------- helpers

    def _plan(self, region: Chunk, slots: int | None = None) -> Plan:
        """The plan of ``region`` for ``slots`` (None: the map's); where nothing fits a thread's share of a
        worker, the map runs alone on each worker from now on and plans for that (:func:`.sharing.go_alone`)."""
        def make() -> Plan:
            return policy.plan(self.spec.shape, budget_bytes=self.budget_bytes, estimates=self._estimates(),
                               halo=self.spec.halo, slots=self.slots if slots is None else slots,
                               whole_traces=self.spec.whole_traces, region=region, itemsize=ITEMSIZE,
                               settings=self.settings, read_range=self._read_range())
        try:
            p = make()
        except BudgetTooSmallError:
            if self.gpu_budget_bytes is not None or not self.sharing.may_go_alone(self.cap_bytes):
                raise
            go_alone(self, "even the smallest chunk does not fit a thread's share of its worker")
            return make()
        if p.probe and self.gpu_budget_bytes is None and self.sharing.may_go_alone(self.cap_bytes) \
                and self.predict(self.spec.read_extents(region)).ready:
            # A probe from a model that is ready: its bound for the smallest chunk is over a thread's share.
            go_alone(self, "the model's bound for the smallest chunk is over a thread's share of its worker")
            return make()
        return p

    def _estimates(self) -> Estimates:
        """What the planner asks of the operator's learned models now."""
        k = self.knowledge
        return Estimates(predict=self.predict, seconds_per_element=k.seconds_per_element(), seconds_for=k.seconds_for,
                         joules_for=k.joules_for, first_touch=self._first_touch(), gpu=self.gpu_limit,
                         cores=self.sharing.cores(self.slots))

    def _first_touch(self) -> FirstTouch | None:
        """What growing the workers' memory past their high-water marks costs a plan now: the least touched
        worker's mark and the operator's learned kernel seconds per byte (None where either is unknown)."""
        if not self.touched:
            return None
        spb = self.knowledge.touch_seconds_per_byte()
        return None if spb is None else FirstTouch(min(self.touched.values()), spb)

    def _upper_for(self, chunk: Chunk) -> float | None:
        """Upper bound for the block this chunk reads (its halo clipped at the volume's edges); None while not ready."""
        pred = self.predict(self.spec.read_extents(chunk))
        return float(pred.upper_bytes) if pred.ready else None

    def _submit(self, item: Pending, at: float) -> Submit:
        sid = self.next_id
        self.next_id += 1
        self.in_flight[sid] = item
        if item.armed and self.arm_started is None:
            self.arm_started = at
        if self.upstream_wait_since is not None:  # the upstream wrote what this chunk reads: the wait is over
            self.arm_upstream_wait += max(0.0, at - self.upstream_wait_since)
            self.upstream_wait_since = None
        extents = self.spec.read_extents(item.chunk)
        pred = self.predict(extents)
        mean, upper = (float(pred.mean_bytes), float(pred.upper_bytes)) if pred.ready else (None, None)
        if upper is not None:
            self.submitted_upper[sid] = upper
        if self.sharing.alone:
            self.submitted_alone.add(sid)
        return Submit(sid, item.chunk, item.decision, item.attempt, self.spec.label(item.chunk), extents,
                      mean, upper, at,
                      per_worker=self.sharing.per_worker_of(item.decision == PROBE and self.gpu_budget_bytes is None),
                      check_room=item.deferred < losses.DEFERRALS)

    def _get(self, sid: int) -> Pending:
        if self.phase not in (RUNNING, FAILED):
            raise MapStateError(f"a chunk event in phase {self.phase}")
        try:
            return self.in_flight[sid]
        except KeyError:
            raise MapStateError(f"submission {sid} is not in flight") from None

    def _take(self, sid: int) -> Pending:
        item = self._get(sid)
        del self.in_flight[sid]
        return item

    def _fail(self, error: BaseException) -> list[Instruction]:
        self.phase = FAILED
        return [Fail(error)]

    def _decided(self, decision: str, plan: Plan | None, reason: str, at: float, **where: str) -> Decided:
        self.probed = self.probed or decision == PROBE
        arm = self.arm.arm if self.arm is not None and plan is not None and not plan.probe else None
        if arm is not None and self.arm is not None:
            reason = f"{reason} [{self.arm.describe()}]"
        return Decided(DecisionRecord(
            decision=decision, reason=reason, operator=self.spec.operator, operator_key=self.spec.operator_key,
            n_chunks=plan.n_chunks if plan else None, chunk_shape=tuple(plan.chunk_shape) if plan else None,  # type: ignore[arg-type]
            predicted_peak_bytes=plan.predicted_peak_bytes if plan else None,
            upper_bound_bytes=plan.upper_bound_bytes if plan else None, at=at, arm=arm,
            warning=self._overhead_warning(plan) if plan is not None and not plan.probe else None, **where))

    def _overhead_warning(self, plan: Plan) -> str | None:
        """:func:`memchunk_prefect.core.plans.overhead_warning`, said once a map."""
        if self._overhead_warned:
            return None
        warning = overhead_warning(plan, self.slots, self.budget_bytes, self.settings)
        self._overhead_warned = warning is not None
        return warning

    def _rewarded(self, pauses: tuple[Pause, ...] = ()) -> list[Instruction]:
        """What the arm's plan earned, once every chunk is written (nothing without an arm or a measured rate).

        ``pauses``: the workers' pauses over the map; those within the plan's time count against it.
        """
        spe = self.knowledge.seconds_per_element()
        # The plan's time: from its first submission to its last end, less the waits for an upstream map's writes.
        wall = self.arm_ended - self.arm_started - self.arm_upstream_wait if self.arm_started is not None else 0.0
        if (self.arm is None or self.arm_started is None or not self.arm_elements or spe is None or wall <= 0
                or self.probed):
            return []  # no arm, nothing written under it, no measured rate, no time measured, or a remainder's plan
        n_paused, paused = paused_within(pauses, self.arm_started, self.arm_ended)
        value, efficiency = bandit.reward_of(self.arm_elements, spe, self.slots, wall,
                                             self.arm_out_of_memory, self.settings.oom_penalty, paused)
        return [Rewarded(Reward(self.spec.operator_key, self.arm.arm, self.arm.arms, value, efficiency,
                                self.arm_elements, wall, self.slots,
                                out_of_memory=self.arm_out_of_memory, n_chunks=self.arm_chunks, pauses=n_paused,
                                paused_seconds=paused, created_at=self.arm_ended))]

    def _ended(self, sid: int, item: Pending, outcome: str, obs: Observation | None, at: float, *,
               kept: bool = False) -> ChunkEnded:
        if item.armed:
            self.arm_ended = max(self.arm_ended, at)
            if outcome == OK or kept:
                self.arm_elements += item.chunk.elements
                self.arm_chunks += 1
            elif outcome in (MEMORY_ERROR, KILLED):
                self.arm_out_of_memory += 1
        return ChunkEnded(sid, item.chunk, outcome, item.decision, obs, kept, len(self.done), self.done_elements, at,
                          queued_chunks=len(self.in_flight) + len(self.queue))

    def _flow_observation(self, item: Pending, outcome: str, peak_bytes: int | None, at: float) -> Observation:
        """The record of a run its worker could not report (it died, or sent nothing): from what the flow knows."""
        read, _ = with_halo(item.chunk, self.spec.halo, self.spec.shape)
        return Observation(operator_key=self.spec.operator_key, elements=read.elements, extents=read.shape,
                           bytes_in=read.elements * ITEMSIZE, peak_bytes=int(peak_bytes or 0), outcome=outcome,
                           censored=outcome in (MEMORY_ERROR, KILLED) and bool(peak_bytes),
                           chunk=item.chunk.key(), budget_bytes=self.budget_bytes, method="flow", created_at=at,
                           gpu_budget_bytes=self.gpu_budget_bytes)


_HANDLERS: dict[type, Any] = {
    Start: MapMachine._on_start,
    ChunkDone: MapMachine._on_done,
    ChunkOutOfMemory: losses.out_of_memory,
    ChunkFailed: MapMachine._on_failed,
    WorkerDied: losses.worker_died,
    GpuContextLost: losses.gpu_context_lost,
    ClusterLost: losses.cluster_lost,
    ChunkDeferred: losses.chunk_deferred,
    MarkersRecovered: MapMachine._on_markers,
    Stop: MapMachine._on_stop,
    PausesRead: MapMachine._on_pauses,
    SlotsChanged: MapMachine._on_slots,
    UpstreamWritten: MapMachine._on_upstream,
    WorkerStands: MapMachine._on_worker_stands,
    FirstUseExpected: MapMachine._on_first_use_expected,
}

__all__ = ["MapMachine", "MapStateError"]
