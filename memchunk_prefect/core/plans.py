"""A plan: how to cut a region for one operator and why, and the decisions a map boundary can take.

Plain data (:class:`Plan`) and the checks every planner applies to its inputs. Units: bytes, seconds, joules,
elements.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Sequence

from memchunk_prefect.core.chunks import (
    Chunk,
    Shape,
)
from memchunk_prefect.core.errors import BudgetError, VolumeError, format_bytes
from memchunk_prefect.core.settings import PolicySettings

CONTINUE = "continue"


RECHUNK = "rechunk"


RETRY_SMALLER = "retry-smaller"


PROBE = "probe"


DECISIONS = (CONTINUE, RECHUNK, RETRY_SMALLER, PROBE)


class NoPlanInRangeError(BudgetError):
    """Chunkings fit the budget but none reads a block of the size asked (a granularity arm has no plan here)."""


@dataclass
class Plan:
    """How to cut a region for one operator, and why.

    ``chunk_shape`` is the shape of the largest chunk (output elements, no halo);
    ``predicted_peak_bytes`` / ``upper_bound_bytes`` are the model's mean and
    upper bound for that chunk *with* its halo. ``probe`` is True for a cold
    start probe, which covers only ``chunks`` and leaves the boxes in
    ``remainder`` to plan.
    """

    chunks: list[Chunk]
    chunk_shape: Shape
    predicted_peak_bytes: float | None
    upper_bound_bytes: float | None
    budget_bytes: int
    estimated_seconds: float | None = None
    estimated_joules: float | None = None
    probe: bool = False
    remainder: list[Chunk] = field(default_factory=list)
    decision: str = RECHUNK
    reason: str = ""
    probe_reason: str = ""  # a probe's: why the model could not plan (the reason without the probe's own words)
    #: On a GPU (a :class:`GpuLimit` given): the GPU model's upper bound for the largest chunk and the GPU
    #: budget, bytes; None on the CPU.
    gpu_upper_bound_bytes: float | None = None
    gpu_budget_bytes: int | None = None

    @property
    def n_chunks(self) -> int:
        return len(self.chunks)

    def to_dict(self) -> dict:
        return {
            "decision": self.decision,
            "chunk_shape": list(self.chunk_shape),
            "n_chunks": self.n_chunks,
            "predicted_peak_bytes": self.predicted_peak_bytes,
            "upper_bound_bytes": self.upper_bound_bytes,
            "budget_bytes": self.budget_bytes,
            "estimated_seconds": self.estimated_seconds,
            "estimated_joules": self.estimated_joules,
            "probe": self.probe,
            "too_little_history": self.probe,
            "remainder": [[list(c.start), list(c.stop)] for c in self.remainder],
            "reason": self.reason,
            "gpu_upper_bound_bytes": self.gpu_upper_bound_bytes,
            "gpu_budget_bytes": self.gpu_budget_bytes,
        }


def check_budget(budget_bytes: object) -> int:
    """A memory budget as a positive int of bytes, or a BudgetError quoting what was given."""
    if (isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Real)
            or not math.isfinite(budget_bytes) or budget_bytes <= 0):
        raise BudgetError(f"the memory budget must be a positive number of bytes, got {budget_bytes!r}")
    return int(float(budget_bytes))


def positive(value: object, what: str, *, integer: bool = True) -> float:
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value <= 0
            or (integer and int(float(value)) != value)):
        kind = "a positive whole number" if integer else "a positive number"
        raise VolumeError(f"{what} must be {kind}, got {value!r}")
    return int(float(value)) if integer else float(value)


def chunks_of(n: int, shape: Sequence[int]) -> str:
    """``"3 chunks of up to (a, b, c)"``, or ``"1 chunk of (a, b, c)"`` (a reason names what the plan is).

    >>> chunks_of(1, (1, 28, 400)), chunks_of(2, (70, 64, 400))
    ('1 chunk of (1, 28, 400)', '2 chunks of up to (70, 64, 400)')
    """
    return f"1 chunk of {tuple(shape)}" if n == 1 else f"{n} chunks of up to {tuple(shape)}"


def check_region(region: object, vol: Shape) -> Chunk:
    if region is None:
        return Chunk.whole(vol)
    if not isinstance(region, Chunk) or not Chunk.whole(vol).contains(region):
        raise VolumeError(f"region must be a Chunk inside the volume of shape {vol}, got {region!r}")
    return region


def overhead_warning(plan: Plan, slots: int, budget_bytes: int, settings: PolicySettings) -> str | None:
    """A plan of thousands of chunks whose task-run bookkeeping is most of its time: what forces it, in words.

    Prefect + Dask cost ``per_task_overhead_seconds`` of slot time per task run whatever the chunk's size,
    so where the budget forces tiny chunks the map spends its time on bookkeeping (and on the Prefect
    API: one task run, several state changes each). The planner already weighs that cost; when the budget
    leaves it no better choice, this says so, with the figures and what to change. None otherwise.
    """
    n, slots = plan.n_chunks, max(slots, 1)
    overhead = n * settings.per_task_overhead_seconds / slots
    if n < settings.many_chunks or not plan.estimated_seconds or overhead < 0.5 * plan.estimated_seconds:
        return None
    return (f"{n} chunks of {plan.chunk_shape}: at ~{settings.per_task_overhead_seconds:g} s of Prefect + "
            f"Dask bookkeeping per task run that is ~{overhead / 60:.0f} min on {slots} slot(s), "
            f"{overhead / plan.estimated_seconds:.0%} of this map's estimated {plan.estimated_seconds / 60:.0f} "
            f"min: the budget of {format_bytes(budget_bytes)} per task forces chunks this small. Give each "
            f"task more memory (a larger memory_budget or target_fraction, fewer threads per worker, or "
            f"workers with more memory) for fewer, larger chunks")
