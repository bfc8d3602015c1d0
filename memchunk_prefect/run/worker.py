"""The worker side of a chunked map: what is pickled to Dask workers, and nothing else.

Each chunk runs as an ordinary Prefect task run of the user's task, whose
function is wrapped in a :class:`BlockFunction` and whose chunked argument is a
:class:`BlockJob` (paths and ints, never arrays). On the worker,
:func:`run_block` reads the block (halo included) straight from the source,
runs the user's function on it, trims the halo, writes the region of the
output zarr store and its completion marker (which carries the measurement),
all measured as one run, and returns a small :class:`Receipt`. A ``MemoryError``
becomes a :class:`~memchunk_prefect.core.errors.ChunkMemoryError` carrying the
censored observation, so the flow can learn from it and split the chunk.

Large arrays never travel through the flow process or the Prefect API.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import importlib
import inspect
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Iterator

import dask
import numpy as np
import psutil
from distributed import get_worker

from memchunk_prefect.core.budget import memory_fraction
from memchunk_prefect.core.chunks import Chunk, Shape, with_halo
from memchunk_prefect.core.errors import (
    ChunkDeferredError,
    ChunkMemoryError,
    GpuContextError,
    OutputWriteError,
    RunnerConfigError,
    VolumeError,
    format_bytes,
)
from memchunk_prefect.core.records import Observation
from memchunk_prefect.core.settings import DTYPE, ITEMSIZE
from memchunk_prefect.io.zarr_store import ZarrOutput
from memchunk_prefect.operators.device import (
    CUDA,
    GpuUse,
    backend,
    is_gpu_context_error,
    is_gpu_out_of_memory,
    release_frames,
)
from memchunk_prefect.run import hydration
from memchunk_prefect.run.logs import heartbeat_at_close_quiet
from memchunk_prefect.run.monitor import default_monitor
from memchunk_prefect.run.process_memory import runs_open

# A worker's close cutting its own heartbeat short is not an error (see HeartbeatAtClose): this module is
# imported by every worker that runs a chunk, and by the server local workers are forked from.
heartbeat_at_close_quiet()


@dataclass(frozen=True)
class BlockJob:
    """Everything a worker needs to run one chunk: small (paths and ints, no arrays)."""

    source: Any  # a memchunk_prefect.io.volume source (SegySource, ZarrSource, ArraySource)
    chunk: Chunk
    halo: Shape
    volume_shape: Shape
    output_path: str
    operator: str
    operator_key: str
    budget_bytes: int
    label: str
    device: str = "cpu"  # where the operator computes ("cpu" or "cuda", resolved by the flow)
    gpu_budget_bytes: int | None = None  # on the GPU: what one task may use of the device's memory, bytes
    upper_bytes: int | None = None  # the plan's bound for the block above where its run starts, bytes (None: none)

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


def _where(fn: Any) -> tuple[str, str] | None:
    """``(module, qualified name)`` under which ``fn`` (or the Prefect task wrapping it) is found again, or None."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<locals>" in name:
        return None
    return (module, name) if _find(module, name) is fn else None


def _find(module: str, name: str) -> Any:
    """The function at ``module.name`` (a Prefect task's ``fn`` where the name is a task), or None."""
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except Exception:  # noqa: BLE001 - not importable here: the caller keeps the copy shipped by value
        return None
    obj = getattr(obj, "fn", obj)
    return obj if callable(obj) else None


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

    def __getstate__(self) -> dict[str, Any]:
        """Pickled with where the function lives (module, qualified name) beside the function itself.

        A function decorated as a Prefect task is not its module's attribute (the task is), so cloudpickle ships
        it by value, and every task run's copy gets a fresh copy of the module's globals: a cache the operator
        keeps at module level (a model, a lookup table, a library's first load) is rebuilt, and held again, by
        every chunk on the same worker. Found again by its name on the worker, it is the module's own function,
        with one set of globals per worker, as in a plain Python process. Where the module does not import there
        (a notebook, ``__main__``), the copy shipped by value is used."""
        state = dict(self.__dict__)
        state["_where"] = _where(self.fn)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        where = state.pop("_where", None)
        found = _find(*where) if where else None
        if found is not None:
            state["fn"] = state["__wrapped__"] = found
        self.__dict__.update(state)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = inspect.signature(self.fn).bind(*args, **kwargs)
        job = bound.arguments[self.param]
        if not isinstance(job, BlockJob):  # called outside the runner: behave as the plain function
            return self.fn(*args, **kwargs)
        # This worker's later task runs validate the flow's settings once and share one API client per thread
        # (see that module).
        hydration.install()
        try:
            return already_written(job) or run_block(self.fn, job, bound)
        except BaseException as exc:
            # Dask and Prefect keep a failed task's exception, whose traceback keeps the block and the operator's
            # arrays (host and GPU) alive in this worker: drop them, so a chunk that ran out of memory leaves
            # none of it held for the next one (memchunk_prefect.operators.device.release_frames).
            del bound
            release_frames(exc)
            raise


STARTED_TOPIC = "memchunk-chunk-started"
"""The Dask event topic under which a worker tells the scheduler that a chunk began (its Prefect task run id)."""


def tell_started() -> None:
    """Log this chunk's start on the scheduler (:data:`STARTED_TOPIC`, ``{"task_run": id}``).

    Dask fails every task assigned to a worker that dies when no failure is allowed, the ones only queued
    there too; these events are what tells the flow which of them had begun
    (:func:`memchunk_prefect.run.cluster.read_started`). Never fails the chunk."""
    run = _task_run_id()
    if run:
        with contextlib.suppress(Exception):  # not on a Dask worker (a plain call, a test): nothing to tell
            get_worker().log_event(STARTED_TOPIC, {"task_run": run})


def kill_line_bytes() -> int | None:
    """This worker's kill line: its ``memory_limit`` times ``distributed.worker.memory.terminate``, bytes; None
    where the nanny kills nothing (no limit, no fraction) or this is no Dask worker."""
    try:
        limit = get_worker().memory_manager.memory_limit
    except Exception:  # noqa: BLE001 - not on a Dask worker
        return None
    fraction = memory_fraction(dask.config.get("distributed.worker.memory.terminate", None))
    return int(limit * fraction) if limit and fraction else None


def check_room(job: BlockJob) -> None:
    """Raise :class:`~memchunk_prefect.core.errors.ChunkDeferredError` where this worker process already holds so
    much that the chunk's bound (``job.upper_bytes``) on top would pass its kill line (:func:`kill_line_bytes`).

    The plan was made for where the worker stood when the flow last heard of it; another map's first use, or
    memory another map's runs left here, may have come since, and a chunk already submitted cannot be recalled.
    Checked only where no other tracked run is open in the process (their memory is theirs, not where this
    worker stands), and only for a chunk with a bound."""
    if job.upper_bytes is None or runs_open():
        return
    kill = kill_line_bytes()
    if kill is None:
        return
    held = psutil.Process().memory_info().rss  # what the nanny compares with its kill line
    if held + job.upper_bytes > kill:
        worker = _worker_name()
        raise ChunkDeferredError(
            f"{job.operator}[{job.label}] did not start on {worker}: the worker holds {format_bytes(held)}, and the "
            f"chunk's bound ({format_bytes(job.upper_bytes)}) would pass its kill line ({format_bytes(kill)}); "
            "the runner plans it again for what the worker holds", worker=worker, process_bytes=held,
            upper_bytes=job.upper_bytes, kill_bytes=kill)


def _worker_name() -> str:
    try:
        return get_worker().address
    except Exception:  # noqa: BLE001 - not on a Dask worker (a plain call, a test)
        return f"pid:{os.getpid()}"


def _task_run_id() -> str:
    """The Prefect task run this chunk runs in ("" outside one)."""
    try:
        from prefect.context import TaskRunContext

        ctx = TaskRunContext.get()
        return str(ctx.task_run.id) if ctx is not None else ""
    except Exception:  # noqa: BLE001 - never let bookkeeping fail a chunk
        return ""


_CALLED: set[str] = set()
"""Operator keys this worker process has run a block of: a run of a key not in it is the process's first call
(``Observation.first_call``). Added as a run ends, so runs that start together on a fresh worker of several
threads are each a first call: each waits on the same imports."""


def run_block(fn: Any, job: BlockJob, bound: inspect.BoundArguments) -> Receipt:
    """Read the block, run ``fn`` on it, trim the halo, write the region; measure all of it.

    The measurement covers read + compute + write, because the worker's memory
    limit applies to all of it. On a GPU (``job.device == "cuda"``) the operator's
    call is also measured on the device (:meth:`memchunk_prefect.operators.device.Backend.track`:
    ``gpu_peak_bytes`` is then its peak above what the device held before, not
    NVML's absolute figure), and a GPU out-of-memory is a censored observation as a
    host one is. Runs on the worker.
    """
    tell_started()
    check_room(job)
    read_chunk, trim = with_halo(job.chunk, job.halo, job.volume_shape)
    base = _observation_base(job, read_chunk)
    gpu = GpuUse()
    param = job_param_name(bound, job)
    if job.device == CUDA:
        # CuPy and its kernels stay loaded in the worker for every later chunk: load them before the measurement so
        # they are not charged to this chunk as working memory (the CPU's libraries load with the operator modules).
        backend(CUDA).load()
    try:
        with default_monitor().track() as run:
            block = job.source.read(read_chunk)
            bound.arguments[param] = block
            with _on_device(job) as gpu:
                out = np.asarray(fn(*bound.args, **bound.kwargs))
            output = _write_region(job, block, out, trim)
            # Nothing of the chunk outlives the measurement: what the process still holds at its end is what the
            # run left behind (Observation.retained_bytes), not this block.
            bound.arguments[param] = job
            del block, out
    except MemoryError as exc:
        raise _out_of_memory(job, base, gpu, exc) from exc
    except Exception as exc:
        if not is_gpu_context_error(exc):
            raise
        raise GpuContextError(
            f"{job.operator}[{job.label}] hit a CUDA error that leaves the GPU context of worker {base['worker']} "
            f"unusable ({exc!r})", worker=base["worker"]) from exc
    finally:
        _CALLED.add(job.operator_key)
    assert run.measurement is not None  # set when the track() block exits
    return _receipt(job, output, _observation(base, run.measurement.observation_fields(), gpu))


def _observation_base(job: BlockJob, read_chunk: Chunk) -> dict[str, Any]:
    """The observation's fields known before the run: the chunk read (halo included, bytes), where, when, budgets."""
    return dict(
        operator_key=job.operator_key, elements=read_chunk.elements, extents=read_chunk.shape,
        bytes_in=read_chunk.elements * ITEMSIZE, worker=_worker_name(), chunk=job.chunk.key(),
        budget_bytes=job.budget_bytes, started_at=time.time(), task_run_id=_task_run_id(),
        host=socket.gethostname(), gpu_budget_bytes=job.gpu_budget_bytes,
        first_call=job.operator_key not in _CALLED)


@contextlib.contextmanager
def _on_device(job: BlockJob) -> Iterator[GpuUse]:
    """Around the operator's call: its GPU memory measured on a GPU; on the CPU an empty :class:`GpuUse`."""
    if job.device == CUDA:
        with backend(CUDA).track() as gpu:
            yield gpu
    else:
        yield GpuUse()


def _write_region(job: BlockJob, block: np.ndarray, out: np.ndarray,
                  trim: tuple[slice, slice, slice]) -> ZarrOutput:
    """Check the operator's block, then write its trimmed region to the output store (not yet marked done)."""
    if out.shape != block.shape:
        raise VolumeError(
            f"operator {job.operator} returned a block of shape {out.shape} for an input block of shape "
            f"{block.shape}: chunked operators must return a block of the same shape as their input"
        )
    output = ZarrOutput.open(job.output_path)
    try:
        # The trimmed view goes to zarr as it is: zarr copies it one storage chunk at a time. A contiguous copy of
        # the whole region first (where the trim cuts crosslines the view is not contiguous) would be memory set by
        # where the chunk's edges fall, not by the block, which the model cannot learn
        # (python -m benchmarks.studies.task_memory measures it).
        output.write(job.chunk, out[trim].astype(DTYPE, copy=False), mark_done=False)
    except OSError as exc:
        raise write_error(job, exc) from exc
    return output


def _observation(base: dict[str, Any], fields: dict[str, Any], gpu: GpuUse) -> Observation:
    """The run's observation: ``base`` and the measured ``fields``, the device's peak (bytes) where measured."""
    if gpu.peak_bytes is not None:
        fields["gpu_peak_bytes"] = gpu.peak_bytes
    return Observation(**base, **fields)


def _out_of_memory(job: BlockJob, base: dict[str, Any], gpu: GpuUse, exc: MemoryError) -> ChunkMemoryError:
    """A ChunkMemoryError carrying the censored observation: the peak reached is a lower bound of the need."""
    m = getattr(exc, "memchunk_measurement", None)
    fields = m.observation_fields() if m is not None else {"peak_bytes": 0, "outcome": "memory_error",
                                                            "censored": True}
    fields.update(outcome="memory_error", censored=True, gpu_out_of_memory=is_gpu_out_of_memory(exc))
    obs = _observation(base, fields, gpu)
    if is_gpu_out_of_memory(exc):
        reached = (f"on the GPU after reaching {format_bytes(gpu.peak_bytes)} there" if gpu.peak_bytes
                   else "on the GPU (peak not measured)")
    else:
        reached = f"after reaching {format_bytes(obs.peak_bytes)}" if obs.peak_bytes else "(peak not measured)"
    budget = (f"GPU budget {format_bytes(job.gpu_budget_bytes)}" if is_gpu_out_of_memory(exc)
              and job.gpu_budget_bytes is not None else f"budget {format_bytes(job.budget_bytes)}")
    return ChunkMemoryError(
        f"{job.operator}[{job.label}] ran out of memory {reached} ({budget}): {exc!r}", obs.to_dict(),
        gpu=is_gpu_out_of_memory(exc))


def _receipt(job: BlockJob, output: ZarrOutput, obs: Observation) -> Receipt:
    """Mark the chunk done, its marker carrying the observation, and return the receipt for the flow.

    The marker carries the observation so that a flow stopped before collecting this receipt loses no measurement.
    """
    try:
        output.mark_done(job.chunk, record=obs.to_dict())
    except OSError as exc:
        raise write_error(job, exc) from exc
    return Receipt(chunk=job.chunk, output_path=job.output_path, observation=obs.to_dict())


def already_written(job: BlockJob) -> Receipt | None:
    """The receipt of a chunk whose completion marker is there already (None: it is not; it runs).

    The flow submits a chunk once unless its run died before writing it; but Dask runs a task again by itself
    when the worker that holds its finished result leaves before the flow gathered it ("lost already computed
    task(s), which will be recomputed elsewhere": a batch job cancelled, preempted or at its walltime just after
    writing a chunk). The chunk's data and marker (with the first run's measurement) are in the output already:
    they are kept and the measurement returned, so nothing written is computed again."""
    try:
        output = ZarrOutput.open(job.output_path)
        if not output.is_done(job.chunk):
            return None
        records = output.done_records([job.chunk])
    except (OSError, ValueError):  # no output to read yet: the chunk runs
        return None
    if not records or records[0].get("operator_key") != job.operator_key:
        return None
    return Receipt(chunk=job.chunk, output_path=job.output_path, observation=dict(records[0]))


_WRITE_HINTS = {errno.ENOSPC: "the disk is full: free space there",
                errno.EDQUOT: "your disk quota is used up: free space or raise the quota",
                errno.EFBIG: "a file size limit was hit (ulimit -f): raise it",
                errno.EROFS: "the filesystem is read-only: choose a writable output directory",
                errno.EACCES: "permission denied: choose a directory you can write"}


def write_error(job: BlockJob, exc: OSError) -> OutputWriteError:
    """An OutputWriteError naming the chunk, the path, the cause and what to do."""
    code = exc.errno or 0
    hint = _WRITE_HINTS.get(code, "fix the cause")
    return OutputWriteError(
        code,
        f"{job.operator}[{job.label}]: could not write its chunk to {job.output_path} "
        f"({errno.errorcode.get(code, 'error')}: {exc.strerror or exc}); {hint}, or set the runner's "
        "output_dir (or chunked(..., output=)) to another place. Chunks already written are kept: rerunning the "
        "flow resumes the output")


def job_param_name(bound: inspect.BoundArguments, job: BlockJob) -> str:
    """The name of the parameter the :class:`BlockJob` was bound to."""
    for name, value in bound.arguments.items():
        if value is job:
            return name
    raise RunnerConfigError("internal: the BlockJob is not among the bound arguments")  # pragma: no cover
