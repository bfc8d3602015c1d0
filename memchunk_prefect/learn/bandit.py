"""The learned policy's memory: one River bandit per operator key, taught each finished map's reward.

:class:`ArmLearner` keeps the rewards (:class:`~memchunk_prefect.core.records.Reward` rows, replayed from the
store) and picks the arm a map's first plan is fitted under with River's
:class:`river.bandit.EpsilonGreedy`; the arms and the reward are defined in :mod:`memchunk_prefect.core.bandit`.

>>> from memchunk_prefect.core.records import Reward
>>> learner = ArmLearner("gst3d_dip|float32|cpu")
>>> learner.choose([("bold",), ("mid", "safe")]).arm  # nothing learned yet: bold first
'bold'
>>> learner.learn(Reward("gst3d_dip|float32|cpu", "bold", ("bold",), -0.2, 0.8, 100, 1.0, 2, out_of_memory=1))
>>> learner.learn(Reward("gst3d_dip|float32|cpu", "mid", ("mid", "safe"), 0.6, 0.6, 100, 1.0, 2))
>>> learner.choose([("bold",), ("mid", "safe")], explore=False).arm
'mid'
"""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Sequence

from memchunk_prefect.core.bandit import ARMS, ArmChoice
from memchunk_prefect.core.records import Reward


class ArmLearner:
    """The bandit of one operator key: taught :class:`Reward` rows, asked which arm to play.

    ``epsilon`` (probability of a random arm) decays as ``epsilon x exp(-decay x
    pulls)``; ``burn_in``: pulls per arm before exploiting (1, see the module docstring).
    """

    def __init__(self, key: str, *, epsilon: float = 0.1, decay: float = 0.05, burn_in: int = 1):
        if not 0.0 <= epsilon <= 1.0:
            raise ValueError(f"epsilon must be in [0, 1], got {epsilon!r}")
        self.key = key
        self.epsilon = float(epsilon)
        self.decay = float(decay)
        self.burn_in = int(burn_in)
        from river import stats  # here, not at import: workers import this module (via the machine), not River

        self.rewards: list[Reward] = []
        self._means: dict[str, Any] = {a: stats.Mean() for a in ARMS}
        self._oom: dict[str, int] = dict.fromkeys(ARMS, 0)

    def learn(self, reward: Reward) -> None:
        """Teach every arm of ``reward.arms`` (they played the same plan) its reward."""
        if reward.operator_key != self.key:
            raise ValueError(f"reward for {reward.operator_key!r} given to the learner of {self.key!r}")
        self.rewards.append(reward)
        for arm in reward.arms:
            if arm in self._means:
                self._means[arm].update(reward.reward)
                self._oom[arm] += int(reward.out_of_memory)

    def _policy(self) -> Any:
        from river import bandit

        seed = int.from_bytes(hashlib.sha256(f"{self.key}|{len(self.rewards)}".encode()).digest()[:4], "big")
        policy = bandit.EpsilonGreedy(epsilon=self.epsilon, decay=self.decay, burn_in=self.burn_in, seed=seed)
        for r in self.rewards:
            for arm in r.arms:
                if arm in self._means:
                    policy.update(arm, r.reward)
        return policy

    def pulls(self, arm: str) -> int:
        return int(self._means[arm].n)

    def expected(self, arm: str) -> float | None:
        return float(self._means[arm].get()) if self._means[arm].n else None

    def choose(self, groups: Sequence[Iterable[str]], *, explore: bool = True) -> ArmChoice:
        """The arm to play among ``groups`` (arms grouped by identical plans); ``explore=False`` exploits only."""
        grouped = [tuple(a for a in ARMS if a in set(g)) for g in groups]
        grouped = [g for g in grouped if g]
        if not grouped:
            raise ValueError(f"no arm to choose from: {groups!r}")
        group_of = {a: g for g in grouped for a in g}
        playable = [a for a in ARMS if a in group_of]
        if len(grouped) == 1:
            arm, why = playable[0], "only plan"
        elif not explore:
            arm, why = max(playable, key=self._rank), "best"
        else:
            unburnt = [a for a in playable if self.pulls(a) < self.burn_in]
            arm = str(self._policy().pull(list(playable)))
            why = "burn-in" if unburnt else ("best" if arm == max(playable, key=self._rank) else "explore")
        return ArmChoice(arm, group_of[arm], self.expected(arm), self.pulls(arm), why)

    def _rank(self, arm: str) -> float:
        """An arm's mean reward; 0 for one never played (as River's ``EpsilonGreedy`` ranks it)."""
        expected = self.expected(arm)
        return 0.0 if expected is None else expected

    def summary(self) -> list[dict[str, Any]]:
        """Per arm: plans taught, mean reward, out-of-memory events (for ``memchunk models``)."""
        return [{"arm": a, "pulls": self.pulls(a), "mean_reward": self.expected(a), "out_of_memory": self._oom[a]}
                for a in ARMS]
