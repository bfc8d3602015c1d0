"""Every operator key's models, rebuilt from the store, and the figures of how well they learned.

The models themselves: :class:`~memchunk_prefect.learn.operator.OperatorModel` (memory, time and energy).
"""

from __future__ import annotations

import math
import threading
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Iterable, Sequence

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
whose kernel time is mostly what any run pays (:meth:`OperatorModel.touch_seconds_per_byte`); half a large
chunk's growth (trace_correlation's 545 MiB blocks grew their workers ~500 MiB) is the operator's own."""

def gpu_view(obs: Observation) -> Observation | None:
    """``obs`` as the GPU model of its key learns it: the GPU peak in place of the host's; None when it says
    nothing about GPU memory.

    A GPU map's key learns two models from the same runs (host bytes and GPU bytes; a GPU chunk must fit both
    budgets). The GPU's view of a run of a map on the GPU (``gpu_budget_bytes`` set): a finished run's
    ``gpu_peak_bytes`` above the worker's resting GPU memory; a GPU out-of-memory censored at what the device
    held when it failed, or the GPU budget where that is more; nothing from a host out-of-memory or a killed
    worker (the device's figure then is wherever the run stopped, neither a peak nor a bound), or an error.
    The host's fields the GPU does not have (what the worker held before, energy) are cleared. The host's
    model ignores a GPU out-of-memory (:meth:`OperatorModel.learn`).
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


#: A scored run whose block has more than this many times the elements of every block learned before it was
#: predicted by extrapolation (:func:`replay_quality` reports its error apart).
BEYOND_RATIO = 1.05


def replay_quality(rows: Iterable[Observation], key: str, *, after: int = 5, **options: Any) -> dict[str, Any]:
    """How well ``key``'s model predicted its own history: each ``ok`` run scored before it is learned.

    ``rows``: the key's observations in the order they were stored. A run is
    scored once the model is ready and has learned ``after`` usable runs: the
    absolute error of the predicted mean (``mape``, a fraction), whether the peak
    was within the upper bound (``coverage``, a share) and the upper bound over
    the peak (``bound_over_peak``, mean). The issue's goals for a real run:
    coverage >= 0.95, mape <= 0.10 after 5 runs, bound_over_peak <= 1.25.
    The error is also split by where the run lay: ``mape_beyond`` over the
    ``scored_beyond`` runs whose block was larger than ``BEYOND_RATIO`` x every
    block learned before it (the model extrapolated), ``mape_within`` over the rest.

    >>> rows = [Observation("k|float32|cpu", n, (1, 1, n), 4 * n, 2**20 + 100 * n)
    ...         for n in range(10_000, 90_000, 5_000)]
    >>> q = replay_quality(rows, "k|float32|cpu")
    >>> q["scored"], q["coverage"], q["mape"] < 0.01
    (11, 1.0, True)
    """
    m = OperatorModel(key, **options)
    errors: list[float] = []
    covered: list[bool] = []
    ratios: list[float] = []
    beyond: list[bool] = []
    largest = 0  # elements of the largest ok block learned so far
    for o in rows:
        if (o.operator_key == key and o.outcome == "ok" and o.usable and o.peak_bytes > 0 and o.elements > 0
                and m.n_observations >= after):
            p = m.predict(o.extents)
            if p.ready:
                peak = m.working_bytes(o)
                errors.append(abs(p.mean_bytes / peak - 1))
                covered.append(peak <= p.upper_bytes)
                ratios.append(p.upper_bytes / peak)
                beyond.append(o.elements > BEYOND_RATIO * largest)
        if o.operator_key == key:
            m.learn(o)
            if o.outcome == "ok" and o.usable:
                largest = max(largest, int(o.elements))
    n = len(errors)
    far = [e for e, b in zip(errors, beyond) if b]
    near = [e for e, b in zip(errors, beyond) if not b]
    return {"key": key, "observations": m.n_observations, "scored": n,
            "mape": sum(errors) / n if n else None, "coverage": sum(covered) / n if n else None,
            "bound_over_peak": sum(ratios) / n if n else None,
            "scored_beyond": len(far), "mape_beyond": sum(far) / len(far) if far else None,
            "mape_within": sum(near) / len(near) if near else None}


def repeatability(rows: Iterable[Observation], key: str, *, coverage: float = 0.95,
                  min_repeats: int = 2) -> dict[str, Any]:
    """What no memory model that sees only the block's shape can beat on ``key``'s runs: the spread of blocks run again.

    A model predicts a chunk's peak from the extents of the block it reads, so
    two runs of the same extents get the same prediction, whatever each really
    peaked at. Their spread is measurement noise to the model (the allocator
    reusing memory a previous task freed, a storage library decompressing
    several chunks at once, other threads of the worker allocating during the
    run): it sets a floor under the learning-quality figures of
    :func:`replay_quality`, in the same units.

    Runs are grouped by extents; groups of at least ``min_repeats`` usable
    ``ok`` runs count. Per group, in sample (the lowest any predictor of the
    group's runs reaches, knowing them all in advance):

    - the best constant's mean absolute percentage error: the constant is the
      median weighted by 1 / peak, which minimises ``sum |c - y| / y``;
    - the tightest constant bound that covers ``coverage`` of the group's
      peaks, over each peak (mean of bound / peak, as ``bound_over_peak``).

    Returned run-weighted over the groups: ``floor_mape`` (a fraction),
    ``floor_bound_over_peak``, ``runs`` and ``groups`` counted; the floors are
    None when no extents repeat ``min_repeats`` times.

    >>> MiB = 2**20
    >>> rows = [Observation("k|float32|cpu", 1000, (1, 10, 100), 4000, p * MiB) for p in (15, 15, 15, 20)]
    >>> r = repeatability(rows, "k|float32|cpu")
    >>> r["groups"], r["runs"], round(r["floor_mape"], 4), round(r["floor_bound_over_peak"], 4)
    (1, 4, 0.0625, 1.25)
    """
    groups: dict[tuple[int, ...], list[int]] = {}
    for o in rows:
        if o.operator_key == key and o.outcome == "ok" and o.usable and o.peak_bytes > 0:
            groups.setdefault(tuple(o.extents), []).append(int(o.peak_bytes))
    mape_sum = bound_sum = 0.0
    runs = n_groups = 0
    for peaks in groups.values():
        if len(peaks) < min_repeats:
            continue
        ys = sorted(peaks)
        weights = [1.0 / y for y in ys]
        half, acc = 0.5 * sum(weights), 0.0
        for y, w in zip(ys, weights):  # the weighted median minimises sum(w * |c - y|) with w = 1 / y
            acc += w
            if acc >= half:
                best = y
                break
        bound = ys[max(0, math.ceil(coverage * len(ys) - 1e-9) - 1)]
        mape_sum += sum(abs(best - y) / y for y in ys)
        bound_sum += sum(bound / y for y in ys)
        runs += len(ys)
        n_groups += 1
    return {"key": key, "runs": runs, "groups": n_groups,
            "floor_mape": mape_sum / runs if runs else None,
            "floor_bound_over_peak": bound_sum / runs if runs else None}


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

    def seconds_per_element(self, key: str, window: int = 20) -> float | None:
        """``key``'s recent compute seconds per element (see :meth:`OperatorModel.seconds_per_element`)."""
        with self._lock:
            return self.model(key).seconds_per_element(window)

    def seconds_for(self, key: str, elements: int) -> float | None:
        """``key``'s compute seconds for a block, when not proportional (see :meth:`OperatorModel.seconds_for`)."""
        with self._lock:
            return self.model(key).seconds_for(elements)

    def joules_for(self, key: str, elements: int, window: int = 20) -> float | None:
        """``key``'s learned energy of a block (see :meth:`OperatorModel.joules_for`), joules; None if none."""
        with self._lock:
            return self.model(key).joules_for(elements, window)

    def touch_seconds_per_byte(self, key: str) -> float | None:
        """What growing a worker's memory costs ``key``'s runs, kernel seconds per byte
        (:meth:`OperatorModel.touch_seconds_per_byte`); where its own runs grew less than
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

    def predictor(self, key: str, itemsize: int = ITEMSIZE):
        """A callable ``extents -> Prediction`` for ``policy.plan`` (serialized with ``learn``)."""
        return lambda extents: self.predict(key, extents, itemsize)

    def keys(self) -> list[str]:
        """Keys with observations in the store (or learned here when there is no store)."""
        with self._lock:
            keys = list(self.store.keys()) if self.store is not None else []
            return keys + [k for k in self._models if k not in keys and self._models[k].n_observations]


class BankKnowledge:
    """The state machine's read-only view of one key's model in a :class:`~memchunk_prefect.learn.model.ModelBank`."""

    def __init__(self, bank: "ModelBank", key: str, settings: PolicySettings):
        self.bank = bank
        self.key = key
        self.settings = settings

    def predict(self, extents: Shape) -> Prediction:
        return self.bank.predict(self.key, extents, ITEMSIZE)

    def predict_gpu(self, extents: Shape) -> Prediction:
        return self.bank.predict_gpu(self.key, extents, ITEMSIZE)

    def seconds_per_element(self) -> float | None:
        return self.bank.seconds_per_element(self.key, self.settings.time_window)

    def seconds_for(self, elements: int) -> float | None:
        return self.bank.seconds_for(self.key, elements)

    def joules_for(self, elements: int) -> float | None:
        return self.bank.joules_for(self.key, elements, self.settings.time_window)

    def touch_seconds_per_byte(self) -> float | None:
        return self.bank.touch_seconds_per_byte(self.key)

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
