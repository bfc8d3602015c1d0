"""How many of a map's tasks one worker runs at once: one per thread, or one alone on its worker.

A Dask worker of ``t`` threads runs ``t`` tasks at once in one process, so each is planned for a ``t``-th of
the worker's headroom. An operator whose smallest chunk needs more than that share (a fixed table, a library
loaded per task) cannot be planned at all, and one whose chunks run far faster large than small is planned
finer than the worker allows. Such a map runs **alone**: one task per worker, planned for the worker's whole
headroom, on a cluster of ``workers`` slots instead of ``workers x t``. Threads left idle cost the map
``1 - 1/t`` of the cluster's compute where the operator is compute-bound; a plan that cannot run at all, or
an out-of-memory kill, costs more. Which is cheaper is decided from the planner's estimates
(:func:`alone_pays`, by ``PolicySettings.alone_gain``, less where the worker's threads share CPU cores and add
no parallelism to pay for: :meth:`Sharing.alone_gain`); a chunk that cannot be planned or split under a thread's
share runs alone regardless.

Dask itself fills every thread of a worker, so the executor says where a task may run. On a cluster whose
workers offer the resource :data:`SLOT_RESOURCE` (``memchunk-slots``, one unit per thread: a local cluster the
runner starts with ``threads_per_worker`` above 1 does; a worker started elsewhere with
``--resources memchunk-slots=THREADS``), every
chunk asks for its share (:func:`slot_request`): one unit, or all of its worker's alone, so Dask never runs a
chunk beside one that runs alone, whichever map either belongs to. Elsewhere a task that runs alone is placed on
the worker with the fewest tasks processing (:func:`least_busy_worker`), which chunks of another map running
at the same time may still share, and the map's own where it plans for workers not yet joined. All sizes are
bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from memchunk_prefect.core import policy
from memchunk_prefect.core.arms import estimated_seconds
from memchunk_prefect.core.errors import BudgetTooSmallError, MemchunkError, format_bytes

#: The Dask worker resource a chunk asks its share of: one unit per worker thread (see the module docstring).
SLOT_RESOURCE = "memchunk-slots"

@dataclass
class Sharing:
    """The map's choice: ``per_worker`` None runs one task per thread (Dask's own), 1 runs one task per worker.

    ``threads``: each worker's threads; ``alone_cap_bytes``: what one task may use alone on the tightest worker
    (:attr:`memchunk_prefect.core.budget.Budget.worker_budget_bytes`; None where not known, and then a map never
    runs alone); ``reason``: why it runs alone, in words (empty while it does not); ``threads_per_core``: how
    many worker threads share each CPU core (:attr:`memchunk_prefect.core.budget.Budget.threads_per_core`).
    """

    threads: int = 1
    alone_cap_bytes: int | None = None
    per_worker: int | None = None
    reason: str = ""
    threads_per_core: float = 1.0

    @property
    def alone(self) -> bool:
        return self.per_worker is not None

    def may_go_alone(self, cap_bytes: int) -> bool:
        """Whether running alone would give a task more than ``cap_bytes``, the per-thread cap (and it is not
        alone already)."""
        return (self.per_worker is None and self.threads > 1 and self.alone_cap_bytes is not None
                and self.alone_cap_bytes > cap_bytes)

    def slots_alone(self, slots: int) -> int:
        """The slots of a cluster of ``slots`` worker threads when each worker runs one task."""
        return max(1, int(slots) // max(1, self.threads))

    def cores(self, slots: int) -> float | None:
        """The CPU cores a map's ``slots`` run on: the cluster's threads over its threads per core (None where
        each thread has a core of its own). Alone on each worker, a task has its worker's threads' cores."""
        if self.threads_per_core <= 1.0:
            return None
        return int(slots) * (self.threads if self.alone else 1) / self.threads_per_core

    def alone_gain(self, gain: float) -> float:
        """The estimated gain a plan alone needs over one task per thread (``gain``: the settings'
        ``alone_gain``), scaled by the parallelism the worker's further threads add: all of it where each thread
        has a core, none where the worker's threads share one. Threads beyond the cores run their tasks no sooner
        than one task per worker, so what is left between the two plans is the per-task overhead and a thread's
        share of the memory, and a plan alone that is estimated no longer is taken.

        >>> [Sharing(threads=2, threads_per_core=t).alone_gain(0.2) for t in (1.0, 2.0)]
        [0.2, 0.0]
        >>> round(Sharing(threads=4, threads_per_core=2.0).alone_gain(0.3), 3)
        0.1
        """
        if self.threads <= 1 or self.threads_per_core <= 1.0:
            return float(gain)
        parallel = self.threads / self.threads_per_core  # threads of a worker that run at once on cores
        return float(gain) * max(0.0, parallel - 1.0) / (self.threads - 1)

    def per_worker_of(self, probe: bool) -> int | None:
        """How many of the map's tasks may run on a task's worker beside it: the map's (None: one a thread), but a
        ``probe`` on workers of several threads runs alone. A probe is there to measure the operator, and a peak
        read beside another task holds the other's memory or its release (``Observation.alone``): a cold start's
        probes, run two to a worker, gave a table operator a slope it does not have and its map many small
        chunks."""
        if probe and self.per_worker is None and self.threads > 1:
            return 1
        return self.per_worker

    def in_flight_cap(self, slots: int, per_slot_cap: int) -> int:
        """Most chunks in flight: ``per_slot_cap`` (the settings') one per thread; alone, exactly one per worker
        (a task queued on a worker would run beside the one there, on its free thread)."""
        return int(slots) if self.alone else int(per_slot_cap)


def alone_words(why: str, threads: int, per_thread_bytes: int, alone_bytes: int, workers: int) -> str:
    """Why a map runs one task per worker, in words (the first words of its plan's reason).

    >>> alone_words("the smallest chunk does not fit a thread's share", 2, 80 * 2**20, 170 * 2**20, 2)
    "one task per worker (2 slots, not 2 x 2 threads): the smallest chunk does not fit a thread's share; a task \
alone on its worker has 170.0 MiB, a thread's share 80.0 MiB; "
    """
    return (f"one task per worker ({workers} slots, not {workers} x {threads} threads): {why}; a task alone on its "
            f"worker has {format_bytes(alone_bytes)}, a thread's share {format_bytes(per_thread_bytes)}; ")


def alone_pays(per_thread_seconds: float | None, alone_seconds: float | None, gain: float = 0.2) -> bool:
    """Whether a plan that runs alone (``alone_seconds``, estimated) beats the per-thread plan
    (``per_thread_seconds``) by more than ``gain`` of it (with no gain asked, matching it is enough). Unknown
    estimates never pay.

    >>> alone_pays(10.0, 7.0), alone_pays(10.0, 9.0), alone_pays(None, 1.0), alone_pays(10.0, 10.0, gain=0.0)
    (True, False, False, True)
    """
    if per_thread_seconds is None or alone_seconds is None or per_thread_seconds <= 0:
        return False
    if gain <= 0.0:
        return alone_seconds <= per_thread_seconds
    return alone_seconds < (1.0 - gain) * per_thread_seconds


def slot_request(per_worker: int | None, units: float, threads: int) -> float:
    """The units of :data:`SLOT_RESOURCE` one chunk asks for on a worker offering ``units`` over ``threads``
    threads: a thread's share, or (``per_worker`` 1: alone) all of them.

    >>> slot_request(None, 2, 2), slot_request(1, 2, 2), slot_request(None, 4, 4)
    (1.0, 2.0, 1.0)
    """
    if per_worker:
        return float(units) / int(per_worker)
    return float(units) / max(1, int(threads))


def least_busy_worker(running: Mapping[str, int], workers: list[str]) -> str | None:
    """The worker of ``workers`` (addresses) running the fewest tasks (``running``: tasks processing on each,
    by address; a worker not in it runs none), the first in ``workers`` on a tie; None without workers.

    >>> least_busy_worker({"a": 1, "b": 0}, ["a", "b"]), least_busy_worker({"a": 1}, ["a", "b"])
    ('b', 'b')
    >>> least_busy_worker({}, []) is None
    True
    """
    if not workers:
        return None
    return min(workers, key=lambda w: (int(running.get(w, 0)), workers.index(w)))


def choose_sharing(m: Any, make: Any) -> None:
    """Before a map machine ``m``'s first real plan: run it alone on each worker where nothing fits a thread's
    share, or where the plan alone is estimated shorter by ``PolicySettings.alone_gain`` (:meth:`Sharing.alone_gain`
    on workers whose threads share cores). ``make()`` plans (a
    decision, a plan or plans) with the machine's budget and slots as they are when it is called."""
    if not m.sharing.may_go_alone(m.cap_bytes) or m.gpu_budget_bytes is not None:
        return
    try:
        shared = make()
    except BudgetTooSmallError:
        go_alone(m, "even the smallest chunk does not fit a thread's share of its worker")
        return
    if m.sharing.alone:  # (a plan that went alone on its own)
        return
    if _is_probe(shared):
        if m.predict(tuple(m.spec.shape)).ready:  # not a cold start: the bound is over a thread's share
            go_alone(m, "the model's bound for the smallest chunk is over a thread's share of its worker")
        return
    before = (m.slots, m.cap_bytes, m.headroom_bytes, m.budget_bytes, m.planned_budget, m.touched)
    go_alone(m, "")
    try:
        alone = make()
    except MemchunkError:
        alone = None
    t_shared, t_alone = estimated_seconds(shared), (None if alone is None else estimated_seconds(alone))
    if alone is not None and not _is_probe(alone) and alone_pays(t_shared, t_alone,
                                                                 m.sharing.alone_gain(m.settings.alone_gain)):
        m.sharing.reason = alone_words(
            f"its plan is estimated at {t_alone:.1f} s, one task per thread at {t_shared:.1f} s",
            m.sharing.threads, before[3], m.budget_bytes, m.slots)
        return
    m.slots, m.cap_bytes, m.headroom_bytes, m.budget_bytes, m.planned_budget, m.touched = before
    m.sharing.per_worker, m.sharing.reason = None, ""


def go_alone(m: Any, why: str) -> None:
    """From now on ``m`` runs one task per worker, planned for the whole worker's headroom; ``why`` in words."""
    s = m.sharing
    per_thread = m.budget_bytes
    s.per_worker = 1
    m.slots = s.slots_alone(m.slots)
    m.cap_bytes = int(s.alone_cap_bytes or m.cap_bytes)
    if m.headroom_bytes is not None:
        m.headroom_bytes *= s.threads
    if m.touched is not None:  # what a task may use without growing its worker: all of the worker's, alone
        m.touched = {a: b * s.threads for a, b in m.touched.items()}
    m.budget_bytes = m.planned_budget = m._budget()
    s.reason = alone_words(why, s.threads, per_thread, m.budget_bytes, m.slots)


def _is_probe(result: Any) -> bool:
    """Whether a decision, a plan or plans (any of them) is a cold-start probe."""
    plans = result if isinstance(result, list) else [result.plan if isinstance(result, policy.Decision) else result]
    return any(p.probe for p in plans)
