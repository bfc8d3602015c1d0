"""How far the simulator's predictions can be trusted on this store: its past flow runs, predicted again.

Before booking a cluster on a prediction, the person booking asks how close the predictions have been. The
store holds the answer for the flows it has seen: each past flow run's maps, its cluster, and how long it took.
:func:`track_record` predicts each of the store's latest completed flow runs on its own survey and cluster
(:func:`memchunk_prefect.sim.plan.from_flow_run`) and sets the simulated makespan's p50 and p90 beside the
makespan it had (first map's start to last map's end).

Each run is predicted from what the store knew when it started (:meth:`~memchunk_prefect.learn.store.Store.copy_as_of`),
as a booking made before it would have been: the plans are those the runner would have made then, and nothing
the run itself taught is used. A run with an operator the store had too little history of to plan (a first run)
is predicted as a cold run instead (the runner probing, ``cold=True``), its chunks drawn from what the store
knew at its end: nothing earlier could say what its operators cost.

:attr:`TrackRecord.deadline_factor` is the multiple of the predicted p90 a deadline would have needed to hold for
90% of those runs (the 90th percentile of real / p90, from :data:`MIN_RUNS_FOR_FACTOR` runs): book at the p90
times it. It is pooled over every flow of the store, or over the runs of one flow (``flow_run=``, what
``--flow-run`` with ``--track-record`` reads), and measures how the simulator misses on
this store's flows and machine (orchestration costs, the first step of a fresh cluster, the machine's load); it
says nothing of a flow the store has not run.

Reads the store, and writes its copies to a temporary directory: no Prefect, no Dask. Units: seconds.
"""

from __future__ import annotations

import math
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from memchunk_prefect.core.errors import FlowRunRecordError, SimulationInputError
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings

#: Predicted runs a :attr:`TrackRecord.deadline_factor` needs. Up to nine runs their 90th percentile is their
#: largest ratio; from five, one slow run among them is one in five at most, not the whole record.
MIN_RUNS_FOR_FACTOR = 5


def booking_factor(ratios: Sequence[float]) -> float | None:
    """The 90th percentile of ``ratios`` (real makespan / predicted p90), at least 1 (a p90 that always held
    needs no margin); None without ratios.

    >>> booking_factor([0.9, 1.0, 1.1, 1.2, 1.5]), booking_factor([0.8, 0.9]), booking_factor([])
    (1.5, 1.0, None)
    """
    return max(1.0, float(np.quantile(list(ratios), 0.9, method="inverted_cdf"))) if len(ratios) else None


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
    same_flow: bool = False  # only runs of the flow being booked (else every flow of the store)

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
    def ratios(self) -> list[float]:
        """Each predicted run's real makespan over its predicted p90."""
        return [r.real_seconds / r.p90_seconds for r in self.predicted if r.p90_seconds]

    @property
    def deadline_factor(self) -> float | None:
        """The multiple of the predicted p90 a deadline needed to hold for 90% of the predicted runs
        (:func:`booking_factor`; None with fewer than :data:`MIN_RUNS_FOR_FACTOR` of them). ``recommend``
        asks the simulated runs to meet the deadline with 90% confidence, which is the p90: the factor is
        measured against the same figure."""
        ratios = self.ratios
        return booking_factor(ratios) if len(ratios) >= MIN_RUNS_FOR_FACTOR else None

    def summary_line(self) -> str:
        """The record in one sentence."""
        done = self.predicted
        if not done:
            return "no past flow run of this store could be predicted again: " + ("; ".join(self.skipped) or
                                                                                   "none is recorded")
        mae, worst = self.median_abs_error, self.worst_abs_error
        assert mae is not None and worst is not None
        what = f"{len(done)} past flow run(s){' of this flow' if self.same_flow else ''}"
        line = (f"{what} predicted again: makespan error median {mae:.0%}, worst {worst:.0%}; "
                f"a deadline at the p90 would have held for {self.held_by_p90} of {len(done)}")
        factor = self.deadline_factor
        if factor is not None:
            line += f"; book at {factor:.2f}x the p90 to have held for 90% of them"
        else:
            line += f" (a booking factor needs {MIN_RUNS_FOR_FACTOR} predicted runs, this store has {len(done)})"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [{**asdict(r), "error": r.error, "held_by_p90": r.held_by_p90} for r in self.rows],
                "skipped": list(self.skipped), "same_flow": self.same_flow, "median_abs_error": self.median_abs_error,
                "worst_abs_error": self.worst_abs_error, "held_by_p90": self.held_by_p90,
                "deadline_factor": self.deadline_factor}


