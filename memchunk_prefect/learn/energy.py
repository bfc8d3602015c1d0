"""The energy model of one operator key: joules per element, what they rest on, and how well they predicted."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from river import metrics, utils

from memchunk_prefect.core.energy import ESTIMATE, DeviceRun, busy_weight, is_measured, split_among_devices
from memchunk_prefect.core.records import Observation
from memchunk_prefect.learn.forms import RATE_HISTORY, _rolling_count


class EnergyModel:
    """Joules per element (halo included) of one operator's ``ok`` runs: the median of the latest ones.

    Runs measured by a counter (``energy_source`` "rapl", "nvml", ...) are used
    whenever any exists, estimates (``"estimate"``: busy cores at a stated power)
    otherwise; the two are never mixed, so one measured run outranks any number of
    guesses. A counter reads a whole device: runs that overlapped on one host share
    it (:func:`memchunk_prefect.core.energy.split_among_devices`), so two chunks
    running side by side are not each charged for both. A median, so one run on a
    busy machine does not move it.

    Parameters (public, as constructed): ``energy_window``, the latest runs the
    median is over; ``metric_window``, the runs in the rolling error (``summary()["energy_mape"]``),
    each scored against what the model predicted before it learned the run.

    >>> from memchunk_prefect.core.records import Observation
    >>> m = EnergyModel()
    >>> for i, joules in enumerate((10.0, 30.0, 20.0)):  # one after another: each run has the counter to itself
    ...     m.learn(Observation("k|float32|cpu", 1000, (1, 1, 1000), 4000, 2**20, seconds=1.0, created_at=10.0 * i,
    ...                         energy_joules=joules, energy_source="rapl"))
    >>> m.joules_per_element(), m.joules_for(500)
    ((0.02, 'rapl'), 10.0)
    """

    def __init__(self, energy_window: int = 20, metric_window: int = 20):
        self.energy_window = energy_window
        self.metric_window = metric_window
        self._runs: deque[_EnergyRun] = deque(maxlen=RATE_HISTORY)
        self._mape: Any = utils.Rolling(metrics.MAPE, window_size=self.metric_window)  # River's Rolling: untyped

    def learn(self, obs: Observation) -> None:
        """Keep an ``ok`` run's energy (others say nothing of it); score what was predicted for it first."""
        if obs.gpu_out_of_memory or obs.outcome != "ok" or obs.elements <= 0 or obs.energy_joules is None:
            return
        run = _EnergyRun.of(obs)
        before = self.joules_per_element(measured_only=run.measured)
        if before is not None and run.joules > 0:
            self._mape.update(run.joules, before[0] * run.elements)
        self._runs.append(run)

    def joules_per_element(self, window: int | None = None, *,
                           measured_only: bool = False) -> tuple[float, str] | None:
        """``(joules per element, source)`` over the latest ``window`` runs (default ``energy_window``) of one
        kind; None before any. ``source`` names the counters ("rapl", "nvml", joined by "+") or "estimate";
        ``measured_only``: None while no counter has measured a run."""
        window = self.energy_window if window is None else window
        measured = [r for r in self._runs if r.measured]
        runs = measured if measured else ([] if measured_only else list(self._runs))
        runs = runs[-max(1, int(window)):]
        if not runs:
            return None
        joules = [r.joules for r in runs]
        if measured:
            joules = _split_by_device(runs)
        rates = sorted(j / r.elements for j, r in zip(joules, runs))
        sources = sorted({r.source for r in runs})
        return rates[len(rates) // 2], "+".join(sources)

    def joules_for(self, elements: int, window: int | None = None) -> float | None:
        """Energy of one block of ``elements`` (halo included), joules, from :meth:`joules_per_element`."""
        jpe = self.joules_per_element(window)
        return None if jpe is None else jpe[0] * int(elements)

    def summary(self) -> dict[str, Any]:
        """``joules_per_element`` and ``energy_source`` (None before a run), ``energy_runs`` kept, and
        ``energy_mape``: the rolling error of the predicted energy (a fraction; None before one was scored)."""
        jpe = self.joules_per_element()
        out: dict[str, Any] = {"joules_per_element": None, "energy_source": None, "energy_runs": len(self._runs),
                               "energy_mape": None}
        if jpe is not None:
            out["joules_per_element"], out["energy_source"] = jpe
        if _rolling_count(self._mape):
            out["energy_mape"] = self._mape.get() / 100.0
        return out


@dataclass(frozen=True)
class _EnergyRun:
    """One ok run's energy, as the energy model keeps it (joules, elements, when and where it ran)."""

    joules: float
    elements: int
    source: str
    start: float
    end: float
    weight: float  # busy cores while it ran (CPU seconds / wall seconds), for sharing a device counter
    host: str

    @property
    def measured(self) -> bool:
        return is_measured(self.source)

    @classmethod
    def of(cls, obs: Observation) -> "_EnergyRun":
        end = float(obs.created_at)
        start = float(obs.started_at) if obs.started_at is not None else end - float(obs.seconds)
        return cls(float(obs.energy_joules or 0.0), int(obs.elements), str(obs.energy_source or ESTIMATE),
                   start, max(start, end), busy_weight(obs.cpu_seconds, obs.seconds), obs.host or obs.worker)


def _split_by_device(runs: Sequence[_EnergyRun]) -> list[float]:
    """Each measured run's share of its device's counter, runs grouped by (host, counter)."""
    return split_among_devices([(r.host, r.source) for r in runs],
                               [DeviceRun(r.start, r.end, r.joules, r.weight) for r in runs])
