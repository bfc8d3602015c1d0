"""MemoryAwareRunner: a DaskTaskRunner that chooses how to cut volumes from learned memory.

Before, with prefect-dask, a chunk size typed by hand::

    from prefect import flow
    from prefect_dask import DaskTaskRunner

    @flow(task_runner=DaskTaskRunner())
    def attributes(path):
        blocks = [read(path, il, il + 32) for il in range(0, 640, 32)]   # why 32? trial and error
        return gst3d_dip.map(blocks)

After::

    from prefect import flow
    from memchunk_prefect import MemoryAwareRunner, chunked
    from tasks import envelope, gst3d_dip

    @flow(task_runner=MemoryAwareRunner())
    def attributes(path):
        env = envelope.map(chunked(path))        # the runner picks the chunking
        dip = gst3d_dip.map(chunked(env))        # continue or rechunk at this boundary
        return dip.result()                      # xarray.DataArray over a zarr store

What happens at a chunked ``.map`` (in a thread of the flow's process: the
``.map`` call returns a :class:`ChunkedResult` at once, as Prefect's does; a map
over another map's result is decided from that map's plan and each of its chunks
runs once the upstream chunks its block reads are written):

1. the operator key and halo come from the task (``memchunk_prefect.operators``);
   the budget per task and the slots are read from the live cluster
   (:mod:`memchunk_prefect.cluster`); the output is created, resumed or replaced
   (:mod:`memchunk_prefect.identity`);
2. the map's state machine (:mod:`memchunk_prefect.machine`, pure) decides
   ``continue``, ``rechunk`` or a cold-start ``probe``, what to submit, when to
   re-plan, and what a failure means; its executor
   (:mod:`memchunk_prefect.executor`) carries that out on Prefect and Dask;
3. each chunk is an ordinary Prefect task run of the user's task (named after its
   chunk, e.g. ``gst3d_dip[iline 64:96]``); on the worker it reads its block
   (halo included) straight from the source, runs the task function, trims the
   halo, writes its region of a zarr store and returns a small receipt with what
   it measured (:mod:`memchunk_prefect.worker`);
4. every receipt teaches the model; the unsubmitted remainder is re-planned
   when the upper bound moved enough to matter;
5. a chunk that ran out of memory (``MemoryError`` in the task, or its worker
   killed → ``KilledWorker``) is recorded as a censored observation, its Prefect
   task run is marked Crashed, and it is split in two and resubmitted
   (``retry-smaller``); one that cannot be split fails the flow with
   :class:`~memchunk_prefect.errors.ChunkOutOfMemoryError`.

Watch maps with observers (:mod:`memchunk_prefect.observe`): the Prefect
artifacts (:mod:`memchunk_prefect.report`) and ``ChunkedResult`` are two.

Ordinary iterables map exactly as with ``DaskTaskRunner``.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import getpass
import logging
import os
import re
import stat
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterable, Mapping, Sequence

import dask
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture, PrefectFutureList
from prefect.logging import get_run_logger
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings
from prefect.utilities.annotations import BaseAnnotation
from prefect_dask import DaskTaskRunner

from . import cluster as _cluster
from . import policy
from .chunks import Chunk, Shape, normalize_halo
from .cluster import WorkerMemory
from .device import AUTO, CUDA, GpuStatus, check_device, gpu_status, resolve_for_workers
from .errors import (
    BudgetError,
    EnergyInputError,
    EnvironmentProblemError,
    MemchunkError,
    OutputPathError,
    RunnerConfigError,
    UpstreamMapError,
)
from .executor import ChunkedMap, MapInterrupted
from .observe import MapLog, MapObserver
from .pinning import local_gpu_cluster, usable_gpus
from .records import STOP_DEATH_SECONDS, Observation, stop_deaths
from .settings import RUNNER_SETTINGS, PolicySettings
from .units import parse_bytes as _parse_bytes
from .units import parse_seconds
from .volume import open_result

if TYPE_CHECKING:  # pragma: no cover
    from .model import ModelBank

logger = logging.getLogger("memchunk_prefect.runner")

# Every task run unpickles the flow with its runner on a Dask worker, which imports this module there. What
# only the flow process needs and costs worker memory is imported where it is used: the model (River, ~65 MiB
# of resident memory) and the report (Prefect artifacts, ~20 MiB). Every MiB a worker holds at rest is a MiB
# less of every task's budget.


# =========================================================================== the user-facing marker


@dataclass(frozen=True)
class Chunked:
    """A mapped argument the runner may cut: made by :func:`chunked`."""

    source: Any
    halo: Shape | None = None
    output: str | None = None
    replace_any: bool = False

    def __iter__(self):  # pragma: no cover - a guard, not an API
        raise TypeError(
            "chunked(...) can only be mapped by a flow whose task_runner is MemoryAwareRunner; "
            "this flow's task runner tried to iterate it"
        )


def chunked(source: Any, halo: int | Sequence[int] | None = None, *, output: str | os.PathLike | None = None,
            replace_any: bool = False) -> Chunked:
    """Mark ``source`` as a volume the runner may cut for the mapped task.

    ``source``: a SEG-Y path, a zarr store path, a numpy array or ``xarray.DataArray``
    (axes iline, xline, twt), or the result of an earlier chunked map.
    ``halo``: extra samples read around each chunk, an int (every axis) or
    (iline, xline, twt); default: what the operator declares. ``output``: where
    the result's zarr store goes (default: under the runner's ``output_dir``).
    An output already there is resumed when it was computed from the same input,
    code and parameters, replaced when it is this operator's output of something
    else, and refused when it is another operator's (or not memchunk's at all);
    ``replace_any=True`` says the path is yours: another operator's memchunk
    output there is replaced too (a store memchunk did not write never is).
    """
    return Chunked(source=source, halo=None if halo is None else normalize_halo(halo),
                   output=None if output is None else os.fspath(output), replace_any=bool(replace_any))


# =========================================================================== the result of a chunked map


class ChunkedResult(PrefectFutureList):
    """The result of a chunked map: its Prefect futures, and the whole output.

    Returned at once, as any Prefect ``.map`` returns its futures: the map runs
    in the background of the flow's process while the flow goes on (submits other
    maps and tasks). ``.wait()`` waits for it; ``.result()`` waits, raises what
    stopped it (as Prefect's ``.result()`` raises a failed task run's error), and
    returns the output as an ``xarray.DataArray`` over its zarr store in the
    input's geometry. Pass it to ``chunked(...)`` (or straight to the next
    ``.map``) to chain operators: the next map is planned from this one's plan
    at once and each of its chunks runs as soon as the chunks it reads are
    written. ``decisions`` and ``events`` (what the runner decided and why, how
    each task run ended), ``chunks``, iterating its futures and the other
    accounts wait for the map to end first; ``output_path`` does not.
    """

    def __init__(self, futures: Iterable[PrefectFuture], *, output_path: str, shape: Shape, chunks: list[Chunk],
                 operator: str, operator_key: str, decisions: list[dict], events: list[dict],
                 observations: list[Observation], budget_bytes: int,
                 predicted: Iterable[tuple[float, float, int]] = (), slow_workers: Iterable[dict] = ()):
        super().__init__(futures)
        self.output_path = output_path
        self.shape = shape
        self._chunks = chunks
        self.operator = operator
        self.operator_key = operator_key
        self._log = MapLog(decisions=decisions, events=events, observations=observations, budget_bytes=budget_bytes,
                           predicted=list(predicted), slow_workers=list(slow_workers))
        self.map: ChunkedMap | None = None  # the map behind it while it runs (None: built from a finished one)
        self._ended = threading.Event()
        self._ended.set()

    @classmethod
    def running(cls, cmap: ChunkedMap, log: MapLog) -> "ChunkedResult":
        """The result of a map about to run in the background; :meth:`_finish` completes it when the map ends."""
        r = cls([], output_path=cmap.output_path, shape=cmap.shape, chunks=[], operator=cmap.name,
                operator_key=cmap.key, decisions=[], events=[], observations=[], budget_bytes=0)
        r._log, r.map = log, cmap
        r._ended.clear()
        return r

    def _finish(self) -> None:
        """The map ended (in its thread): its chunks and futures become the result's."""
        cmap = self.map
        if cmap is not None:
            self._chunks = sorted(cmap.machine.done) if cmap.machine is not None else []
            list.extend(self, cmap.futures)
        self._ended.set()

    @property
    def done(self) -> bool:
        """Whether the map has ended (finished, failed or stopped)."""
        return self._ended.is_set()

    @property
    def seen(self) -> bool:
        """Whether what stopped the map reached the user (``.result()``, a downstream map's error, the flow's end)."""
        return self.map is None or self.map.error_seen

    @property
    def error(self) -> BaseException | None:
        """What stopped the map (None while it runs, or when it finished its output)."""
        return self.map.error if self.map is not None and self.done else None

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the map to end, at most ``timeout`` seconds (Prefect's ``wait``: never raises the map's error)."""
        _wait_event(self._ended, timeout)

    def result(self, timeout: float | None = None, raise_on_failure: bool = True):
        """The whole output as an ``xarray.DataArray``, once every chunk is written.

        Raises ``TimeoutError`` after ``timeout`` seconds, and what stopped the map
        (with ``raise_on_failure=False``: returns it instead, as Prefect does).
        """
        self.wait(timeout)
        if not self.done:
            raise TimeoutError(f"the chunked map over {self.operator} did not end within {timeout} s")
        err = self.error
        if err is not None:
            self.map.error_seen = True  # type: ignore[union-attr]
            if raise_on_failure:
                raise err
            return err
        return open_result(self.output_path)

    @property
    def chunks(self) -> list[Chunk]:
        """The chunks written (waits for the map to end)."""
        self.wait()
        return self._chunks

    @property
    def log(self) -> MapLog:
        """What the map's observers saw (waits for the map to end)."""
        self.wait()
        return self._log

    def __iter__(self):
        self.wait()
        return list.__iter__(self)

    def __len__(self) -> int:
        self.wait()
        return list.__len__(self)

    def __getitem__(self, i: Any) -> Any:
        self.wait()
        return list.__getitem__(self, i)

    @property
    def decisions(self) -> list[dict]:
        return self.log.decisions

    @property
    def events(self) -> list[dict]:
        return self.log.events

    @property
    def observations(self) -> list[Observation]:
        return self.log.observations

    @property
    def budget_bytes(self) -> int:
        return self.log.budget_bytes

    @property
    def oom_events(self) -> int:
        return self.log.oom_events

    def summary(self) -> dict:
        """Plain-data account of this map, for logs, artifacts and the demo: waits for the map to end, and raises
        what stopped it, as :meth:`result` does (a flow that writes "done" after its summaries never says so of a
        map that failed)."""
        self.result()
        return self.log.summary(operator=self.operator, operator_key=self.operator_key, chunks=self.chunks,
                                output=self.output_path)


