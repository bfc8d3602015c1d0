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

What happens at a chunked ``.map`` (all in the flow's thread; the map returns
once every chunk of the output is written, because the next boundary's
decision needs what this one measured):

1. the operator key and halo come from the task (``memchunk_prefect.operators``);
2. :func:`memchunk_prefect.policy.decide` chooses ``continue``, ``rechunk`` or a
   cold-start ``probe`` from the model's upper bound and the budget;
3. chunks are submitted as ordinary Prefect task runs of the user's task (named
   after their chunk, e.g. ``gst3d_dip[iline 64:96]``); on the worker each reads
   its block (halo included) straight from the source, runs the task function,
   trims the halo, writes its region of a zarr store and returns a small
   :class:`Receipt` with the measured :class:`~memchunk_prefect.records.Observation`;
4. every receipt teaches the model; the unsubmitted remainder is re-planned
   when the upper bound moved enough to matter;
5. a chunk that ran out of memory (``MemoryError`` in the task, or its worker
   killed → ``KilledWorker``) is recorded as a censored observation, its Prefect
   task run is marked Crashed, and it is split in two and resubmitted
   (``retry-smaller``); one that cannot be split fails the flow with
   :class:`~memchunk_prefect.errors.ChunkOutOfMemoryError`.

Ordinary iterables map exactly as with ``DaskTaskRunner``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import re
import stat
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
from prefect.futures import PrefectFuture, PrefectFutureList
from prefect_dask import DaskTaskRunner
from prefect_dask.task_runners import PrefectDaskFuture

from . import policy as policy_mod
from .chunks import Chunk, Shape, normalize_halo, uncovered_boxes, with_halo
from .errors import (
    ChunkedSourceError,
    ChunkOutOfMemoryError,
    ClusterLostError,
    MemchunkError,
    OutputPathError,
    OutputWriteError,
    RunnerConfigError,
    VolumeError,
    format_bytes,
)
from .operators import operator_key, operator_name, spec_of
from .policy import PROBE, RECHUNK, RETRY_SMALLER, PolicySettings
from .records import Observation

logger = logging.getLogger("memchunk_prefect.runner")

#: Dask's default: the scheduler retries a task whose worker died this many times, killing a
#: worker each time. 0 reports a memory death on the first death (FACTS.md); the runner
#: handles it by splitting the chunk instead.
ALLOWED_FAILURES = 0


# =========================================================================== the user-facing marker


@dataclass(frozen=True)
class Chunked:
    """A mapped argument the runner may cut: made by :func:`chunked`."""

    source: Any
    halo: Shape | None = None
    output: str | None = None

    def __iter__(self):  # pragma: no cover - a guard, not an API
        raise TypeError(
            "chunked(...) can only be mapped by a flow whose task_runner is MemoryAwareRunner; "
            "this flow's task runner tried to iterate it"
        )


def chunked(source: Any, halo: int | Sequence[int] | None = None, *, output: str | os.PathLike | None = None) -> Chunked:
    """Mark ``source`` as a volume the runner may cut for the mapped task.

    ``source``: a SEG-Y path, a zarr store path, a numpy array or ``xarray.DataArray``
    (axes iline, xline, twt), or the result of an earlier chunked map.
    ``halo``: extra samples read around each chunk, an int (every axis) or
    (iline, xline, twt); default: what the operator declares. ``output``: where
    the result's zarr store goes (default: under the runner's ``output_dir``).
    """
    return Chunked(source=source, halo=None if halo is None else normalize_halo(halo),
                   output=None if output is None else os.fspath(output))


# =========================================================================== what travels to workers


@dataclass(frozen=True)
class BlockJob:
    """Everything a worker needs to run one chunk: small (paths and ints, no arrays)."""

    source: Any  # a memchunk_prefect.volume source (SegySource, ZarrSource, ArraySource)
    chunk: Chunk
    halo: Shape
    volume_shape: Shape
    output_path: str
    operator: str
    operator_key: str
    budget_bytes: int
    label: str

    def __repr__(self) -> str:  # shown in Prefect logs and the UI's parameters: keep it short
        return f"BlockJob({self.operator}[{self.label}])"


@dataclass(frozen=True)
class Receipt:
    """What a finished chunk returns to the flow: where it wrote, and what it measured."""

    chunk: Chunk
    output_path: str
    observation: dict

    def __repr__(self) -> str:
        return f"Receipt({self.chunk.key()}, peak={format_bytes(self.observation.get('peak_bytes'))})"


class ChunkMemoryError(MemchunkError, MemoryError):
    """Raised on the worker when a chunk's task ran out of memory; carries the censored observation."""

    def __init__(self, message: str, observation: dict):
        super().__init__(message)
        self.observation = observation

    def __reduce__(self):
        return (ChunkMemoryError, (self.args[0], self.observation))


def chunk_task_run_name(parameters: dict[str, Any]) -> str:
    """Task run names that show the chunk: ``gst3d_dip[iline 64:96]``."""
    for value in parameters.values():
        if isinstance(value, BlockJob):
            return f"{value.operator}[{value.label}]"
    return "chunk"


class BlockFunction:
    """The user's block function, run on a worker against one :class:`BlockJob`.

    It keeps the user's signature (``functools.update_wrapper``), so Prefect binds
    parameters as for the original task; the chunked parameter arrives as a
    ``BlockJob`` and is replaced by the numpy block before the user's function runs.
    """

    def __init__(self, fn: Any, param: str):
        self.fn = fn
        self.param = param
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Receipt:
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        job = bound.arguments[self.param]
        if not isinstance(job, BlockJob):  # called outside the runner: behave as the plain function
            return self.fn(*args, **kwargs)
        return run_block(self.fn, job, bound)


def _worker_name() -> str:
    try:
        from distributed import get_worker

        return get_worker().address
    except Exception:
        return f"pid:{os.getpid()}"


