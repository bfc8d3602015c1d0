"""The objects a user handles at a chunked map: the :func:`chunked` marker and the :class:`ChunkedResult` it returns.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from prefect.futures import PrefectFuture, PrefectFutureList

from memchunk_prefect.core.chunks import Chunk, Shape, normalize_halo
from memchunk_prefect.core.errors import RunnerConfigError, UpstreamMapError
from memchunk_prefect.core.records import Observation
from memchunk_prefect.io.identity import MDIO, OUTPUT_FORMATS, ZARR
from memchunk_prefect.io.volume import as_source
from memchunk_prefect.io.zarr_store import ZarrSource, open_result
from memchunk_prefect.run.executor import ChunkedMap
from memchunk_prefect.run.observe import MapLog


@dataclass(frozen=True)
class Chunked:
    """A mapped argument the runner may cut: made by :func:`chunked`."""

    source: Any
    halo: Shape | None = None
    output: str | None = None
    replace_any: bool = False
    output_format: str = ZARR

    def __iter__(self):  # pragma: no cover - a guard, not an API
        raise TypeError(
            "chunked(...) can only be mapped by a flow whose task_runner is MemoryAwareRunner; "
            "this flow's task runner tried to iterate it"
        )


def chunked(source: Any, halo: int | Sequence[int] | None = None, *, output: str | os.PathLike | None = None,
            replace_any: bool = False, output_format: str | None = None) -> Chunked:
    """Mark ``source`` as a volume the runner may cut for the mapped task.

    ``source``: a SEG-Y path, an MDIO dataset or zarr store path, a numpy array or
    ``xarray.DataArray`` (dims iline, xline, twt or inline, crossline, time/depth),
    an MDIO ``xarray.Dataset`` (``mdio.open_mdio(path)``), or the result of an
    earlier chunked map. ``halo``: extra samples read around each chunk, an int
    (every axis) or (inline, crossline, vertical); default: what the operator
    declares. ``output``: where the result goes (default: under the runner's
    ``output_dir``). ``output_format``: ``"zarr"`` (the default; a zarr store
    with the input's dim names) or ``"mdio"`` (an MDIO v1 dataset that
    ``mdio.open_mdio`` opens, dims inline, crossline, time/depth); unset, an
    ``output`` ending ``.mdio`` means MDIO.
    An output already there is resumed when it was computed from the same input,
    code and parameters (and in the same format), replaced when it is this
    operator's output of something else, and refused when it is another
    operator's (or not memchunk's at all); ``replace_any=True`` says the path is
    yours: another operator's memchunk output there is replaced too (a store
    memchunk did not write never is).
    """
    out = None if output is None else os.fspath(output)
    return Chunked(source=source, halo=None if halo is None else normalize_halo(halo), output=out,
                   replace_any=bool(replace_any), output_format=_output_format(output_format, out))


def _output_format(output_format: str | None, output: str | None) -> str:
    """The format asked for, or the one the output path's suffix names; RunnerConfigError for an unknown format or
    an output path ending ``.mdio`` written as zarr (it would be read back as MDIO)."""
    mdio_path = output is not None and output.lower().rstrip("/").endswith(".mdio")
    if output_format is None:
        return MDIO if mdio_path else ZARR
    if output_format not in OUTPUT_FORMATS:
        raise RunnerConfigError(f"chunked(..., output_format={output_format!r}): expected one of "
                                f"{', '.join(map(repr, OUTPUT_FORMATS))}")
    if output_format == ZARR and mdio_path:
        raise RunnerConfigError(f"chunked(..., output={output!r}, output_format='zarr'): a path ending .mdio is read "
                                "back as an MDIO dataset; pass output_format='mdio', or name the zarr store .zarr")
    return output_format


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
        err = self._outcome(timeout)
        if err is not None:
            if raise_on_failure:
                raise err
            return err
        return open_result(self.output_path)

    def _outcome(self, timeout: float | None = None) -> BaseException | None:
        """Wait for the map to end; what stopped it (None: it wrote every chunk). ``TimeoutError`` after
        ``timeout`` seconds."""
        self.wait(timeout)
        if not self.done:
            raise TimeoutError(f"the chunked map over {self.operator} did not end within {timeout} s")
        err = self.error
        if err is not None:
            self.map.error_seen = True  # type: ignore[union-attr]
        return err

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
        map that failed). It does not open the output as :meth:`result` does: a flow that only logs its maps'
        summaries has no use for the dataset (opening it imported xarray in the flow process, 0.7 s of CPU in a
        py-spy profile of one of the workload family's flows)."""
        err = self._outcome()
        if err is not None:
            raise err
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


def upstream_plan(upstream: ChunkedResult, task: Any) -> tuple[tuple[Chunk, ...], ChunkedMap | None, dict | None]:
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
    src = as_source(up.output_path)  # a ZarrSource, or an MdioSource for an MDIO output
    identity = src.identity(complete=False) if isinstance(src, ZarrSource) else src.identity()
    if upstream.done and up.error is None:
        return tuple(upstream.chunks), up, identity
    return up.plan_snapshot(), up, identity
