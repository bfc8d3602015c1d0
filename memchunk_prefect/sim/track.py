"""How far the simulator's predictions can be trusted on this store: its past flow runs, predicted again.

Before booking a cluster on a prediction, the person booking asks how close the predictions have been. The
store holds the answer for the flows it has seen: each past flow run's maps, its cluster, and how long it took.
:func:`track_record` simulates each of the store's latest completed flow runs on its own survey and cluster
(:func:`memchunk_prefect.sim.plan.from_flow_run`) and sets the simulated makespan's p50 and p90 beside the
makespan it had (first map's start to last map's end). A run whose keys had no observation from an earlier flow
run is predicted as a cold run (the runner probing, ``cold=True``), the others warm.

:attr:`TrackRecord.deadline_factor` is the multiple of the p50 a deadline would have needed to hold for 90% of
those runs (the 90th percentile of real / p50, from :data:`MIN_RUNS_FOR_FACTOR` runs): book at the p50 times
it, or at the p90 where the p90 is larger.

The record is in-sample: the models that predict a past run learned from that run too, so it reads the
simulator's misfit to this store's flows (orchestration costs, the first step of a fresh cluster, a machine's
load), not how it would do on an operator it never saw. It says nothing of a flow the store has not run.

Pure apart from reading the store: no Prefect, no Dask. Units: seconds.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from memchunk_prefect.core.errors import FlowRunRecordError, SimulationInputError
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings

#: Completed runs a :attr:`TrackRecord.deadline_factor` needs: a 90th percentile of fewer is the largest one.
MIN_RUNS_FOR_FACTOR = 5


@dataclass(frozen=True)
class TrackRow:
    """One past flow run: its makespan (seconds) and the simulator's p50 / p90 for it, predicted cold or warm."""

    flow_run_id: str
    started_at: float  # epoch seconds, its first map's start
    cold: bool
    real_seconds: float
    p50_seconds: float | None  # None: no simulated run completed
    p90_seconds: float | None
    maps: int

    @property
    def error(self) -> float | None:
        """p50 / real - 1: negative where the prediction was short."""
        return None if self.p50_seconds is None else self.p50_seconds / self.real_seconds - 1.0

    @property
    def held_by_p90(self) -> bool:
        """Whether a deadline booked at the prediction's p90 would have held."""
        return self.p90_seconds is not None and self.real_seconds <= self.p90_seconds


@dataclass
class TrackRecord:
    """The store's latest completed flow runs beside their predictions (:func:`track_record`); ``skipped``:
    flow runs left out, each with why."""

    rows: list[TrackRow]
    skipped: list[str] = field(default_factory=list)

    @property
    def predicted(self) -> list[TrackRow]:
        return [r for r in self.rows if r.error is not None]

    @property
    def median_abs_error(self) -> float | None:
        errors = [abs(r.error) for r in self.predicted if r.error is not None]
        return float(np.median(errors)) if errors else None

    @property
    def worst_abs_error(self) -> float | None:
        errors = [abs(r.error) for r in self.predicted if r.error is not None]
        return max(errors) if errors else None

    @property
    def held_by_p90(self) -> int:
        return sum(r.held_by_p90 for r in self.predicted)

    @property
    def deadline_factor(self) -> float | None:
        """The multiple of the p50 a deadline needed to hold for 90% of the predicted runs (at least 1; None
        with fewer than :data:`MIN_RUNS_FOR_FACTOR` of them)."""
        ratios = [r.real_seconds / r.p50_seconds for r in self.predicted if r.p50_seconds]
        if len(ratios) < MIN_RUNS_FOR_FACTOR:
            return None
        return max(1.0, float(np.quantile(ratios, 0.9, method="inverted_cdf")))

    def summary_line(self) -> str:
        """The record in one sentence."""
        done = self.predicted
        if not done:
            return "no past flow run of this store could be predicted again: " + ("; ".join(self.skipped) or
                                                                                   "none is recorded")
        mae, worst = self.median_abs_error, self.worst_abs_error
        assert mae is not None and worst is not None
        line = (f"{len(done)} past flow run(s) predicted again: makespan error median {mae:.0%}, worst {worst:.0%}; "
                f"a deadline at the p90 would have held for {self.held_by_p90} of {len(done)}")
        factor = self.deadline_factor
        if factor is not None:
            line += f"; book at {factor:.2f}x the p50 to have held for 90% of them"
        else:
            line += f" (a booking factor needs {MIN_RUNS_FOR_FACTOR} runs)"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [{**asdict(r), "error": r.error, "held_by_p90": r.held_by_p90} for r in self.rows],
                "skipped": list(self.skipped), "median_abs_error": self.median_abs_error,
                "worst_abs_error": self.worst_abs_error, "held_by_p90": self.held_by_p90,
                "deadline_factor": self.deadline_factor}


def _cold_keys(store: Any, flow_run_id: str, started_at: float, keys: set[str]) -> bool:
    """Whether any of the run's keys had no observation from another flow run before ``started_at``."""
    for key in keys:
        if not any(o.flow_run_id != flow_run_id and o.created_at < started_at for o in store.observations(key)):
            return True
    return False


def track_record(store: Any = None, *, last: int = 10, runs: int = 10, seed: int = 0,
                 settings: PolicySettings = DEFAULT_SETTINGS) -> TrackRecord:
    """The store's ``last`` latest completed flow runs, each simulated ``runs`` times on its own survey and
    cluster, beside the makespan it had (see the module docstring). ``store``: a path, a
    :class:`~memchunk_prefect.learn.store.Store` or None (the runner's default store)."""
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.sim.plan import from_flow_run

    if int(last) < 1 or int(runs) < 1:
        raise SimulationInputError(f"a track record needs last >= 1 flow runs and runs >= 1 simulations of each, got "
                                   f"last={last}, runs={runs}")
    opened = not isinstance(store, Store)
    st = Store(store) if opened else store
    try:
        by_run: dict[str, list[Any]] = {}
        for m in st.maps():
            if m.flow_run_id:
                by_run.setdefault(m.flow_run_id, []).append(m)
        order = sorted(by_run, key=lambda i: min(m.started_at for m in by_run[i]))
        rows: list[TrackRow] = []
        skipped: list[str] = []
        for run_id in reversed(order):
            if len(rows) >= int(last):
                break
            maps = by_run[run_id]
            if any(m.outcome != "ok" for m in maps):
                skipped.append(f"{run_id}: did not finish every map")
                continue
            started = min(m.started_at for m in maps)
            real = max(m.ended_at for m in maps) - started
            cold = _cold_keys(st, run_id, started, {m.operator_key for m in maps})
            try:
                plan = from_flow_run(st, run_id, runs=runs, seed=seed, cold=cold, settings=settings)
            except (SimulationInputError, FlowRunRecordError) as exc:
                skipped.append(f"{run_id}: {exc}")
                continue
            s = plan.summary()
            if not (real > 0 and math.isfinite(real)):
                skipped.append(f"{run_id}: no makespan recorded")
                continue
            rows.append(TrackRow(run_id, started, cold, real, s.makespan_p50, s.makespan_p90, len(maps)))
        return TrackRecord(list(reversed(rows)), skipped)
    finally:
        if opened:
            st.close()
