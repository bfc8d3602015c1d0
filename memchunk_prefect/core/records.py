"""The plain records of memchunk-prefect: what a task run measured, and what a model predicts.

An :class:`Observation` is what one task run left: what ran, on what, how much
memory and time it took. It is plain data (ints, floats, strings), so it crosses
process boundaries, goes into SQLite as a row and comes back without pickle.

Outcomes:

- ``ok`` — the run finished; ``peak_bytes`` is its measured peak above the
  worker's resting level;
- ``memory_error`` — the task raised ``MemoryError``; ``peak_bytes`` is what it
  reached before failing, and ``censored`` is True: it *needed more* than that;
- ``killed`` — its worker was killed (by the nanny for memory, or otherwise).
  The flow side writes this record from what it knows (chunk, budget); for a
  memory kill ``peak_bytes`` is the budget it crossed and ``censored`` is True;
- ``error`` — any other exception; not used to learn memory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Mapping, Sequence

from memchunk_prefect.core.errors import format_bytes

OUTCOMES = ("ok", "memory_error", "killed", "error")


FIRST_USE_BYTES = 16 * 2**20
"""A finished run that left more than this many bytes held in its worker, and more than :data:`FIRST_USE_SHARE`
of its peak (a worker's first call of its operator: whatever share), was a first use (:func:`first_use_bytes`);
less is what any run leaves (allocator pages, caches)."""
FIRST_USE_SHARE = 0.25


def first_use_bytes(obs: "Observation", min_bytes: float = FIRST_USE_BYTES, share: float = FIRST_USE_SHARE) -> int:
    """What ``obs`` left held in its worker process, bytes, where that makes it a first use (a CUDA context, a
    library loaded, a cache: paid once per worker, not per block); else 0. Only a finished run is one.

    A run left more than ``min_bytes`` and more than ``share`` of its peak held; a worker's first call of its
    operator (``Observation.first_call``), more than ``min_bytes`` whatever its peak: what the process loads
    once (a library imported) is a first call's by definition, and a small share of a large peak is still no
    part of the block's (the models explanation, "First uses, first calls and first touches", has the case).

    >>> o = Observation("k|float32|cpu", 10_000, (1, 25, 400), 40_000, 160 * 2**20, retained_bytes=150 * 2**20)
    >>> first_use_bytes(o) == 150 * 2**20, first_use_bytes(Observation("k|float32|cpu", 1, (1, 1, 1), 4, 9))
    (True, 0)
    >>> import dataclasses
    >>> first = Observation("k|float32|cpu", 10_000, (1, 25, 400), 40_000, 150 * 2**20, retained_bytes=22 * 2**20)
    >>> first_use_bytes(first), first_use_bytes(dataclasses.replace(first, first_call=True)) == 22 * 2**20
    (0, True)
    """
    left = obs.retained_bytes
    if obs.outcome != "ok" or obs.censored or left is None:
        return 0
    left = min(int(left), int(obs.peak_bytes))
    if obs.first_call:
        return left if left > min_bytes else 0
    return left if left > max(min_bytes, share * obs.peak_bytes) else 0


STOP_DEATH_SECONDS = 5.0
"""A worker death inferred as out-of-memory this many seconds or less before the flow run was stopped (Ctrl-C, a
cancellation, a job's time limit) is taken as the stop's (:func:`stop_deaths`)."""


def stop_deaths(observations: Sequence["Observation"], stopped_at: float, memory_killed: Sequence[str] = (),
                window_s: float = STOP_DEATH_SECONDS) -> list["Observation"]:
    """The observations among ``observations`` that a stop explains better than memory: worker deaths the flow
    inferred as out-of-memory (``outcome`` killed, ``method`` flow: the worker never reported) from ``window_s``
    seconds before ``stopped_at`` (epoch seconds) on, on a worker the nanny did not report killing for memory
    (``memory_killed``: worker addresses from the scheduler's ``worker-restart-memory`` events).

    Why: a signal to a job's process group (Ctrl-C, `timeout`, a batch system's time limit or cancellation) ends
    the flow and its local workers at once, and a worker's death reaches the map a moment before the flow's stop
    does. Learned as out-of-memory, such a death is a censored observation claiming the chunk needed more than the
    worker's whole headroom: the next run plans far smaller chunks for nothing (an H100 demo stopped by `timeout`
    left envelope planned at 28x its peak, 325 chunks instead of 9). A death the nanny reported as a memory kill is
    kept: that is the one certain sign.

    >>> o = Observation("k|float32|cpu", 10, (1, 1, 10), 40, 500, outcome="killed", censored=True, method="flow",
    ...                 created_at=100.0, worker="tcp://a:1")
    >>> [len(stop_deaths([o], t)) for t in (101.0, 106.0, 99.0)], len(stop_deaths([o], 101.0, ["tcp://a:1"]))
    ([1, 0, 1], 0)
    """
    return [o for o in observations
            if o.outcome == "killed" and o.method == "flow" and o.created_at >= stopped_at - window_s
            and o.worker not in memory_killed]


@dataclass
class Observation:
    """One task run's measured memory and time, with the chunk that caused them.

    Units: bytes and seconds. ``elements`` and ``extents`` include the halo
    (they describe the block the operator actually held in memory).
    """

    operator_key: str
    elements: int
    extents: tuple[int, int, int]
    bytes_in: int
    peak_bytes: int
    seconds: float = 0.0
    outcome: str = "ok"
    censored: bool = False
    cpu_seconds: float | None = None
    worker: str = ""
    chunk: str = ""  # Chunk.key() of the output chunk (no halo), e.g. "i0-32_x0-64_t0-400"
    budget_bytes: int | None = None
    gpu_peak_bytes: int | None = None
    #: Energy of the run, joules: measured by a counter, or estimated (see ``energy_source``); None if neither.
    energy_joules: float | None = None
    shared: bool = False  # True when other tasks ran in the same process: the peak mixes them
    method: str = ""  # how peak_bytes was measured: "vmhwm", "psutil", "tracemalloc", "flow" (from a death)
    #: Process memory of the worker when the run started (its resting level then), bytes; None if unknown.
    baseline_bytes: int | None = None
    #: The worker's resting memory the map's budget assumed (read from the cluster when the map started),
    #: bytes; None if unknown. ``baseline_bytes - others_bytes - resting_bytes`` is memory the budget did not see.
    resting_bytes: int | None = None
    #: Of ``baseline_bytes``, what other task runs on the worker held when this one started (their own slots'
    #: memory, not the worker's resting level), bytes; None if unknown (records older than schema v6).
    others_bytes: int | None = None
    #: How far the run took the worker process's memory above the most it had held before (its high-water
    #: mark), bytes; None if unknown (records older than schema v7). Memory a process holds for the first time
    #: is faulted in and zeroed by the kernel during the run: a first large call took 0.8-1.4 s where later
    #: ones took 0.3 s (``python -m benchmarks.studies.first_touch``), a cost paid once per growth, not per element.
    grew_bytes: int | None = None
    #: Memory the run left held in its worker process at its end, above its start, bytes; None if unknown (records
    #: older than schema v10, runs that shared their process with another). Where large, it is a first use (a CUDA
    #: context, a library loaded, a cache): paid once per worker process, not per block
    #: (:meth:`memchunk_prefect.learn.memory.MemoryModel.first_use_bytes`).
    retained_bytes: int | None = None
    flow_run_id: str = ""
    created_at: float = field(default_factory=time.time)
    #: What ``energy_joules`` is: a counter ("nvml", "rapl", "nvml+rapl": measured over the whole device
    #: during the run) or "estimate" (CPU seconds x a power figure, :mod:`memchunk_prefect.core.energy`); None if none.
    energy_source: str | None = None
    #: When the run started (epoch seconds; None for records older than schema v5).
    started_at: float | None = None
    #: The Prefect task run that ran it ("" when unknown: older records, a plain call outside Prefect).
    task_run_id: str = ""
    #: The host name of the machine it ran on ("" when unknown).
    host: str = ""
    #: The chunked map it belongs to (``MapRun.map_id``; "" when unknown: older records, markers recovered).
    map_id: str = ""
    #: The GPU memory one task of the map might use (above the worker's resting GPU memory), bytes; None on
    #: the CPU and for records older than schema v8. ``gpu_peak_bytes`` is measured against it.
    gpu_budget_bytes: int | None = None
    #: True when the run ran out of the GPU's memory (``outcome`` is then "memory_error" and ``gpu_peak_bytes``
    #: a lower bound of what it needed there); False for a host out-of-memory and every other outcome.
    gpu_out_of_memory: bool = False
    #: Kernel CPU time of the run's thread (page faults and zeroing of the memory it touched), seconds; None if
    #: unknown (records older than schema v9, platforms without a per-thread figure). Of ``seconds``, the part
    #: a first touch inflates: see :meth:`memchunk_prefect.learn.time.TimeModel.compute_seconds`.
    sys_seconds: float | None = None
    #: True when the run was its worker process's first call of this operator key: its seconds then include what
    #: a first call pays once per process (a library imported, a kernel compiled, a file opened), not per block
    #: (:meth:`memchunk_prefect.learn.time.TimeModel.first_call_seconds`). None if unknown (records older than
    #: schema v12).
    first_call: bool | None = None
    #: When the runner submitted the run's task (epoch seconds; None where unknown: records older than schema
    #: v13, a run no runner submitted). ``started_at`` less this is the wait for a slot and, on a free one, what
    #: a submission costs before the block function starts.
    submitted_at: float | None = None
    #: The shares of the run's wall time (0-1) after which its memory above ``baseline_bytes`` first reached 50%
    #: and 90% of its peak; None where unknown (records older than schema v15, a run that overlapped another in
    #: its process, one too short to sample). How soon an operator's memory peaks decides how far a task that
    #: does not fit gets before its worker is killed (:mod:`memchunk_prefect.run.rise`).
    rise_50: float | None = None
    rise_90: float | None = None

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {OUTCOMES}, got {self.outcome!r}")
        self.extents = tuple(int(e) for e in self.extents)  # type: ignore[assignment]
        self.elements = int(self.elements)
        self.bytes_in = int(self.bytes_in)
        self.peak_bytes = int(self.peak_bytes)

    @property
    def unseen_bytes(self) -> int:
        """Memory the worker held that the budget did not see: the run's start above the resting level assumed,
        less what other runs on the worker held then (>= 0, bytes)."""
        if self.baseline_bytes is None or self.resting_bytes is None:
            return 0
        return max(0, int(self.baseline_bytes) - int(self.others_bytes or 0) - int(self.resting_bytes))

    @property
    def alone(self) -> bool:
        """Whether the run had its worker process to itself from its start to its end, so that ``peak_bytes`` is
        its own. On a worker of one thread every run is; on one of several, a run that overlapped another reads
        the process's peak, which holds the other's memory too (or the other's release, below this one's start),
        far from its own either way. The monitor reads
        ``retained_bytes`` only for a run that was alone, so a ``shared`` record with it set was alone.
        """
        return not self.shared or self.retained_bytes is not None

    @property
    def usable(self) -> bool:
        """Whether this record says anything about memory (errors other than memory do not)."""
        return self.outcome != "error"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["extents"] = list(self.extents)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Observation":
        return cls(**_known_fields(cls, d, tuples=("extents",)))


@dataclass(frozen=True)
class Prediction:
    """A model's figures for one block (halo included), in bytes: what the planner plans with.

    - ``mean_bytes``: expected peak above the worker's resting level;
    - ``upper_bytes``: one-sided upper bound at the model's confidence, widened where a
      block is larger than any seen; the fixed heuristic's plans fit this;
    - ``n_observations``: usable ``ok`` observations behind it;
    - ``ready``: enough history to plan; False means the numbers are a guess and
      the policy probes instead;
    - ``reason``: why (not) ready, in words, for logs and the CLI;
    - ``tight_bytes``: the least bound a plan may be fitted with: the mean times
      the operator's learned error margin (no widening for extrapolation beyond
      the sizes seen); None means the same as ``upper_bytes``. The learned policy
      (``bandit.py``) chooses how far between this and ``upper_bytes`` to plan.

    The one prediction type: the memory model (``learn/memory.py``) returns it, the policy
    (``policy.py``) and the map state machine read it, tests build it by hand.
    """

    mean_bytes: float
    upper_bytes: float
    n_observations: int = 0
    ready: bool = True
    reason: str = ""
    tight_bytes: float | None = None


@dataclass
class Reward:
    """What one plan of the learned policy earned: the reward its arm is taught, and the figures behind it.

    - ``arm``: the risk level the plan was fitted at (``bandit.ARMS``);
    - ``arms``: every arm whose plan was the same chunking (all are taught:
      their outcome would have been this one), ``arm`` included;
    - ``reward``: ``efficiency - penalty x out_of_memory - paused share`` (see
      :func:`memchunk_prefect.core.bandit.reward_of`);
    - ``efficiency``: compute time the plan's chunks needed at the operator's
      measured seconds per element, over the slot time they held
      (``slots x wall_seconds``), 0..1;
    - ``elements``: output elements written under the plan; ``wall_seconds``:
      from its first submission to its last chunk's end (retries included);
    - ``out_of_memory``: chunks of the plan that raised ``MemoryError`` or whose
      worker was killed for memory;
    - ``pauses`` / ``paused_seconds``: its workers' pauses (Dask's pause line)
      while it ran, and the worker-seconds they lasted.
    """

    operator_key: str
    arm: str
    arms: tuple[str, ...]
    reward: float
    efficiency: float
    elements: int
    wall_seconds: float
    slots: int
    out_of_memory: int = 0
    n_chunks: int = 0
    pauses: int = 0  # times a worker paused (Dask's pause line) during the plan; not stored (the reward includes it)
    paused_seconds: float = 0.0  # worker-seconds paused during the plan
    flow_run_id: str = ""
    created_at: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.arms = tuple(str(a) for a in self.arms)
        if self.arm not in self.arms:
            self.arms = (self.arm,) + self.arms

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["arms"] = list(self.arms)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Reward":
        return cls(**_known_fields(cls, d, tuples=("arms",)))


@dataclass
class MapRun:
    """One chunked map of a flow run, as the store keeps it: what it read, where it wrote, how it ran.

    What a trace of the run needs beyond its observations: which map fed which
    (``source`` is the upstream map's ``output_path`` when the map read another
    map's result), the volume and halo (a chunk's input box), the element size
    and the cluster it ran on. Times are epoch seconds; sizes bytes.

    - ``source``: the path read (a SEG-Y file, a zarr store) or "" for an array in memory;
    - ``source_bytes``: the size of that file on disk (a directory's files summed), or None;
    - ``outcome``: "ok" (every chunk written), "failed" or "interrupted".

    What a simulation of the run on another survey or cluster needs besides (None for maps recorded before
    store schema v11): ``params``, the map's other arguments as JSON (arrays by shape and dtype);
    ``whole_traces``, whether the operator keeps traces whole (the planner never cuts ``twt``); and the
    cluster the budget was read from: ``workers`` (the slots planned for, over the threads), ``threads_per_worker``,
    ``memory_limit_bytes`` and ``kill_fraction`` of the worker that set the budget, and ``resting_bytes``, the
    workers' median resting memory then. ``threads_per_core`` (None before store schema v14): the workers'
    threads per CPU core the budget counted, from the cores each worker may run on (its affinity: a batch job's
    cpuset; :func:`memchunk_prefect.core.budget.threads_per_core`), 1.0 where each thread had a core; None also
    where the workers' cores were not read.
    """

    flow_run_id: str
    operator: str
    operator_key: str
    source: str
    output_path: str
    shape: tuple[int, int, int]
    halo: tuple[int, int, int]
    itemsize: int
    slots: int
    budget_bytes: int
    started_at: float
    ended_at: float
    outcome: str = "ok"
    source_bytes: int | None = None
    #: This map's id, unique per chunked map: its observations carry it (``Observation.map_id``).
    map_id: str = ""
    params: str | None = None
    whole_traces: bool | None = None
    workers: int | None = None
    threads_per_worker: int | None = None
    memory_limit_bytes: int | None = None
    kill_fraction: float | None = None
    resting_bytes: int | None = None
    threads_per_core: float | None = None

    def __post_init__(self) -> None:
        self.shape = tuple(int(v) for v in self.shape)  # type: ignore[assignment]
        self.halo = tuple(int(v) for v in self.halo)  # type: ignore[assignment]
        if self.whole_traces is not None:
            self.whole_traces = bool(self.whole_traces)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["shape"], d["halo"] = list(self.shape), list(self.halo)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "MapRun":
        return cls(**_known_fields(cls, d, tuples=("shape", "halo")))


def _known_fields(cls: type, d: Mapping[str, Any], *, tuples: tuple[str, ...]) -> dict[str, Any]:
    """The entries of ``d`` that are fields of the dataclass ``cls`` (others, from newer writers, are dropped)."""
    names = {f.name for f in fields(cls)}
    return {k: (tuple(v) if k in tuples else v) for k, v in d.items() if k in names}


# --------------------------------------------------------------------------- worker pauses

#: The status a worker has while paused (Dask's ``Status.paused``, as the scheduler logs it).
PAUSED = "paused"


@dataclass(frozen=True)
class Pause:
    """A worker paused from ``start`` to ``end`` (epoch seconds; ``end`` is the read time if it is still paused)."""

    worker: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return max(0.0, self.end - self.start)


def pauses_from(changes: Sequence[tuple[str, float, str]], now: float) -> tuple[Pause, ...]:
    """Each worker's paused intervals from its status changes (a pause not yet ended runs to ``now``).

    Any other status ends a pause: ``running``, and ``removed`` for a worker that
    left (a nanny kills a worker past its pause line without a status change).

    >>> pauses_from([("w", 1.0, "paused"), ("w", 3.5, "running"), ("v", 2.0, "paused")], now=4.0)
    (Pause(worker='v', start=2.0, end=4.0), Pause(worker='w', start=1.0, end=3.5))
    >>> pauses_from([("w", 1.0, "paused"), ("w", 2.0, "removed")], now=9.0)
    (Pause(worker='w', start=1.0, end=2.0),)
    """
    out: list[Pause] = []
    started: dict[str, float] = {}
    for worker, t, status in sorted(changes, key=lambda c: (c[0], c[1])):
        if status == PAUSED:
            started.setdefault(worker, t)
        elif worker in started:
            out.append(Pause(worker, started.pop(worker), t))
    out += [Pause(w, t, max(t, now)) for w, t in started.items()]
    return tuple(sorted(out, key=lambda p: (p.worker, p.start)))


@dataclass(frozen=True)
class WorkerNow:
    """One worker as the scheduler last heard of it (its heartbeat): status, tasks running, memory (bytes):
    the process's, what of it is results Dask holds (``managed_bytes``, which it could spill), its limit."""

    address: str
    status: str
    executing: int
    memory_bytes: int
    memory_limit_bytes: int
    managed_bytes: int = 0


@dataclass(frozen=True)
class PausedIdle:
    """What the scheduler says of pauses now: its count of task transitions (moves whenever any task anywhere
    changes state), how many workers it has, and those paused with no task running (:class:`WorkerNow`)."""

    transitions: int
    n_workers: int
    workers: tuple[WorkerNow, ...]


def paused_idle_since(previous: Mapping[str, float], now_read: PausedIdle, last_transitions: int | None,
                      now: float) -> dict[str, float]:
    """Since when (seconds, on the caller's clock) each worker has been paused with no task running; the others
    are left out. A paused worker takes no new task until its memory falls below Dask's pause line; with a task
    running, that task's end may free it; with none, nothing in the worker will unless what it holds can be
    spilled. A time is kept from ``previous`` for a worker still so, else it starts at ``now``; every time starts
    again when the scheduler's transitions moved since ``last_transitions`` (a task changed state somewhere:
    the cluster is not stuck, whatever the polls between saw).

    >>> w = (WorkerNow("a", "paused", 0, 9, 10), WorkerNow("b", "paused", 1, 9, 10),
    ...      WorkerNow("c", "running", 0, 1, 10))
    >>> paused_idle_since({"a": 3.0, "c": 1.0}, PausedIdle(50, 3, w), 50, now=7.0)
    {'a': 3.0}
    >>> paused_idle_since({"a": 3.0}, PausedIdle(51, 3, w), 50, now=7.0)
    {'a': 7.0}
    """
    keep = previous if last_transitions == now_read.transitions else {}
    return {w.address: keep.get(w.address, now) for w in now_read.workers if w.status == PAUSED and w.executing == 0}


def stuck_paused(since: Mapping[str, float], now_read: PausedIdle, now: float,
                 patience_s: float) -> tuple[list[WorkerNow], bool]:
    """``(stuck, all_stuck)``: the workers paused with nothing running for at least ``patience_s`` seconds
    (``since`` from :func:`paused_idle_since`), and whether that is every worker of the cluster: a map whose
    every worker is stuck paused waits for ever (Dask does not kill a paused worker below its kill line).

    >>> a = WorkerNow("a", "paused", 0, 9, 10)
    >>> stuck, every = stuck_paused({"a": 0.0}, PausedIdle(7, 2, (a,)), now=40.0, patience_s=30.0)
    >>> [x.address for x in stuck], every
    (['a'], False)
    >>> stuck_paused({"a": 0.0}, PausedIdle(7, 1, (a,)), now=40.0, patience_s=30.0)[1]
    True
    >>> stuck_paused({"a": 0.0}, PausedIdle(7, 1, (a,)), now=20.0, patience_s=30.0)
    ([], False)
    """
    stuck = [w for w in now_read.workers if w.address in since and now - since[w.address] >= patience_s]
    return stuck, now_read.n_workers > 0 and len(stuck) >= now_read.n_workers


def memory_limit_to_unpause(stuck: Sequence[WorkerNow], pause_fraction: float, task_bytes: int) -> int:
    """The smallest ``memory_limit`` (bytes, rounded up to 256 MiB) under which the stuck workers' memory now sits
    below the pause line with room for one task of ``task_bytes`` above it.

    >>> memory_limit_to_unpause([WorkerNow("a", "paused", 0, 850 << 20, 1 << 30)], 0.8, 400 << 20) // 2**20
    1792
    """
    held = max((w.memory_bytes for w in stuck), default=0)
    need = (held + max(0, int(task_bytes))) / max(pause_fraction, 1e-3)
    step = 256 << 20
    return int(-(-need // step) * step)


#: Workers named one by one in :func:`stuck_paused_message` (the rest are counted).
NAMED_WORKERS = 4


def stuck_paused_message(operator: str, stuck: Sequence[WorkerNow], n_workers: int, pause_fraction: float,
                         patience_s: float, task_bytes: int) -> str:
    """What a map says of ``stuck`` workers (paused with no task running for ``patience_s`` seconds): which (the
    first :data:`NAMED_WORKERS`), what they hold against their limit and pause line, why it will not pass, and the
    memory_limit that would do (:func:`memory_limit_to_unpause`). All ``n_workers`` stuck: the map stops; fewer:
    the others run it.

    >>> m = stuck_paused_message("envelope", [WorkerNow("tcp://w:1", "paused", 0, 850 << 20, 1 << 30, 0)], 1, 0.8,
    ...                          30, 400 << 20)
    >>> print(m)  # doctest: +NORMALIZE_WHITESPACE
    envelope cannot go on: every worker of the cluster (1) paused for at least 30 s with no task running, over
    Dask's pause line (distributed.worker.memory.pause: 0.8 of memory_limit): tcp://w:1 holds 850.0 MiB of its
    1.0 GiB memory_limit (83%; 0 B of it results Dask could spill). A paused worker takes no task until its memory
    falls, and memory its process keeps for itself does not (a library's first use, say: on an NVIDIA H100 a GPU
    worker's first chunk left ~280 MiB of CUDA's host libraries held). Stopped rather than wait for ever; the
    chunks written are kept (a rerun resumes there). To go on, give the workers a memory_limit of at least 1.8 GiB
    (what they hold under the pause line, with room for one chunk of the map's budget), or restart them if that
    memory leaked
    """
    held = "; ".join(f"{w.address} holds {format_bytes(w.memory_bytes)} of its {format_bytes(w.memory_limit_bytes)} "
                     f"memory_limit ({w.memory_bytes / max(w.memory_limit_bytes, 1):.0%}; "
                     f"{format_bytes(w.managed_bytes)} of it results Dask could spill)"
                     for w in stuck[:NAMED_WORKERS])
    if len(stuck) > NAMED_WORKERS:
        held += f"; and {len(stuck) - NAMED_WORKERS} more"
    every = len(stuck) >= n_workers
    who = f"every worker of the cluster ({n_workers})" if every else f"{len(stuck)} of the {n_workers} workers"
    enough = memory_limit_to_unpause(stuck, pause_fraction, task_bytes)
    fix = (f"give the workers a memory_limit of at least {format_bytes(enough)} "
           "(what they hold under the pause line, with room for one chunk of the map's budget), or restart them if "
           "that memory leaked")
    head = f"{operator} cannot go on: " if every else f"{operator}: "
    tail = ("Stopped rather than wait for ever; the chunks written are kept (a rerun resumes there). To go on, "
            if every else "The other workers run the map without them. To use them, ")
    return (f"{head}{who} paused for at least {patience_s:g} s with no task running, over Dask's pause line "
            f"(distributed.worker.memory.pause: {pause_fraction:g} of memory_limit): {held}. A paused worker takes "
            "no task until its memory falls, and memory its process keeps for itself does not (a library's first "
            "use, say: on an NVIDIA H100 a GPU worker's first chunk left ~280 MiB of CUDA's host libraries held). "
            f"{tail}{fix}")


def paused_within(pauses: Sequence[Pause], since: float, until: float) -> tuple[int, float]:
    """``(pauses, paused worker-seconds)`` that overlap the window ``[since, until]``, clipped to it.

    >>> paused_within([Pause("w", 1.0, 3.0), Pause("v", 5.0, 9.0), Pause("w", 20.0, 21.0)], 2.0, 6.0)
    (2, 2.0)
    """
    n, seconds = 0, 0.0
    for p in pauses:
        overlap = min(p.end, until) - max(p.start, since)
        if overlap > 0:
            n += 1
            seconds += overlap
    return n, seconds
