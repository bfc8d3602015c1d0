"""Every operator key's models, rebuilt from the store, and the view the decision core reads them through.

:class:`ModelBank` keeps one :class:`~memchunk_prefect.learn.operator.OperatorModel` per key, and a second one
learned from the GPU's view of the same runs (:func:`gpu_view`) for maps on a GPU, plus each key's learned-policy
bandit. Models are rebuilt by replaying the store's rows, never unpickled, so what a model knows is always on disk.
"""

from __future__ import annotations

import itertools
import math
import statistics
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Sequence

from memchunk_prefect.core.bandit import ArmChoice
from memchunk_prefect.core.chunks import Shape
from memchunk_prefect.core.records import Observation, Prediction, Reward
from memchunk_prefect.core.settings import ITEMSIZE, PolicySettings
from memchunk_prefect.learn.bandit import ArmLearner
from memchunk_prefect.learn.forms import MIB
from memchunk_prefect.learn.operator import OperatorModel

if TYPE_CHECKING:  # pragma: no cover
    from memchunk_prefect.learn.store import Store

TOUCH_POOL_BYTES = 256 * MIB
"""Bytes an operator's own runs must have grown their workers by, in all, before the cost of growing one is
taken from them alone (:meth:`ModelBank.touch_seconds_per_byte`): a cold start's probes grow a few tens of MiB,
whose kernel time is mostly what any run pays; a large chunk's growth is the operator's own."""


def gpu_view(obs: Observation) -> Observation | None:
    """``obs`` as the GPU model of its key learns it: the GPU peak in place of the host's; None when it says
    nothing about GPU memory.

    A GPU map's key learns two models from the same runs (host bytes and GPU bytes; a GPU chunk must fit both
    budgets). The GPU's view of a run of a map on the GPU (``gpu_budget_bytes`` set): a finished run's
    ``gpu_peak_bytes`` above the worker's resting GPU memory; a GPU out-of-memory censored at what the device
    held when it failed, or the GPU budget where that is more; nothing from a host out-of-memory or a killed
    worker (the device's figure then is wherever the run stopped, neither a peak nor a bound), or an error.
    The host's fields the GPU does not have (what the worker held before, energy) are cleared. The host's
    model ignores a GPU out-of-memory (:meth:`memchunk_prefect.learn.memory.MemoryModel.learn`).
    """
    if obs.gpu_budget_bytes is None or not obs.usable:
        return None  # not a map on the GPU (a CPU run's NVML figure is another process's business)
    if obs.gpu_out_of_memory:
        # It needed more than it held when it failed, and more than the budget it was planned within (a first
        # large allocation that fails leaves the pool where it was: 0 measured).
        peak, outcome, censored = max(int(obs.gpu_peak_bytes or 0), int(obs.gpu_budget_bytes)), "memory_error", True
    elif obs.outcome == "ok" and obs.gpu_peak_bytes is not None:
        peak, outcome, censored = int(obs.gpu_peak_bytes), "ok", False
    else:
        return None
    return replace(obs, peak_bytes=peak, outcome=outcome, censored=censored, gpu_out_of_memory=False,
                   budget_bytes=obs.gpu_budget_bytes, baseline_bytes=None, resting_bytes=None, others_bytes=None,
                   grew_bytes=None, retained_bytes=None, energy_joules=None, energy_source=None, shared=False)


MIN_RUN_PAIRS = 3
"""Pairs of flow runs of one operator (:meth:`memchunk_prefect.learn.time.TimeModel.run_offsets`), counted over
every operator in the store, before :meth:`ModelBank.run_spread` is learned."""


def _median_variance(k: int) -> float:
    """The variance of the median of ``k`` draws of a standard normal, near enough: the mean's ``1 / k`` up to two
    draws (the median of two is their mean), ``pi / 2k`` beyond (its large-``k`` form, a little high for few)."""
    return 1.0 / k if k <= 2 else math.pi / (2 * k)