def run_block(fn: Any, job: BlockJob, bound: inspect.BoundArguments) -> Receipt:
    """Read the block, run ``fn`` on it, trim the halo, write the region; measure all of it.

    The measurement covers read + compute + write, because the worker's memory
    limit applies to all of it. Runs on the worker.
    """
    from .monitor import default_monitor
    from .volume import ZarrOutput

    read_chunk, trim = with_halo(job.chunk, job.halo, job.volume_shape)
    base = dict(operator_key=job.operator_key, elements=read_chunk.elements, extents=read_chunk.shape,
                bytes_in=read_chunk.elements * 4, worker=_worker_name(), chunk=job.chunk.key(),
                budget_bytes=job.budget_bytes)
    try:
        with default_monitor().track() as run:
            block = job.source.read(read_chunk)
            bound.arguments[job_param_name(bound, job)] = block
            out = fn(*bound.args, **bound.kwargs)
            out = np.asarray(out)
            if out.shape != block.shape:
                raise VolumeError(
                    f"operator {job.operator} returned a block of shape {out.shape} for an input block of shape "
                    f"{block.shape}: chunked operators must return a block of the same shape as their input"
                )
            output = ZarrOutput.open(job.output_path)
            try:
                output.write(job.chunk, np.ascontiguousarray(out[trim], dtype=np.float32), mark_done=False)
            except OSError as exc:
                raise _write_error(job, exc) from exc
            del block, out
    except MemoryError as exc:
        m = getattr(exc, "memchunk_measurement", None)
        fields = m.observation_fields() if m is not None else {"peak_bytes": 0, "outcome": "memory_error",
                                                                "censored": True}
        fields.update(outcome="memory_error", censored=True)
        obs = Observation(**base, **fields)
        reached = f"after reaching {format_bytes(obs.peak_bytes)}" if obs.peak_bytes else "(peak not measured)"
        raise ChunkMemoryError(
            f"{job.operator}[{job.label}] ran out of memory {reached} "
            f"(budget {format_bytes(job.budget_bytes)}): {exc!r}", obs.to_dict()) from exc
    obs = Observation(**base, **run.measurement.observation_fields())
    # The marker carries the observation: a flow stopped before collecting this receipt loses no measurement.
    try:
        output.mark_done(job.chunk, record=obs.to_dict())
    except OSError as exc:
        raise _write_error(job, exc) from exc
    return Receipt(chunk=job.chunk, output_path=job.output_path, observation=obs.to_dict())


def _write_error(job: BlockJob, exc: OSError) -> OutputWriteError:
    import errno

    hint = {errno.ENOSPC: "the disk is full: free space there",
            errno.EDQUOT: "your disk quota is used up: free space or raise the quota",
            errno.EFBIG: "a file size limit was hit (ulimit -f): raise it",
            errno.EROFS: "the filesystem is read-only: choose a writable output directory",
            errno.EACCES: "permission denied: choose a directory you can write"}.get(
        exc.errno or 0, "fix the cause")
    return OutputWriteError(
        exc.errno or 0,
        f"{job.operator}[{job.label}]: could not write its chunk to {job.output_path} "
        f"({errno.errorcode.get(exc.errno or 0, 'error')}: {exc.strerror or exc}); {hint}, or set the runner's "
        "output_dir (or chunked(..., output=)) to another place. Chunks already written are kept: rerunning the "
        "flow resumes the output")


def job_param_name(bound: inspect.BoundArguments, job: BlockJob) -> str:
    for name, value in bound.arguments.items():
        if value is job:
            return name
    raise RunnerConfigError("internal: the BlockJob is not among the bound arguments")  # pragma: no cover


# =========================================================================== the result of a chunked map


class ChunkedResult(PrefectFutureList):
    """The result of a chunked map: its Prefect futures, and the whole output.

    ``.result()`` returns the output as an ``xarray.DataArray`` over its zarr store
    in the input's geometry. Pass it to ``chunked(...)`` (or straight to the next
    ``.map``) to chain operators. ``decisions`` and ``events`` record what the
    runner decided and why.
    """

    def __init__(self, futures: Iterable[PrefectFuture], *, output_path: str, shape: Shape, chunks: list[Chunk],
                 operator: str, operator_key: str, decisions: list[dict], events: list[dict],
                 observations: list[Observation], budget_bytes: int):
        super().__init__(futures)
        self.output_path = output_path
        self.shape = shape
        self.chunks = chunks
        self.operator = operator
        self.operator_key = operator_key
        self.decisions = decisions
        self.events = events
        self.observations = observations
        self.budget_bytes = budget_bytes

    def result(self, timeout: float | None = None, raise_on_failure: bool = True):  # type: ignore[override]
        from .volume import open_result

        return open_result(self.output_path)

    def wait(self, timeout: float | None = None) -> None:
        return None  # a chunked map returns when every chunk is written

    @property
    def oom_events(self) -> int:
        return sum(1 for e in self.events if e.get("event") in ("memory_error", "killed"))

    def summary(self) -> dict:
        """Plain-data account of this map, for logs, artifacts and the demo."""
        peaks = [o.peak_bytes for o in self.observations if o.outcome == "ok"]
        return {
            "operator": self.operator,
            "operator_key": self.operator_key,
            "decisions": [d["decision"] for d in self.decisions],
            "reasons": [d["reason"] for d in self.decisions],
            "tasks": len(self.observations),
            "chunks": len(self.chunks),
            "oom_events": self.oom_events,
            "recovered": self.oom_events,
            "peak_bytes": max(peaks) if peaks else None,
            "budget_bytes": self.budget_bytes,
            "output": self.output_path,
        }


# =========================================================================== the runner


