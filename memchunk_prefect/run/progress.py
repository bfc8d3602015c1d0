"""Progress of each chunked map in the terminal: a live bar while it runs, one line when it ends.

:class:`TerminalProgress` is a map observer (:mod:`memchunk_prefect.run.observe`)
the runner adds to every chunked map unless ``MemoryAwareRunner(progress=False)``.
On a terminal it shows, while the map runs (rich, which Prefect already
depends on): chunks written / planned, the share of the volume written, elapsed
time and the time left as the learned time model predicts it (the measured
rate while the model has too little), the largest peak so far against the
budget, and the out-of-memory events recovered. When the map ends, the bar
gives way to one line that stays::

    gst3d_dip  7 chunks, 128 x 128 x 400 in 16.3 s; peak 384.1 MiB of a 726.7 MiB budget;
    out of memory: 1 avoided, 0 recovered

(one line on the terminal, folded here).

When the output is not a terminal (CI logs, a file) only that line is written,
once per map. "Avoided" counts the chunks of Dask's ``chunks="auto"`` the model
says would have run out of memory (the same figure as the run summary artifact);
"recovered" the chunks that ran out of memory and were split and rerun.

The bar is drawn with the console Prefect's log handler prints with, so log
lines of this process appear above the bar instead of through it. Worker
processes write to the terminal on their own; with their INFO lines on
(Prefect's task-run lines, Dask's worker log) those lines can interleave with
the bar: :func:`memchunk_prefect.run.logs.quiet` turns them off, as
the ``memchunk`` command does.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Any, Callable

from memchunk_prefect.core.errors import format_bytes
from memchunk_prefect.core.messages import KILLED, MEMORY_ERROR, OK
from memchunk_prefect.run.observe import MapEnd, MapObserver, MapStart, TaskEnded, TaskSubmitted

logger = logging.getLogger("memchunk_prefect.run.progress")

#: Outcomes of a chunk that ran out of memory (split and rerun by the runner).
OUT_OF_MEMORY = (MEMORY_ERROR, KILLED)


def format_seconds(s: float | None) -> str:
    """``s`` as ``12.4 s``, ``3 min 05 s`` or ``1 h 02 min`` (``-`` for None).

    >>> format_seconds(12.44), format_seconds(185), format_seconds(3720), format_seconds(None)
    ('12.4 s', '3 min 05 s', '1 h 02 min', '-')
    """
    if s is None or not math.isfinite(s):
        return "-"
    if s < 60:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)} min {int(s % 60):02d} s"
    return f"{int(s // 3600)} h {int(s % 3600 // 60):02d} min"


def seconds_left(queued_blocks: list[int], slots: int, block_seconds: Callable[[int], float | None] | None,
                 elapsed: float, done_elements: int, total_elements: int) -> tuple[float | None, str]:
    """Predicted seconds until the map ends, and where the figure comes from (``learned`` or ``so far``).

    ``queued_blocks``: the elements (halo included) of each chunk still to run
    (in flight or planned); ``block_seconds(elements)``: the learned compute
    seconds of one such block, None while the time model has too little. With
    no learned figure, the rate measured so far is extrapolated.

    >>> seconds_left([100, 100, 100, 100], 2, lambda e: e / 100, 9.0, 0, 10)
    (2.0, 'learned')
    >>> seconds_left([100], 1, None, 6.0, 3, 4)
    (2.0, 'so far')
    >>> seconds_left([], 2, None, 6.0, 4, 4)
    (0.0, 'done')
    """
    if not queued_blocks:
        return 0.0, "done"
    if block_seconds is not None:
        try:
            # Plans cut equal chunks: one model evaluation per distinct block size.
            known = {e: block_seconds(e) for e in set(queued_blocks)}
            each = [known[e] for e in queued_blocks]
        except Exception:  # noqa: BLE001 - a figure for the display only
            each = [None]
        if each and all(s is not None for s in each):
            # Slots run in parallel: the total work over the slots, and never less than the longest block.
            work = float(sum(each))  # type: ignore[arg-type]
            return max(work / max(1, slots), max(each)), "learned"  # type: ignore[type-var]
    if done_elements <= 0 or elapsed <= 0:
        return None, ""
    return elapsed * (total_elements - done_elements) / done_elements, "so far"


def terminal_console() -> Any:
    """The rich Console Prefect's console log handler prints with (else a new one on standard error).

    The bar must be drawn by the console that prints the log lines: rich then
    prints each line above the live bar instead of through it.
    """
    try:
        from prefect.logging.handlers import PrefectConsoleHandler

        for h in logging.getLogger().handlers:
            if isinstance(h, PrefectConsoleHandler) and getattr(h, "console", None) is not None:
                return h.console
    except Exception:  # noqa: BLE001  # pragma: no cover - Prefect moved it
        pass
    from rich.console import Console

    return Console(stderr=True)


class TerminalProgress(MapObserver):
    """One chunked map's progress on the terminal (see the module docstring).

    ``console``: a rich Console (default: standard error); ``live``: show the
    live bar (default: when the console is a terminal); either way one line is
    printed when the map ends.
    """

    def __init__(self, console: Any = None, live: bool | None = None, refresh_per_second: float = 4.0):
        self.console = console if console is not None else terminal_console()
        self.live = self.console.is_terminal if live is None else bool(live)
        self.refresh_per_second = refresh_per_second
        self._progress: Any = None
        self._task: Any = None
        self._reset(None)

    def _reset(self, start: MapStart | None) -> None:
        """Per-map state (one observer may watch every map of a runner, one after the other)."""
        self.start = start
        self.started_at = (start.at or time.time()) if start is not None else 0.0
        self.blocks: dict[int, int] = {}  # submission id -> elements of the block it reads (in flight)
        self.last_block = 0  # elements of the latest submitted block (the plan's size, for queued chunks)
        self.done_chunks = 0
        self.done_elements = 0
        self.queued = 0  # in flight + planned, after the latest chunk ended
        self.peak = 0
        self.recovered = 0

    # ---- the observer calls

    def on_map_start(self, event: MapStart) -> None:
        self._stop_live()
        self._reset(event)
        if self.live:
            self._start_live(event)

    def on_submit(self, event: TaskSubmitted) -> None:
        n = math.prod(event.read_extents)
        self.blocks[event.id] = n
        self.last_block = n
        self.queued = max(self.queued, len(self.blocks))
        self._refresh()

    def on_chunk_end(self, event: TaskEnded) -> None:
        self.blocks.pop(event.id, None)
        self.done_chunks, self.done_elements = event.done_chunks, event.done_elements
        self.queued = event.queued_chunks
        o = event.observation
        if event.outcome == OK and o is not None and o.peak_bytes:
            self.peak = max(self.peak, int(o.peak_bytes))
        if event.outcome in OUT_OF_MEMORY:
            self.recovered += 1
        self._refresh()

    def on_map_end(self, event: MapEnd) -> None:
        self._stop_live()
        if self.start is None:
            return
        self.done_chunks, self.done_elements = event.done_chunks, event.done_elements
        self.console.print(self.final_line(event), highlight=False, soft_wrap=True)

    # ---- what is shown

    @property
    def total_elements(self) -> int:
        return math.prod(self.start.shape) if self.start is not None else 0

    def left(self, now: float | None = None) -> tuple[float | None, str]:
        s = self.start
        if s is None:
            return None, ""
        in_flight = list(self.blocks.values())
        planned = max(0, self.queued - len(in_flight))
        return seconds_left(in_flight + [self.last_block] * planned, s.slots, s.block_seconds,
                            (now or time.time()) - self.started_at, self.done_elements, self.total_elements)

    def status(self, now: float | None = None) -> str:
        """The live line's text after the bar and the elapsed time."""
        s = self.start
        assert s is not None
        left, source = self.left(now)
        planned = self.done_chunks + self.queued
        parts = [f"{self.done_chunks}/{planned} chunks" if planned else "planning"]
        if left is not None and source != "done":
            parts.append(f"~{format_seconds(left)} left ({source})")
        parts.append(f"peak {format_bytes(self.peak) if self.peak else '-'} / {format_bytes(s.budget_bytes)}")
        parts.append(f"{self.recovered} out-of-memory recovered")
        return ", ".join(parts)

    def avoided(self) -> int | None:
        """Chunks of Dask's ``chunks="auto"`` the model says would not fit the budget (None: no figure)."""
        s = self.start
        if s is None or s.predict is None or not s.budget_bytes:
            return None
        from memchunk_prefect.run.report import naive_chunking

        try:
            naive = naive_chunking(s.shape, s.halo, s.budget_bytes, s.predict)
        except Exception as exc:  # noqa: BLE001 - a figure for the display only
            logger.debug("no naive-chunking estimate: %r", exc)
            return None
        return int(naive["over_budget"]) if naive else None

    def final_line(self, event: MapEnd) -> str:
        s = self.start
        assert s is not None
        wall = (event.at or time.time()) - self.started_at
        shape = " x ".join(map(str, s.shape))
        if event.error is None:
            head = f"{self.done_chunks} chunks, {shape} in {format_seconds(wall)}"
        else:
            share = 100.0 * self.done_elements / self.total_elements if self.total_elements else 0.0
            head = (f"stopped after {format_seconds(wall)} with {self.done_chunks} chunks written ({share:.0f}% of "
                    f"{shape}): {type(event.error).__name__}")
        avoided = self.avoided()
        paused = (f"; workers paused {event.pauses}x, {format_seconds(event.paused_seconds)}"
                  if event.pauses else "")
        return (f"{s.operator}  {head}; peak {format_bytes(self.peak) if self.peak else '-'} of a "
                f"{format_bytes(s.budget_bytes)} budget; out of memory: "
                f"{'-' if avoided is None else avoided} avoided, {self.recovered} recovered{paused}")

    # ---- the live bar

    def _start_live(self, event: MapStart) -> None:
        self._progress = _LIVE.acquire(self.console, self.refresh_per_second)
        self._task = self._progress.add_task(event.operator, total=max(1, self.total_elements),
                                             status=self.status(event.at or time.time()))

    def _refresh(self) -> None:
        if self._progress is not None:
            self._progress.update(self._task, completed=self.done_elements, status=self.status(), refresh=True)

    def _stop_live(self) -> None:
        if self._progress is None:
            return
        try:
            _LIVE.release(self.console, self._progress, self._task)
        finally:
            self._progress = None