class ModelBank:
    """One :class:`OperatorModel` per key, rebuilt by replaying the store's rows (never unpickled).

    ``learn(obs)`` writes the row first, then learns, so what a model knows is
    always on disk. :meth:`refresh` replays rows other processes have added
    since (flows sharing a store). Thread-safe.
    """

    def __init__(self, store: "Store | None", **model_options: Any):
        self.store = store
        self.model_options = model_options
        self._models: dict[str, OperatorModel] = {}
        self._last_id: dict[str, int] = {}
        self._gpu_models: dict[str, OperatorModel] = {}
        self._gpu_last_id: dict[str, int] = {}
        self._learners: dict[str, ArmLearner] = {}
        self._last_reward: dict[str, int] = {}
        self._lock = threading.RLock()

    def model(self, key: str) -> OperatorModel:
        """The model of ``key`` (an empty one if the store has nothing for it)."""
        with self._lock:
            m = self._models.get(key)
            if m is None:
                m = OperatorModel(key, **self.model_options)
                self._models[key] = m
                self._last_id[key] = 0
                self._replay(key)
            return m

    def gpu_model(self, key: str) -> OperatorModel:
        """The GPU-memory model of ``key``: learned from the same rows through :func:`gpu_view` (an empty one
        where no run of ``key`` measured the GPU)."""
        with self._lock:
            m = self._gpu_models.get(key)
            if m is None:
                m = self._gpu_models[key] = OperatorModel(key, **self.model_options)
                self._gpu_last_id[key] = 0
                self._replay_gpu(key)
            return m

    @staticmethod
    def _learn_gpu(m: OperatorModel, obs: Observation) -> None:
        view = gpu_view(obs)
        if view is not None:
            m.learn(view)

    def _replay(self, key: str) -> None:
        if self.store is None:
            return
        m = self._models[key]
        for row_id, obs in self.store.rows(key, after=self._last_id.get(key, 0)):
            m.learn(obs)
            self._last_id[key] = row_id

    def _replay_gpu(self, key: str) -> None:
        if self.store is None:
            return
        m = self._gpu_models[key]
        for row_id, obs in self.store.rows(key, after=self._gpu_last_id.get(key, 0)):
            self._learn_gpu(m, obs)
            self._gpu_last_id[key] = row_id

    def refresh(self, key: str | None = None) -> None:
        """Learn rows added to the store by others since this bank last looked."""
        with self._lock:
            for k in ([key] if key else list(self._models)):
                if k in self._models:
                    self._replay(k)
                if k in self._gpu_models:
                    self._replay_gpu(k)

    def learn(self, obs: Observation) -> str:
        """Persist ``obs`` to the store, then learn it (and its GPU view, see :func:`gpu_view`); returns what the
        host model did with it."""
        with self._lock:
            key = obs.operator_key
            m = self.model(key)
            gpu = key in self._gpu_models or gpu_view(obs) is not None
            if self.store is None:
                if gpu:
                    self._learn_gpu(self.gpu_model(key), obs)
                return m.learn(obs)
            self._replay(key)  # rows others wrote before ours, in order
            row_id = self.store.add(obs)
            self._last_id[key] = row_id
            if gpu:
                self.gpu_model(key)  # created from the rows (ours included), or brought up to them
                self._replay_gpu(key)
            return m.learn(obs)

    def learner(self, key: str) -> ArmLearner:
        """The learned policy's bandit of ``key``, rebuilt from the store's rewards (and any added since)."""
        with self._lock:
            lrn = self._learners.get(key)
            if lrn is None:
                lrn = self._learners[key] = ArmLearner(key)
            if self.store is not None:
                for row_id, r in self.store.reward_rows(key, after=self._last_reward.get(key, 0)):
                    lrn.learn(r)
                    self._last_reward[key] = row_id
            return lrn

    def reward(self, r: Reward) -> None:
        """Persist a finished plan's reward, then teach the bandit of its key."""
        with self._lock:
            lrn = self.learner(r.operator_key)
            if self.store is not None:
                self._last_reward[r.operator_key] = self.store.add_reward(r)
            lrn.learn(r)

    def choose_arm(self, key: str, groups: Sequence[Sequence[str]]) -> ArmChoice:
        """The arm ``key``'s bandit plays among ``groups`` (arms grouped by identical plans)."""
        with self._lock:
            return self.learner(key).choose(groups)

    def predict(self, key: str, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        """The prediction of ``key``'s model for a block of ``extents`` (halo included)."""
        with self._lock:
            return self.model(key).predict(extents, itemsize)

    def predict_gpu(self, key: str, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        """The GPU-memory prediction of ``key``'s model for a block of ``extents`` (halo included)."""
        with self._lock:
            return self.gpu_model(key).predict(extents, itemsize)

    def seconds_per_element(self, key: str, window: int | None = None) -> float | None:
        """``key``'s recent compute seconds per element over ``window`` runs (default: the model's ``time_window``,
        :meth:`memchunk_prefect.learn.time.TimeModel.seconds_per_element`)."""
        with self._lock:
            return self.model(key).seconds_per_element(window)

    def seconds_for(self, key: str, elements: int) -> float | None:
        """``key``'s compute seconds for a block, when not proportional
        (:meth:`memchunk_prefect.learn.time.TimeModel.seconds_for`)."""
        with self._lock:
            return self.model(key).seconds_for(elements)

    def joules_for(self, key: str, elements: int, window: int | None = None) -> float | None:
        """``key``'s learned energy of a block, joules, over ``window`` runs (default: the model's ``energy_window``,
        :meth:`memchunk_prefect.learn.energy.EnergyModel.joules_for`); None if none."""
        with self._lock:
            return self.model(key).joules_for(elements, window)

    def touch_seconds_per_byte(self, key: str) -> float | None:
        """What growing a worker's memory costs ``key``'s runs, kernel seconds per byte
        (:meth:`memchunk_prefect.learn.time.TimeModel.touch_seconds_per_byte`); where its own runs grew less than
        ``TOUCH_POOL_BYTES`` in all, every model this bank has loaded, pooled: the cost is the kernel's,
        paid alike by any operator on the machine, and an operator's first map has none of its own.
        None before any such run."""
        with self._lock:
            own_seconds, own_grew = self.model(key).touch_costs()
            if own_grew >= TOUCH_POOL_BYTES:
                return own_seconds / own_grew
            costs = [m.touch_costs() for m in self._models.values()]
            grew = sum(c[1] for c in costs)
            return sum(c[0] for c in costs) / grew if grew > 0 else None

    def first_call_seconds(self, key: str) -> float | None:
        """What a worker process's first call of ``key`` takes beyond a later call of the same block, seconds
        (:meth:`memchunk_prefect.learn.time.TimeModel.first_call_seconds`); None before it is learned."""
        with self._lock:
            return self.model(key).time.first_call_seconds()

    def first_call_block_seconds(self, key: str, elements: int) -> float | None:
        """What ``key``'s first call of a block takes in a worker process, one-off cost and compute together
        (:meth:`memchunk_prefect.learn.time.TimeModel.first_call_block_seconds`); None where none was that size."""
        with self._lock:
            return self.model(key).time.first_call_block_seconds(elements)

    def memory_rise(self, key: str) -> tuple[float, float] | None:
        """When in its run a block of ``key`` reaches half and 90% of its memory peak, shares of its wall time
        (:meth:`memchunk_prefect.learn.memory.MemoryModel.rise`); None before it is learned."""
        with self._lock:
            return self.model(key).rise()

    def time_spread(self, key: str) -> float | None:
        """How far ``key``'s timed runs stray from its time model, a log-normal's sigma
        (:meth:`memchunk_prefect.learn.time.TimeModel.time_spread`); None before enough runs."""
        with self._lock:
            return self.model(key).time.time_spread()

    def run_spread(self) -> float | None:
        """How far whole flow runs strayed from the time models, as the standard deviation of a log-normal factor
        that every block of a run shares; None before :data:`MIN_RUN_PAIRS` pairs of flow runs (:meth:`run_pairs`).

        From each pair of flow runs of one operator, the gap between their offsets
        (:meth:`memchunk_prefect.learn.time.TimeModel.run_offsets`): with a run factor of sigma ``s`` and blocks
        that stray from their run by ``b`` (:meth:`~memchunk_prefect.learn.time.TimeModel.within_run_spread`), a
        gap between runs of ``i`` and ``j`` blocks varies by ``2 s^2 + (c_i + c_j) b^2``, ``c_k`` the variance of the
        median of ``k`` (``1 / k`` up to 2, ``pi / 2k`` beyond). So ``s^2`` is half of what the gaps vary by
        (1.4826 x their median absolute value, squared) less the blocks' mean share, at least 0: a run of two
        blocks carries half their scatter into its offset, which is no drift of the run.

        Pairs, not each run against its operator's centre: with two or three runs, the centre sits on one of
        them. Pooled over every operator in the store (loaded where it is not yet): what makes a run slow as a
        whole (the machine's state, the block sizes it ran) is shared by the operators on it. What a simulated
        run's blocks share (:func:`memchunk_prefect.sim.inputs.run_factor`), so a prediction's p90 covers how far
        whole runs stray."""
        pairs = self.run_pairs()
        if len(pairs) < MIN_RUN_PAIRS:
            return None
        spread = 1.4826 * statistics.median(gap for gap, _ in pairs)
        blocks = statistics.fmean(noise for _, noise in pairs)
        return math.sqrt(max(0.0, spread**2 - blocks) / 2)

    def run_pairs(self) -> list[tuple[float, float]]:
        """For each pair of flow runs of one operator, over every operator in the store: how far apart their
        offsets lay (log terms), and the variance their blocks' own scatter puts in that gap (what
        :meth:`run_spread` takes off)."""
        with self._lock:
            models = [self.model(key) for key in self.keys()]
            pairs = []
            for m in models:
                misses = list(m.time.run_misses().values())
                if len(misses) < 2:
                    continue
                scatter = m.time.within_run_spread() or 0.0
                runs = [(statistics.median(x), _median_variance(len(x)) * scatter**2) for x in misses]
                pairs += [(abs(a - b), va + vb) for (a, va), (b, vb) in itertools.combinations(runs, 2)]
            return pairs

    def predictor(self, key: str, itemsize: int = ITEMSIZE):
        """A callable ``extents -> Prediction`` for ``policy.plan`` (serialized with ``learn``)."""
        return lambda extents: self.predict(key, extents, itemsize)

    def keys(self) -> list[str]:
        """Keys with observations in the store (or learned here when there is no store)."""
        with self._lock:
            keys = list(self.store.keys()) if self.store is not None else []
            return keys + [k for k in self._models if k not in keys and self._models[k].n_observations]


class BankKnowledge:
    """The state machine's read-only view of one key's models in a :class:`ModelBank`
    (:class:`memchunk_prefect.core.machine.Knowledge`); ``settings`` give the per-task overhead of a block's time."""

    def __init__(self, bank: "ModelBank", key: str, settings: PolicySettings):
        self.bank = bank
        self.key = key
        self.settings = settings

    def predict(self, extents: Shape) -> Prediction:
        return self.bank.predict(self.key, extents, ITEMSIZE)

    def predict_gpu(self, extents: Shape) -> Prediction:
        return self.bank.predict_gpu(self.key, extents, ITEMSIZE)

    def seconds_per_element(self) -> float | None:
        return self.bank.seconds_per_element(self.key)

    def seconds_for(self, elements: int) -> float | None:
        return self.bank.seconds_for(self.key, elements)

    def joules_for(self, elements: int) -> float | None:
        return self.bank.joules_for(self.key, elements)

    def touch_seconds_per_byte(self) -> float | None:
        return self.bank.touch_seconds_per_byte(self.key)

    def first_call_seconds(self) -> float | None:
        return self.bank.first_call_seconds(self.key)

    def time_spread(self) -> float | None:
        return self.bank.time_spread(self.key)

    def run_spread(self) -> float | None:
        return self.bank.run_spread()

    def memory_rise(self) -> tuple[float, float] | None:
        return self.bank.memory_rise(self.key)

    def first_call_block_seconds(self, elements: int) -> float | None:
        return self.bank.first_call_block_seconds(self.key, elements)

    def block_seconds(self, elements: int) -> float | None:
        """Learned wall seconds of one block of ``elements`` (halo included): its compute time as the planner
        estimates it, plus the per-task overhead; None while no time is learned (for progress displays)."""
        compute = self.seconds_for(elements)
        if compute is None:
            spe = self.seconds_per_element()
            if spe is None:
                return None
            compute = elements * spe
        return compute + self.settings.per_task_overhead_seconds

    def margin(self) -> float | None:
        """The learned margin: the conformal quantile of needed / predicted mean (None until learned)."""
        return self.bank.model(self.key).conformal_factor()

    def choose_arm(self, groups: list[tuple[str, ...]]) -> ArmChoice:
        return self.bank.choose_arm(self.key, groups)