def parse_bytes(value: int | float | str | None, *, what: str = "memory_budget") -> int | None:
    """``"2GiB"``, ``"512 MB"``, ``2e9`` or ``None`` -> bytes; a bad value is a RunnerConfigError naming ``what``.

    >>> parse_bytes("2GiB"), parse_bytes("1.5 MiB"), parse_bytes(1000), parse_bytes(None)
    (2147483648, 1572864, 1000, None)
    """
    from .errors import BudgetError
    from .units import parse_bytes as parse

    if value is None:
        return None
    try:
        return parse(int(value) if isinstance(value, float) else value)
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
      resting memory; default: derived from the workers' ``memory_limit``;
    - ``target_fraction``: share of a worker's ``memory_limit`` (per thread) the
      derived budget aims at (default 0.75: below Dask's pause 0.80 and kill 0.95);
    - ``store``: path of the observation store (default ``$MEMCHUNK_STORE`` or
      under the Prefect home);
    - ``output_dir``: where chunked outputs go when ``chunked(..., output=)`` is not
      given (default ``$MEMCHUNK_OUTPUT_DIR`` or a per-user temporary directory);
    - ``policy``: a :class:`~memchunk_prefect.policy.PolicySettings` (or a dict of its fields).

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
        target_fraction: float = 0.75,
        store: str | os.PathLike | None = None,
        output_dir: str | os.PathLike | None = None,
        policy: PolicySettings | Mapping[str, Any] | None = None,
    ):
        if cluster is not None:
            raise RunnerConfigError(
                "MemoryAwareRunner does not take a live `cluster` object: it cannot be serialized into task "
                "submissions (prefect-dask #17754). Pass `address=cluster.scheduler_address` instead, or "
                "`cluster_class` and `cluster_kwargs`"
            )
        if address is None and cluster_class is None and not cluster_kwargs:
            cluster_kwargs = _default_cluster_kwargs()
        super().__init__(address=address, cluster_class=cluster_class, cluster_kwargs=cluster_kwargs,
                         adapt_kwargs=adapt_kwargs, client_kwargs=client_kwargs,
                         performance_report_path=performance_report_path)
        if not 0 < float(target_fraction) <= 0.95:
            raise RunnerConfigError(
                f"`target_fraction` must be in (0, 0.95] (Dask's nanny kills a worker at 0.95 of its "
                f"memory_limit), got {target_fraction!r}")
        self.memory_budget = parse_bytes(memory_budget)
        self.target_fraction = float(target_fraction)
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
        self.policy = policy
        self._bank = None
        self._map_count = 0
        self._cluster_checked = False

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
        )

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by settings

    def __getstate__(self) -> dict[str, Any]:
        # Keep submissions cheap: the flow (with its runner) is pickled into every task run.
        state = self.__dict__.copy()
        state["_bank"] = None
        return state

    def __enter__(self):
        super().__enter__()
        self._exit_stack.enter_context(_one_api_for_workers())
        return self

    @property
    def client(self):
        if self._client is None:
            import dask

            # Report a worker's death on the first death instead of retrying it on (and killing) others.
            with dask.config.set({"distributed.scheduler.allowed-failures": ALLOWED_FAILURES}):
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
        from prefect.utilities.annotations import BaseAnnotation

        static = {k: (v.unwrap() if isinstance(v, BaseAnnotation) else v)
                  for k, v in parameters.items() if k != param}
        cmap = ChunkedMap(self, task, param, marker, static, wait_for)
        # --- report (memchunk_prefect/report.py): table + progress artifacts per map, the flow run's summary
        from . import report

        return report.run_reported(cmap)

    # ---------------------------------------------------------------- shared state for maps

    def model_bank(self):
        """The model bank over this runner's store (opened once per flow run)."""
        if self._bank is None:
            from .model import ModelBank
            from .store import Store

            self._bank = ModelBank(Store(self.store))
        return self._bank

    def slots_and_budget(self) -> tuple[int, int]:
        """(task slots in the cluster, per-task memory budget in bytes), read from the live cluster.

        Read afresh at every chunked map: between maps the workers are idle, so
        their process memory is their resting level (which grows once Prefect and
        the operators are imported on them), and the budget is what lies above it.
        """
        info = self.client.scheduler_info(n_workers=-1) if _accepts_n_workers(self.client) else self.client.scheduler_info()
        workers = list(info.get("workers", {}).values())
        deadline = time.monotonic() + 60
        while not workers and time.monotonic() < deadline:  # an adaptive or external cluster still starting
            time.sleep(0.5)
            info = self.client.scheduler_info()
            workers = list(info.get("workers", {}).values())
        if not workers:
            raise RunnerConfigError(
                f"the Dask cluster at {self.client.scheduler.address} has no workers after 60 s: start workers "
                "(`dask worker ADDRESS --memory-limit 4GiB --nthreads 1`) or check adapt_kwargs")
        slots = sum(int(w.get("nthreads", 1)) for w in workers)
        self._check_cluster_once()
        if self.memory_budget is not None:
            budget = self.memory_budget
        else:
            budgets = []
            for w in workers:
                resting = int((w.get("metrics") or {}).get("memory", 0) or 0)
                budgets.append(policy_mod.task_budget_bytes(
                    int(w.get("memory_limit") or 0), int(w.get("nthreads", 1)),
                    target_fraction=self.target_fraction, resting_bytes=resting))
            budget = min(budgets)
        return slots, int(budget)

    def _check_cluster_once(self) -> None:
        """Warn once per flow run when the scheduler retries dead workers' tasks (see policy.allowed_failures_warning)."""
        if self._cluster_checked:
            return
        self._cluster_checked = True
        try:
            # A lambda travels by value, so a scheduler without memchunk installed can run it.
            n = self.client.run_on_scheduler(lambda dask_scheduler: dask_scheduler.allowed_failures)
        except Exception as exc:  # noqa: BLE001 - a scheduler that refuses run_on_scheduler: nothing to say
            logger.info("could not read the scheduler's allowed-failures: %r", exc)
            return
        message = policy_mod.allowed_failures_warning(n, self.client.scheduler.address)
        if message:
            logger.warning("%s", message)
            _flow_logger().warning("memchunk: %s", message)

    def kill_threshold_bytes(self) -> int | None:
        """Smallest memory at which the nanny kills a worker (0.95 x memory_limit), minus its resting memory."""
        info = self.client.scheduler_info()
        out = []
        for w in info.get("workers", {}).values():
            limit = int(w.get("memory_limit") or 0)
            if limit:
                out.append(int(0.95 * limit) - int((w.get("metrics") or {}).get("memory", 0) or 0))
        return min(out) if out else None

    def next_output_path(self, operator: str) -> str:
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else uuid.uuid4().hex
        base = Path(self.output_dir or os.environ.get("MEMCHUNK_OUTPUT_DIR")
                    or Path(tempfile.gettempdir()) / f"memchunk-{_user()}").absolute()
        self._map_count += 1
        # A task name is free text: keep it to one safe path component, and check the result stays inside.
        safe = re.sub(r"[^A-Za-z0-9_.-]", "_", operator).lstrip(".") or "operator"
        _private_dir(base)
        _private_dir(base / run_id)
        path = base / run_id / f"{self._map_count:02d}-{safe}.zarr"
        if not path.resolve().is_relative_to(base.resolve()):
            raise OutputPathError(f"{path}: the output for {operator!r} would leave the output directory {base}")
        return str(path)


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