def _predict(store: Any, run_id: str, started: float, ended: float, work: Path, runs: int, seed: int,
             settings: PolicySettings) -> tuple[bool, Any]:
    """(cold, the plan) of one past flow run: warm from the store as it stood at its start, else (an operator with
    too little history then) cold from the store as it stood at its end."""
    from memchunk_prefect.core.errors import TooLittleHistoryError
    from memchunk_prefect.sim.plan import from_flow_run
    from memchunk_prefect.sim.recorded import recorded_flow

    # The cores its workers shared: a map of store v14 or later keeps the count (and the copy keeps the map); an
    # older one is counted from the run's own chunks, which the copy as of its start leaves out.
    kw: dict[str, Any] = {}
    if any(m.threads_per_core is None for m in store.maps(run_id)):
        cluster = recorded_flow(store, run_id).cluster
        kw = {"threads_per_core": cluster.threads_per_core} if cluster and cluster.threads_per_core else {}
    copy = store.copy_as_of(work / "as-of.sqlite", started, keep_flow_run=run_id)
    try:
        return False, from_flow_run(copy, run_id, runs=runs, seed=seed, settings=settings, **kw)
    except TooLittleHistoryError:
        copy = store.copy_as_of(work / "as-of.sqlite", ended, keep_flow_run=run_id)
        return True, from_flow_run(copy, run_id, runs=runs, seed=seed, cold=True, settings=settings, **kw)


def _open(store: Any) -> Any:
    """The store at ``store`` (None: the runner's default store); StoreError where there is none (a track record
    of a mistyped path is never an empty new store)."""
    from memchunk_prefect.core.errors import StoreError
    from memchunk_prefect.learn.store import Store, default_store_path

    path = Path(store) if store is not None else default_store_path()
    if not path.is_file():
        raise StoreError(f"no store at {path}: a track record reads the store your flows ran with; give it with "
                         "--store (store=) or MEMCHUNK_STORE")
    return Store(path)


def _same_flow(store: Any, by_run: dict[str, list[Any]], flow_run: str) -> dict[str, list[Any]]:
    """The flow runs of ``by_run`` (maps by flow run) with the same operator keys, map for map, as ``flow_run``."""
    from memchunk_prefect.sim.recorded import resolve_flow_run

    keys = sorted(m.operator_key for m in by_run.get(resolve_flow_run(store, flow_run), []))
    return {i: maps for i, maps in by_run.items() if sorted(m.operator_key for m in maps) == keys}


def track_record(store: Any = None, *, last: int = 10, runs: int = 10, seed: int = 0,
                 flow_run: str | None = None, settings: PolicySettings = DEFAULT_SETTINGS) -> TrackRecord:
    """The store's ``last`` latest completed flow runs, each simulated ``runs`` times on its own survey and
    cluster from what the store knew then, beside the makespan it had (see the module docstring). ``store``: a
    path, a :class:`~memchunk_prefect.learn.store.Store` or None (the runner's default store); ``flow_run``: only
    runs of the same flow as this one (an id, its start, or ``latest``): the same operator keys, map for map, so
    a booking for that flow carries its own margin, not one pooled with the store's other flows."""
    from memchunk_prefect.learn.store import Store

    if int(last) < 1 or int(runs) < 1:
        raise SimulationInputError(f"a track record needs at least 1 flow run (--track-record N, last=) and 1 "
                                   f"simulated run of each (--runs, runs=), got {last} and {runs}")
    opened = not isinstance(store, Store)
    st = _open(store) if opened else store
    try:
        by_run: dict[str, list[Any]] = {}
        for m in st.maps():
            if m.flow_run_id:
                by_run.setdefault(m.flow_run_id, []).append(m)
        if flow_run is not None:
            by_run = _same_flow(st, by_run, flow_run)
        order = sorted(by_run, key=lambda i: min(m.started_at for m in by_run[i]))
        rows: list[TrackRow] = []
        skipped: list[str] = []
        with tempfile.TemporaryDirectory(prefix="memchunk-track-") as tmp:
            for run_id in reversed(order):
                if len(rows) >= int(last):
                    break
                maps = by_run[run_id]
                started, ended = min(m.started_at for m in maps), max(m.ended_at for m in maps)
                if any(m.outcome != "ok" for m in maps):
                    skipped.append(f"{run_id}: did not finish every map")
                    continue
                if not (ended > started and math.isfinite(ended - started)):
                    skipped.append(f"{run_id}: no makespan recorded")
                    continue
                try:
                    cold, plan = _predict(st, run_id, started, ended, Path(tmp), int(runs), seed, settings)
                except (SimulationInputError, FlowRunRecordError) as exc:
                    skipped.append(f"{run_id}: {exc}")
                    continue
                s = plan.summary()
                rows.append(TrackRow(run_id, started, cold, ended - started, s.makespan_p50, s.makespan_p90,
                                     len(maps)))
        return TrackRecord(list(reversed(rows)), skipped, same_flow=flow_run is not None)
    finally:
        if opened:
            st.close()
