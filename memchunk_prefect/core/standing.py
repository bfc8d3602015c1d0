"""Where a map's workers stand: how far above the resting memory its budget assumed each one starts its tasks.

A worker's memory creeps up over a long map (Prefect's task-run engine keeps ~40-75 KB per task run on a Dask
worker: measured 309 -> 335 MiB over 700 task runs of a plain ``DaskTaskRunner``), and a first use (a library's
import, a CUDA context) leaves memory held for good. What a worker holds above the resting memory read at the
map's start is not the operator's, so a map takes it off its kill headroom, never adds it to the operator's
bound (:meth:`memchunk_prefect.core.machine.MapMachine._budget`).

A map learns where a worker stands from its own runs there (:meth:`WorkerStanding.follow`), and from the runs
of the flow run's other maps (:meth:`WorkerStanding.heard`): maps of a chained flow run side by side on the same
workers, and one operator's first use of a 150 MiB library on a worker, or the memory its runs left there, is
where another map's next chunk there starts. Pure: no clocks, no I/O.

Units: bytes.

>>> from memchunk_prefect.core.records import Observation
>>> s = WorkerStanding(estimate=10)
>>> s.worst()
10
>>> s.follow(Observation("k|float32|cpu", 1, (1, 1, 1), 4, 50, worker="w1", baseline_bytes=120, resting_bytes=100))
>>> s.worst()
20
>>> s.heard("w1", 170)
>>> s.worst()
170
>>> s.heard("w1", 60)
>>> s.worst()
170
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from memchunk_prefect.core.records import Observation

#: Runs per worker whose starts say where a worker of several threads stands (see :meth:`WorkerStanding.follow`).
DRIFT_RUNS = 4


@dataclass
class WorkerStanding:
    """Each worker's start above the resting memory a map's budget assumed, bytes.

    ``estimate``: what the map assumes before any run reports (``Start.drift_bytes``: this operator's recent
    runs started that far above it, or a first use of it left that much held); ``drift``: each worker's
    standing, once a run there reported it; ``recent``: each worker's last ``DRIFT_RUNS`` of those readings.
    """

    estimate: int = 0
    drift: dict[str, int] = field(default_factory=dict)
    recent: dict[str, deque] = field(default_factory=dict)
    pending: dict[str, dict[str, int]] = field(default_factory=dict)  # worker -> {other map: its first use there}

    def worst(self) -> int:
        """The highest standing of any worker known, with the first uses other maps have still to pay there, or
        the estimate before any is known, bytes."""
        known = set(self.drift) | set(self.pending)
        if not known:
            return self.estimate
        return max(self.current(w) + sum(self.pending.get(w, {}).values()) for w in known)

    def follow(self, obs: Observation) -> None:
        """Note where ``obs``'s worker stands now: where its run started, plus what the run left held there (a
        first use; ``Observation.retained_bytes``), which the worker's next run starts above.

        A run alone in its process reads that exactly: the latest run says where the worker stands. Runs that
        shared their process with others (a worker of several threads) start above whatever the others held or
        had just freed and the allocator not yet returned: one such start read 234 MiB above the resting memory
        on a 600 MiB worker, which left the budget no room for a single trace. Memory the worker really holds
        shows under every run's start, so there the least of its last ``DRIFT_RUNS`` starts is where it stands.
        """
        if obs.baseline_bytes is None or obs.resting_bytes is None or not obs.worker:
            return
        now = obs.unseen_bytes + int(obs.retained_bytes or 0)
        recent = self.recent.setdefault(obs.worker, deque(maxlen=DRIFT_RUNS))
        recent.append(now)
        self.drift[obs.worker] = min(recent) if obs.shared else now

    def current(self, worker: str) -> int:
        """Where ``worker`` stands as this map knows it: its latest standing, or the estimate before any, bytes."""
        return self.drift.get(worker, self.estimate)

    def grew(self, worker: str, nbytes: int) -> None:
        """``worker`` holds ``nbytes`` more than this map knows of (another map's run left it there): every reading
        this map has of the worker is that much low now, and a worker it has none of stands that much above the
        estimate."""
        if nbytes <= 0 or not worker:
            return
        recent = self.recent.setdefault(worker, deque([self.estimate], maxlen=DRIFT_RUNS))
        shifted = [r + int(nbytes) for r in recent]
        recent.clear()
        recent.extend(shifted)
        self.drift[worker] = self.current(worker) + int(nbytes)

    def heard(self, worker: str, above: int, source: str = "") -> None:
        """Another map's (``source``) run on ``worker``, alone in its process, says the worker's next task starts
        ``above`` bytes above the resting memory this map read. Raised to it where this map knows less
        (:meth:`grew`); never lowered by it: a report may arrive after this map's own newer reading, and a
        standing too high costs a smaller chunk where one too low costs a worker. The source has run there, so
        a first use of it expected there is paid (and in ``above``)."""
        self.pending.get(worker, {}).pop(source, None)
        self.grew(worker, int(above) - self.current(worker))

    def expect(self, worker: str, source: str, nbytes: int) -> None:
        """Another map (``source``) left ``nbytes`` held on a worker at its first chunk there, and has not run
        on ``worker`` yet: it will when it does. Held apart from the readings, which cannot show it before it
        happens, until the source's first report from ``worker`` (:meth:`heard`). ``nbytes`` 0: the source
        ended without running there; nothing of it is kept for ``worker``."""
        if nbytes <= 0:
            self.pending.get(worker, {}).pop(source, None)
        elif worker and source:
            self.pending.setdefault(worker, {})[source] = int(nbytes)
