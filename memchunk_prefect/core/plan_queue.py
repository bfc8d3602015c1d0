"""The chunks of a map waiting to run: what is queued in order, and what may run now (the upstream gate).

A :class:`Pending` is a chunk with the decision that made it and its attempt; :class:`PlanQueue` keeps them
in submission order (split pieces go to the front); :class:`Gate` says whether a chunk's block (halo
included) is written upstream when the map reads a map still running.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any, Iterable, Iterator

from memchunk_prefect.core.chunks import Chunk, Shape, covers, with_halo
from memchunk_prefect.core.messages import MapSpec
from memchunk_prefect.core.plans import RETRY_SMALLER


@dataclass
class Pending:
    """A chunk queued or in flight, with the decision that made it and how many times it already ran."""

    chunk: Chunk
    decision: str
    attempt: int = 0
    armed: bool = False  # planned under the map's learned-policy arm (its outcome counts in the reward)
    restarted: int = 0  # times it broke its worker's GPU context, each followed by a restart of that worker
    deferred: int = 0  # times it found no room where it began (ChunkDeferred)


class _Cells:
    """Boxes by the cells of a grid over a volume's line axes (about ``per_axis`` cells on each) that they overlap:
    the boxes another box may intersect, found without a look at every box (traces are cut on the line axes; a
    box cut in time is told apart by :meth:`Chunk.intersect`)."""

    def __init__(self, shape: Shape, per_axis: int = 64):
        self._step = tuple(max(1, -(-int(s) // per_axis)) for s in shape[:2])
        self._cells: dict[tuple[int, ...], list[Chunk]] = {}

    def _keys(self, box: Chunk) -> Iterator[tuple[int, ...]]:
        return itertools.product(*(range(a // st, max(a, b - 1) // st + 1)
                                   for a, b, st in zip(box.start[:2], box.stop[:2], self._step)))

    def add(self, box: Chunk, item: Chunk) -> None:
        """File ``item`` under the cells ``box`` overlaps."""
        for k in self._keys(box):
            self._cells.setdefault(k, []).append(item)

    def near(self, box: Chunk) -> set[Chunk]:
        """The items filed under any cell ``box`` overlaps (a superset of those whose box intersects it)."""
        out: set[Chunk] = set()
        for k in self._keys(box):
            out.update(self._cells.get(k, ()))
        return out


class Gate:
    """Which chunks of a gated map may run: those whose whole block (halo included) the upstream map has written.

    A map over an upstream map's result is planned from the upstream's *plan* and starts while the upstream
    runs; each of its chunks waits in the queue (not on a worker slot) until the upstream chunks its block
    reads are written (:class:`UpstreamWritten`), whatever cut the upstream ends with (re-plans, split pieces,
    a resume's old chunks: coverage is checked element by element, :func:`~memchunk_prefect.core.chunks.covers`).
    Cost: a chunk is checked when first asked about and again only when an upstream write touches its block;
    the writes a block meets, and the waiting blocks a write touches, are found through a grid over the line axes
    (:class:`_Cells`), not by a look at every write or every waiting chunk: a simulated map of 2,000 chunks over
    one of 960 spent 24 s of 50 in that look (``python -m benchmarks.sim_validation`` times a 1,000-worker
    simulation). Element by element is checked only once the writes in a block hold as many elements as it.
    """

    def __init__(self, spec: "MapSpec"):
        self._spec = spec
        self.open = not spec.gated  # the upstream is complete (or there is none): every chunk may run
        self.written: list[Chunk] = []
        # chunk -> [its block, upstream chunks in it, count last short, elements of theirs in it (overlaps twice)]
        self._waiting: dict[Chunk, list[Any]] = {}
        self._written_cells = _Cells(spec.shape)  # upstream writes by where they are
        self._waiting_cells = _Cells(spec.shape)  # waiting chunks by where their blocks are (stale ones skipped)
        self.version = 0  # moves with every write heard: a chunk short before may be ready after

    def ready(self, chunk: Chunk) -> bool:
        if self.open:
            return True
        entry = self._waiting.get(chunk)
        if entry is None:
            block = with_halo(chunk, self._spec.halo, self._spec.shape)[0]
            parts = [(w, w.intersect(block)) for w in self._written_cells.near(block)]
            pieces = [w for w, part in parts if part is not None]
            held = sum(part.elements for _, part in parts if part is not None)
            entry = self._waiting[chunk] = [block, pieces, -1, held]
            self._waiting_cells.add(block, chunk)
        block, pieces, checked, held = entry
        if len(pieces) == checked:
            return False  # no upstream write touched its block since it was last found short
        if held >= block.elements and covers(pieces, block):
            del self._waiting[chunk]  # ready for good: upstream writes are never undone
            return True
        entry[2] = len(pieces)
        return False

    def add(self, chunks: Iterable[Chunk], complete: bool) -> None:
        if self.open:
            return
        self.version += 1
        if complete:
            self.open = True
            self._waiting.clear()
            return
        for w in chunks:
            self.written.append(w)
            self._written_cells.add(w, w)
            for chunk in self._waiting_cells.near(w):
                entry = self._waiting.get(chunk)
                if entry is None:
                    continue  # found ready since it was filed
                part = w.intersect(entry[0])
                if part is not None:
                    entry[1].append(w)
                    entry[3] += part.elements


class PlanQueue:
    """The planned chunks not yet submitted, in submission order, with what the re-plan check asks of them kept
    up to date: how many of each read-block shape are queued, and how many are split pieces.

    After every event the machine asks for the largest block queued and whether split pieces wait; over a list
    that was O(queue) per event, O(n^2) per map: 4.5 M halo boxes computed (26 s) for a simulated map of
    5,600 chunks. Here each chunk's block is computed once, when it is queued, and the questions cost
    O(distinct shapes) (a plan cuts a box into a few shapes).
    """

    def __init__(self, spec: "MapSpec", items: Iterable[Pending] = ()):
        self._spec = spec
        self._items: deque[Pending] = deque()
        self._shapes: Counter[Shape] = Counter()
        self._split = 0
        self._added = 0  # moves with every chunk queued
        self._dry: tuple[int, int] | None = None  # (gate version, _added) of the last look that found none ready
        self.extend(items)

    def _count(self, item: Pending, n: int) -> None:
        self._shapes[self._spec.read_extents(item.chunk)] += n
        self._split += n * (item.decision == RETRY_SMALLER)

    def extend(self, items: Iterable[Pending]) -> None:
        for item in items:
            self._count(item, 1)
            self._items.append(item)
            self._added += 1

    def push_front(self, items: Iterable[Pending]) -> None:
        """Put ``items`` first, in their order (a resubmission, split pieces)."""
        items = list(items)
        for item in items:
            self._count(item, 1)
        self._items.extendleft(reversed(items))
        self._added += len(items)

    def popleft(self) -> Pending:
        item = self._items.popleft()
        self._count(item, -1)
        return item

    def pop_first(self, gate: Gate) -> Pending | None:
        """The first queued item whose chunk ``gate`` lets run, taken off the queue; None if there is none.

        A look that found none is not repeated until the gate hears a write or a chunk is queued: a gated map
        asks after every event, and a simulated map of 960 chunks waiting on its upstream spent 12 s of its 25 s
        in these looks (``python -m benchmarks.sim_validation`` times a 1,000-worker simulation)."""
        if self._dry == (gate.version, self._added):
            return None
        for i, item in enumerate(self._items):
            if gate.ready(item.chunk):
                del self._items[i]
                self._count(item, -1)
                return item
        self._dry = (gate.version, self._added)
        return None

    def largest_read(self) -> Shape | None:
        """The largest block (elements, halo included) a queued chunk reads; None when nothing is queued."""
        shapes = [s for s, n in self._shapes.items() if n > 0]
        return max(shapes, key=math.prod) if shapes else None

    @property
    def has_split_pieces(self) -> bool:
        return self._split > 0

    def __iter__(self) -> Iterator[Pending]:
        return iter(self._items)

    def __getitem__(self, i: int | slice) -> Any:
        return list(self._items)[i] if isinstance(i, slice) else self._items[i]

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)
