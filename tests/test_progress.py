"""The terminal progress of a chunked map, fed the observer events a map emits (the real-map case: test_runner)."""

from __future__ import annotations

import io
import math
import re

from rich.console import Console

from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.messages import KILLED, OK
from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.run.observe import MapEnd, MapStart, TaskEnded, TaskSubmitted
from memchunk_prefect.run.progress import TerminalProgress

MiB = 2**20
SHAPE = (64, 64, 100)


def _console(terminal: bool) -> tuple[Console, io.StringIO]:
    out = io.StringIO()
    return Console(file=out, force_terminal=terminal, width=300, color_system=None), out


def _start(predict=None, block_seconds=None, at: float = 1000.0) -> MapStart:
    return MapStart(operator="gst3d_dip", operator_key="gst3d_dip|float32|cpu", shape=SHAPE, halo=(0, 0, 0),
                    output_path="/tmp/x.zarr", budget_bytes=700 * MiB, slots=2, predict=predict, at=at,
                    block_seconds=block_seconds)


def _chunk(i: int) -> Chunk:
    return Chunk((16 * i, 0, 0), (16 * i + 16, 64, 100))


def _obs(peak: int, outcome: str = OK) -> Observation:
    return Observation(operator_key="gst3d_dip|float32|cpu", elements=16 * 64 * 100, extents=(16, 64, 100),
                       bytes_in=16 * 64 * 100 * 4, peak_bytes=peak, outcome=outcome, censored=outcome != OK)


def _run_map(p: TerminalProgress, *, killed: int = 0, error: BaseException | None = None, **start) -> None:
    """Four chunks on two slots; ``killed`` of them run out of memory first (split in the real runner)."""
    p.on_map_start(_start(**start))
    sid, done, elements = 0, 0, 0
    for i in range(4):
        if i < killed:
            p.on_submit(TaskSubmitted(sid, _chunk(i), "rechunk", 0, f"c{i}", (16, 64, 100), at=1000.0 + i))
            p.on_chunk_end(TaskEnded(sid, _chunk(i), KILLED, "rechunk", _obs(900 * MiB, KILLED), done_chunks=done,
                                      done_elements=elements, at=1001.0 + i, queued_chunks=4 - i))
            sid += 1
        p.on_submit(TaskSubmitted(sid, _chunk(i), "rechunk", 0, f"c{i}", (16, 64, 100), at=1000.0 + i))
        done, elements = done + 1, elements + _chunk(i).elements
        p.on_chunk_end(TaskEnded(sid, _chunk(i), OK, "rechunk", _obs((100 + i) * MiB), done_chunks=done,
                                  done_elements=elements, at=1001.0 + i, queued_chunks=3 - i))
        sid += 1
    p.on_map_end(MapEnd(error, done, elements, at=1010.0))


def test_off_a_terminal_one_line_per_map_when_it_ends_with_peak_budget_and_out_of_memory_recovered():
    console, out = _console(terminal=False)
    p = TerminalProgress(console=console)
    assert not p.live
    _run_map(p, killed=1)
    line, = out.getvalue().splitlines()
    assert line == ("gst3d_dip  4 chunks, 64 x 64 x 100 in 10.0 s; peak 103.0 MiB of a 700.0 MiB budget; "
                    "out of memory: - avoided, 1 recovered")


def test_avoided_counts_the_dask_auto_chunks_the_model_says_would_not_fit():
    console, out = _console(terminal=False)
    # A model that says any block needs 1 GiB per MiB of input: every one of Dask's auto chunks is over 700 MiB.
    predict = lambda ext: Prediction(math.prod(ext) * 4 * 1024.0, math.prod(ext) * 4 * 1100.0)  # noqa: E731
    _run_map(TerminalProgress(console=console), predict=predict)
    assert out.getvalue().rstrip().endswith("out of memory: 1 avoided, 0 recovered"), out.getvalue()