def _wait_event(event: threading.Event, timeout: float | None = None) -> bool:
    """``event.wait(timeout)`` in short steps, so Ctrl-C and Prefect's cancellation signal reach a waiting flow."""
    deadline = None if timeout is None else time.monotonic() + max(0.0, float(timeout))
    while not event.is_set():
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:
            return False
        event.wait(0.5 if left is None else min(0.5, left))
    return True


# =========================================================================== the runner


def parse_bytes(value: int | float | str | None, *, what: str = "memory_budget") -> int | None:
    """``"2GiB"``, ``"512 MB"``, ``2e9`` or ``None`` -> bytes; a bad value is a RunnerConfigError naming ``what``.

    >>> parse_bytes("2GiB"), parse_bytes("1.5 MiB"), parse_bytes(1000), parse_bytes(None)
    (2147483648, 1572864, 1000, None)
    """
    if value is None:
        return None
    try:
        return _parse_bytes(int(value) if isinstance(value, float) else value)
    except BudgetError as exc:
        raise RunnerConfigError(f"`{what}`: {exc}") from exc


def _default_cluster_kwargs() -> dict[str, Any]:
    """A local cluster sized to the machine: one single-thread worker process per core.

    One thread per worker process gives clean per-task memory figures (each
    process's peak is one task's peak); memory is split evenly among workers.
    The dashboard listens on loopback only, on a free port.
    """
    n = max(1, os.cpu_count() or 1)
    return {"n_workers": n, "threads_per_worker": 1, "processes": True, "dashboard_address": "127.0.0.1:0"}


