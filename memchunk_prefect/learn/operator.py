"""What is learned of one operator key: its memory, time and energy models behind one object."""

from __future__ import annotations

import inspect
from typing import Any, Sequence

from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.core.settings import ITEMSIZE
from memchunk_prefect.learn.energy import EnergyModel
from memchunk_prefect.learn.memory import MemoryModel
from memchunk_prefect.learn.time import TimeModel


def _params(cls: type) -> set[str]:
    """The keyword arguments ``cls`` takes (its hyperparameters), but ``key``."""
    return {name for name in inspect.signature(cls).parameters if name != "key"}


_OWNERS = {cls: _params(cls) for cls in (MemoryModel, TimeModel, EnergyModel)}


class OperatorModel:
    """The models of one operator key, each fed every observation: :attr:`memory` (peak bytes of a block,
    :class:`~memchunk_prefect.learn.memory.MemoryModel`), :attr:`time` (its compute seconds,
    :class:`~memchunk_prefect.learn.time.TimeModel`) and :attr:`energy` (its joules,
    :class:`~memchunk_prefect.learn.energy.EnergyModel`).

    ``options`` are the sub-models' hyperparameters, each given to every model
    that takes it (``min_size_ratio``, ``prior_noise`` or ``first_touch_bytes`` to
    memory and time alike); a name none takes is a TypeError. The methods callers
    use are here too, each delegating to the model that owns it.
    Not thread-safe on its own; :class:`~memchunk_prefect.learn.bank.ModelBank`
    serializes ``learn`` and ``predict``. Memory sets aside the peaks of runs that
    overlapped another in their process once enough runs had theirs alone
    (:class:`~memchunk_prefect.learn.memory.MemoryModel`); time learns every run.

    >>> from memchunk_prefect.core.records import Observation
    >>> m = OperatorModel("toy|float32|cpu")
    >>> for n in (2**18, 2**19, 2**20, 2**21):
    ...     _ = m.learn(Observation("toy|float32|cpu", n, (1, 1, n), 4 * n, 50 * 2**20 + 28 * n, seconds=n * 1e-7))
    >>> p = m.predict((1, 1, 2**22))
    >>> p.ready, round(p.mean_bytes / (50 * 2**20 + 28 * 2**22), 3), round(m.seconds_per_element() * 1e7, 3)
    (True, 1.0, 1.0)
    >>> round(m.summary()["bytes_per_element"], 1)
    28.0
    """

    def __init__(self, key: str, **options: Any):
        unknown = sorted(set(options).difference(*_OWNERS.values()))
        if unknown:
            raise TypeError(f"OperatorModel got unexpected keyword argument(s): {', '.join(unknown)} "
                            f"(the hyperparameters of the memory, time and energy models are taken)")
        self.key = key
        self.memory = MemoryModel(key, **{k: v for k, v in options.items() if k in _OWNERS[MemoryModel]})
        self.time = TimeModel(**{k: v for k, v in options.items() if k in _OWNERS[TimeModel]})
        self.energy = EnergyModel(**{k: v for k, v in options.items() if k in _OWNERS[EnergyModel]})

    def __repr__(self) -> str:
        return f"OperatorModel({self.key!r}, n_observations={self.n_observations})"

    def learn(self, obs: Observation) -> str:
        """Teach every model ``obs``; returns what memory did with it
        (:meth:`memchunk_prefect.learn.memory.MemoryModel.learn`)."""
        if obs.operator_key != self.key:
            raise ValueError(f"observation for {obs.operator_key!r} given to the model of {self.key!r}")
        self.energy.learn(obs)
        self.time.learn(obs)
        return self.memory.learn(obs)

    def summary(self) -> dict[str, Any]:
        """Plain figures for the CLI and reports: memory's, then time's, then energy's (``summary()`` of each)."""
        out = {**self.memory.summary(), **self.time.summary(), **self.energy.summary()}
        if "superlinear_power" in out:  # reports have it last
            out["superlinear_power"] = out.pop("superlinear_power")
        return out

    # Memory (MemoryModel).

    @property
    def n_observations(self) -> int:
        return self.memory.n_observations

    def predict(self, extents: Sequence[int], itemsize: int = ITEMSIZE) -> Prediction:
        return self.memory.predict(extents, itemsize)

    def explain(self, extents: Sequence[int]) -> dict[str, Any]:
        return self.memory.explain(extents)

    def form(self) -> str:
        return self.memory.form()

    def memory_curve_supported(self) -> bool:
        return self.memory.memory_curve_supported()

    def conformal_factor(self) -> float | None:
        return self.memory.conformal_factor()

    def unseen_bytes(self) -> float:
        return self.memory.unseen_bytes()

    def first_use(self, obs: Observation) -> int:
        return self.memory.first_use(obs)

    def working_bytes(self, obs: Observation) -> int:
        return self.memory.working_bytes(obs)

    def first_use_bytes(self) -> float:
        return self.memory.first_use_bytes()

    def rise(self) -> tuple[float, float] | None:
        return self.memory.rise()

    # Time (TimeModel).

    def seconds_per_element(self, window: int | None = None) -> float | None:
        return self.time.seconds_per_element(window)

    def seconds_for(self, elements: int) -> float | None:
        return self.time.seconds_for(elements)

    def time_form(self) -> str:
        return self.time.time_form()

    def time_curve_weight(self) -> tuple[float, str | None]:
        return self.time.time_curve_weight()

    def time_fits(self, elements: Sequence[int] = ()) -> dict[str, dict[str, Any]]:
        return self.time.time_fits(elements)

    def curve_supported(self) -> bool:
        return self.time.curve_supported()

    def rates_rise(self) -> bool:
        return self.time.rates_rise()

    def rate_ratio(self) -> float | None:
        return self.time.rate_ratio()

    def first_touch(self, obs: Observation) -> bool:
        return self.time.first_touch(obs)

    def compute_seconds(self, obs: Observation) -> float | None:
        return self.time.compute_seconds(obs)

    def resting_sys_per_element(self, window: int | None = None) -> float | None:
        return self.time.resting_sys_per_element(window)

    def growth_kernel_seconds(self, sys_seconds: float, elements: int, rest: float | None = None) -> float:
        return self.time.growth_kernel_seconds(sys_seconds, elements, rest)

    def touch_costs(self) -> tuple[float, float]:
        return self.time.touch_costs()

    def touch_seconds_per_byte(self) -> float | None:
        return self.time.touch_seconds_per_byte()

    # Energy (EnergyModel).

    def joules_per_element(self, window: int | None = None, *,
                           measured_only: bool = False) -> tuple[float, str] | None:
        return self.energy.joules_per_element(window, measured_only=measured_only)

    def joules_for(self, elements: int, window: int | None = None) -> float | None:
        return self.energy.joules_for(elements, window)
