"""The chunked maps of one flow run: each runs in a thread of its own; the flow's end waits for them all.

A chunked ``.map`` returns at once (as Prefect's does) and its map runs in the background of the flow's
process. :class:`FlowMaps` starts those threads, and when the flow run ends (its task runner closes) waits for
every map, stops the ones still running if the flow stopped around them, and says which map's error the
flow run should end with: Prefect marks a flow run Completed when its function returns, before it closes the
task runner, so an error nobody waited for would otherwise be lost.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Callable

from memchunk_prefect.core.errors import MemchunkError
from memchunk_prefect.run.chunked import ChunkedResult, _wait_event
from memchunk_prefect.run.executor import MapInterrupted
from memchunk_prefect.run.prefect_api import flow_logger, flow_run_state

logger = logging.getLogger("memchunk_prefect.run.runner")


class FlowMaps:
    """The chunked maps a flow run started, running or ended, and the stop their threads should raise."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._maps: list[ChunkedResult] = []
        #: What every map's thread raises at its next look (the flow run stopped around the maps), or None.
        self.stop: BaseException | None = None

    def start(self, result: ChunkedResult) -> None:
        """Run ``result``'s map in a thread of its own, in a copy of the flow's context (its flow run, settings
        and logger), so the ``.map`` that made it returns at once."""
        thread = threading.Thread(target=contextvars.copy_context().run, args=(_run_map, result),
                                  name=f"memchunk-map-{result.operator}", daemon=True)
        with self._lock:
            self._maps.append(result)
        thread.start()

    def finish(self, flow_error: BaseException | None,
               forget_stop_deaths: Callable[[str, float], None]) -> ChunkedResult | None:
        """Wait for every map; the map whose error the flow run should end with, if any.

        ``flow_error``: what stopped the flow (Ctrl-C, a cancellation, an error in the flow's own code): the maps
        still running stop too, keeping what they wrote (their task runs in flight are marked Cancelled, or
        Crashed after an error), and ``forget_stop_deaths(flow_run_id, stopped_at)`` is asked to forget the
        worker deaths the stop explains. Without one, a map that failed and whose error nobody has seen
        (``.result()``) is what the flow run ends with.
        """
        with self._lock:
            maps = list(self._maps)
        flow_run_id = maps[0].map.flow_run_id if maps and maps[0].map is not None else ""
        flow_error = flow_error or _failed_around(maps, flow_run_id)
        if flow_error is not None and any(not r.done for r in maps):
            self.stop = (MapInterrupted(f"the flow run stopped ({type(flow_error).__name__})")
                         if not isinstance(flow_error, Exception)
                         else MemchunkError(f"the flow run failed around it ({type(flow_error).__name__}: "
                                            f"{flow_error})"))
        if flow_error is not None and not isinstance(flow_error, Exception) and maps:
            forget_stop_deaths(flow_run_id, time.time())
        for r in maps:
            _wait_event(r._ended)
        unseen = [r for r in maps if r.error is not None and not r.seen]
        if flow_error is not None:
            for r in unseen:
                logger.info("%s: stopped (%s: %s) as the flow run ended", r.operator, type(r.error).__name__, r.error)
            return None
        for r in unseen[1:]:
            flow_logger(logger).error("memchunk: the chunked map over %s failed and nothing waited for it: %r",
                                      r.operator, r.error)
        if not unseen:
            return None
        unseen[0].map.error_seen = True  # type: ignore[union-attr]
        return unseen[0]


def _failed_around(maps: list[ChunkedResult], flow_run_id: str) -> BaseException | None:
    """An error in the flow's own code is handled by Prefect's engine before the task runner closes: the flow
    run's state says whether the flow failed around its maps (read only where a map is unseen or running)."""
    unseen = [r for r in maps if r.done and r.error is not None and not r.seen]
    if not maps or not (unseen or any(not r.done for r in maps)):
        return None
    state = flow_run_state(flow_run_id)
    if state is not None and state.is_final() and not state.is_completed():
        return MemchunkError(f"the flow run ended {state.name}: {state.message}")
    return None


def _run_map(result: ChunkedResult) -> None:
    """A map's thread: run it; what stops it is kept on the map (``.result()`` and the flow's end raise it)."""
    try:
        result.map.run()  # type: ignore[union-attr]
    except BaseException:  # noqa: BLE001 - kept in ChunkedMap.error, raised where the user looks
        pass
    finally:
        result._finish()
