"""A cluster simulated as discrete events: worker slots, the nanny's kill line, restarts, batch jobs' queue waits
and walltimes, and each worker's high-water mark.

Tasks are submitted with their drawn memory and seconds; :meth:`SimulatedCluster.next` advances the clock to
the next task that ends (done, killed for memory, or lost with its job) and says which. Units: bytes, seconds
(simulated, from 0).
"""

from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass

import numpy as np

from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.errors import SimulationInputError
from memchunk_prefect.sim.inputs import ClusterShape, _Task

# Kinds of event, in the order events at the same time are handled: a task ends, a worker comes (back), a
# worker leaves at its walltime. How a task ends: done, killed with its worker, lost with a worker that left.
_END, _COME, _LEAVE = 0, 1, 2
_DONE, _KILLED, _LOST = 0, 1, 2

#: When a task whose memory rise is unknown reaches half and 90% of its peak, shares of its run: evenly to its
#: peak half way through.
EVEN_RISE = (0.25, 0.45)


def kill_share(reach: float, rise: tuple[float, float] | None) -> float:
    """The share of a task's run after which its memory reaches ``reach`` (0-1) of its peak: through the times it
    reaches half and 90% of it (``rise``, shares of its run; :meth:`memchunk_prefect.learn.memory.MemoryModel.rise`)
    on straight lines, on past 90% at the same pace (never beyond its end). Unknown (None), it rises evenly to its
    peak half way through (:data:`EVEN_RISE`).

    >>> kill_share(0.5, None), kill_share(1.0, None), kill_share(0.25, (0.1, 0.8)), kill_share(1.0, (0.1, 0.8))
    (0.25, 0.5, 0.05, 0.975)
    """
    half, most = rise if rise is not None else EVEN_RISE
    reach = min(1.0, max(0.0, reach))
    if reach <= 0.5:
        return half * reach / 0.5
    if reach <= 0.9:
        return half + (most - half) * (reach - 0.5) / 0.4
    return min(1.0, most + (most - half) * (reach - 0.9) / 0.4)


#: The pseudo-task :meth:`SimulatedCluster.next` returns when a worker comes (back) and tasks wait for it.
_WAKE = _Task(-1, Chunk((0, 0, 0), (1, 1, 1)), (1, 1, 1), 0, 0.0, key=-1)


@dataclass
class _Ended:
    task: _Task
    at: float
    killed: bool
    lost: bool = False  # its worker left at walltime (not killed: nothing to learn about memory)


def _work_share(task: _Task) -> float:
    """The share of a task's seconds that is work, not its per-task overhead as it ran (1 where it has none)."""
    if task.seconds <= 0:
        return 1.0
    return max(0.0, task.seconds - task.overhead_seconds * task.overhead_share) / task.seconds