class MemoryAwareRunner(DaskTaskRunner):
    """A ``DaskTaskRunner`` that cuts chunked volumes so every chunk fits in memory.

    Takes every ``DaskTaskRunner`` argument (``cluster_class``, ``cluster_kwargs``,
    ``address``, ``adapt_kwargs``, ``client_kwargs``, ``performance_report_path``)
    plus:

    - ``memory_budget``: bytes (or ``"2GiB"``) one task may use above its worker's
      resting memory, at most; default: derived from the workers' ``memory_limit``;
    - ``target_fraction``: caps the budget at this share of a worker's ``memory_limit``
      (per thread) less its resting memory; default: no cap, the budget is the line
      where the worker's nanny kills it (``distributed.worker.memory.terminate``, read
      from each worker) less its resting memory, and the safety margin under that
      line is learned per operator (see :func:`memchunk_prefect.cluster.budget`);
    - ``store``: path of the observation store (default ``$MEMCHUNK_STORE`` or
      under the Prefect home);
    - ``output_dir``: where chunked outputs go when ``chunked(..., output=)`` is not
      given (default ``$MEMCHUNK_OUTPUT_DIR`` or a per-user temporary directory);
    - ``policy``: a :class:`~memchunk_prefect.settings.PolicySettings` (or a dict of its fields);
    - ``observers``: :class:`~memchunk_prefect.observe.MapObserver` objects told about
      every chunked map (in the flow's process, from each map's own thread, maps side by
      side at once: see :mod:`memchunk_prefect.observe`; not sent to workers);
    - ``progress``: each chunked map's progress on standard error
      (:mod:`memchunk_prefect.progress`): a live bar on a terminal and one line
      when the map ends (only that line when the output is not a terminal);
      ``False`` for none;
    - ``objective``: ``"time"`` (default: the shortest estimated run) or ``"energy"``
      (the least estimated joules: busy slots, idle slots of a last wave, per-task
      overhead; :func:`memchunk_prefect.policy.estimate_joules`);
    - ``deadline``: with ``objective="energy"``, the most seconds (or ``"10min"``)
      a chunked map may be estimated to take: the least energy that meets it;
    - ``watts_per_core`` / ``idle_watts_per_core``: power of a busy / an idle core,
      watts, for energy estimates where no counter can be read and for the energy
      objective (:mod:`memchunk_prefect.energy` states the defaults).

    These four set the same fields of ``policy``.

    - ``device``: where operators that take a ``device`` parameter (every one in
      :mod:`tasks`) run when a map does not give it: ``"cpu"``, ``"cuda"`` (every
      worker must have a usable GPU through CuPy, one worker per GPU) or ``"auto"``
      (the GPU when every worker has one, else the CPU); default None: each
      operator's own default, the CPU. The operator key carries the device a map
      ran on, so CPU and GPU memory are learned apart (:mod:`memchunk_prefect.device`).

    Zero arguments work: a local cluster of one single-thread worker process per
    core, memory split among them, budget derived from their limit.
    """

    def __init__(
        self,
        cluster: Any = None,
        address: str | None = None,
        cluster_class: Any = None,
        cluster_kwargs: dict[str, Any] | None = None,
        adapt_kwargs: dict[str, Any] | None = None,
        client_kwargs: dict[str, Any] | None = None,
        performance_report_path: str | None = None,
        *,
        memory_budget: int | str | None = None,
        target_fraction: float | None = None,
        store: str | os.PathLike | None = None,
        output_dir: str | os.PathLike | None = None,
        policy: PolicySettings | Mapping[str, Any] | None = None,
        observers: Iterable[MapObserver] = (),
        progress: bool = True,
        objective: str | None = None,
        deadline: float | str | None = None,
        watts_per_core: float | None = None,
        idle_watts_per_core: float | None = None,
        device: str | None = None,
    ):
        if cluster is not None:
            raise RunnerConfigError(
                "MemoryAwareRunner does not take a live `cluster` object: it cannot be serialized into task "
                "submissions (prefect-dask #17754). Pass `address=cluster.scheduler_address` instead, or "
                "`cluster_class` and `cluster_kwargs`"
            )
        device = None if device is None else check_device(device)
        if address is None and cluster_class is None and not cluster_kwargs:
            # On the GPU, one single-thread worker per GPU (each plans for its own GPU's memory); else one per core.
            gpus = usable_gpus()[0] if device in (CUDA, AUTO) else []
            cluster_class, cluster_kwargs = local_gpu_cluster(gpus) if gpus else (None, _default_cluster_kwargs())
        allow_slow_first_start()
        _fail_fast_without_a_database()
        super().__init__(address=address, cluster_class=cluster_class, cluster_kwargs=cluster_kwargs,
                         adapt_kwargs=adapt_kwargs, client_kwargs=client_kwargs,
                         performance_report_path=performance_report_path)
        if target_fraction is not None:
            kill = _cluster.configured_kill_fraction() if address is None else None
            ceiling = kill if kill is not None else 1.0
            try:
                ok = 0 < float(target_fraction) <= ceiling
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise RunnerConfigError(
                    f"`target_fraction` must be in (0, {ceiling:g}], got {target_fraction!r}"
                    + (f" (Dask's nanny kills a worker at {kill:g} of its memory_limit: "
                       "distributed.worker.memory.terminate)" if kill is not None else ""))
        self.memory_budget = parse_bytes(memory_budget)
        self.target_fraction = None if target_fraction is None else float(target_fraction)
        self.store = None if store is None else os.fspath(store)
        self.output_dir = None if output_dir is None else os.fspath(output_dir)
        if policy is None:
            policy = PolicySettings()
        elif isinstance(policy, Mapping):
            try:
                policy = PolicySettings(**policy)
            except TypeError as exc:
                raise RunnerConfigError(f"`policy` has an unknown setting: {exc}") from exc
        elif not isinstance(policy, PolicySettings):
            raise RunnerConfigError(f"`policy` must be a PolicySettings or a dict, got {type(policy).__name__}")
        energy: dict[str, Any] = {name: value for name, value in (
            ("objective", objective), ("watts_per_core", watts_per_core), ("idle_watts_per_core", idle_watts_per_core),
            ("deadline_seconds", None if deadline is None else _deadline_seconds(deadline))) if value is not None}
        if energy:
            policy = dataclasses.replace(policy, **energy)  # validated by PolicySettings (EnergyInputError)
        self.policy = policy
        # The device of operators that take one (a `device` parameter) and were not given it: None leaves each
        # operator's own default (the CPU); "auto" runs them on the GPU where every worker has one.
        self.device = device
        self._worker_gpus: dict[str, GpuStatus] | None = None
        self.observers = tuple(observers)
        self.progress = bool(progress)
        for o in self.observers:
            if not isinstance(o, MapObserver):
                raise RunnerConfigError(f"`observers` must be MapObserver objects, got {type(o).__name__}")
        self._bank: "ModelBank | None" = None
        self._map_count = 0
        self._cluster_checked = False
        self._kill_fractions: dict[str, object] = {}
        self._machines_recorded = False
        self._writer: Any = None  # report.ArtifactWriter of the flow run this runner is entered for
        self._lock = threading.RLock()  # what the maps' threads share: the bank, the writer, the list of maps
        self._maps: list[ChunkedResult] = []  # the chunked maps of the flow run, running or ended
        self._stop: BaseException | None = None  # set when the flow run stops around its maps
    # ---------------------------------------------------------------- Prefect plumbing

    def duplicate(self) -> "MemoryAwareRunner":
        return type(self)(
            address=self.address,
            cluster_class=self.cluster_class,
            cluster_kwargs=self.cluster_kwargs,
            adapt_kwargs=self.adapt_kwargs,
            client_kwargs=self.client_kwargs,
            performance_report_path=self.performance_report_path,
            memory_budget=self.memory_budget,
            target_fraction=self.target_fraction,
            store=self.store,
            output_dir=self.output_dir,
            policy=self.policy,
            observers=self.observers,
            progress=self.progress,
            device=self.device,
        )

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, MemoryAwareRunner)
            and super().__eq__(other)
            and self.memory_budget == other.memory_budget
            and self.target_fraction == other.target_fraction
            and self.store == other.store
            and self.output_dir == other.output_dir
            and self.policy == other.policy
            and self.progress == other.progress
            and self.device == other.device
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by settings

    def __getstate__(self) -> dict[str, Any]:
        # Keep submissions cheap: the flow (with its runner) is pickled into every task run. Observers watch
        # maps in the flow's process only.
        state = self.__dict__.copy()
        state["_bank"] = None
        state["observers"] = ()
        state["_lock"], state["_maps"], state["_stop"], state["_writer"] = None, [], None, None  # the flow's only
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()

    def __enter__(self):
        self._check_paths()  # before a cluster is started or anything submitted
        self._maps, self._stop = [], None
        super().__enter__()
        self._exit_stack.enter_context(_one_api_for_workers())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Wait for the flow run's chunked maps (stopping them if the flow stopped), finish the reports' artifact
        calls, then close the store this flow run opened, whatever happened: a process that runs flow after flow
        (a scheduler loop, a notebook, `python -m benchmarks.consecutive`) kept one SQLite connection (2 file
        descriptors) per flow run open until it exited. A map that failed unseen fails the flow run here."""
        failed: BaseException | None = None
        try:
            unseen = self.finish_maps(exc_info[1] if len(exc_info) > 1 else None)
            if unseen is not None:
                failed = unseen.error
                assert failed is not None
                _fail_flow_run(unseen.map.flow_run_id if unseen.map is not None else "", failed)
            self.wait_for_reports(close=True)
            super().__exit__(*exc_info)
        finally:
            bank, self._bank = self._bank, None
            if bank is not None and bank.store is not None:
                bank.store.close()
        if failed is not None:
            raise failed

    def wait_for_reports(self, timeout: float | None = None, *, close: bool = False) -> float:
        """Wait for the artifact calls the maps' reports left to the writer's thread; seconds waited.

        At most ``timeout`` seconds (``RunnerSettings.report_wait_seconds`` by default): a Prefect API that
        does not answer is logged and left behind, never waited for forever. ``close`` also stops the thread
        (the runner does at the end of its flow run).
        """
        writer = self._writer
        if writer is None:
            return 0.0
        if close:
            self._writer = None
        limit = RUNNER_SETTINGS.report_wait_seconds if timeout is None else float(timeout)
        t = time.perf_counter()
        done = writer.close(limit) if close else writer.wait(limit)
        if not done:
            logger.warning("memchunk: %d artifact call(s) to the Prefect API were still unfinished after %.0f s; "
                           "left behind (the run's results are not affected)", writer.pending, limit)
        return time.perf_counter() - t

    def _report_writer(self) -> Any:
        """The flow run's artifact writer (started at its first chunked map)."""
        with self._lock:
            if self._writer is None:
                from .report import ArtifactWriter  # flow process only: see the note at the top of the module

                self._writer = ArtifactWriter()
            return self._writer

    def _check_paths(self) -> None:
        """The store can be written; else EnvironmentProblemError, at once. (The default output directory is not
        checked here: every map may name its own output; one that needs the default and cannot write there
        raises OutputPathError naming it.)"""
        from .doctor import FAIL, check_store

        failed = [c for c in (check_store(self.store),) if c.status == FAIL]
        if failed:
            raise EnvironmentProblemError("MemoryAwareRunner cannot start, nothing was run:\n"
                                          + "\n".join(f"  {c.line()}" for c in failed))

    @property
    def client(self):
        if self._client is None:
            # Maps run in threads of their own and the first to ask creates the client: under the lock, so one
            # client is made, and so two threads' ``dask.config.set`` (process-global, not thread-safe) cannot
            # interleave and leave allowed-failures changed for the whole process after both exit.
            with self._lock:
                if self._client is None:
                    # Report a worker's death on the first death instead of retrying it on (and killing) others.
                    with dask.config.set({"distributed.scheduler.allowed-failures":
                                          RUNNER_SETTINGS.allowed_failures}):
                        return super().client
        return self._client

    # ---------------------------------------------------------------- map interception

    def map(self, task: Any, parameters: dict[str, Any], wait_for: Iterable[PrefectFuture] | None = None):
        chunked_params = {k: v for k, v in parameters.items() if isinstance(v, (Chunked, ChunkedResult))}
        if not chunked_params:
            return super().map(task, parameters, wait_for)
        if len(chunked_params) > 1:
            raise RunnerConfigError(
                f"a map over {task.name} has {len(chunked_params)} chunked arguments ({', '.join(chunked_params)}); "
                "a chunked map cuts one volume: pass the others unchunked (for example as a path read inside the task)"
            )
        (param, marker), = chunked_params.items()
        if isinstance(marker, ChunkedResult):
            marker = chunked(marker)
        # Every other argument goes whole to each chunk (a chunked map does not zip with iterables:
        # a sigma of (2, 2, 2) is one parameter, not three).
        static = {k: (v.unwrap() if isinstance(v, BaseAnnotation) else v)
                  for k, v in parameters.items() if k != param}
        upstream = marker.source if isinstance(marker.source, ChunkedResult) else None
        from . import report  # flow process only: see the note at the top of the module

        incoming, upstream_map, identity = None, None, None
        if upstream is not None:
            incoming, upstream_map, identity = self._upstream_plan(upstream, task)
        log = MapLog()
        cmap = ChunkedMap(self, task, param, source=upstream.output_path if upstream is not None else marker.source,
                          incoming=incoming, halo=marker.halo, output_path=marker.output,
                          replace_any=marker.replace_any, static=static, wait_for=wait_for,
                          observers=[log, report.MapReporter(self._report_writer()), *self.observers,
                                     *_progress_observers(self.progress)],
                          upstream=upstream_map, source_identity=identity)
        result = ChunkedResult.running(cmap, log)
        # The map runs in its own thread, in a copy of the flow's context (its flow run, settings and logger), so
        # `.map` returns at once as Prefect's does; the runner waits for it at the flow's end (__exit__).
        thread = threading.Thread(target=contextvars.copy_context().run, args=(self._run_map, result),
                                  name=f"memchunk-map-{cmap.name}", daemon=True)
        with self._lock:
            self._maps.append(result)
        thread.start()
        return result

    def _upstream_plan(self, upstream: ChunkedResult, task: Any) -> tuple[tuple[Chunk, ...], ChunkedMap | None,
                                                                             dict | None]:
        """What a map over ``upstream`` decides from: its chunking (its plan so far, while it runs), the map to
        follow (None: built from a finished one), and the identity of its output (its ``write_id``: the same
        whether it is finished or still written, so a rerun resumes a downstream output either way)."""
        up = upstream.map
        if up is None:
            return tuple(upstream.chunks), None, None
        _wait_event(up.planned)  # its first decision (milliseconds to a second after its .map)
        if up.out is None:  # it stopped before its output existed: nothing to read
            raise UpstreamMapError(
                f"cannot map {getattr(task, 'name', task)!r} over the result of {up.name}: that map stopped before "
                f"it began ({type(up.error).__name__}: {up.error}); fix that error and rerun the flow") from up.error
        from .volume import ZarrSource

        identity = ZarrSource(up.output_path).identity(complete=False)
        if upstream.done and up.error is None:
            return tuple(upstream.chunks), up, identity
        return up.plan_snapshot(), up, identity

    def _run_map(self, result: ChunkedResult) -> None:
        """A map's thread: run it; what stops it is kept on the map (``.result()`` and the flow's end raise it)."""
        try:
            result.map.run()  # type: ignore[union-attr]
        except BaseException:  # noqa: BLE001 - kept in ChunkedMap.error, raised where the user looks
            pass
        finally:
            result._finish()

    def stop_requested(self) -> BaseException | None:
        """What the maps' threads raise to stop (the flow run stopped around them), or None."""
        return self._stop

    def finish_maps(self, flow_error: BaseException | None) -> ChunkedResult | None:
        """Wait for every map this flow run started; the map whose error the flow run should end with, if any.

        ``flow_error``: what stopped the flow (Ctrl-C, a cancellation, an error in the flow's own code): the maps
        still running stop too, keeping what they wrote (their task runs in flight are marked Cancelled, or
        Crashed after an error). Without one, a map that failed and whose error nobody has seen
        (``.result()``) is what the flow run ends with: Prefect marks a flow run Completed when its function
        returns, before it closes the task runner, so that map's error would otherwise be lost.
        """
        with self._lock:
            maps = list(self._maps)
        unseen = [r for r in maps if r.done and r.error is not None and not r.seen]
        if flow_error is None and maps and (unseen or any(not r.done for r in maps)):
            # An error in the flow's own code is handled by Prefect's engine before the task runner closes: the
            # flow run's state says whether the flow failed around its maps.
            state = _flow_run_state(maps[0].map.flow_run_id if maps[0].map is not None else "")
            if state is not None and state.is_final() and not state.is_completed():
                flow_error = MemchunkError(f"the flow run ended {state.name}: {state.message}")
        if flow_error is not None and any(not r.done for r in maps):
            self._stop = (MapInterrupted(f"the flow run stopped ({type(flow_error).__name__})")
                          if not isinstance(flow_error, Exception)
                          else MemchunkError(f"the flow run failed around it ({type(flow_error).__name__}: "
                                             f"{flow_error})"))
        if flow_error is not None and not isinstance(flow_error, Exception) and maps:
            self._forget_stop_deaths(maps[0].map.flow_run_id if maps[0].map is not None else "", time.time())
        for r in maps:
            _wait_event(r._ended)
        unseen = [r for r in maps if r.error is not None and not r.seen]
        if flow_error is not None:
            for r in unseen:
                logger.info("%s: stopped (%s: %s) as the flow run ended", r.operator, type(r.error).__name__, r.error)
            return None
        for r in unseen[1:]:
            _flow_logger().error("memchunk: the chunked map over %s failed and nothing waited for it: %r",
                                 r.operator, r.error)
        if not unseen:
            return None
        unseen[0].map.error_seen = True  # type: ignore[union-attr]
        return unseen[0]

    def _forget_stop_deaths(self, flow_run_id: str, stopped_at: float) -> None:
        """Delete from the store the worker deaths this flow run learned as out of memory just before it was
        stopped (Ctrl-C, a cancellation, a job's time limit): the stop explains them (``records.stop_deaths``).
        The maps still running learn no more of them (``ChunkedMap.record``). A failing store is logged."""
        bank = self._bank
        if bank is None or bank.store is None or not flow_run_id:
            return
        try:
            gone = stop_deaths(bank.store.run_observations(flow_run_id), stopped_at,
                               _cluster.read_memory_kills(self.client) or ())
            if gone:
                n = bank.store.retract(gone)
                logger.warning("the flow run stopped: %d worker death(s) of the last %g s before it are not kept as "
                               "out of memory (no nanny memory kill was logged for them): %s", n, STOP_DEATH_SECONDS,
                               ", ".join(f"{o.operator_key} {o.chunk}" for o in gone))
        except Exception as exc:  # noqa: BLE001
            logger.warning("could not look for worker deaths caused by the stop: %r", exc)

    # ---------------------------------------------------------------- shared state for maps

    def model_bank(self) -> "ModelBank":
        """The model bank over this runner's store (opened once per flow run)."""
        with self._lock:  # maps run in threads of their own
            if self._bank is None:
                from .model import ModelBank  # flow process only: see the note at the top of the module
                from .store import Store

                self._bank = ModelBank(Store(self.store))
            return self._bank

    def workers(self, modules: Sequence[str] = ()) -> list[WorkerMemory]:
        """The cluster's workers as the budget sees them: kill fraction (read once per worker), resting memory,
        high-water mark.

        The resting memory is read on each worker after importing what a task run
        of this map imports there (``modules`` besides the runner's own), so a fresh
        worker's first task does not start above what the budget assumed.
        """
        info = _cluster.wait_for_workers(self.client)
        new = [a for a in info["workers"] if a not in self._kill_fractions]
        if new:
            self._kill_fractions.update(_cluster.read_kill_fractions(self.client, new))
        marks = _cluster.read_marks(self.client, (*_cluster.WORKER_MODULES, *modules))
        return _cluster.workers_from_info(info, self._kill_fractions, _cluster.configured_kill_fraction(),
                                          {a: r for a, (r, _) in marks.items()}, {a: h for a, (_, h) in marks.items()})

    def budget(self, modules: Sequence[str] = ()) -> _cluster.Budget:
        """Task slots, the per-task memory budget and how it was derived, read from the live cluster.

        Read afresh at every chunked map: between maps the workers are idle, so
        their process memory is their resting level (which grows once Prefect and
        the operators are imported on them), and the budget is what lies above it
        up to the kill line (see :func:`memchunk_prefect.cluster.budget`).
        """
        workers = self.workers(modules)
        self._check_cluster_once()
        b = _cluster.budget(workers, target_fraction=self.target_fraction, memory_budget=self.memory_budget)
        requested = self.requested_workers()
        planned = _cluster.planned_slots({w.address: w.nthreads for w in workers}, requested)
        if planned != b.slots:
            b = dataclasses.replace(b, slots=planned, reason=f"{b.reason}; planned for {planned} slots: "
                                                              f"{requested} workers requested, {len(workers)} joined")
        return b

    def requested_workers(self) -> int | None:
        """Workers the runner's own cluster was asked for (None on a scheduler started elsewhere): see
        :func:`memchunk_prefect.cluster.requested_workers`."""
        # prefect-dask keeps the cluster it started (or was given) in ``_cluster``; None with an address.
        return _cluster.requested_workers(getattr(self, "_cluster", None))

    def slots_now(self) -> int | None:
        """The slots a running map should plan for now (the workers there, or the requested ones; see
        :func:`memchunk_prefect.cluster.planned_slots`); None when the scheduler cannot be asked."""
        nthreads = _cluster.read_nthreads(self.client)
        return _cluster.planned_slots(nthreads, self.requested_workers()) if nthreads else None

    def slots_and_budget(self) -> tuple[int, int]:
        """(task slots in the cluster, per-task memory budget in bytes): see :meth:`budget`."""
        b = self.budget()
        return b.slots, b.budget_bytes

    def kill_headroom_bytes(self) -> int | None:
        """What a task may use above its worker's resting memory before the nanny kills it (smallest over workers)."""
        return _cluster.kill_headroom_bytes(self.workers())

    def map_device(self, requested: str) -> str:
        """The device (``"cpu"`` or ``"cuda"``) a map asking for ``requested`` runs on, from what the cluster's
        workers report (:func:`memchunk_prefect.device.resolve_for_workers`; read once per set of workers)."""
        requested = check_device(requested)
        if requested == "cpu":
            return "cpu"
        with self._lock:
            addresses = set(_cluster.wait_for_workers(self.client)["workers"])
            if self._worker_gpus is None or set(self._worker_gpus) != addresses:
                self._worker_gpus = {str(k): v for k, v in self.client.run(gpu_status).items()}
            return resolve_for_workers(requested, self._worker_gpus)

    def gpu_budget(self) -> _cluster.GpuBudget:
        """The GPU memory one task may use, read from the workers' devices now (at every map on the GPU, as the
        host budget is): see :func:`memchunk_prefect.cluster.gpu_budget`."""
        statuses = {str(k): v for k, v in self.client.run(gpu_status).items()}
        nthreads = _cluster.read_nthreads(self.client) or {}
        return _cluster.gpu_budget(statuses, nthreads, target_fraction=self.target_fraction)

    def record_machines(self) -> None:
        """Store what the cluster's hosts are (CPU, memory, system) once per runner, for traces."""
        if self._machines_recorded:
            return
        self._machines_recorded = True
        machines = _cluster.read_machines(self.client)
        try:
            store = self.model_bank().store
            if store is not None and machines:
                store.put_machines(machines)
        except Exception as exc:  # noqa: BLE001 - never stops a run
            logger.warning("could not record the cluster's machines: %r", exc)

    def _check_cluster_once(self) -> None:
        """Warn once per flow run when the scheduler retries dead workers' tasks (policy.allowed_failures_warning)."""
        with self._lock:  # two maps' threads read the budget at once
            if self._cluster_checked:
                return
            self._cluster_checked = True
        message = policy.allowed_failures_warning(_cluster.read_allowed_failures(self.client),
                                                  self.client.scheduler.address)
        if message:
            logger.warning("%s", message)
            _flow_logger().warning("memchunk: %s", message)

    def next_output_path(self, operator: str) -> str:
        ctx = FlowRunContext.get()
        run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else uuid.uuid4().hex
        base = default_output_dir(self.output_dir)
        self._map_count += 1
        # A task name is free text: keep it to one safe path component, and check the result stays inside.
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", operator).lstrip(".") or "operator"
        _private_dir(base)
        _private_dir(base / run_id)
        path = base / run_id / f"{self._map_count:02d}-{safe}.zarr"
        if not path.resolve().is_relative_to(base.resolve()):
            raise OutputPathError(f"{path}: the output for {operator!r} would leave the output directory {base}")
        return str(path)