def _accepts_n_workers(client: Any) -> bool:
    try:
        return "n_workers" in inspect.signature(client.scheduler_info).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return False


def _user() -> str:
    try:
        import getpass

        return getpass.getuser()
    except Exception:  # pragma: no cover
        return str(os.getuid())


@contextlib.contextmanager
def _one_api_for_workers():
    """Give Dask workers the flow's Prefect API, instead of one temporary server per worker.

    With no ``PREFECT_API_URL`` the flow talks to a temporary local server; each
    worker process would otherwise start its own on the same SQLite file (seconds
    per worker, "database is locked"; FACTS.md). The settings context is pickled
    into every submission, so setting the URL here reaches the workers.
    """
    from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

    if get_current_settings().api.url:
        yield
        return
    try:
        from prefect.server.api.server import SubprocessASGIServer

        server = SubprocessASGIServer()
        server.start()
        url = server.api_url
    except Exception as exc:  # pragma: no cover - depends on the local install
        logger.warning("could not share the temporary Prefect server with workers: %r", exc)
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


# =========================================================================== one chunked map


@dataclass
class _Pending:
    chunk: Chunk
    decision: str
    attempt: int = 0


class ChunkedMap:
    """One chunked ``.map`` from decision to finished output. Lives in the flow's thread."""

    def __init__(self, runner: MemoryAwareRunner, task: Any, param: str, marker: Chunked,
                 static: dict[str, Any], wait_for: Iterable[PrefectFuture] | None):
        from .volume import as_source

        self.runner = runner
        self.task = task
        self.param = param
        self.static = static
        self.wait_for = list(wait_for) if wait_for else None
        self.spec = spec_of(task)
        self.name = operator_name(task)
        upstream = marker.source if isinstance(marker.source, ChunkedResult) else None
        self.incoming = list(upstream.chunks) if upstream is not None else None
        try:
            self.source = as_source(upstream.output_path if upstream is not None else marker.source)
        except ChunkedSourceError:
            raise
        self.shape: Shape = tuple(int(s) for s in self.source.shape)  # type: ignore[assignment]
        if "sample_interval_ms" in inspect.signature(task.fn).parameters and "sample_interval_ms" not in static:
            # Operators that need the sample interval get the volume's own, from its headers.
            interval = self.source.coords().get("sample_interval_ms")
            if interval:
                static["sample_interval_ms"] = float(interval)
        self.halo = marker.halo if marker.halo is not None else self.spec.halo_for(static)
        self.whole_traces = self.spec.whole_traces
        self.key = operator_key(task, static, dtype="float32")
        self.output_path = marker.output or runner.next_output_path(self.name)
        # What an existing output must have been computed from to be resumed rather than recomputed: the
        # operator key holds only memory parameters, so every parameter and the halo are added here.
        self.identity = {"operator_key": self.key, "input": self.source.identity(), "code": _code_digest(task.fn),
                         "params": _params_digest(static), "halo": list(self.halo)}
        self.settings = runner.policy
        self.decisions: list[dict] = []
        self.events: list[dict] = []
        self.observations: list[Observation] = []
        self.futures: list[PrefectDaskFuture] = []
        self.done: list[Chunk] = []
        self.region_reason = "after probing: "  # why boxes planned in the loop are planned (for the log)
        self.reporter = None  # --- report: a memchunk_prefect.report.MapReporter, set by report.run_reported

    # ---------------------------------------------------------------- model access

    def predict(self, extents: Shape):
        return self.runner.model_bank().predict(self.key, extents, 4)

    def seconds_per_element(self) -> float | None:
        obs = [o for o in self.runner.model_bank().store.observations(self.key) if o.outcome == "ok" and o.elements]
        if not obs:
            return None
        rates = sorted(o.seconds / o.elements for o in obs[-20:])
        return rates[len(rates) // 2]

    def learn(self, obs: Observation) -> None:
        self.observations.append(obs)
        try:
            self.runner.model_bank().learn(obs)
        except Exception as exc:  # the store must never stop a run; say so loudly
            logger.warning("could not record an observation for %s: %r", self.key, exc)

    def record(self, decision: str, plan: policy_mod.Plan | None, reason: str, **extra: Any) -> None:
        entry = {"decision": decision, "reason": reason, "operator": self.name, "operator_key": self.key,
                 "n_chunks": plan.n_chunks if plan else None,
                 "chunk_shape": list(plan.chunk_shape) if plan else None,
                 "predicted_peak_bytes": plan.predicted_peak_bytes if plan else None,
                 "upper_bound_bytes": plan.upper_bound_bytes if plan else None, "time": time.time(), **extra}
        self.decisions.append(entry)
        logger.info("%s: %s — %s", self.name, decision, reason)
        _flow_logger().info("memchunk %s: %s — %s", self.name, decision, reason)

    # ---------------------------------------------------------------- the loop

    def run(self) -> ChunkedResult:

        slots, budget = self.runner.slots_and_budget()
        self.slots, self.budget = slots, budget
        out, done_before = self.open_output()
        self.out = out
        self.done.extend(done_before)
        from prefect.cache_policies import NO_CACHE

        # A chunk's effect is its write: never serve it from a cache.
        wrapped = self.task.with_options(task_run_name=chunk_task_run_name, cache_policy=NO_CACHE)
        wrapped.fn = BlockFunction(self.task.fn, self.param)
        self.wrapped = wrapped

        queue: list[_Pending] = []
        regions: list[Chunk] = []  # boxes still to plan (after a probe, or what a resumed output lacks)
        planned_upper: float | None = None
        if done_before:
            # Resume: plan only what the completed chunks (of whatever cut) do not cover.
            self.recover_observations(done_before)
            regions = uncovered_boxes(self.shape, done_before)
            self.region_reason = "the part a resumed output lacks: "
            self.record("resume", None, f"resuming {self.output_path}: {len(done_before)} chunks already written; "
                                        + (f"{len(regions)} boxes left to compute" if regions else "nothing left"))
        else:
            decision = policy_mod.decide(self.shape, self.incoming, budget_bytes=budget, predict=self.predict,
                                         halo=self.halo, slots=slots, whole_traces=self.whole_traces,
                                         seconds_per_element=self.seconds_per_element(), settings=self.settings)
            self.record(decision.decision, decision.plan, decision.reason)
            plan = decision.plan
            queue.extend(_Pending(c, decision.decision) for c in plan.chunks)
            regions.extend(plan.remainder)
            planned_upper = plan.upper_bound_bytes
        in_flight: dict[Any, tuple[_Pending, PrefectDaskFuture, float]] = {}
        try:
            self.loop(queue, regions, planned_upper, in_flight)
        except BaseException as exc:  # Ctrl-C, a Prefect cancellation (TerminationSignal), a lost cluster, ...
            self.abandon(in_flight, exc)
            raise
        return self.finalize()

    def loop(self, queue: list[_Pending], regions: list[Chunk], planned_upper: float | None,
             in_flight: dict[Any, tuple[_Pending, PrefectDaskFuture, float]]) -> None:
        """Submit, collect and re-plan until every box is written. ``in_flight`` is the caller's, for cleanup."""
        from distributed import as_completed

        slots, budget = self.slots, self.budget
        probe_scale = 1.0
        ac = as_completed(loop=self.runner.client.loop)
        max_in_flight = max(2 * slots, slots + 1)
        while queue or in_flight or regions:
            # Submit up to the in-flight cap; the rest stays re-plannable.
            while queue and len(in_flight) < max_in_flight:
                item = queue.pop(0)
                fut = self.submit(item)
                in_flight[fut.wrapped_future.key] = (item, fut, time.time())
                ac.add(fut.wrapped_future)
            if not in_flight:
                # Probes finished: plan every box left at once (so no slot waits for a small box), or
                # probe again with larger chunks while the history is still too short.
                pending_regions, regions = regions, []
                for index, region in enumerate(pending_regions):
                    p = policy_mod.plan(self.shape, budget_bytes=budget, predict=self.predict, halo=self.halo,
                                        slots=slots, whole_traces=self.whole_traces, region=region,
                                        seconds_per_element=self.seconds_per_element(), settings=self.settings)
                    if p.probe:
                        probe_scale *= 2
                        p = policy_mod.probe_plan(self.shape, budget_bytes=budget, halo=self.halo, slots=slots,
                                                  whole_traces=self.whole_traces, region=region,
                                                  settings=self.settings, scale=probe_scale, reason=p.reason)
                        self.record(PROBE, p, p.reason, region=region.key())
                        queue.extend(_Pending(c, p.decision) for c in p.chunks)
                        regions = list(p.remainder) + pending_regions[index + 1:]
                        break
                    self.record(RECHUNK, p, self.region_reason + p.reason, region=region.key())
                    queue.extend(_Pending(c, p.decision) for c in p.chunks)
                if not regions:
                    planned_upper = self.queue_bound(queue)
                continue
            dask_future = next(ac)
            item, fut, t0 = in_flight[dask_future.key]
            self.finish(item, fut, dask_future, queue)  # if it raises, the item stays in flight for abandon()
            del in_flight[dask_future.key]
            if self.reporter is not None:  # --- report: progress artifact, table row
                self.reporter.chunk_finished(item)
            # Mid-map: when the bound for what is queued moved enough, re-plan the unsubmitted remainder.
            # Like is compared with like: the bound of the largest queued chunk now, against the same
            # figure when the queue was (re)planned.
            if queue and planned_upper is not None and not any(q.decision == RETRY_SMALLER for q in queue):
                new_upper = self.queue_bound(queue)
                if new_upper is not None and policy_mod.bound_moved(planned_upper, new_upper, self.settings):
                    queue[:], _ = self.replan(queue, planned_upper, new_upper)
                    planned_upper = self.queue_bound(queue)

    def recover_observations(self, chunks: Iterable[Chunk]) -> int:
        """Store the observations that completion markers carry and the store lacks; returns how many.

        A run stopped between a chunk's write and the flow collecting its receipt
        (Ctrl-C, a cancelled or killed flow process, a lost scheduler) left the
        measurement only in the marker. Matched by (chunk, created_at), so nothing
        is stored twice.
        """
        records = [Observation.from_dict(r) for r in self.out.done_records(chunks)]
        records = [o for o in records if o.operator_key == self.key]
        if not records:
            return 0
        bank = self.runner.model_bank()
        have = {(o.chunk, o.created_at) for o in bank.store.observations(self.key)}
        n = 0
        for obs in records:
            if (obs.chunk, obs.created_at) not in have:
                try:
                    bank.learn(obs)
                    n += 1
                except Exception as exc:  # the store must never stop a run
                    logger.warning("could not record an observation for %s: %r", self.key, exc)
        if n:
            logger.info("%s: stored %d observations recovered from completion markers", self.name, n)
        return n

    def abandon(self, in_flight: dict[Any, tuple[_Pending, PrefectDaskFuture, float]], exc: BaseException) -> None:
        """The map stops early: keep what finished, stop what did not, leave no task run RUNNING.

        Chunks whose task already returned are learned from (their observation is
        stored, their completion marker is on disk); the others are cancelled on the
        cluster and their Prefect task runs marked Cancelled (interrupted) or Crashed
        (cluster lost). Nothing is finalized: the output stays resumable.
        """
        from prefect.states import State

        interrupted = not isinstance(exc, Exception)  # KeyboardInterrupt, TerminationSignal, SystemExit
        kept = 0
        unsettled: list[tuple[_Pending, PrefectDaskFuture]] = []
        for item, fut, _ in list(in_flight.values()):
            dask_future = fut.wrapped_future
            state = None
            with contextlib.suppress(BaseException):
                if dask_future.status == "finished":
                    state = dask_future.result(timeout=5)
            if isinstance(state, State) and state.is_completed():
                with contextlib.suppress(Exception):
                    receipt = state.result()
                    self.learn(Observation.from_dict(receipt.observation))
                    self.done.append(item.chunk)
                    kept += 1
                    continue
            with contextlib.suppress(BaseException):
                dask_future.cancel()
            unsettled.append((item, fut))
        # Cancelling first, then marking: a task a worker started just before the cancellation reached it
        # creates its task run a moment later, so runs not found yet are looked for again for up to 2 s.
        why = ("the flow run was interrupted or cancelled" if interrupted else
               f"the chunked map stopped ({type(exc).__name__})")
        deadline = time.monotonic() + 2.0
        while unsettled:
            missing = [(item, fut) for item, fut in unsettled
                       if _set_task_run_state(fut.task_run_id, "Cancelled" if interrupted else "Crashed",
                                              f"{why} before {self.name}[{item.chunk.label(self.shape)}] finished; "
                                              "the chunk is not marked written and is computed when the flow runs "
                                              "again") == "missing"]
            if not missing or time.monotonic() > deadline:
                break
            unsettled = missing
            time.sleep(0.25)
        # Chunks that finished on their worker after the last receipt was taken: keep their measurements too.
        with contextlib.suppress(BaseException):
            self.recover_observations([item.chunk for item, _, _ in in_flight.values()
                                       if item.chunk not in self.done and self.out.is_done(item.chunk)])
        in_flight.clear()
        with contextlib.suppress(BaseException):
            written = len(self.out.completed_chunks())
            logger.warning("%s: stopped early (%s); %d chunks are marked written in %s (kept: a rerun resumes "
                           "there); %d were collected while stopping", self.name, type(exc).__name__, written,
                           self.output_path, kept)

    def queue_bound(self, queue: list[_Pending]) -> float | None:
        """The model's upper bound (bytes) for the largest queued chunk with its halo; None while not ready."""
        if not queue:
            return None
        largest = max(queue, key=lambda q: q.chunk.elements).chunk
        pred = self.predict(policy_mod._extents_with_halo(largest.shape, self.halo, self.shape))
        return float(pred.upper_bytes) if getattr(pred, "ready", True) else None

    def open_output(self) -> tuple[Any, list[Chunk]]:
        """Create the output store, or resume one computed from the same input, operator and code.

        Returns the store and the chunks already written to it. An existing store at
        the path resumes when its recorded identity (operator key with its memory
        parameters, the input's :meth:`~memchunk_prefect.volume.Source.identity`, a
        digest of the task's source code) equals this map's: completed chunks are
        kept and only what they do not cover is computed (all of it is kept when it
        is complete). A store of the same operator and shape computed from anything
        else is replaced; a store of another operator or shape is never touched.
        """
        import json

        import zarr

        from .volume import ZarrOutput

        # JSON round trip: the identity is compared with what the store's attributes give back.
        identity = json.loads(json.dumps(self.identity))
        attrs = {"operator": self.name, "operator_key": self.key, "memchunk_identity": identity}
        try:
            return ZarrOutput.create(self.output_path, self.shape, self.source.coords(), dtype="float32",
                                     attrs=attrs), []
        except OutputPathError:
            pass
        existing = ZarrOutput.open(self.output_path)
        found = dict(zarr.open_group(self.output_path, mode="r").attrs)
        if existing.shape != self.shape or found.get("operator_key") != self.key:
            raise OutputPathError(
                f"{self.output_path}: already holds output of {found.get('operator_key')!r} with shape "
                f"{existing.shape}, not {self.key!r} with shape {self.shape}; choose another output path")
        if identity["input"] is not None and found.get("memchunk_identity") == identity:
            return existing, existing.completed_chunks()
        if identity["input"] is None:
            why = ("its input (an array in memory, or a zarr store not written by memchunk) cannot be identified "
                   "without reading it all")
        else:
            old = found.get("memchunk_identity") or {}
            names = {"input": "another input (or the input changed since)", "code": "other task code",
                     "params": "other parameters", "halo": "another halo"}
            why = "it was computed from " + (" and ".join(v for k, v in names.items() if old.get(k) != identity[k])
                                             or "something else")
        self.record("restart", None, f"{self.output_path} is replaced: {why}")
        return ZarrOutput.create(self.output_path, self.shape, self.source.coords(), dtype="float32",
                                 attrs=attrs, overwrite=True), []

    def submit(self, item: _Pending) -> PrefectDaskFuture:
        job = BlockJob(source=self.source, chunk=item.chunk, halo=self.halo, volume_shape=self.shape,
                       output_path=self.output_path, operator=self.name, operator_key=self.key,
                       budget_bytes=self.budget, label=item.chunk.label(self.shape))
        params = dict(self.static)
        params[self.param] = job
        fut = DaskTaskRunner.submit(self.runner, self.wrapped, params, wait_for=self.wait_for)
        self.futures.append(fut)
        if self.reporter is not None:  # --- report: the model's prediction for this chunk, for the table
            self.reporter.submitted(item)
        return fut

    def replan(self, queue: list[_Pending], old_upper: float, new_upper: float) -> tuple[list[_Pending], float]:
        boxes, kept = policy_mod.remaining_boxes([q.chunk for q in queue])
        keep = set(kept)
        out = [q for q in queue if q.chunk in keep]
        upper = new_upper
        for box in boxes:
            p = policy_mod.plan(self.shape, budget_bytes=self.budget, predict=self.predict, halo=self.halo,
                                slots=self.slots, whole_traces=self.whole_traces, region=box,
                                seconds_per_element=self.seconds_per_element(), settings=self.settings)
            if p.probe:  # cannot happen once ready; keep the old cut
                out.extend(_Pending(c, RECHUNK) for c in box_chunks(queue, box))
                continue
            self.record(RECHUNK, p, f"mid-map re-plan: the upper bound moved from {format_bytes(old_upper)} to "
                                    f"{format_bytes(new_upper)}; " + p.reason, region=box.key())
            out.extend(_Pending(c, RECHUNK) for c in p.chunks)
            upper = p.upper_bound_bytes or upper
        return out, upper

    def finish(self, item: _Pending, fut: PrefectDaskFuture, dask_future: Any, queue: list[_Pending]) -> None:
        """Take one finished submission: learn from it, or split it, or fail the map."""
        from prefect.states import State

        try:
            state = dask_future.result()
        except Exception as exc:  # the worker died (KilledWorker), or the cluster went away
            if dask_future.status == "cancelled" or self.runner.client.status not in ("running", "connecting"):
                # No worker death: the scheduler forgot the task (it was killed, restarted, or unreachable).
                detail = " ".join(str(exc).split())
                written = len(self.out.completed_chunks())
                raise ClusterLostError(
                    f"lost the Dask scheduler at {self.runner.client.scheduler.address} while running "
                    f"{self.name} ({type(exc).__name__}: {detail}); the {written} chunks written so far are kept in "
                    f"{self.output_path}. Start the scheduler again (or point the runner at a live one) and rerun "
                    "the flow: it resumes the output and computes only the missing chunks") from exc
            self.on_killed(item, fut, exc, queue)
            return
        finally:
            with contextlib.suppress(Exception):
                dask_future.release()  # completed results must not be recomputed if a worker dies later
        if isinstance(state, State):
            fut._final_state = state
        if isinstance(state, State) and state.is_completed():
            receipt = state.result()
            obs = Observation.from_dict(receipt.observation)
            self.learn(obs)
            self.done.append(item.chunk)
            self.events.append({"event": "ok", "chunk": item.chunk.key(), "decision": item.decision,
                                "peak_bytes": obs.peak_bytes, "seconds": obs.seconds, "worker": obs.worker})
            return
        exc = state.result(raise_on_failure=False) if isinstance(state, State) else state
        if isinstance(exc, MemoryError) or _is_memory_error(exc):
            obs_dict = getattr(exc, "observation", None)
            obs = Observation.from_dict(obs_dict) if obs_dict else self.flow_side_observation(
                item, "memory_error", peak_bytes=self.budget)
            self.learn(obs)
            self.events.append({"event": "memory_error", "chunk": item.chunk.key(), "decision": item.decision,
                                "peak_bytes": obs.peak_bytes, "worker": obs.worker})
            self.retry_smaller(item, queue, needed_bytes=obs.peak_bytes, cause="MemoryError")
            return
        # Any other failure is the operator's own: stop and say which chunk.
        if isinstance(exc, BaseException):
            raise exc
        raise MemchunkError(f"{self.name}[{item.chunk.label(self.shape)}] ended in state {state!r}")

    def flow_side_observation(self, item: _Pending, outcome: str, *, peak_bytes: int | None) -> Observation:
        """The record of a run the worker could not report (its process died): from what the flow knows."""
        read, _ = with_halo(item.chunk, self.halo, self.shape)
        return Observation(operator_key=self.key, elements=read.elements, extents=read.shape,
                           bytes_in=read.elements * 4, peak_bytes=int(peak_bytes or 0), outcome=outcome,
                           censored=outcome in ("memory_error", "killed") and bool(peak_bytes),
                           chunk=item.chunk.key(), budget_bytes=self.budget, method="flow")

    def on_killed(self, item: _Pending, fut: PrefectDaskFuture, exc: BaseException, queue: list[_Pending]) -> None:
        if self.out.is_done(item.chunk):
            # The worker died after writing the chunk and its marker (before returning): keep it, do not redo it.
            _mark_crashed(fut.task_run_id, f"worker died after {self.name}[{item.chunk.label(self.shape)}] was "
                                           "written; the chunk is kept")
            self.done.append(item.chunk)
            self.recover_observations([item.chunk])
            self.events.append({"event": "lost", "chunk": item.chunk.key(), "decision": item.decision,
                                "kept": True})
            return
        threshold = self.runner.kill_threshold_bytes() or self.budget
        pred = self.predict(policy_mod._extents_with_halo(item.chunk.shape, self.halo, self.shape))
        upper = getattr(pred, "upper_bytes", None) if getattr(pred, "ready", False) else None
        # A worker killed while its chunk was predicted far below the kill line was most likely killed for
        # another reason (a node lost, SIGKILL): run the same chunk again once, and learn nothing from it.
        memory_kill = upper is None or upper > 0.5 * threshold or item.attempt > 0
        message = (f"worker running {self.name}[{item.chunk.label(self.shape)}] died ({type(exc).__name__}); "
                   + ("treated as out of memory: the chunk is split and resubmitted" if memory_kill
                      else "resubmitting the same chunk"))
        _mark_crashed(fut.task_run_id, message)
        if memory_kill:
            obs = self.flow_side_observation(item, "killed", peak_bytes=threshold)
            self.learn(obs)
            self.events.append({"event": "killed", "chunk": item.chunk.key(), "decision": item.decision,
                                "peak_bytes": obs.peak_bytes, "worker": ""})
            self.retry_smaller(item, queue, needed_bytes=threshold, cause="worker killed")
        else:
            self.learn(self.flow_side_observation(item, "error", peak_bytes=0))
            self.events.append({"event": "lost", "chunk": item.chunk.key(), "decision": item.decision})
            queue.insert(0, _Pending(item.chunk, item.decision, item.attempt + 1))

    def retry_smaller(self, item: _Pending, queue: list[_Pending], *, needed_bytes: int, cause: str) -> None:
        pieces = policy_mod.split_chunk(item.chunk, whole_traces=self.whole_traces)
        label = item.chunk.label(self.shape)
        if not pieces:
            raise ChunkOutOfMemoryError(
                f"{self.name}[{label}] ran out of memory ({cause}) and cannot be split further "
                f"(shape {item.chunk.shape}{', whole traces' if self.whole_traces else ''}): it needed more than "
                f"{format_bytes(needed_bytes)} with a budget of {format_bytes(self.budget)} per task. Give workers "
                "more memory (memory_limit), fewer threads per worker, or a smaller operator parameter",
                operator=self.key, chunk=item.chunk, budget_bytes=self.budget, needed_bytes=needed_bytes)
        self.record(RETRY_SMALLER, None,
                    f"{label} ran out of memory ({cause}, needed more than {format_bytes(needed_bytes)}): split "
                    f"into {len(pieces)} pieces of {pieces[0].shape}", chunk=item.chunk.key())
        for piece in reversed(pieces):
            queue.insert(0, _Pending(piece, RETRY_SMALLER, item.attempt + 1))

    def settle_task_runs(self) -> int:
        """Give the Prefect API the final state of task runs whose worker died right after finishing them.

        A task run's final state leaves its worker as an event sent in the
        background; a worker killed just after a task returned can take that event
        with it, leaving the run RUNNING in the UI although the flow holds its
        Completed state (and the chunk is written). Called when a worker died
        during the map; one bulk read of this map's task runs. Returns how many
        runs were set.
        """
        from prefect.client.orchestration import get_client
        from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
        from prefect.states import Completed

        held = [f.task_run_id for f in self.futures
                if getattr(f, "_final_state", None) is not None and f._final_state.is_completed()]
        fixed = 0
        try:
            with get_client(sync_client=True) as client:
                for i in range(0, len(held), 200):
                    ids = held[i:i + 200]
                    runs = client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=ids)),
                                                 limit=len(ids))
                    for r in runs:
                        if r.state is None or not r.state.is_final():
                            client.set_task_run_state(r.id, Completed(
                                message="completed; its worker died before reporting it"), force=True)
                            fixed += 1
        except Exception as exc:
            logger.info("could not settle the task runs of %s: %r", self.name, exc)
        return fixed

    def finalize(self) -> ChunkedResult:
        self.out.finalize()  # raises IncompleteOutputError unless every element was written
        if any(e["event"] in ("lost", "killed") for e in self.events):
            self.settle_task_runs()
        for f in self.futures:
            with contextlib.suppress(Exception):
                f.wrapped_future.release()
        return ChunkedResult(self.futures, output_path=self.output_path, shape=self.shape,
                             chunks=sorted(self.done), operator=self.name, operator_key=self.key,
                             decisions=self.decisions, events=self.events, observations=self.observations,
                             budget_bytes=self.budget)


