"""What the chunked maps of one flow run tell each other about their workers: where each starts its next task.

Maps of a chained flow run side by side on the same workers. When one operator's first use leaves a library or
a CUDA context held on a worker, or its runs leave memory there, every other map's next chunk there starts that
much higher than that map's budget assumed. A map's run alone in its worker process reads where the worker
stands (process memory, bytes, not relative to anyone's resting level); the board passes it to the other
running maps, and each hears it with its next event, as
:class:`~memchunk_prefect.core.messages.WorkerStands` against its own resting level, before it submits again.
One board per runner's cluster view, shared by its maps' threads.

A map's first chunk on a worker that leaves a library held there (a first use) is, in all likelihood, what its
first chunk on every other worker will do: the board tells the other maps to keep room for it on the workers
the map has not reported from yet (:class:`~memchunk_prefect.core.messages.FirstUseExpected`), until it does.

>>> board = StandingBoard()
>>> a, b = board.join("map-a"), board.join("map-b")
>>> board.tell(b, "w2", 300, at=0.5)
>>> board.tell(a, "w1", 400, first_use=150, at=1.0)
>>> [(type(t).__name__, t.worker, t.source) for t in b.take()]
[('Standing', 'w1', 'map-a'), ('Expected', 'w2', 'map-a')]
>>> [(type(t).__name__, t.worker, t.process_bytes) for t in a.take()]
[('Standing', 'w2', 300)]
>>> board.leave(b); board.tell(a, "w1", 1, at=2.0); b.take()
[]

A map that ends takes back the first use it had the others expect where it did not run:

>>> c = board.join("map-c"); board.leave(a, at=3.0)
>>> [(t.worker, t.source, t.nbytes) for t in c.take()]
[('w2', 'map-a', 0)]
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Union

from memchunk_prefect.core.messages import FirstUseExpected, WorkerStands
from memchunk_prefect.core.records import Observation


@dataclass(frozen=True)
class Standing:
    """``worker``'s next task starts with its process at ``process_bytes``, as a run of map ``source`` left it."""

    worker: str
    process_bytes: int
    source: str
    at: float


@dataclass(frozen=True)
class Expected:
    """Map ``source`` left ``nbytes`` held at its first chunk on a worker and has not run on ``worker`` yet."""

    worker: str
    source: str
    nbytes: int
    at: float


Told = Union[Standing, Expected]


def standing_of(obs: Observation) -> int | None:
    """Where ``obs``'s worker process stands after the run, bytes: where the run started plus what it left held
    there; None where the run shared its process (another task's memory, or its release, is in those figures)
    or did not read them."""
    if obs.baseline_bytes is None or not obs.worker or not obs.alone or obs.outcome != "ok":
        return None
    return int(obs.baseline_bytes) - int(obs.others_bytes or 0) + int(obs.retained_bytes or 0)


def told_event(told: Told, resting: dict[str, int]) -> WorkerStands | FirstUseExpected:
    """What a map's machine hears of ``told``: a standing against the resting memory the map read on that worker
    (``resting``, bytes by address; the worker must be in it)."""
    if isinstance(told, Standing):
        return WorkerStands(told.worker, told.process_bytes - int(resting[told.worker]), at=told.at,
                            source=told.source)
    return FirstUseExpected(told.worker, told.source, told.nbytes, at=told.at)


class Inbox:
    """What one map (``source``: its ``map_id``) has not read yet of what the others told (thread-safe)."""

    def __init__(self, source: str) -> None:
        self.source = source
        self._lock = threading.Lock()
        self._told: list[Told] = []

    def put(self, told: list[Told]) -> None:
        with self._lock:
            self._told.extend(told)

    def take(self) -> list[Told]:
        """What was told since the last call, oldest first."""
        with self._lock:
            out, self._told = self._told, []
        return out


class StandingBoard:
    """The maps of a flow run that are running, each with its inbox, and the workers each reported from
    (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inboxes: list[Inbox] = []
        self._reported: dict[str, set[str]] = {}  # map -> the workers it told a standing of
        self._workers: set[str] = set()  # every worker any map told a standing of

    def join(self, source: str) -> Inbox:
        inbox = Inbox(source)
        with self._lock:
            self._inboxes.append(inbox)
        return inbox

    def leave(self, inbox: Inbox, at: float = 0.0) -> None:
        """``inbox``'s map ended: it hears no more, and the maps still running keep no room for a first use of it
        on the workers it did not run on (it told none, or never will)."""
        source = inbox.source
        with self._lock:
            if inbox in self._inboxes:
                self._inboxes.remove(inbox)
            not_run = sorted(self._workers - self._reported.get(source, set()))
            told: list[Told] = [Expected(w, source, 0, at) for w in not_run]
            others = list(self._inboxes)
        for other in others:
            other.put(told)

    def tell(self, sender: Inbox, worker: str, process_bytes: int, *, first_use: int = 0, at: float) -> None:
        """A run of ``sender``'s map left ``worker`` at ``process_bytes``, having left ``first_use`` bytes held
        there at its first chunk on it (0: none): every other running map hears, and, for a first use, to keep
        room for it on the workers that map has not run on yet."""
        source = sender.source
        with self._lock:
            self._reported.setdefault(source, set()).add(worker)
            self._workers.add(worker)
            told: list[Told] = [Standing(worker, int(process_bytes), source, at)]
            if first_use > 0:
                told += [Expected(w, source, int(first_use), at)
                         for w in sorted(self._workers - self._reported[source])]
            others = [i for i in self._inboxes if i is not sender]
        for inbox in others:
            inbox.put(told)