def _flow_run_state(flow_run_id: str) -> Any:
    """The flow run's state as the Prefect API has it (None when it cannot be read)."""
    if not flow_run_id:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(uuid.UUID(flow_run_id)).state
    except Exception as exc:  # noqa: BLE001
        logger.debug("could not read flow run %s: %r", flow_run_id, exc)
        return None


def _fail_flow_run(flow_run_id: str, error: BaseException) -> None:
    """Mark the flow run Failed with ``error`` (it was marked Completed when its function returned)."""
    if not flow_run_id:
        return
    try:
        from prefect.client.orchestration import get_client
        from prefect.states import Failed

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Failed(message=f"a chunked map failed and nothing waited for it: "
                                                                 f"{type(error).__name__}: {error}"), force=True)
    except Exception as exc:  # noqa: BLE001 - the error is raised all the same
        logger.warning("could not mark flow run %s Failed: %r", flow_run_id, exc)


def _deadline_seconds(deadline: float | str) -> float:
    """A map deadline in seconds from ``90``, ``"90s"``, ``"10min"``; EnergyInputError for anything else."""
    try:
        return parse_seconds(deadline)
    except (MemchunkError, TypeError, ValueError) as exc:
        raise EnergyInputError(f"`deadline` must be seconds (90) or a duration ('90s', '10min', '2h'), got "
                               f"{deadline!r}: {exc}") from exc


def _progress_observers(on: bool) -> list[MapObserver]:
    if not on:
        return []
    from .progress import TerminalProgress  # flow process only

    return [TerminalProgress()]


def default_output_dir(output_dir: str | os.PathLike | None = None) -> Path:
    """Where chunked outputs go when ``chunked(..., output=)`` is not given (absolute).

    ``output_dir`` (the runner's), else ``$MEMCHUNK_OUTPUT_DIR``, else a per-user
    directory under the temporary directory.
    """
    return Path(output_dir or os.environ.get("MEMCHUNK_OUTPUT_DIR")
                or Path(tempfile.gettempdir()) / f"memchunk-{_user()}").absolute()


def _private_dir(d: Path) -> None:
    """Create ``d`` (and parents) user-only, and refuse one that is not a directory owned by this user.

    The default output directory lies under the shared temporary directory, where
    another user could have created (or linked) it first.
    """
    d.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(d)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise OutputPathError(f"{d}: not a directory owned by you; set the runner's output_dir= or "
                              "MEMCHUNK_OUTPUT_DIR to a directory of your own")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(d, 0o700)


def _user() -> str:
    try:
        return getpass.getuser()
    except Exception:  # noqa: BLE001  # pragma: no cover - no user name in the environment
        return str(os.getuid())


