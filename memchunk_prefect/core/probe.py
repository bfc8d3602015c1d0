"""Cold start: a wave of small real chunks that teaches the model an operator it has never seen.

With no usable history the planner cannot bound a block's memory, so it probes: one chunk per slot (at least
two), all of one size, cut side by side from the region's start. The first wave is a fraction of the largest
block an operator needing ``probe_multiple`` times its input would fit; the map machine sizes the next wave from
what the first measured. Probes are real work: their results are kept, and only the boxes they leave
(``Plan.remainder``) are planned afterwards.
"""

from __future__ import annotations

import itertools
import math
from typing import Callable, Sequence

from memchunk_prefect.core.chunks import (
    Chunk,
    Shape,
    check_shape,
    extents_with_halo,
    normalize_halo,
    with_halo,
)
from memchunk_prefect.core.errors import BudgetTooSmallError, format_bytes
from memchunk_prefect.core.estimates import GpuLimit
from memchunk_prefect.core.plans import PROBE, Plan, check_budget, check_region, positive
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE, PolicySettings


def probe_budget(budget_bytes: int, gpu: GpuLimit | None) -> int:
    """The budget cold-start probes are sized for: the host's, or the GPU's where that is smaller (nothing is
    known of the operator's GPU memory either, and a probe that runs out of it is one more censored chunk)."""
    return budget_bytes if gpu is None else min(int(budget_bytes), int(gpu.budget_bytes))


def probe_plan(
    shape: Sequence[int],
    *,
    budget_bytes: int,
    halo: int | Sequence[int] | None = None,
    slots: int = 1,
    whole_traces: bool = True,
    region: Chunk | None = None,
    itemsize: int = ITEMSIZE,
    settings: PolicySettings = DEFAULT_SETTINGS,
    scale: float | None = None,
    reason: str = "too little history",
    others_left: bool = False,
    fits: Callable[[Shape], bool] | None = None,
) -> Plan:
    """A cold-start probe wave: one chunk per slot (at least two), all of one size, from ``region``'s start.

    The largest probe an unknown operator can be given is the block that fits the
    budget if it needs ``settings.probe_multiple`` times its input; a wave's
    probes are ``scale`` times that (``settings.probe_first_share`` by default:
    the first wave). They lie side by side across the region's xlines in a strip
    of as many ilines as that allows, so they are real work of one size (equal
    probes keep every slot busy for the same time). The runner sizes its second
    wave from what the first measured (:mod:`memchunk_prefect.core.machine`): small
    first, because an operator whose memory grows faster than its size can
    outgrow any multiple of its input (a 100x-sized first probe of one quadratic
    in its traces was killed), then as large as that growth allows, because a
    light operator measured only at its memory floor is planned several times
    too cautiously. What is left (``remainder``) is at most three boxes. Probes
    are real work: their results are kept. A wave that takes all of ``region``
    when nothing else is left to plan teaches two sizes itself (else the next
    run would probe one size again); ``others_left``: boxes outside ``region``
    remain to be planned after it, so its probes may all be of one size. ``fits(extents)``: whether a probe
    may read a block of ``extents`` (halo included) at all; :func:`plan` passes the model's bounds, which a block
    at least as large as one that ran out of memory exceeds, so a probe is never a size known to fail.

    >>> p = probe_plan((10, 40, 100), budget_bytes=100 * 4 * 12_000, slots=2, scale=1.0)
    >>> [c.shape for c in p.chunks], [c.shape for c in p.remainder]
    ([(6, 20, 100), (6, 20, 100)], [(4, 40, 100)])
    """
    vol = check_shape(shape)
    h = normalize_halo(halo)
    region = check_region(region, vol)
    r = region.shape
    budget_bytes = check_budget(budget_bytes)
    slots = int(positive(slots, "slots"))
    itemsize = int(positive(itemsize, "itemsize"))
    scale = float(positive(settings.probe_first_share if scale is None else scale, "scale", integer=False))
    _check_floor(vol, r, h, whole_traces, itemsize, budget_bytes)
    n = min(max(slots, 2), r[1])  # (more probes than trace columns cannot be cut)
    # Elements (halo included) a probe may hold: scale x what an operator needing probe_multiple x its input fits.
    max_elems = max(1.0, budget_bytes * scale / (settings.probe_multiple * itemsize))
    strip = _Strip(region, h, vol, fits)
    rows, widths, t_len = strip.size(n, max_elems, whole_traces)
    if rows >= r[0] and t_len == r[2] and r[1] >= 3 and not others_left:
        widths = _two_sizes(n, r[1])
    chunks, remainder = strip.cut(rows, widths, t_len)
    largest = max(chunks, key=lambda c: c.elements)
    return Plan(
        chunks=chunks,
        chunk_shape=largest.shape,
        predicted_peak_bytes=None,
        upper_bound_bytes=None,
        budget_bytes=int(budget_bytes),
        probe=True,
        remainder=remainder,
        decision=PROBE,
        reason=(f"{reason}: probing with {len(chunks)} chunks of {largest.shape} ({scale:.3g} of the largest block "
                f"an operator needing {settings.probe_multiple:g}x its input fits)"),
        probe_reason=reason,
    )


