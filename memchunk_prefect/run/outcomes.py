"""What a chunk's failed task run means for its map: the event its machine hears (flow process).

A chunk's Prefect task run that did not complete raised something on its worker, or ended in a state that is not
an exception. :func:`failure_event` reads which: out of memory (split, learned), a broken GPU context (restart the
worker), no room where it began (plan it again), or the operator's own error (stop, naming the chunk). A worker's
death never reaches here: Dask reports it on the future itself (``KilledWorker``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

from memchunk_prefect.core.errors import ChunkDeferredError, GpuContextError, MemchunkError
from memchunk_prefect.core.messages import ChunkDeferred, ChunkFailed, ChunkOutOfMemory, Event, GpuContextLost
from memchunk_prefect.core.records import Observation


def is_memory_error(exc: Any) -> bool:
    """A task's exception that means it ran out of memory (also when it arrives unpickled as another class).

    >>> is_memory_error(MemoryError()), is_memory_error(ValueError())
    (True, False)
    """
    return isinstance(exc, MemoryError) or (isinstance(exc, BaseException) and type(exc).__name__ in (
        "MemoryError", "ChunkMemoryError", "_ArrayMemoryError"))


def failure_event(sid: int, raised: Any, not_raised: str, observed: Callable[[dict], Observation],
                  resting: Mapping[str, int], at: float) -> Event:
    """The event of submission ``sid``, whose task run ended with ``raised`` (its exception, or what its state
    held when that is not one: ``not_raised`` then says so). ``observed`` completes a worker's record with what the
    flow knows; ``resting``: the resting memory the map read on each worker, bytes (a worker that joined since
    counts as the lowest of them).

    >>> failure_event(3, ChunkDeferredError("no room", "w1", 700, 300, 900), "", dict, {"w1": 200}, at=1.0)
    ChunkDeferred(id=3, worker='w1', process_bytes=700, above_bytes=500, upper_bytes=300, kill_bytes=900, at=1.0)
    """
    if is_memory_error(raised):
        obs = getattr(raised, "observation", None)
        return ChunkOutOfMemory(sid, observed(obs) if obs else None, at=at, gpu=bool(getattr(raised, "gpu", False)))
    if isinstance(raised, GpuContextError):
        return GpuContextLost(sid, raised.worker, raised, at=at)
    if isinstance(raised, ChunkDeferredError):
        rest = resting.get(raised.worker, min(resting.values(), default=0))
        return ChunkDeferred(sid, raised.worker, raised.process_bytes, raised.process_bytes - int(rest),
                             raised.upper_bytes, raised.kill_bytes, at=at)
    if isinstance(raised, BaseException):  # any other failure is the operator's own: stop and say which chunk
        return ChunkFailed(sid, raised, at=at)
    return ChunkFailed(sid, MemchunkError(not_raised), at=at)
