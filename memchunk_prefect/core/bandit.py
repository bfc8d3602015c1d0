"""The learned part of the decision: how close to the memory limit a plan may go, chosen from measured rewards.

What it covers: the arms a plan can be fitted at, the reward a finished plan
earns, and a River bandit per operator key that picks an arm from the rewards
so far. What it does not: planning (``policy.py`` plans each arm; the map state
machine in ``machine.py`` asks which to run and reports the reward), or storing
(``store.py`` keeps :class:`~memchunk_prefect.core.records.Reward` rows; a learner is
rebuilt by replaying them, never unpickled).

Why a bandit, and over what. A plan must fit the memory budget (the kill line
less the worker's resting memory). What it must fit *with* is a judgement: the
model's upper bound widens for blocks larger than any it has seen (leverage,
and a curved form blended in while the data cannot rule it out), which keeps a
cold run safe but can cut a heavy operator into twice the chunks it needs once
warm. The arms are three risk levels of that bound:

- ``safe``: the upper bound as the model gives it (the fixed heuristic);
- ``mid``: halfway between the upper bound and the tight bound;
- ``bold``: the tight bound: the mean times the operator's learned error margin
  (the conformal quantile of needed / predicted over its recent runs), with no
  widening for extrapolation (beyond the largest block, a faster-growing form the
  runs cannot rule out counts by its weight), for blocks up to twice the largest one measured
  (``OperatorModel.tight_reach``; the full bound beyond). Each bold plan can at
  most double what is known, so a warm operator climbs to the size that fits
  over runs instead of jumping to it from small probes.

Two more arms are *granularity* levels: the chunk count the time model picked
may be wrong even where memory is not the question (a worker's first touch of
memory, an operator whose time grows with the square of its traces read as
linear from noisy runs: measured 0.77x against 0.90x of the best static chunking
between two counts the model saw as equal). Both fit the ``safe`` bound:

- ``finer``: the planner's best plan among those whose largest block read is at
  most the ``safe`` plan's / ``SIZE_STEP``;
- ``coarser``: the same among those reading at least ``SIZE_STEP`` x it (absent
  where none fits the budget: the bound already chose the size).

A granularity arm is offered only where the planner's estimate of its plan is
within ``ALTERNATIVE_TOLERANCE`` of the ``safe`` plan's: a neighbour worth a
night to measure, not a plan expected to lose. They are off unless
``PolicySettings.granularity_arms`` is set: a reward is one map's, and a plan
that is as efficient in its own map can cost the maps after it (measured: a
finer trace_correlation left each fresh worker's memory growth to the
gst3d_dip after it, and the flow ran 1.04-1.13x the heuristic's time on the
nights the policy had settled; ``settings.py`` has the figures).

Hard limit: every arm's bound, the boldest included, must fit the budget, so no
arm ever plans a chunk whose mean times its learned margin crosses the kill line
(the reference design's agent chooses continue / rechunk / reset; here the
same continue-or-rechunk decision is re-taken under each arm, and the pure
planner is the only thing that cuts chunks).

Reward: the plan's *slot efficiency*, the compute its chunks needed (output
elements x the operator's measured seconds per element) over the slot time they
held (``slots x`` wall seconds from first submission to last end, retries and
splits included; for a chained map, less the time it had nothing running
because the upstream map had not yet written what its next chunk reads), minus
``penalty`` (1.0: a whole map's worth) per chunk that ran out of memory, minus
the share of that slot time its workers spent paused
(a worker above Dask's pause line, 0.8 of its limit, takes no new task; the
scheduler's log of status changes says when: ``records.pauses_from``). Paused
time is counted as lost whether or not a task was waiting for that worker (an
upper bound of what it cost; a single-thread worker finishing its one chunk
loses nothing): a plan that runs its workers into the pause line is closer to
the kill line, and earns less than one that fits below it in the same time.
Only a map planned whole teaches: a cold start's plan of the box its probes
left is not comparable (see ``machine.py``).
Efficiency is dimensionless, so surveys of different sizes teach the same arms
(no context is needed to compare them; the plans themselves are re-made for
each survey, slots and budget).

The bandit (:class:`memchunk_prefect.learn.bandit.ArmLearner`) is River's
:class:`river.bandit.EpsilonGreedy` with a burn-in of one plan per arm: every arm whose plan differs
from those already measured is played once, in the order of ``ARMS``, then the arm with the best mean reward,
or a random one with probability ``epsilon`` (decaying with plans taught). A new
operator plays bold first (its plan is never smaller than safe's, see
``tight_reach``); when bold runs out of memory its mean drops below 0. Without
the burn-in an arm never played ranked at 0, below any plan that finished, so a
plan that differed from the first one played was tried by epsilon alone (about
once in ten nights, fewer as epsilon decays): the policy could not find out that
a neighbour was faster. The burn-in costs at most one night per differing arm at
that arm's speed, each a plan within the hard limit above and, for the
granularity arms, within ``ALTERNATIVE_TOLERANCE`` of the heuristic's estimate.
An arm whose plan is the same chunking as the chosen one is taught the same
reward (its outcome would have been this one), so arms that agree cost no
exploration. The choice is reproducible: the policy is rebuilt from the rewards
with a seed drawn from the key and the number of rewards.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from memchunk_prefect.core.records import Prediction

__all__ = ["ARMS", "BOLD", "MID", "SAFE", "FINER", "COARSER", "GRANULARITY_ARMS", "HEURISTIC_ARM", "WIDENING",
           "SIZE_STEP", "ALTERNATIVE_TOLERANCE", "read_range", "arm_view", "reward_of", "ArmChoice"]

BOLD, MID, SAFE, FINER, COARSER = "bold", "mid", "safe", "finer", "coarser"
ARMS: tuple[str, ...] = (BOLD, MID, SAFE, FINER, COARSER)
"""Every arm, in the order burn-in tries them (the granularity arms after ``safe``: they are planned from it)."""
GRANULARITY_ARMS: tuple[str, ...] = (FINER, COARSER)
HEURISTIC_ARM = SAFE
"""The arm the fixed heuristic always plays (the policy switched off)."""
WIDENING = {BOLD: 0.0, MID: 0.5, SAFE: 1.0, FINER: 1.0, COARSER: 1.0}
"""Share of the model's widening (upper bound - tight bound) each arm keeps."""
SIZE_STEP = 1.5
"""How much smaller (``finer``) or larger (``coarser``) than the ``safe`` plan's a granularity arm's largest block
read must be: a neighbour of the planner's choice (on 2 slots, 2 chunks -> 4, 4 -> 6 or 2, 6 -> 10 or 4)."""
ALTERNATIVE_TOLERANCE = 0.5
"""A granularity arm is offered only while the planner estimates its plan at most this much slower than the
``safe`` plan: a neighbour, not a plan the model expects to lose by far (one chunk per slot against a slot
left idle, a whole wave more of halo). Not tighter, because the arm exists to test that same estimate: in
``python -m benchmarks.studies.nights`` (192 x 192 x 100) trace_correlation's time model, read as linear
on some nights, estimated 4 chunks at 1.15-1.25 s and 8 at 1.26-1.28x that; the 4 chunks took 2.52-2.62 s (a
reward of 0.02-0.14 against 0.38-0.51 for 10 chunks on the other nights), and at 0.25 the finer plan was not
offered on those nights, so the policy could not leave the plan it had measured worst."""