def _check_floor(vol: Shape, r: Shape, h: Shape, whole_traces: bool, itemsize: int, budget_bytes: int) -> None:
    """Without history nothing is known of the operator but this: it holds at least its input block and
    writes an output block as large. If even the smallest block allowed cannot do that, refuse now, before
    anything is submitted."""
    smallest = extents_with_halo((1, 1, r[2] if whole_traces else 1), h, vol)
    floor_bytes = 2 * itemsize * math.prod(smallest)
    if floor_bytes > budget_bytes:
        smallest_name = "one trace" if whole_traces else "one sample"
        raise BudgetTooSmallError(
            f"the memory budget of {format_bytes(budget_bytes)} per task cannot hold even {smallest_name} column "
            f"with its halo (extents {smallest}: {format_bytes(floor_bytes)} for its input and output alone). "
            "Give workers more memory (memory_limit), fewer threads per worker, or a larger memory_budget")


def _two_sizes(n: int, xlines: int) -> list[int]:
    """Widths of a wave that takes the whole region with nothing else left to plan, so it must teach two sizes
    itself: 2 units on half the slots, 1 unit twice on the others, the larger first (every slot holds 2 units)."""
    sizes = [2] * -(-n // 2) + [1] * (2 * (n // 2))
    while sum(sizes) > xlines and len(sizes) > 2:
        sizes.pop()
    cuts = [round(xlines * k / sum(sizes)) for k in itertools.accumulate(sizes)]
    return [b - a for a, b in zip([0] + cuts[:-1], cuts)]


class _Strip:
    """Probes side by side across a region's xlines, from its start: how large they may be, and the cut."""

    def __init__(self, region: Chunk, halo: Shape, vol: Shape, fits: Callable[[Shape], bool] | None):
        self.region, self.halo, self.vol, self.fits = region, halo, vol, fits

    def read(self, rows: int, widths: Sequence[int], t_len: int) -> float:
        """Elements of the largest block the probes read, placed at the region's start (halos clipped at the
        volume's edges, as they are read: a probe in a corner holds half the halo an interior block would);
        infinite where one of them does not ``fits``."""
        i0, x, t0 = self.region.start
        out = 0
        for w in widths:
            block = with_halo(Chunk((i0, x, t0), (i0 + rows, x + w, t0 + t_len)), self.halo, self.vol)[0]
            if self.fits is not None and not self.fits(block.shape):
                return math.inf
            out = max(out, block.elements)
            x += w
        return out

    def size(self, n: int, max_elems: float, whole_traces: bool) -> tuple[int, list[int], int]:
        """(ilines, widths, samples) of ``n`` probes of one size reading at most ``max_elems`` each."""
        r = self.region.shape
        t_len = r[2]
        if not whole_traces:
            while t_len > 1 and self.read(1, [1], t_len) > max_elems:
                t_len = -(-t_len // 2)
        cuts = [round(r[1] * k / n) for k in range(1, n + 1)]
        widths = [b - a for a, b in zip([0] + cuts[:-1], cuts)]  # the probes across every xline, of one size
        rows = 1
        if self.read(1, widths, t_len) <= max_elems:  # a strip as thick as the probes allow
            rows = _largest(1, r[0], lambda k: self.read(k, widths, t_len) <= max_elems)
        else:  # even one iline across every xline is too much: the probes take part of the first iline
            widths = [_largest(1, max(1, r[1] // n), lambda k: self.read(1, [k] * n, t_len) <= max_elems)] * n
        return rows, widths, t_len

    def cut(self, rows: int, widths: Sequence[int], t_len: int) -> tuple[list[Chunk], list[Chunk]]:
        """The probes, and what they leave of the region (at most three boxes)."""
        region = self.region
        i0, x, t0 = region.start
        chunks: list[Chunk] = []
        for w in widths:
            chunks.append(Chunk((i0, x, t0), (i0 + rows, x + w, t0 + t_len)))
            x += w
        remainder: list[Chunk] = []
        if t0 + t_len < region.stop[2]:
            remainder.append(Chunk((i0, region.start[1], t0 + t_len), (i0 + rows, x, region.stop[2])))
        if x < region.stop[1]:
            remainder.append(Chunk((i0, x, t0), (i0 + rows, region.stop[1], region.stop[2])))
        if i0 + rows < region.stop[0]:
            remainder.append(Chunk((i0 + rows, region.start[1], t0), region.stop))
        return chunks, remainder


def _largest(lo: int, hi: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [lo, hi] with ``ok(n)``, for ``ok`` true up to some n and false beyond (``lo`` if none):
    by bisection, so a survey of a million ilines costs twenty checks.

    >>> _largest(1, 1000, lambda n: n * n <= 200)
    14
    """
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


#: A probe wave's blocks differ from the last wave's by at least this factor (smaller or larger): two sizes
#: this far apart separate a fixed overhead from a slope.
PROBE_SIZE_STEP = 1.5


def next_probe_scale(last: float, budget_bytes: int, peak_bytes: float, gpu_budget_bytes: int | None,
                     gpu_peak_bytes: float, settings: PolicySettings = DEFAULT_SETTINGS) -> float:
    """The next probe wave's blocks, as a share of the largest an operator needing ``probe_multiple`` x its
    input fits, after a wave of share ``last`` peaked at ``peak_bytes`` (``gpu_peak_bytes`` on the GPU).

    As far as that peak allows if memory grew with the square of the block (within ``probe_growth_budget``
    of the budget), up to the largest; 1.5x smaller where that is not 1.5x larger (two sizes separate a fixed
    overhead from a slope); a quarter after a wave that measured nothing (every probe ran out of memory). On
    the GPU the tighter of the two budgets against its own peak.

    >>> next_probe_scale(0.125, 800, 10.0, None, 0.0)  # a light operator: as large as growth allows
    1.0
    >>> next_probe_scale(0.125, 800, 0.0, None, 0.0)  # nothing measured: a quarter
    0.03125
    """
    if peak_bytes <= 0:
        return last / 4
    room = budget_bytes / peak_bytes
    if gpu_budget_bytes is not None:
        if gpu_peak_bytes <= 0:  # the GPU measured nothing (every probe ran out of it)
            return last / 4
        room = min(room, gpu_budget_bytes / gpu_peak_bytes)
    up = min(1.0, last * math.sqrt(settings.probe_growth_budget * room))
    return up if up >= PROBE_SIZE_STEP * last else last / PROBE_SIZE_STEP
