"""Chunk and halo arithmetic over plain tuples of ints.

A volume has three axes, in this order: ``iline``, ``xline``, ``twt`` (time or
depth samples). A :class:`Chunk` is a half-open box ``[start, stop)`` of
*output* elements. To compute it exactly an operator needs a *halo* of extra
input around it; :func:`with_halo` widens a chunk by the halo and **clips at the
volume's edges** — the one edge rule used everywhere in this package. Clipping
is exact because an operator applied to a block whose edge is the volume's edge
sees the same boundary as it does on the whole volume.

Everything here is pure and cheap; nothing reads data. Errors quote the values.

>>> c = Chunk((0, 4, 0), (4, 8, 50))
>>> c.shape, c.elements
((4, 4, 50), 800)
>>> read, trim = with_halo(c, (2, 2, 0), (10, 10, 50))
>>> read
Chunk(start=(0, 2, 0), stop=(6, 10, 50))
>>> trim
(slice(0, 4, None), slice(2, 6, None), slice(0, 50, None))
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Sequence

from memchunk_prefect.core.errors import HaloTooLargeError, VolumeError

AXES: tuple[str, str, str] = ("iline", "xline", "twt")
Shape = tuple[int, int, int]


@dataclass(frozen=True, order=True)
class Chunk:
    """A half-open box ``[start, stop)`` of a 3D volume, in element indices (not header numbers)."""

    start: Shape
    stop: Shape

    def __post_init__(self) -> None:
        start = ints3(self.start, "a chunk's start")
        stop = ints3(self.stop, "a chunk's stop")
        if any(a < 0 or b <= a for a, b in zip(start, stop)):
            raise VolumeError(
                f"a chunk needs 0 <= start < stop on every axis, got start={self.start}, stop={self.stop}"
            )
        object.__setattr__(self, "start", start)
        object.__setattr__(self, "stop", stop)

    @classmethod
    def whole(cls, shape: Sequence[int]) -> "Chunk":
        """The chunk covering a whole volume of ``shape``."""
        return cls((0, 0, 0), check_shape(shape))

    @property
    def shape(self) -> Shape:
        return tuple(b - a for a, b in zip(self.start, self.stop))  # type: ignore[return-value]

    @property
    def elements(self) -> int:
        s = self.shape
        return s[0] * s[1] * s[2]

    def slices(self) -> tuple[slice, slice, slice]:
        return tuple(slice(a, b) for a, b in zip(self.start, self.stop))  # type: ignore[return-value]

    def label(self, shape: Sequence[int] | None = None) -> str:
        """A short human label naming only the axes that are cut, e.g. ``iline 64:96``.

        >>> Chunk((64, 0, 0), (96, 10, 50)).label((128, 10, 50))
        'iline 64:96'
        >>> Chunk((0, 0, 0), (10, 10, 50)).label((10, 10, 50))
        'whole'
        """
        parts = []
        for axis, a, b, n in zip(AXES, self.start, self.stop, shape or (None, None, None)):
            if n is None or a != 0 or b != n:
                parts.append(f"{axis} {a}:{b}")
        return ", ".join(parts) if parts else "whole"

    def key(self) -> str:
        """A filename- and key-safe identifier: ``i64-96_x0-10_t0-50``."""
        return "_".join(f"{p}{a}-{b}" for p, a, b in zip("ixt", self.start, self.stop))

    @classmethod
    def from_key(cls, key: str) -> "Chunk":
        """Inverse of :meth:`key`; anything else is a VolumeError.

        >>> Chunk.from_key("i0-4_x0-8_t0-50")
        Chunk(start=(0, 0, 0), stop=(4, 8, 50))
        """
        try:
            parts = key.split("_")
            if len(parts) != 3 or [p[:1] for p in parts] != ["i", "x", "t"]:
                raise ValueError(key)
            ab = [tuple(int(v) for v in p[1:].split("-")) for p in parts]
            return cls(tuple(a for a, _ in ab), tuple(b for _, b in ab))  # type: ignore[arg-type]
        except (ValueError, TypeError, AttributeError):
            raise VolumeError(f"{key!r} is not a chunk key like 'i0-4_x0-8_t0-50'") from None

    def contains(self, other: "Chunk") -> bool:
        return all(a <= c and d <= b for a, b, c, d in zip(self.start, self.stop, other.start, other.stop))

    def intersect(self, other: "Chunk") -> "Chunk | None":
        start = tuple(max(a, c) for a, c in zip(self.start, other.start))
        stop = tuple(min(b, d) for b, d in zip(self.stop, other.stop))
        if any(b <= a for a, b in zip(start, stop)):
            return None
        return Chunk(start, stop)  # type: ignore[arg-type]


def ints3(values: object, what: str) -> Shape:
    """Three ints from ``values`` (ints, or floats with integral values), else a VolumeError naming ``what``.

    >>> ints3((1, 2.0, 3), "a shape")
    (1, 2, 3)
    """
    if type(values) is tuple and len(values) == 3 and all(type(v) is int for v in values):
        return values  # the common case, already exact (chunks are made by the 100k)
    try:
        items = list(values)  # type: ignore[call-overload]
    except TypeError:
        raise VolumeError(f"{what} must be 3 ints (iline, xline, twt), got {values!r}") from None
    if len(items) != 3:
        raise VolumeError(f"{what} must have 3 values (iline, xline, twt), got {len(items)}: {values!r}")
    out = []
    for v in items:
        if isinstance(v, bool) or not hasattr(v, "__int__") or isinstance(v, (str, bytes)):
            raise VolumeError(f"{what} must be 3 ints (iline, xline, twt), got {values!r}")
        try:
            i = int(v)
        except (TypeError, ValueError, OverflowError):
            raise VolumeError(f"{what} must be 3 finite ints (iline, xline, twt), got {values!r}") from None
        if i != v:
            raise VolumeError(f"{what} must be 3 whole numbers (iline, xline, twt), got {values!r}")
        out.append(i)
    return tuple(out)  # type: ignore[return-value]


def check_shape(shape: Sequence[int]) -> Shape:
    """Validate a volume shape: three positive ints.

    >>> check_shape((2, 3, 4))
    (2, 3, 4)
    """
    out = ints3(shape, "a volume shape")
    if any(s <= 0 for s in out):
        raise VolumeError(f"a volume shape must be positive on every axis, got {out}: the volume is empty")
    return out


def normalize_halo(halo: int | Sequence[int] | None) -> Shape:
    """An int (every axis) or three ints, or None (no halo), as a 3-tuple of non-negative ints.

    >>> normalize_halo(2), normalize_halo((1, 2, 0)), normalize_halo(None)
    ((2, 2, 2), (1, 2, 0), (0, 0, 0))
    """
    if halo is None:
        return (0, 0, 0)
    if isinstance(halo, bool):
        raise VolumeError(f"halo must be an int or 3 ints (iline, xline, twt), got {halo!r}")
    if hasattr(halo, "__index__") and not isinstance(halo, (str, bytes)):
        h = int(halo)
        out: tuple[int, ...] = (h, h, h)
    else:
        out = ints3(halo, "halo (an int or 3 ints)")
    if any(h < 0 for h in out):
        raise VolumeError(f"halo must be non-negative on every axis, got {out}")
    return out  # type: ignore[return-value]


def max_halo(*halos: int | Sequence[int] | None) -> Shape:
    """Axis-wise maximum of several halos."""
    hs = [normalize_halo(h) for h in halos]
    return tuple(max(h[i] for h in hs) if hs else 0 for i in range(3))  # type: ignore[return-value]


def check_halo(halo: Sequence[int], shape: Sequence[int], *, what: str = "volume") -> Shape:
    """Refuse a halo larger than the volume along an axis that has more than one element.

    A halo wider than the whole volume can never be filled with real data, which
    almost always means the halo (or the operator's parameters) are wrong.
    """
    h = normalize_halo(halo)
    s = check_shape(shape)
    bad = [f"{AXES[i]}: halo {h[i]} >= {s[i]} elements" for i in range(3) if s[i] > 1 and h[i] >= s[i]]
    if bad:
        raise HaloTooLargeError(
            f"the halo {h} is larger than the {what} of shape {s} ({'; '.join(bad)}). "
            "Use a smaller halo (or smaller operator parameters such as sigma or window), or a larger volume."
        )
    return h


def with_halo(chunk: Chunk, halo: int | Sequence[int] | None,
              shape: Sequence[int]) -> tuple[Chunk, tuple[slice, slice, slice]]:
    """The block to read for ``chunk`` and the slices that trim the halo off the result.

    The halo is clipped at the volume's edges (the package's one edge rule).
    Returns ``(read_chunk, trim)`` where ``block[trim]`` has ``chunk.shape``.
    """
    h = normalize_halo(halo)
    s = check_shape(shape)
    if any(b > n for b, n in zip(chunk.stop, s)):
        raise VolumeError(f"chunk {chunk} reaches past the volume of shape {s}")
    start = tuple(max(0, a - hh) for a, hh in zip(chunk.start, h))
    stop = tuple(min(n, b + hh) for b, hh, n in zip(chunk.stop, h, s))
    read = Chunk(start, stop)  # type: ignore[arg-type]
    trim = tuple(slice(a - r, a - r + (b - a)) for a, b, r in zip(chunk.start, chunk.stop, start))
    return read, trim  # type: ignore[return-value]


def extents_with_halo(chunk_shape: Sequence[int], halo: Sequence[int], volume_shape: Sequence[int]) -> Shape:
    """What an interior chunk of ``chunk_shape`` holds in memory: its shape plus the halo on both sides.

    Clipped to the volume (a block can never be larger than the volume). This is
    the block size the planner and the model reason about before a chunk has a
    position; :func:`with_halo` gives the exact block of a placed chunk (smaller
    at the volume's edges).

    >>> extents_with_halo((4, 4, 50), (2, 2, 0), (10, 6, 50))
    (8, 6, 50)
    """
    return tuple(min(int(c) + 2 * int(h), int(n)) for c, h, n in zip(chunk_shape, halo, volume_shape))  # type: ignore[return-value]


def largest_read_extents(region: "Chunk", counts: Sequence[int], halo: Sequence[int],
                         volume_shape: Sequence[int]) -> Shape:
    """The largest block (per axis) that a :func:`balanced_grid` of ``region`` into ``counts`` pieces reads.

    Each piece's halo is clipped at the volume's edges, as :func:`with_halo`
    reads it: cut in two, a slab holds its halo on one side only, which
    :func:`extents_with_halo` (an interior chunk) over-states. The grid is
    separable, so the largest block is the largest extent along each axis.

    >>> largest_read_extents(Chunk((0, 0, 0), (128, 8, 10)), (2, 1, 1), (12, 0, 0), (128, 8, 10))
    (76, 8, 10)
    >>> extents_with_halo((64, 8, 10), (12, 0, 0), (128, 8, 10))
    (88, 8, 10)
    """
    return _largest_read_extents(region, tuple(int(c) for c in counts), tuple(int(h) for h in halo),
                                 tuple(int(n) for n in volume_shape))


@functools.lru_cache(maxsize=2**16)
def _largest_read_extents(region: "Chunk", counts: tuple[int, ...], halo: tuple[int, ...],
                          volume_shape: tuple[int, ...]) -> Shape:
    # O(pieces) per call, and the planner asks it for every candidate count of every plan: the same questions
    # recur across a simulation's repeated runs (the same warm models give the same plans), so they are cached.
    out = []
    for a0, a1, c, h, n in zip(region.start, region.stop, counts, halo, volume_shape):
        out.append(max(min(n, a0 + b + h) - max(0, a0 + a - h) for a, b in even_splits(a1 - a0, max(1, c))))
    return tuple(out)  # type: ignore[return-value]


def grid(shape: Sequence[int], chunk_shape: Sequence[int]) -> list[Chunk]:
    """Cut a volume into a regular grid of chunks (the last along each axis may be smaller).

    >>> [c.shape for c in grid((5, 2, 3), (2, 2, 3))]
    [(2, 2, 3), (2, 2, 3), (1, 2, 3)]
    """
    s = check_shape(shape)
    cs = tuple(min(c, n) for c, n in zip(check_shape(chunk_shape), s))
    out = []
    for i in range(0, s[0], cs[0]):
        for x in range(0, s[1], cs[1]):
            for t in range(0, s[2], cs[2]):
                out.append(Chunk((i, x, t), (min(i + cs[0], s[0]), min(x + cs[1], s[1]), min(t + cs[2], s[2]))))
    return out


def even_splits(n: int, parts: int) -> list[tuple[int, int]]:
    """Split ``range(n)`` into ``parts`` contiguous pieces whose sizes differ by at most one.

    >>> even_splits(10, 3)
    [(0, 4), (4, 7), (7, 10)]
    """
    parts = max(1, min(int(parts), int(n)))
    base, extra = divmod(int(n), parts)
    out, a = [], 0
    for k in range(parts):
        b = a + base + (1 if k < extra else 0)
        out.append((a, b))
        a = b
    return out


def balanced_grid(shape: Sequence[int], counts: Sequence[int]) -> list[Chunk]:
    """Cut each axis into ``counts[axis]`` near-equal pieces (sizes differ by at most one).

    Unlike :func:`grid` there is no small remainder chunk, so work is balanced.

    >>> [c.shape for c in balanced_grid((10, 4, 6), (3, 1, 1))]
    [(4, 4, 6), (3, 4, 6), (3, 4, 6)]
    """
    s = check_shape(shape)
    counts = tuple(max(1, c) for c in ints3(counts, "piece counts"))
    ranges = [even_splits(n, c) for n, c in zip(s, counts)]
    return [Chunk((i0, x0, t0), (i1, x1, t1))
            for (i0, i1) in ranges[0] for (x0, x1) in ranges[1] for (t0, t1) in ranges[2]]


def split(chunk: Chunk, axes: Iterable[int] = (0, 1)) -> list[Chunk]:
    """Halve a chunk along its longest axis among ``axes``; ``[]`` if none can be split.

    Used on out-of-memory: the two halves together cover exactly the chunk.

    >>> split(Chunk((0, 0, 0), (4, 6, 10)))
    [Chunk(start=(0, 0, 0), stop=(4, 3, 10)), Chunk(start=(0, 3, 0), stop=(4, 6, 10))]
    >>> split(Chunk((0, 0, 0), (1, 1, 10)))
    []
    """
    if not isinstance(chunk, Chunk):
        raise VolumeError(f"split() needs a Chunk, got {type(chunk).__name__}: {chunk!r}")
    try:
        axes = list(axes)
    except TypeError:
        raise VolumeError(f"split axes must be among 0 (iline), 1 (xline), 2 (twt), got {axes!r}") from None
    if any(isinstance(a, bool) or not isinstance(a, int) or not 0 <= a <= 2 for a in axes):
        raise VolumeError(f"split axes must be among 0 (iline), 1 (xline), 2 (twt), got {axes!r}")
    shape = chunk.shape
    candidates = [a for a in axes if shape[a] > 1]
    if not candidates:
        return []
    axis = max(candidates, key=lambda a: (shape[a], -a))
    mid = chunk.start[axis] + shape[axis] // 2
    lo_stop = list(chunk.stop)
    lo_stop[axis] = mid
    hi_start = list(chunk.start)
    hi_start[axis] = mid
    return [Chunk(chunk.start, tuple(lo_stop)), Chunk(tuple(hi_start), chunk.stop)]  # type: ignore[arg-type]


def covers_exactly(chunks: Iterable[Chunk], shape: Sequence[int]) -> bool:
    """True when the chunks tile the volume with no gap and no overlap."""
    s = check_shape(shape)
    try:
        chunks = list(chunks)
    except TypeError:
        raise VolumeError(f"covers_exactly() needs an iterable of Chunk objects, got {chunks!r}") from None
    if not all(isinstance(c, Chunk) for c in chunks):
        raise VolumeError("covers_exactly() needs Chunk objects, got "
                          f"{sorted({type(c).__name__ for c in chunks if not isinstance(c, Chunk)})}")
    if sum(c.elements for c in chunks) != s[0] * s[1] * s[2]:
        return False
    whole = Chunk.whole(s)
    if not all(whole.contains(c) for c in chunks):
        return False
    # Equal volume and every pair disjoint <=> exact tiling.
    ordered = sorted(chunks)
    for i, a in enumerate(ordered):
        for b in ordered[i + 1:]:
            if b.start[0] >= a.stop[0]:
                break
            if a.intersect(b) is not None:
                return False
    return True


def uncovered_boxes(shape: Sequence[int], chunks: Iterable[Chunk]) -> list[Chunk]:
    """Disjoint boxes that together hold exactly the elements of ``shape`` that no chunk covers.

    Used to resume an output: what earlier runs completed (any cut, overlaps
    allowed) is subtracted, and only these boxes are planned and computed.
    Works on the grid compressed to the chunks' boundaries (at most 2k+2 cells
    per axis for k chunks); each box grows from its first free cell along twt,
    then xline, then iline, so slabs of whole ilines come back as one box.

    >>> uncovered_boxes((10, 4, 8), [Chunk((0, 0, 0), (3, 4, 8)), Chunk((5, 0, 0), (7, 4, 8))])
    [Chunk(start=(3, 0, 0), stop=(5, 4, 8)), Chunk(start=(7, 0, 0), stop=(10, 4, 8))]
    >>> uncovered_boxes((4, 4, 4), [Chunk((0, 0, 0), (4, 4, 4))])
    []
    """
    import numpy as np

    s = check_shape(shape)
    clipped = [c.intersect(Chunk.whole(s)) for c in chunks]
    boxes_in = [c for c in clipped if c is not None]
    bounds = [sorted({0, n, *(c.start[a] for c in boxes_in), *(c.stop[a] for c in boxes_in)})
              for a, n in enumerate(s)]
    index = [{v: k for k, v in enumerate(b)} for b in bounds]
    free = np.ones([len(b) - 1 for b in bounds], dtype=bool)
    for c in boxes_in:
        free[tuple(slice(index[a][c.start[a]], index[a][c.stop[a]]) for a in range(3))] = False
    n_i, n_j, n_k = free.shape
    out: list[Chunk] = []
    for i, j, k in np.argwhere(free):
        if not free[i, j, k]:  # taken by a box grown from an earlier cell
            continue
        k1 = k + 1
        while k1 < n_k and free[i, j, k1]:
            k1 += 1
        j1 = j + 1
        while j1 < n_j and free[i, j1, k:k1].all():
            j1 += 1
        i1 = i + 1
        while i1 < n_i and free[i1, j:j1, k:k1].all():
            i1 += 1
        free[i:i1, j:j1, k:k1] = False
        out.append(Chunk((bounds[0][i], bounds[1][j], bounds[2][k]), (bounds[0][i1], bounds[1][j1], bounds[2][k1])))
    return out


def covers(chunks: Iterable[Chunk], box: Chunk) -> bool:
    """Whether ``chunks`` (overlaps allowed) cover every element of ``box``.

    What a map reading an upstream map's output while it is still written asks
    of each chunk's block: may it be read yet?

    >>> covers([Chunk((0, 0, 0), (2, 4, 4)), Chunk((2, 0, 0), (5, 4, 4))], Chunk((1, 0, 0), (4, 4, 4)))
    True
    >>> covers([Chunk((0, 0, 0), (2, 4, 4))], Chunk((1, 0, 0), (4, 4, 4)))
    False
    """
    pieces = [p for p in (c.intersect(box) for c in chunks) if p is not None]
    if sum(p.elements for p in pieces) < box.elements:
        return False  # cannot cover, overlaps or not
    shifted = [Chunk(tuple(a - o for a, o in zip(p.start, box.start)),  # type: ignore[arg-type]
                     tuple(b - o for b, o in zip(p.stop, box.start))) for p in pieces]  # type: ignore[arg-type]
    return not uncovered_boxes(box.shape, shifted)
