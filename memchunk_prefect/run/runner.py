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
    from memchunk_prefect.operators import envelope, gst3d_dip

    @flow(task_runner=MemoryAwareRunner())
    def attributes(path):
        env = envelope.map(chunked(path))        # the runner picks the chunking
        dip = gst3d_dip.map(chunked(env))        # continue or rechunk at this boundary
        return dip.result()                      # xarray.DataArray over a zarr store

At a chunked ``.map`` the runner reads the budget and slots from the live cluster
(:mod:`~memchunk_prefect.run.cluster`), opens, resumes or replaces the output
(:mod:`~memchunk_prefect.io.identity`), and starts the map in a thread of the flow's
process (:mod:`~memchunk_prefect.run.maps`): the pure state machine
(:mod:`~memchunk_prefect.core.machine`) decides probe, continue, rechunk or
retry-smaller, and the executor (:mod:`~memchunk_prefect.run.executor`) carries that
out as ordinary Prefect task runs on Dask, one per chunk
(:mod:`~memchunk_prefect.run.worker` is what runs on the workers). Observers
(:mod:`~memchunk_prefect.run.observe`) watch each map.

Ordinary iterables map exactly as with ``DaskTaskRunner``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import dask
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture
from prefect.utilities.annotations import BaseAnnotation
from prefect_dask import DaskTaskRunner

from memchunk_prefect.core.errors import (
    BudgetError,
    EnvironmentProblemError,
    RunnerConfigError,
)
from memchunk_prefect.core.records import STOP_DEATH_SECONDS, stop_deaths
from memchunk_prefect.core.settings import RUNNER_SETTINGS, PolicySettings, check_target_fraction, policy_settings
from memchunk_prefect.core.units import parse_bytes
from memchunk_prefect.operators.device import AUTO, CUDA, check_device
from memchunk_prefect.run import cluster as _cluster
from memchunk_prefect.run import doctor
from memchunk_prefect.run.chunked import Chunked, ChunkedResult, chunked, upstream_plan
from memchunk_prefect.run.executor import ChunkedMap, MapContext
from memchunk_prefect.run.logs import heartbeat_at_close_quiet, typed_errors_in_one_line
from memchunk_prefect.run.maps import FlowMaps
from memchunk_prefect.run.observe import MapLog, MapObserver
from memchunk_prefect.run.outputs import default_output_dir, output_path_for
from memchunk_prefect.run.pinning import local_gpu_cluster, usable_gpus
from memchunk_prefect.run.prefect_api import (
    fail_flow_run,
    one_api_for_workers,
    started_cluster,
    temporary_server_defaults,
)
from memchunk_prefect.run.worker_start import method_for, starting_workers

if TYPE_CHECKING:  # pragma: no cover
    from memchunk_prefect.learn.bank import ModelBank

logger = logging.getLogger("memchunk_prefect.run.runner")

# Every task run unpickles the flow with its runner on a Dask worker, which imports this module there. What
# only the flow process needs and costs worker memory is imported where it is used: the model (River, ~65 MiB
# of resident memory) and the report (Prefect artifacts, ~20 MiB). Every MiB a worker holds at rest is a MiB
# less of every task's budget.