def test_on_a_terminal_a_live_bar_shows_chunks_time_left_and_peak_then_gives_way_to_the_line():
    console, out = _console(terminal=True)
    p = TerminalProgress(console=console)
    assert p.live
    _run_map(p, block_seconds=lambda elements: 2.0)
    text = out.getvalue()
    assert "2/4 chunks, ~2.0 s left (learned), peak 101.0 MiB / 700.0 MiB, 0 out-of-memory recovered" in text, text
    assert text.rstrip().endswith("out of memory: - avoided, 0 recovered")
    assert p._progress is None, "the live display is stopped when the map ends"


def test_two_maps_running_at_once_share_one_live_display_a_row_each():
    """Chunked maps run side by side (``.map`` returns at once): each gets its own row of one live display on the
    console (rich allows one live display per console), the display stops when the last of them ends, and each
    map's line is printed when it ends."""
    console, out = _console(terminal=True)
    a, b = TerminalProgress(console=console), TerminalProgress(console=console)
    a.on_map_start(_start())
    b.on_map_start(MapStart(operator="envelope", operator_key="envelope|float32|cpu", shape=SHAPE, halo=(0, 0, 0),
                            output_path="/tmp/y.zarr", budget_bytes=700 * MiB, slots=2, at=1000.0))
    assert a._progress is not None and a._progress is b._progress, "one display, not two"
    assert [t.description for t in a._progress.tasks] == ["gst3d_dip", "envelope"]
    display = a._progress
    a.on_map_end(MapEnd(None, 0, 0, at=1005.0))
    assert display.live.is_started and [t.description for t in display.tasks] == ["envelope"], \
        "the other map's row stays while it runs"
    b.on_map_end(MapEnd(None, 0, 0, at=1006.0))
    assert not display.live.is_started, "the display stops with the last map"
    ended = re.findall(r"(gst3d_dip|envelope)  0 chunks, 64 x 64 x 100 in", out.getvalue())
    assert ended == ["gst3d_dip", "envelope"], out.getvalue()
    after_a = out.getvalue().split("gst3d_dip  0 chunks")[1]
    assert "envelope " in after_a and "gst3d_dip " not in after_a, "the ended map's row is not drawn again"
    _run_map(TerminalProgress(console=console))  # a later map starts a display again


def test_without_a_learned_time_the_time_left_is_the_rate_so_far():
    console, _ = _console(terminal=False)
    p = TerminalProgress(console=console)
    p.on_map_start(_start(at=1000.0))
    p.on_submit(TaskSubmitted(0, _chunk(0), "rechunk", 0, "c0", (16, 64, 100), at=1000.0))
    p.on_chunk_end(TaskEnded(0, _chunk(0), OK, "rechunk", _obs(MiB), done_chunks=1,
                              done_elements=_chunk(0).elements, at=1004.0, queued_chunks=3))
    assert "1/4 chunks, ~12.0 s left (so far)" in p.status(now=1004.0)


def test_a_failed_map_says_how_far_it_got_and_one_observer_serves_map_after_map():
    console, out = _console(terminal=False)
    p = TerminalProgress(console=console)
    _run_map(p, killed=2, error=KeyboardInterrupt())
    _run_map(p)
    first, second = out.getvalue().splitlines()
    assert "stopped after 10.0 s with 4 chunks written (100% of 64 x 64 x 100): KeyboardInterrupt" in first
    assert "2 recovered" in first and second.endswith("0 recovered"), "counts start again at each map"


def test_a_map_that_fails_before_it_starts_prints_nothing():
    console, out = _console(terminal=False)
    TerminalProgress(console=console).on_map_end(MapEnd(RuntimeError("no workers"), 0, 0))
    assert out.getvalue() == ""


def test_workers_paused_during_the_map_are_on_its_line():
    console, out = _console(terminal=False)
    p = TerminalProgress(console=console)
    p.on_map_start(_start())
    p.on_map_end(MapEnd(None, 0, 0, at=1003.0, pauses=2, paused_seconds=2.2))
    assert out.getvalue().rstrip().endswith("0 recovered; workers paused 2x, 2.2 s")