class SimulatedCluster:
    """Worker slots running tasks first come, first served; a worker whose tasks cross its kill line dies.

    A task's memory rises to its peak as its operator's learned runs did (:func:`kill_share`: through the shares of
    its run at which it reached half and 90% of its peak, evenly to its peak half way where none were timed): a
    worker is killed when the tasks running on it together need more than its headroom, at the moment the newest
    of them crosses the kill line on that rise (a task needing just over what is left dies about when it peaks;
    one needing 10x what is left early in its rise, as a whole survey tried by split-on-failure does; every task
    on it then ends killed; no task is placed on a worker due to die), and is back after ``restart_seconds``.
    Each placed task gets its own key, so the events of one map never end another
    map's task that reuses a submission id. A task that takes its worker above the
    most it has held (``marks``: the most its tasks together held since the worker
    started, 0 for a fresh or restarted one) runs longer by that growth at its
    operator's learned kernel seconds per byte (``_Task.touch_seconds_per_byte``),
    as a real worker faults that memory in. A task of an operator no task of which has ended on its worker process
    yet runs longer by its operator's first call (``_Task.first_call_seconds``: a library imported, a
    kernel compiled), as a real worker's first call does (``Observation.first_call``); where first calls of about
    its block's size were timed, it takes what they took, which may be less than the model reads a later call
    (:meth:`~memchunk_prefect.sim.inputs.Draws.task`). Where the threads
    outnumber the CPU cores (``ClusterShape.threads_per_core``), a task that starts while more work runs than
    there are cores works as much longer, and its per-task overhead takes as much longer as the tasks running
    outnumber the cores (:meth:`_core_shares`): the learned seconds are those of a task with a
    core to itself.
    A task goes to the free worker running the fewest
    tasks, the lowest number among equals, as Dask's scheduler hands a queued task to the least
    occupied idle worker (``decide_worker_rootish_queuing_enabled`` in distributed's scheduler), so
    two tasks on two idle workers of two threads each run one per worker (kept in a heap: O(log
    workers) per placement); one of a map that runs alone (``_Task.per_worker``) to the least
    occupied worker running fewer tasks than that.

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
        self._starting: list[tuple[_Task, float | None]] = []  # placed now, not yet timed; the share of its run
        # after which it takes its worker over the kill line (None: it does not)
        self._keys = 0
        self._seq = 0
        self.busy_slot_seconds = 0.0
        self.busy_joules = 0.0
        self.lost_worker_seconds = 0.0
        self.peak_bytes: dict[int, int] = {w: 0 for w in range(shape.workers)}
        self.marks: dict[int, int] = {w: 0 for w in range(shape.workers)}  # each worker process's high-water mark
        self.called: dict[int, set[str]] = {w: set() for w in range(shape.workers)}  # operators ended on each
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
        # Heap of (tasks running, worker) for workers that may have a free slot, checked when taken; _offered:
        # the running count each worker was last pushed with (an entry with another count is stale).
        self._ready: list[tuple[int, int]] = []
        self._offered: dict[int, int] = {}
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
        self._settle()
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
        n = len(self.running[w])
        if self._offered.get(w) != n:
            self._offered[w] = n
            heapq.heappush(self._ready, (n, w))

    def _free_worker(self) -> int | None:
        # Every available worker is in the heap under its running count (offered when it joins, comes back, or a
        # task starts or ends on it); a stale entry is dropped, and one not available when it reaches the top is
        # dropped until it is offered again.
        while self._ready:
            n, w = self._ready[0]
            if self._offered.get(w) == n and self._available(w):
                return w
            heapq.heappop(self._ready)
            if self._offered.get(w) == n:
                del self._offered[w]
        return None

    def _free_worker_below(self, limit: int) -> int | None:
        """The free worker running the fewest tasks, below ``limit`` (a map that runs alone on each worker:
        :mod:`memchunk_prefect.core.sharing`), the lowest number among equals; O(workers)."""
        return min((w for w in self._offered if self._available(w) and len(self.running[w]) < limit),
                   key=lambda w: (len(self.running[w]), w), default=None)

    def _dispatch(self) -> None:
        while self.pending:
            limit = self.pending[0].per_worker
            w = self._free_worker() if not limit else self._free_worker_below(limit)
            if w is None:
                return
            task = self.pending.pop(0)
            self._keys += 1
            task.key, task.started, task.worker = self._keys, self.now, w
            self.running[w].append(task)
            self._offer(w)  # under its new running count: the next task goes to a less occupied worker first
            self._live[task.key] = task
            load = sum(t.memory for t in self.running[w])
            self.peak_bytes[w] = max(self.peak_bytes[w], load)
            headroom = self.shape.headroom_bytes
            dies_after = None
            if load > headroom:  # its memory, rising to its peak as its operator's does, crosses the kill line then
                dies_after = kill_share(max(0.0, headroom - (load - task.memory)) / max(task.memory, 1), task.rise)
            task.first_call = task.operator_key not in self.called[w]
            extra = task.first_call_seconds if task.first_call else 0.0
            if load > self.marks[w]:  # (a task that dies gets through the same share of this growth)
                task.grew_bytes = load - self.marks[w]
                task.touch_seconds = task.grew_bytes * task.touch_seconds_per_byte
                extra += task.touch_seconds
                self.marks[w] = load
            if extra != 0 and task.seconds > 0:  # busy longer (or, a first call faster than the model, shorter)
                task.joules *= (task.seconds + extra) / task.seconds  # at the same power
            task.seconds += extra
            if dies_after is not None:
                self.dies_at[w] = math.inf  # due to die: nothing more lands on it (when: once its tasks are timed)
            self._starting.append((task, dies_after))

    def _settle(self) -> None:
        """Time the tasks started at this instant, and their worker's death where one took it over its kill line:
        once every task starting now is placed, so a wave of them shares the cores as one (:meth:`_core_shares`)."""
        if not self._starting:
            return
        share, crowd = self._core_shares()
        starting, self._starting = self._starting, []
        for task, dies_after in starting:
            if task.key not in self._live:  # ended already (its worker left at this instant)
                continue
            overhead = min(task.overhead_seconds, task.seconds)
            task.seconds = overhead * crowd + (task.seconds - overhead) * share
            task.share, task.overhead_share = share, crowd
            if dies_after is not None:
                # The worker dies when the newest task reaches the kill line; everything on it dies with it.
                w = task.worker
                die = self.now + dies_after * task.seconds
                self.dies_at[w] = die
                for t in self.running[w]:
                    end = t.started + t.seconds
                    self._push(min(die, end), _END, t.key, _KILLED if end > die else _DONE)
            else:
                self._push(self.now + task.seconds, _END, task.key, _DONE)

    def _core_shares(self) -> tuple[float, float]:
        """How much longer a task just started takes because the tasks running now outnumber the CPU cores the
        cluster's threads share (``ClusterShape.threads_per_core``; both 1 where each thread has a core): the
        factor on its work, and the factor on its per-task overhead. Read as the task starts, for the tasks running
        then (a wave of equal tasks starts together; a task that starts as others end is charged what it starts
        with).

        Its work takes as much longer as the work running outnumbers the cores: 4 tasks working on 2 cores each
        take twice their work's time. Each running task counts by the share of its seconds that is work
        (:func:`_work_share`), so tasks of a plain flow that are mostly Prefect's and Dask's hand-over leave the
        cores to the work of the others. Its overhead takes as much longer as the tasks running outnumber the
        cores, counted whole: the flow's process and the server serve the tasks in flight in turn, on the same
        cores (a plain flow's step of tasks that return at once takes as long on two workers of two threads over 2
        cores as on two of one thread).

        Counted as whole tasks, the work of the workload family's flows of 8 and 32 slabs a step on two workers of
        two threads over 2 cores reads twice as long as it runs: ``python -m benchmarks.sim_noise`` finds such
        flows predicted 25-38% long in two validation runs of three (CHANGELOG.md)."""
        per_core = float(self.shape.threads_per_core)
        if per_core <= 1.0:
            return 1.0, 1.0
        work = sum(_work_share(t) for t in self._live.values())
        return (max(1.0, work * per_core / self.shape.slots),
                max(1.0, len(self._live) * per_core / self.shape.slots))

    def _push(self, at: float, kind: int, ident: int, how: int = _DONE) -> None:
        self._seq += 1
        heapq.heappush(self._events, (at, kind, self._seq, ident, how))

    @property
    def idle(self) -> bool:
        """Nothing runs and nothing waits (a pending restart alone does not count)."""
        return not self._live and not self.pending

    def next(self) -> _Ended:
        """Advance to the next task end (or to a worker's arrival or return, when tasks wait for it)."""
        ended = self.next_before(math.inf)
        assert ended is not None
        return ended

    def next_before(self, until: float) -> _Ended | None:
        """:meth:`next`, or None when nothing happens before ``until`` (the clock is then at ``until``: the flow
        calls its next map then)."""
        self._settle()
        while self._events:
            if self._events[0][0] > until:
                self.now = max(self.now, until)
                return None
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
                    self.marks[w] = 0  # the nanny starts a new process: it has held nothing, called nothing
                    self.called[w] = set()
                    self.away_until[w] = self.now + self.shape.restart_seconds
                    self._push(self.away_until[w], _COME, w)  # back then
            elif how == _LOST:
                self.lost_worker_seconds += spent
                self.walltime_losses += 1
            else:
                self.called[w].add(task.operator_key)
            self._offer(w)
            self._dispatch()
            ended = _Ended(task, self.now, how == _KILLED, how == _LOST)
            self.ended.append(ended)
            return ended
        raise SimulationInputError("internal: the simulated cluster has nothing running")
