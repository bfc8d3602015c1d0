"""What the chunked maps of one flow run tell each other about their workers: memory a run left held for good.

Maps of a chained flow run side by side on the same workers. When one operator's first use leaves a library or
a CUDA context held on a worker, every other map's next chunk there starts that much higher than that map's
budget assumed; each map hears of it with its next event (:class:`~memchunk_prefect.core.messages.WorkerGrew`)
and its budget follows before it submits again. One board per runner's cluster view, shared by its maps'
threads.

>>> board = GrowthBoard()
>>> a, b = board.join(), board.join()
>>> board.tell(a, "tcp://w1:1", 150 * 2**20, at=1.0)
>>> [(e.worker, e.nbytes) for e in b.take()], a.take()
([('tcp://w1:1', 157286400)], [])
>>> board.leave(b); board.tell(a, "tcp://w1:1", 1, at=2.0); b.take()
[]
"""

from __future__ import annotations

import threading

from memchunk_prefect.core.messages import WorkerGrew


class Inbox:
    """One map's unread :class:`WorkerGrew` events (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: list[WorkerGrew] = []

    def put(self, event: WorkerGrew) -> None:
        with self._lock:
            self._events.append(event)

    def take(self) -> list[WorkerGrew]:
        """The events since the last call, oldest first."""
        with self._lock:
            events, self._events = self._events, []
        return events


class GrowthBoard:
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

    def tell(self, sender: Inbox | None, worker: str, nbytes: int, *, at: float) -> None:
        """A run of the map reading ``sender`` left ``nbytes`` held on ``worker``: every other map hears of it."""
        if nbytes <= 0 or not worker:
            return
        event = WorkerGrew(worker, int(nbytes), at=at)
        with self._lock:
            others = [i for i in self._inboxes if i is not sender]
        for inbox in others:
            inbox.put(event)