class _SharedDisplays:
    """One live display per console, a row per running map.

    Chunked maps run side by side (``.map`` returns at once), and two live displays
    on one terminal draw over each other's line. Maps run in threads of their own,
    so taking and leaving a display is under a lock; rich's ``Progress`` locks its
    own updates.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._displays: dict[int, tuple[Any, int]] = {}  # id(console) -> (Progress, maps showing on it)

    def acquire(self, console: Any, refresh_per_second: float) -> Any:
        with self._lock:
            progress, users = self._displays.get(id(console), (None, 0))
            if progress is None:
                progress = _new_display(console, refresh_per_second)
                progress.start()
            self._displays[id(console)] = (progress, users + 1)
            return progress

    def release(self, console: Any, progress: Any, task: Any) -> None:
        with self._lock:
            try:
                progress.remove_task(task)
                progress.refresh()  # else the next print above the display redraws the removed row
            finally:
                _, users = self._displays.get(id(console), (progress, 1))
                if users <= 1:
                    self._displays.pop(id(console), None)
                    progress.stop()
                else:
                    self._displays[id(console)] = (progress, users - 1)


def _new_display(console: Any, refresh_per_second: float) -> Any:
    from rich.progress import BarColumn, Progress, ProgressColumn, TextColumn
    from rich.text import Text

    class Elapsed(ProgressColumn):
        def render(self, task: Any) -> Text:
            return Text(format_seconds(task.elapsed or 0.0))

    # Styles named here, not by theme: Prefect's console (shared, see terminal_console) has a theme without
    # rich's defaults ("bar.back" and the like).
    return Progress(TextColumn("{task.description}"),
                    BarColumn(style="grey30", complete_style="cyan", finished_style="green", pulse_style="cyan"),
                    TextColumn("{task.percentage:>3.0f}%"), Elapsed(), TextColumn("{task.fields[status]}"),
                    console=console, transient=True, refresh_per_second=refresh_per_second)


_LIVE = _SharedDisplays()