# =========================================================================== the runner


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
      line is learned per operator (see :func:`memchunk_prefect.core.budget.budget`);
    - ``store``: path of the observation store (default ``$MEMCHUNK_STORE`` or
      under the Prefect home);
    - ``output_dir``: where chunked outputs go when ``chunked(..., output=)`` is not
      given (default ``$MEMCHUNK_OUTPUT_DIR``, else ``memchunk-outputs`` in the working directory;
      :mod:`memchunk_prefect.run.outputs`);
    - ``policy``: a :class:`~memchunk_prefect.core.settings.PolicySettings` (or a dict of its fields);
    - ``observers``: :class:`~memchunk_prefect.run.observe.MapObserver` objects told about
      every chunked map (in the flow's process, from each map's own thread, maps side by
      side at once: see :mod:`memchunk_prefect.run.observe`; not sent to workers);
    - ``progress``: each chunked map's progress on standard error
      (:mod:`memchunk_prefect.run.progress`): a live bar on a terminal and one line
      when the map ends (only that line when the output is not a terminal);
      ``False`` for none;
    - ``objective``: ``"time"`` (default: the shortest estimated run) or ``"energy"``
      (the least estimated joules: busy slots, idle slots of a last wave, per-task
      overhead; :func:`memchunk_prefect.core.estimates.estimate_joules`);
    - ``deadline``: with ``objective="energy"``, the most seconds (or ``"10min"``)
      a chunked map may be estimated to take: the least energy that meets it;
    - ``watts_per_core`` / ``idle_watts_per_core``: power of a busy / an idle core,
      watts, for energy estimates where no counter can be read and for the energy
      objective (:mod:`memchunk_prefect.core.energy` states the defaults).

    These four set the same fields of ``policy``.

    - ``device``: where operators that take a ``device`` parameter (every one in
      :mod:`memchunk_prefect.operators`) run when a map does not give it: ``"cpu"``, ``"cuda"`` (every
      worker must have a usable GPU through CuPy, one worker per GPU) or ``"auto"``
      (the GPU when every worker has one, else the CPU); default None: each
      operator's own default, the CPU. The operator key carries the device a map
      ran on, so CPU and GPU memory are learned apart (:mod:`memchunk_prefect.operators.device`).

    Zero arguments work: a local cluster of one single-thread worker process per
    core, memory split among them, budget derived from their limit, its workers forked
    from one process that imported what a task run needs (:mod:`~memchunk_prefect.run.worker_start`).
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
            cluster_class, cluster_kwargs = (local_gpu_cluster(gpus) if gpus
                                             else (None, _cluster.default_cluster_kwargs()))
        if address is None and cluster_class is None and cluster_kwargs:
            cluster_kwargs = _cluster.local_cluster_kwargs(cluster_kwargs)  # slots (core.sharing), a loopback dashboard
        method_for(address, cluster_class, cluster_kwargs)  # a bad $MEMCHUNK_WORKER_START is refused here, at once
        temporary_server_defaults()
        doctor.fail_fast_without_a_database()
        super().__init__(address=address, cluster_class=cluster_class, cluster_kwargs=cluster_kwargs,
                         adapt_kwargs=adapt_kwargs, client_kwargs=client_kwargs,
                         performance_report_path=performance_report_path)
        if target_fraction is not None:
            check_target_fraction(target_fraction, _cluster.configured_kill_fraction() if address is None else None)
        try:
            self.memory_budget = None if memory_budget is None else parse_bytes(memory_budget, what="memory_budget")
        except BudgetError as exc:
            raise RunnerConfigError(str(exc)) from exc
        self.target_fraction = None if target_fraction is None else float(target_fraction)
        self.store = None if store is None else os.fspath(store)
        self.output_dir = None if output_dir is None else os.fspath(output_dir)
        policy = policy_settings(
            policy,
            objective=objective,
            watts_per_core=watts_per_core,
            idle_watts_per_core=idle_watts_per_core,
            deadline=deadline,
        )
        self.policy = policy
        # The device of operators that take one (a `device` parameter) and were not given it: None leaves each
        # operator's own default (the CPU); "auto" runs them on the GPU where every worker has one.
        self.device = device
        self.observers = tuple(observers)
        self.progress = bool(progress)
        for o in self.observers:
            if not isinstance(o, MapObserver):
                raise RunnerConfigError(f"`observers` must be MapObserver objects, got {type(o).__name__}")
        self._bank: "ModelBank | None" = None
        self._map_count = 0
        self._view: _cluster.ClusterView | None = None
        self._writer: Any = None  # report.ArtifactWriter of the flow run this runner is entered for
        self._lock = threading.RLock()  # what the maps' threads share: the writer, the cluster view
        self._client_lock = threading.Lock()  # apart: the cluster starts while the flow's thread goes on
        self._bank_lock = threading.Lock()  # apart: the bank is opened beside the cluster's start, not after it
        self._warming: list[threading.Thread] | None = None
        self._flow_maps = FlowMaps()  # the chunked maps of the flow run, running or ended

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
        state["_lock"], state["_flow_maps"], state["_writer"] = None, None, None  # the flow's only
        state["_bank_lock"], state["_client_lock"], state["_warming"] = None, None, None
        state["_view"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._client_lock = threading.Lock()
        self._bank_lock = threading.Lock()

    def __enter__(self):
        typed_errors_in_one_line()
        heartbeat_at_close_quiet()
        self._check_paths()  # before a cluster is started or anything submitted
        self._flow_maps = FlowMaps()
        super().__enter__()
        self._exit_stack.enter_context(one_api_for_workers())
        return self

    def __exit__(self, *exc_info: Any) -> None:
        """Wait for the flow run's chunked maps (stopping them if the flow stopped), finish the reports' artifact
        calls, then close the store this flow run opened, whatever happened: left open, a process that runs flow
        after flow (a scheduler loop, a notebook, `python -m benchmarks.studies.consecutive`) would keep one SQLite
        connection (2 file descriptors) per flow run until it exited. A map that failed unseen fails the flow run
        here."""
        failed: BaseException | None = None
        for thread in self._warming or ():
            thread.join(60)  # the bank it may still be opening is closed below, the cluster by prefect-dask
        try:
            unseen = self.finish_maps(exc_info[1] if len(exc_info) > 1 else None)
            if unseen is not None:
                failed = unseen.error
                assert failed is not None
                fail_flow_run(unseen.map.flow_run_id if unseen.map is not None else "", failed)
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
                from memchunk_prefect.run.report import ArtifactWriter  # flow process only: see the top's note

                self._writer = ArtifactWriter()
            return self._writer

    def _check_paths(self) -> None:
        """The store can be written; else EnvironmentProblemError, at once. (The default output directory is not
        checked here: every map may name its own output; one that needs the default and cannot write there
        raises OutputPathError naming it.)"""
        from memchunk_prefect.run.doctor import FAIL, check_store

        failed = [c for c in (check_store(self.store),) if c.status == FAIL]
        if failed:
            raise EnvironmentProblemError("MemoryAwareRunner cannot start, nothing was run:\n"
                                          + "\n".join(f"  {c.line()}" for c in failed))

    @property
    def client(self):
        if self._client is None:
            # Maps run in threads of their own and the first to ask creates the client: under the lock, so one
            # client is made, and so two threads' ``dask.config.set`` (process-global, not thread-safe) cannot
            # interleave and leave allowed-failures changed for the whole process after both exit. A lock of its
            # own: the flow's thread (output paths, the cluster view) goes on while the cluster starts.
            with self._client_lock:
                if self._client is None:
                    # Report a worker's death on the first death instead of retrying it on (and killing) others.
                    with dask.config.set({"distributed.scheduler.allowed-failures":
                                          RUNNER_SETTINGS.allowed_failures}), \
                            starting_workers(self.address, self.cluster_class, self.cluster_kwargs):
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
        ((param, marker),) = chunked_params.items()
        if isinstance(marker, ChunkedResult):
            marker = chunked(marker)
        if not isinstance(marker.source, ChunkedResult):
            # Opened here, in the flow's thread, before a cluster starts: a bad input is reported at once.
            from memchunk_prefect.io.volume import as_source

            marker = dataclasses.replace(marker, source=as_source(marker.source))
        self._warm_up()
        # Every other argument goes whole to each chunk (a chunked map does not zip with iterables:
        # a sigma of (2, 2, 2) is one parameter, not three).
        static = {k: (v.unwrap() if isinstance(v, BaseAnnotation) else v)
                  for k, v in parameters.items() if k != param}
        upstream = marker.source if isinstance(marker.source, ChunkedResult) else None
        from memchunk_prefect.run import report  # flow process only: see the note at the top of the module

        incoming, upstream_map, identity = None, None, None
        if upstream is not None:
            incoming, upstream_map, identity = upstream_plan(upstream, task)
        log = MapLog()
        cmap = ChunkedMap(self._map_context(), task, param,
                          source=upstream.output_path if upstream is not None else marker.source,
                          incoming=incoming, halo=marker.halo, output_path=marker.output,
                          output_format=marker.output_format, replace_any=marker.replace_any, static=static,
                          wait_for=wait_for,
                          observers=[log, report.MapReporter(self._report_writer()), *self.observers,
                                     *_progress_observers(self.progress)],
                          upstream=upstream_map, source_identity=identity)
        result = ChunkedResult.running(cmap, log)
        self._flow_maps.start(result)
        return result

    def stop_requested(self) -> BaseException | None:
        """What the maps' threads raise to stop (the flow run stopped around them), or None."""
        return self._flow_maps.stop

    def finish_maps(self, flow_error: BaseException | None) -> ChunkedResult | None:
        """Wait for every map this flow run started; the map whose error the flow run should end with, if any
        (see :meth:`memchunk_prefect.run.maps.FlowMaps.finish`)."""
        return self._flow_maps.finish(flow_error, self._forget_stop_deaths)

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
        with self._bank_lock:  # maps run in threads of their own
            if self._bank is None:
                from memchunk_prefect.learn.bank import ModelBank  # flow process only: see the top's note
                from memchunk_prefect.learn.store import Store

                self._bank = ModelBank(Store(self.store))
            return self._bank

    def _warm_up(self) -> None:
        """At the flow run's first chunked map, start the cluster (its workers take seconds to spawn) and open the
        model bank (River and the store: ~0.7 s), each in a thread of its own, so both run beside the map's setup
        in the flow's thread (imports, the source's geometry, the output) instead of after it. A failure here is
        left for the map, which asks again and says what went wrong."""
        if self._warming is None:
            self._warming = [threading.Thread(target=_quietly, args=(fn, what), name=f"memchunk-{what}", daemon=True)
                             for fn, what in ((lambda: self.client, "cluster-start"),
                                              (self.model_bank, "bank-open"))]
            for thread in self._warming:
                thread.start()

    @property
    def cluster_view(self) -> _cluster.ClusterView:
        """What this runner's maps see of its cluster (made on first use, shared by the flow run's maps)."""
        with self._lock:
            if self._view is None:
                self._view = _cluster.ClusterView(
                    lambda: self.client, lambda: started_cluster(self),
                    target_fraction=self.target_fraction, memory_budget=self.memory_budget,
                    adaptive=bool(self.adapt_kwargs))
            return self._view

    def _map_context(self) -> MapContext:
        """What a chunked map of this runner is given (the executor never reaches back into the runner)."""
        return MapContext(cluster=self.cluster_view, bank=self.model_bank, policy=self.policy, device=self.device,
                          stop=self.stop_requested, output_path=self.next_output_path,
                          submit=functools.partial(DaskTaskRunner.submit, self))

    def next_output_path(self, operator: str, suffix: str = ".zarr") -> str:
        """A fresh path for ``operator``'s output under the output directory: ``<flow run>/<n>-<operator>.zarr``
        (``.mdio`` for an MDIO output)."""
        ctx = FlowRunContext.get()
        run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else uuid.uuid4().hex
        run = ({"flow": ctx.flow.name if ctx.flow else "", "flow_run": ctx.flow_run.name, "flow_run_id": run_id}
               if ctx and ctx.flow_run else {"flow_run_id": run_id})
        with self._lock:
            self._map_count += 1
            n = self._map_count
        return output_path_for(default_output_dir(self.output_dir), run_id, n, operator, run, suffix=suffix)


def _quietly(fn: Callable[[], Any], what: str) -> None:
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the map does it again and says what went wrong
        logger.debug("memchunk %s ahead of the first map failed: %r", what, exc)


def _progress_observers(on: bool) -> list[MapObserver]:
    if not on:
        return []
    from memchunk_prefect.run.progress import TerminalProgress  # flow process only

    return [TerminalProgress()]
