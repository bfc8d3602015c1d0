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


def choose_arm(m: Any, make: Any) -> Any:
    """Make a map machine ``m``'s first real plan under every arm (``make()`` plans with its ``predict``),
    choose one, keep it (``m.arm``).

    Arms whose plan is the same chunking are grouped (one outcome teaches
    them all); an arm under which nothing fits is left out. Returns what
    ``make()`` returned under the chosen arm; raises the ``safe`` arm's
    error when no arm fits.
    """
    results: dict[str, Any] = {}
    errors: dict[str, MemchunkError] = {}
    arms = bandit.ARMS if m.settings.learned_policy else (bandit.HEURISTIC_ARM,)
    if not m.settings.granularity_arms:
        arms = tuple(a for a in arms if a not in bandit.GRANULARITY_ARMS)
    for arm in arms:
        if arm in bandit.GRANULARITY_ARMS:
            safe = results.get(bandit.SAFE)
            if safe is None:
                continue  # finer or coarser than nothing
            m.safe_read_elements = m._largest_read(chunks_of(safe))
        m.arm = bandit.ArmChoice(arm, (arm,), None, 0, "")
        try:
            results[arm] = make()
        except MemchunkError as exc:
            errors[arm] = exc
            continue
        if arm in bandit.GRANULARITY_ARMS and not near(results[arm], results[bandit.SAFE]):
            del results[arm]
    m.arm = None
    if not results:
        raise errors[bandit.HEURISTIC_ARM]
    groups: dict[Any, tuple[str, ...]] = {}
    for arm, result in results.items():
        sig = signature(result)
        groups[sig] = groups.get(sig, ()) + (arm,)
    if m.settings.learned_policy:
        choice = m.knowledge.choose_arm(list(groups.values()))
    else:
        choice = bandit.ArmChoice(bandit.HEURISTIC_ARM, (bandit.HEURISTIC_ARM,), None, 0, "heuristic")
    m.arm = choice
    return results[choice.arm]