def _flow_logger() -> Any:
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow run
        return logger


#: Seconds a flow waits for Prefect's temporary server when none is configured. Its first start migrates a new
#: database: ~23 s on a busy 2-core machine, beyond Prefect's default 20 s
#: (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``), and a flow that gives up leaves a half-started server
#: holding the database ("database is locked").
FIRST_START_TIMEOUT_SECONDS = 180
_STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def allow_slow_first_start() -> bool:
    """Give Prefect's temporary server :data:`FIRST_START_TIMEOUT_SECONDS` to start, unless the user chose a timeout.

    Called when a runner is made (at ``@flow(task_runner=MemoryAwareRunner())``,
    before the flow starts the server). A value the user set in the environment
    or a Prefect profile is left alone. Sets the environment variable (worker
    processes started later inherit it) and refreshes Prefect's global settings,
    which were read when Prefect was imported. Returns whether it changed anything.
    """
    if _STARTUP_TIMEOUT_ENV in os.environ or get_current_settings().api.url:
        return False  # the user's own timeout, or a configured server: no temporary server to wait for
    try:
        from prefect.context import refresh_global_settings_context
        from prefect.settings.models.server.ephemeral import ServerEphemeralSettings

        default = ServerEphemeralSettings.model_fields["startup_timeout_seconds"].default
        if get_current_settings().server.ephemeral.startup_timeout_seconds != default:
            return False  # chosen in a profile
        os.environ[_STARTUP_TIMEOUT_ENV] = str(FIRST_START_TIMEOUT_SECONDS)
        refresh_global_settings_context()
    except Exception as exc:  # noqa: BLE001 - a Prefect without these: its own default applies
        logger.debug("could not raise the temporary server's startup timeout: %r", exc)
        return False
    return True


