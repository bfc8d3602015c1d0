"""The learned policy's part in a map's first plan: one plan under every arm, equal plans grouped, one chosen.

Helpers over what the planner returns (a :class:`~memchunk_prefect.core.policy.Decision`, a
:class:`~memchunk_prefect.core.plans.Plan`, or a list of plans run side by side): their chunks, estimated
seconds and signature (two arms whose plans cut the same chunks are one outcome), and whether a granularity
arm's plan is near enough the safe arm's to be offered at all.
"""

from __future__ import annotations

from typing import Any

from memchunk_prefect.core import bandit, policy
from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.errors import (
    MemchunkError,
)
from memchunk_prefect.core.plans import PROBE


def probes(make: Any) -> bool:
    """Whether ``make()`` (a decision or a plan) is a cold-start probe; False when it raises (no arm fits yet)."""
    try:
        result = make()
    except MemchunkError:
        return False
    return bool(result.decision == PROBE if isinstance(result, policy.Decision) else result.probe)


def chunks_of(result: Any) -> list[Chunk]:
    """The chunks of a decision, a plan, or plans."""
    plans = result if isinstance(result, list) else [result.plan if isinstance(result, policy.Decision) else result]
    return [c for p in plans for c in p.chunks]


def estimated_seconds(result: Any) -> float | None:
    """The planner's makespan estimate of a decision, a plan, or plans run side by side (their longest); None
    where one has none."""
    if isinstance(result, list):
        secs = [estimated_seconds(r) for r in result]
        return None if not secs or any(x is None for x in secs) else max(x for x in secs if x is not None)
    plan = result.plan if isinstance(result, policy.Decision) else result
    return plan.estimated_seconds


def near(alternative: Any, safe: Any) -> bool:
    """Whether a granularity arm's plan is estimated within ``bandit.ALTERNATIVE_TOLERANCE`` of the safe plan's
    (True where either has no estimate: nothing says it loses)."""
    alt, base = estimated_seconds(alternative), estimated_seconds(safe)
    return alt is None or base is None or alt <= base * (1.0 + bandit.ALTERNATIVE_TOLERANCE)


def signature(result: Any) -> Any:
    """What makes two plans the same: their decision and chunks (for a decision, a plan or a list of plans)."""
    if isinstance(result, list):
        return tuple(signature(r) for r in result)
    if isinstance(result, policy.Decision):
        return (result.decision, signature(result.plan))
    return tuple(result.chunks)
