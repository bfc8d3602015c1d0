"""What the chunked maps of one flow run tell each other about their workers: where each starts its next task.

Maps of a chained flow run side by side on the same workers. When one operator's first use leaves a library or
a CUDA context held on a worker, or its runs leave memory there, every other map's next chunk there starts that
much higher than that map's budget assumed. A map's run alone in its worker process reads where the worker
stands (process memory, bytes, not relative to anyone's resting level); the board passes it to the other
running maps, and each hears it with its next event, as
:class:`~memchunk_prefect.core.messages.WorkerStands` against its own resting level, before it submits again.
One board per runner's cluster view, shared by its maps' threads.

>>> board = StandingBoard()
>>> a, b = board.join(), board.join()
>>> board.tell(a, "tcp://w1:1", 400 * 2**20, at=1.0)
>>> [(s.worker, s.process_bytes) for s in b.take()], a.take()
([('tcp://w1:1', 419430400)], [])
>>> board.leave(b); board.tell(a, "tcp://w1:1", 1, at=2.0); b.take()
[]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from memchunk_prefect.core.records import Observation


@dataclass(frozen=True)
class Standing:
    """``worker``'s next task starts with its process at ``process_bytes`` (as read at ``at``, epoch seconds)."""

    worker: str
    process_bytes: int
    at: float


def standing_of(obs: Observation) -> int | None:
    """Where ``obs``'s worker process stands after the run, bytes: where the run started plus what it left held
    there; None where the run shared its process (another task's memory, or its release, is in those figures)
    or did not read them."""
    if obs.baseline_bytes is None or not obs.worker or not obs.alone or obs.outcome != "ok":
        return None
    return int(obs.baseline_bytes) - int(obs.others_bytes or 0) + int(obs.retained_bytes or 0)


class Inbox:
    """One map's unread standings (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._standings: list[Standing] = []

    def put(self, standing: Standing) -> None:
        with self._lock:
            self._standings.append(standing)

    def take(self) -> list[Standing]:
        """The standings told since the last call, oldest first."""
        with self._lock:
            out, self._standings = self._standings, []
        return out


class StandingBoard:
    """The maps of a flow run that are running, each with its inbox (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: list[Inbox] = []

    def join(self) -> Inbox:
        inbox = Inbox()
        with self._lock:
            self._inboxes.append(inbox)
        return inbox

    def leave(self, inbox: Inbox) -> None:
        with self._lock:
            if inbox in self._inboxes:
                self._inboxes.remove(inbox)

    def tell(self, sender: Inbox | None, worker: str, process_bytes: int, *, at: float) -> None:
        """A run of the map reading ``sender`` says ``worker`` stands at ``process_bytes``: every other map hears."""
        standing = Standing(worker, int(process_bytes), at)
        with self._lock:
            others = [i for i in self._inboxes if i is not sender]
        for inbox in others:
            inbox.put(standing)
