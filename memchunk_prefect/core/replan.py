"""When the unsubmitted remainder of a running map is re-planned, and whether the new cut pays.

A re-plan is never undone by the next observation: the trigger needs a bound
(or budget) that moved by more than ``settings.replan_threshold``, and a box's
new cut replaces its queued chunks only when those no longer fit or the new cut
is estimated ``settings.replan_gain`` faster (or cheaper in joules). The state
machine (:mod:`memchunk_prefect.core.machine`) owns when to ask; these
functions are the rules. Units: bytes, elements, seconds, joules."""

from __future__ import annotations

from typing import Sequence

from memchunk_prefect.core.chunks import (
    Chunk,
    Shape,
)
from memchunk_prefect.core.errors import format_bytes
from memchunk_prefect.core.estimates import (
    Estimates,
)
from memchunk_prefect.core.plans import (
    Plan,
)
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings


def bound_moved(old_upper: float | None, new_upper: float | None, settings: PolicySettings = DEFAULT_SETTINGS) -> bool:
    """Whether a new upper bound differs enough from the one a plan used to re-plan the remainder.

    >>> bound_moved(100.0, 130.0), bound_moved(100.0, 110.0), bound_moved(None, 5.0)
    (True, False, True)
    """
    if old_upper is None or new_upper is None:
        return old_upper is not new_upper
    if old_upper <= 0:
        return True
    return abs(new_upper - old_upper) / old_upper > settings.replan_threshold


def remaining_boxes(chunks: Sequence[Chunk]) -> tuple[list[Chunk], list[Chunk]]:
    """Group unsubmitted chunks into boxes that can be re-planned, and the chunks to keep as they are.

    Chunks are grouped in bands of equal iline range; a band whose chunks fill
    the whole xline/twt extent of all the chunks is a box, and adjacent full
    bands merge. Chunks of partial bands are kept unchanged.

    >>> cs = [Chunk((0, 5, 0), (2, 10, 4)), Chunk((2, 0, 0), (4, 5, 4)), Chunk((2, 5, 0), (4, 10, 4)),
    ...       Chunk((4, 0, 0), (6, 10, 4))]
    >>> boxes, kept = remaining_boxes(cs)
    >>> boxes, kept
    ([Chunk(start=(2, 0, 0), stop=(6, 10, 4))], [Chunk(start=(0, 5, 0), stop=(2, 10, 4))])
    """
    if not chunks:
        return [], []
    x0 = min(c.start[1] for c in chunks)
    x1 = max(c.stop[1] for c in chunks)
    t0 = min(c.start[2] for c in chunks)
    t1 = max(c.stop[2] for c in chunks)
    bands: dict[tuple[int, int], list[Chunk]] = {}
    for c in chunks:
        bands.setdefault((c.start[0], c.stop[0]), []).append(c)
    boxes: list[Chunk] = []
    kept: list[Chunk] = []
    current: list[int] | None = None
    for (i0, i1) in sorted(bands):
        members = bands[(i0, i1)]
        full = sum(c.elements for c in members) == (i1 - i0) * (x1 - x0) * (t1 - t0)
        if full and current is not None and current[1] == i0:
            current[1] = i1
        elif full:
            if current is not None:
                boxes.append(Chunk((current[0], x0, t0), (current[1], x1, t1)))
            current = [i0, i1]
        else:
            if current is not None:
                boxes.append(Chunk((current[0], x0, t0), (current[1], x1, t1)))
                current = None
            kept.extend(members)
    if current is not None:
        boxes.append(Chunk((current[0], x0, t0), (current[1], x1, t1)))
    return boxes, kept


def replan_pays(
    queued: int,
    largest_shape: Shape,
    largest_read: Shape,
    new: Plan,
    *,
    budget_bytes: int,
    estimates: Estimates,
    slots: int,
    settings: PolicySettings,
) -> str | None:
    """Why a box's new plan ``new`` should replace its ``queued`` chunks (in words), or None to keep them.

    ``queued`` is how many chunks of the box wait, the largest of which has
    ``largest_shape`` and reads a block of ``largest_read`` elements (halo
    included). They are replaced when that block's upper bound no longer fits
    ``budget_bytes`` (or the GPU), or when ``new`` is estimated faster (or, under
    the energy objective, cheaper) by more than ``settings.replan_gain``.
    """
    pred = estimates.predict(largest_read)
    if pred.upper_bytes > budget_bytes:
        return (
            f"the queued chunks of up to {largest_shape} no longer fit "
            f"({format_bytes(pred.upper_bytes)} over {format_bytes(budget_bytes)})"
        )
    gpu_over = estimates.gpu.why_over(largest_read) if estimates.gpu is not None else None
    if gpu_over:
        return f"the queued chunks of up to {largest_shape} no longer fit ({gpu_over})"
    if settings.objective == "energy" and new.estimated_joules is not None:
        old_j = estimates.joules(queued, largest_read, slots, settings, pred.mean_bytes)
        if new.estimated_joules < old_j * (1 - settings.replan_gain):
            return f"estimated {old_j:.0f} J -> {new.estimated_joules:.0f} J"
        return None
    old_secs = estimates.seconds(queued, largest_read, slots, settings, pred.mean_bytes)
    if new.estimated_seconds is not None and new.estimated_seconds < old_secs * (1 - settings.replan_gain):
        return f"estimated {old_secs:.2f} s -> {new.estimated_seconds:.2f} s"
    return None