def read_range(arm: str, safe_read_elements: float) -> tuple[float, float] | None:
    """``(least, most)`` elements a plan under ``arm`` may read in its largest block (None: any).

    >>> read_range("finer", 3000.0), read_range("coarser", 3000.0), read_range("mid", 3000.0)
    ((0.0, 2000.0), (4500.0, inf), None)
    """
    if arm == FINER:
        return 0.0, float(safe_read_elements) / SIZE_STEP
    if arm == COARSER:
        return float(safe_read_elements) * SIZE_STEP, math.inf
    return None


def arm_view(pred: Prediction, arm: str) -> Prediction:
    """The prediction a plan under ``arm`` is fitted with: ``upper_bytes`` moved towards the tight bound.

    Not-ready predictions (the policy probes) and predictions without a tight
    bound are returned unchanged.

    >>> p = Prediction(mean_bytes=100.0, upper_bytes=150.0, tight_bytes=110.0)
    >>> arm_view(p, "bold").upper_bytes, arm_view(p, "mid").upper_bytes, arm_view(p, "safe").upper_bytes
    (110.0, 130.0, 150.0)
    """
    if arm not in WIDENING:
        raise ValueError(f"arm must be one of {ARMS}, got {arm!r}")
    if not pred.ready or pred.tight_bytes is None or WIDENING[arm] == 1.0:
        return pred
    tight = min(float(pred.tight_bytes), float(pred.upper_bytes))
    upper = tight + WIDENING[arm] * (float(pred.upper_bytes) - tight)
    return dataclasses.replace(pred, upper_bytes=upper)


def reward_of(elements: int, seconds_per_element: float, slots: int, wall_seconds: float,
              out_of_memory: int = 0, penalty: float = 1.0, paused_seconds: float = 0.0) -> tuple[float, float]:
    """``(reward, efficiency)`` of a finished plan; see the module docstring.

    ``elements`` written at ``seconds_per_element`` (compute seconds each) on
    ``slots`` slots over ``wall_seconds``; efficiency is capped at 1 (a plan
    cannot use more slot time than there is; a faster-than-median run says so).
    ``paused_seconds``: worker-seconds its workers spent paused within that
    time, taken off as a share of the slot time held.

    >>> reward_of(1000, 0.001, 2, 1.0)
    (0.5, 0.5)
    >>> reward_of(1000, 0.001, 2, 1.0, out_of_memory=1)
    (-0.5, 0.5)
    >>> reward_of(1000, 0.001, 2, 1.0, paused_seconds=0.5)
    (0.25, 0.5)
    """
    held = max(1, int(slots)) * max(float(wall_seconds), 1e-9)
    efficiency = min(1.0, max(0.0, int(elements) * float(seconds_per_element) / held))
    paused = min(1.0, max(0.0, float(paused_seconds)) / held)
    return efficiency - float(penalty) * int(out_of_memory) - paused, efficiency


@dataclass(frozen=True)
class ArmChoice:
    """Which arm a plan is made under, and why: ``expected`` reward (None: never played), ``pulls`` so far."""

    arm: str
    arms: tuple[str, ...]  # the arms whose plans are this same chunking
    expected: float | None
    pulls: int
    why: str  # "burn-in", "explore", "best", "only plan", "heuristic"

    def describe(self) -> str:
        """The reason, in words, for the decision's log line."""
        same = f" (same plan as {', '.join(a for a in self.arms if a != self.arm)})" if len(self.arms) > 1 else ""
        if self.why == "heuristic":
            return f"fixed heuristic: fitted at the {self.arm} bound"
        expected = ("no reward yet" if self.expected is None
                    else f"expected reward {self.expected:.2f} over {self.pulls} plan(s)")
        return f"learned policy: arm {self.arm}{same}, {self.why}, {expected}"