def _fail_fast_without_a_database() -> None:
    """With no Prefect API configured, a flow starts a temporary server on a SQLite file under the Prefect home;
    where that cannot be written the server never starts and Prefect retries it for minutes with thousands of
    lines of tracebacks. Say so at once, with the path and the fix (:class:`EnvironmentProblemError`)."""
    from .doctor import FAIL, check_prefect_api

    if get_current_settings().api.url:
        return  # a configured server: reaching it is Prefect's to report (``memchunk doctor`` checks it)
    check = check_prefect_api()
    if check.status == FAIL:
        raise EnvironmentProblemError(f"{check.detail}; {check.fix}")


@contextlib.contextmanager
def _one_api_for_workers():
    """Give Dask workers the flow's Prefect API, instead of one temporary server per worker.

    With no ``PREFECT_API_URL`` the flow talks to a temporary local server; each
    worker process would otherwise start its own on the same SQLite file (seconds
    of start-up per worker, and "database is locked" errors). The settings context
    is pickled into every submission, so setting the URL here reaches the workers.
    """
    if get_current_settings().api.url:
        yield
        return
    try:
        from prefect.server.api.server import SubprocessASGIServer  # the server package is heavy: only when needed

        server = SubprocessASGIServer()
        server.start()
        url = server.api_url
    except Exception as exc:  # pragma: no cover - depends on the local install
        logger.warning("could not share the temporary Prefect server with workers: %r", exc)
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield
