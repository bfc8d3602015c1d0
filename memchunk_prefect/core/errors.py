"""Every exception a memchunk-prefect user can meet, one type per kind of failure.

Each message says what was wrong (with the values), and what to do about it.
All inherit from :class:`MemchunkError`, so ``except MemchunkError`` catches
everything this package raises on purpose. Where a built-in type is the natural
one for a caller (a missing file is a ``FileNotFoundError``; a bad argument is a
``ValueError``) the exception inherits from it as well, so existing handlers keep
working.

The table of errors in docs/reference/errors.md lists each one with what to do.
"""

from __future__ import annotations


class MemchunkError(Exception):
    """Base class of every error memchunk-prefect raises on purpose."""


# --------------------------------------------------------------------------- input data


class SegyError(MemchunkError):
    """A SEG-Y file could not be used as a post-stack 3D volume."""

    def __init__(self, path: object, message: str):
        self.path = str(path)
        super().__init__(f"{self.path}: {message}")


class SegyFileNotFoundError(SegyError, FileNotFoundError):
    """The SEG-Y path does not exist."""


class NotSegyError(SegyError):
    """The file is not SEG-Y at all: its binary header holds no SEG-Y sample format (a text, image or archive
    file given a .sgy name)."""


class SegyTruncatedError(SegyError):
    """The file is shorter than its headers say (a cut-off copy or download)."""


class SegyEmptyError(SegyError):
    """The file holds no traces, or no samples per trace."""


class SegyNotA3DVolumeError(SegyError):
    """The traces do not form a sorted inline/crossline grid (shot gathers, 2D lines, unsorted files)."""


class SegyPrestackError(SegyError):
    """The file is pre-stack (several offsets per inline/crossline); operators here need post-stack."""


class SegyGeometryError(SegyError):
    """The header geometry disagrees with the trace count or with itself."""


class MdioError(MemchunkError):
    """An MDIO store that cannot be read as a post-stack 3D volume (not MDIO v1, no such variable, other
    dimensions), or an MDIO output that cannot be written (the ``mdio`` extra is not installed)."""


class MdioNotFoundError(MdioError, FileNotFoundError):
    """The MDIO path does not exist."""


class VolumeError(MemchunkError, ValueError):
    """A volume, a block request or a halo that cannot be used (zero size, bad shape, bad region)."""


class HaloTooLargeError(VolumeError):
    """The requested halo is larger than the volume along some axis."""


class IncompleteOutputError(MemchunkError):
    """An output store was opened as a result but not every element of it was written."""


class OutputPathError(MemchunkError, ValueError):
    """An output path from parameters would escape its output directory."""


# --------------------------------------------------------------------------- measurement, model, store


class OutputWriteError(MemchunkError, OSError):
    """A worker could not write a chunk of the output (disk full, quota, file size limit, read-only, permissions).

    The chunk is not marked written; chunks written before it are kept, so a rerun
    after fixing the cause resumes the output.
    """


class MeasurementError(MemchunkError, ValueError):
    """Memory could not be measured in the requested way."""


class StoreError(MemchunkError):
    """The observation store cannot be used."""


class StoreSchemaTooNewError(StoreError):
    """The store was written by a newer memchunk-prefect; refusing to touch it."""


class UnknownOperatorError(MemchunkError, KeyError):
    """No observations or model exist under the given operator key."""

    def __str__(self) -> str:  # KeyError would quote the whole message
        return str(self.args[0]) if self.args else ""


# --------------------------------------------------------------------------- planning and running


class BudgetError(MemchunkError, ValueError):
    """A memory budget that cannot be met or understood."""


class BudgetTooSmallError(BudgetError):
    """Even the smallest chunk the operator allows is predicted to exceed the memory budget."""


class ChunkOutOfMemoryError(MemchunkError, MemoryError):
    """A chunk ran out of memory and cannot be split any further.

    Carries ``operator``, ``chunk``, ``budget_bytes`` and ``needed_bytes`` (the
    measured lower bound of what it needs), so a caller can act on them, and
    ``device``: whose memory ran out, ``"host"`` or ``"gpu"`` (both figures are
    then of that memory: a GPU chunk's against the map's GPU budget per task).
    """

    def __init__(self, message: str, *, operator: str = "", chunk: object = None,
                 budget_bytes: int | None = None, needed_bytes: int | None = None, device: str = "host"):
        super().__init__(message)
        self.operator = operator
        self.chunk = chunk
        self.budget_bytes = budget_bytes
        self.needed_bytes = needed_bytes
        self.device = device

    def __reduce__(self):
        return (_rebuild_chunk_oom, (self.args[0], self.operator, self.chunk,
                                     self.budget_bytes, self.needed_bytes, type(self), self.device))


class MemoryNotChunkSizeError(ChunkOutOfMemoryError):
    """``MemoryError`` keeps coming at chunk sizes the model puts far under the budget, split after split:
    what fails is not the chunk's size (an address-space limit, thread pools reserving memory, another
    process), so the map stops instead of splitting on. Same fields as :class:`ChunkOutOfMemoryError`."""


def _rebuild_chunk_oom(message, operator, chunk, budget_bytes, needed_bytes, cls=ChunkOutOfMemoryError,
                       device="host"):
    return cls(message, operator=operator, chunk=chunk, budget_bytes=budget_bytes, needed_bytes=needed_bytes,
               device=device)