def box_chunks(queue: list[_Pending], box: Chunk) -> list[Chunk]:
    return [q.chunk for q in queue if box.contains(q.chunk)]


def _is_memory_error(exc: Any) -> bool:
    return isinstance(exc, BaseException) and type(exc).__name__ in ("MemoryError", "ChunkMemoryError",
                                                                      "_ArrayMemoryError")


def _mark_crashed(task_run_id: Any, message: str) -> None:
    """Mark a task run whose worker died as Crashed: nothing else will (prefect #12968, #21638)."""
    _set_task_run_state(task_run_id, "Crashed", message)


def _set_task_run_state(task_run_id: Any, name: str, message: str) -> str:
    """Force a task run into a final state (``Crashed`` or ``Cancelled``) unless it has one.

    Returns ``"set"``, ``"final"`` (left alone), ``"missing"`` (not created: its
    worker never started it) or ``"error"``.
    """
    try:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound
        from prefect.states import Cancelled, Crashed

        state = {"Crashed": Crashed, "Cancelled": Cancelled}[name](message=message)
        with get_client(sync_client=True) as client:
            try:
                current = client.read_task_run(task_run_id).state
            except ObjectNotFound:  # the worker never started it (yet): nothing to mark
                return "missing"
            if current is not None and current.is_final():
                return "final"
            client.set_task_run_state(task_run_id, state, force=True)
            return "set"
    except Exception as exc:
        logger.info("could not mark task run %s %s: %r", task_run_id, name, exc)
        return "error"


def _params_digest(params: Mapping[str, Any]) -> str:
    """SHA-256 of a map's other arguments (JSON where possible, else their repr; arrays by content)."""
    import hashlib
    import json

    def plain(v: Any) -> Any:
        if isinstance(v, np.ndarray):
            return {"ndarray": hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest(), "dtype": str(v.dtype),
                    "shape": list(v.shape)}
        if isinstance(v, (list, tuple)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {str(k): plain(x) for k, x in v.items()}
        return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)

    return hashlib.sha256(json.dumps(plain(dict(params)), sort_keys=True).encode()).hexdigest()


def _code_digest(fn: Any) -> str:
    """SHA-256 of a task function's source (its bytecode when the source is not available)."""
    import hashlib

    try:
        text = inspect.getsource(fn).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        text = code.co_code + repr(code.co_consts).encode() if code is not None else repr(fn).encode()
    return hashlib.sha256(text).hexdigest()


def _flow_logger():
    try:
        from prefect.logging import get_run_logger

        return get_run_logger()
    except Exception:
        return logger