class ChunkMemoryError(MemchunkError, MemoryError):
    """Raised on a worker when a chunk's task ran out of memory (``MemoryError``); the runner splits the chunk.

    Carries ``observation``: the censored record (a plain dict of
    :class:`~memchunk_prefect.core.records.Observation` fields) of what the run reached
    before it failed, so the flow learns "needs more than this" from it. Pickles
    with it (it travels from the worker to the flow).
    """

    def __init__(self, message: str, observation: dict, gpu: bool = False):
        super().__init__(message)
        self.observation = observation
        self.gpu = bool(gpu)  # the GPU's memory ran out (CuPy's OutOfMemoryError), not the host's

    def __reduce__(self):
        return (ChunkMemoryError, (self.args[0], self.observation, self.gpu))


class ChunkDeferredError(MemchunkError, RuntimeError):
    """Raised on a worker when a chunk finds, where it begins, its worker process already holding so much that the
    chunk's bound on top would pass the worker's kill line: it starts nothing, and the runner plans it again for
    what the worker holds (:mod:`memchunk_prefect.core.losses`). Carries ``worker`` (its address),
    ``process_bytes`` (the process's memory then), ``upper_bytes`` (the chunk's bound) and ``kill_bytes`` (the
    kill line), bytes. Pickles with them."""

    def __init__(self, message: str, worker: str = "", process_bytes: int = 0, upper_bytes: int = 0,
                 kill_bytes: int = 0):
        super().__init__(message)
        self.worker, self.process_bytes = worker, int(process_bytes)
        self.upper_bytes, self.kill_bytes = int(upper_bytes), int(kill_bytes)

    def __reduce__(self):
        return (ChunkDeferredError, (self.args[0], self.worker, self.process_bytes, self.upper_bytes,
                                     self.kill_bytes))


class GpuContextError(MemchunkError, RuntimeError):
    """A chunk's task hit a CUDA error that leaves its worker's CUDA context unusable (an illegal address, a
    device-side assert, a launch failure...): only a new worker process recovers. Raised on the worker, naming
    it (``worker``, its address); the runner restarts that worker and runs the chunk once more, and fails the map
    with this error when the same chunk does it again or restarts pass their limit. Pickles with ``worker``."""

    def __init__(self, message: str, worker: str = ""):
        super().__init__(message)
        self.worker = worker

    def __reduce__(self):
        return (GpuContextError, (self.args[0], self.worker))


class WorkersPausedError(MemchunkError, RuntimeError):
    """Every worker of the cluster has stayed paused (over Dask's pause line, ``distributed.worker.memory.pause``)
    with no task running for longer than the runner waits (``RunnerSettings.paused_stall_seconds``): the map
    cannot go on, since a paused worker takes no task until its memory falls and nothing running will free it.
    Not an out-of-memory event of a chunk (no chunk is split for it); the chunks written are kept."""


class RunnerConfigError(MemchunkError, ValueError):
    """MemoryAwareRunner was given arguments that conflict or make no sense."""


class EnvironmentProblemError(MemchunkError, RuntimeError):
    """Something a run cannot work without is missing or wrong (an unwritable Prefect home or store, an API
    that does not answer): found before anything started; the message names each problem and its fix."""


class SimulationInputError(MemchunkError, ValueError):
    """A simulation was asked of something that cannot be simulated (the message says what and what to do)."""


class UnknownStepError(UnknownOperatorError, SimulationInputError):
    """A step of a simulation names neither a registered operator nor an operator key the store has seen; the
    message lists the keys the store holds. Both a ``KeyError`` and a :class:`SimulationInputError`."""


class TooLittleHistoryError(SimulationInputError):
    """An operator key the store holds too little of to simulate: ``key``, the flow ``runs`` and
    ``observations`` behind it (finished, usable ones), and the model's ``reason`` it is not ready."""

    def __init__(self, message: str, *, key: str, runs: int, observations: int, reason: str = ""):
        self.key, self.runs, self.observations, self.reason = key, int(runs), int(observations), reason
        super().__init__(message)


class FlowRunRecordError(SimulationInputError):
    """A flow run that cannot be simulated from what the store recorded of it: an id the store does not hold,
    a run with no chunked map, or one recorded before the store kept what a simulation needs (the message
    names what is missing and the flags that supply it)."""


class EnergyInputError(MemchunkError, ValueError):
    """A power figure or an energy objective that cannot be used (not a positive number, an unknown objective)."""


class TraceExportError(MemchunkError):
    """A flow run that cannot be exported as a workflow trace (unknown, unfinished, without chunked maps,
    or an output path that cannot be written)."""


class ClusterLostError(MemchunkError, ConnectionError):
    """The Dask scheduler went away (killed, restarted, network lost) while a chunked map was running.

    Chunks already written stay written (each has its completion marker); running
    the flow again resumes the output and computes only what is missing.
    """


class UpstreamMapError(MemchunkError):
    """A chunked map read the output of another chunked map that stopped without finishing it (failed,
    interrupted): the downstream map stops too, keeping the chunks it wrote (a rerun resumes both)."""


class DeviceError(MemchunkError, ValueError):
    """A device that cannot run an operator: an unknown name, ``device="cuda"`` where this process has no usable
    GPU (no CuPy, no driver, no device), or workers of one map that do not all have one. ``device="auto"``
    never raises it for want of a GPU (it falls back to the CPU)."""


class ChunkedSourceError(MemchunkError, TypeError):
    """``chunked(...)`` was given something that is not a volume it can read."""


def format_bytes(n: float | int | None) -> str:
    """``1536 -> '1.5 KiB'``: human-readable binary units for messages.

    >>> format_bytes(3 * 2**30)
    '3.0 GiB'
    >>> format_bytes(None)
    'unknown'
    """
    if n is None:
        return "unknown"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover
