"""Check a plan before it starts: a recorded flow run, simulated on another survey or cluster, from Python.

"Last night's flow ran on the 10 GB survey; will it finish by 6 am on the 400 GB one with 40 workers of
16 GiB?" :func:`from_flow_run` answers from the store alone (no Prefect server, no Dask cluster): the flow
run's maps, with their operators, parameters, halos and chaining as recorded
(:func:`memchunk_prefect.sim.recorded.recorded_flow`), simulated ``runs`` times on the survey and cluster
given (each figure not given is the recorded run's), with the learned models of the store, the runner's own
state machine and its measured per-map work. :func:`recommend_flow_run` gives the cluster to ask for::

    from memchunk_prefect.sim import from_flow_run

    plan = from_flow_run(flow_run="latest", shape=(2000, 2000, 1500), workers=40, memory_limit="16GiB",
                         deadline=datetime.time(6, 0))
    plan.meets_deadline, plan.makespan_seconds, plan.kills, plan.chunks_per_step

A deadline is seconds, a duration (``"6h"``, ``"HH:MM"``), a ``datetime`` (seconds from now to it) or a
``datetime.time`` (the next such time of day). Units: bytes, seconds.
"""

from __future__ import annotations

import datetime as _dt
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from memchunk_prefect.core.chunks import Shape
from memchunk_prefect.core.errors import SimulationInputError
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings
from memchunk_prefect.core.units import parse_bytes, parse_seconds
from memchunk_prefect.sim.inputs import ClusterShape, MapWork, PriorKnowledge, Step, StoreModels
from memchunk_prefect.sim.recommend import Recommendation
from memchunk_prefect.sim.recorded import RecordedFlow, recorded_flow
from memchunk_prefect.sim.simulate import Summary

Deadline = float | int | str | _dt.datetime | _dt.time


@dataclass
class FlowPlan:
    """What the simulator says of a recorded flow run on one survey and cluster.

    ``summaries``: one per strategy simulated (the first is the one the properties read, ``memchunk`` by
    default); ``recorded``: the flow run as the store holds it; ``deadline_seconds``: from the start, None
    without a deadline; ``confidence``: the chance of meeting it that :attr:`meets_deadline` asks for.
    """

    recorded: RecordedFlow
    shape: Shape
    cluster: ClusterShape
    summaries: list[Summary]
    deadline_seconds: float | None = None
    confidence: float = 0.9
    map_work: MapWork | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def flow_run_id(self) -> str:
        return self.recorded.flow_run_id

    @property
    def steps(self) -> list[Step]:
        return self.recorded.steps

    def summary(self, strategy: str | None = None) -> Summary:
        """The summary of ``strategy`` (default: the first simulated)."""
        for s in self.summaries:
            if strategy is None or s.strategy == strategy:
                return s
        raise SimulationInputError(f"{strategy!r} was not simulated: choose from "
                                   f"{', '.join(s.strategy for s in self.summaries)}")

    @property
    def completes(self) -> bool:
        """Every simulated run finished (no run failed: no worker killed past what the strategy survives)."""
        s = self.summary()
        return s.completed == s.runs

    @property
    def completed_fraction(self) -> float:
        s = self.summary()
        return s.completed / s.runs

    @property
    def makespan_seconds(self) -> float | None:
        """The median makespan of the runs that finished, seconds (None: none did)."""
        return self.summary().makespan_p50

    @property
    def makespan_p90_seconds(self) -> float | None:
        return self.summary().makespan_p90

    @property
    def kills(self) -> float:
        """Out-of-memory events (workers killed, chunks retried) per simulated run, on average."""
        return self.summary().out_of_memory_mean

    @property
    def chunks_per_step(self) -> list[float]:
        """Per step of the flow, the median chunks it wrote over the runs that finished it."""
        return list(self.summary().chunks_per_map)

    @property
    def p_deadline(self) -> float | None:
        """The share of simulated runs that finished within the deadline (None without a deadline)."""
        return self.summary().p_deadline

    @property
    def meets_deadline(self) -> bool | None:
        """Whether the runs finished within the deadline with at least :attr:`confidence` (None without one)."""
        p = self.p_deadline
        return None if p is None else p >= self.confidence

    def to_dict(self) -> dict[str, Any]:
        r = self.recorded
        return {"flow_run_id": r.flow_run_id, "steps": [asdict(s) for s in r.steps], "params": r.params,
                "recorded_shape": list(r.shape), "recorded_makespan_seconds": r.makespan_seconds,
                "shape": list(self.shape), "cluster": asdict(self.cluster),
                "deadline_seconds": self.deadline_seconds, "confidence": self.confidence,
                "meets_deadline": self.meets_deadline, "completes": self.completes,
                "makespan_seconds": self.makespan_seconds, "kills": self.kills,
                "chunks_per_step": self.chunks_per_step, "notes": [*r.notes, *self.notes],
                "strategies": [s.to_dict() for s in self.summaries]}


def deadline_seconds(deadline: Deadline | None, now: float | None = None) -> float | None:
    """Seconds from ``now`` (default: the clock) to ``deadline`` (see the module docstring); None for None.

    >>> deadline_seconds("6h"), deadline_seconds(90), deadline_seconds(_dt.datetime(2030, 1, 1, 6), now=_dt.datetime(
    ...     2030, 1, 1, 5, 30).timestamp())
    (21600.0, 90.0, 1800.0)
    """
    if deadline is None:
        return None
    t0 = time.time() if now is None else float(now)
    if isinstance(deadline, _dt.datetime):
        seconds = deadline.timestamp() - t0
    elif isinstance(deadline, _dt.time):
        start = _dt.datetime.fromtimestamp(t0, tz=deadline.tzinfo)
        at = start.replace(hour=deadline.hour, minute=deadline.minute, second=deadline.second, microsecond=0)
        if at <= start:
            at += _dt.timedelta(days=1)
        seconds = at.timestamp() - t0
    elif isinstance(deadline, (int, float)) and not isinstance(deadline, bool):
        seconds = float(deadline)
    else:
        seconds = parse_seconds(str(deadline))
    if not seconds > 0:
        raise SimulationInputError(f"the deadline {deadline!r} is {seconds:.0f} s from now: give one in the future "
                                   "(seconds, '6h', 'HH:MM', a datetime or a datetime.time)")
    return float(seconds)


def _models(store: Any, settings: PolicySettings, prior: PriorKnowledge | None, cold: bool) -> tuple[StoreModels,
                                                                                                     bool]:
    """The store's models (a path, a Store, or None for the default store), and whether they were opened here."""
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.sim.inputs import store_models

    if isinstance(store, Store):
        return StoreModels(ModelBank(store), settings, prior, cold=cold), False
    return store_models(None if store is None else Path(store), settings, prior, cold=cold), True


def _shape(shape: Sequence[int]) -> Shape:
    """A survey shape given by a caller: three positive extents (iline, xline, twt)."""
    out = tuple(int(s) for s in shape)
    if len(out) != 3 or min(out) < 1:
        raise SimulationInputError(f"a survey shape is three positive extents (iline, xline, twt), got {tuple(shape)}")
    return out


def _bytes(value: int | str | None, what: str) -> int | None:
    return None if value is None else parse_bytes(value, what=what)


def flow_cluster(recorded: RecordedFlow, models: StoreModels, *, workers: int | None = None,
                 memory_limit: int | str | None = None, threads_per_worker: int | None = None,
                 resting: int | str | None = None, **cluster_kw: Any) -> tuple[ClusterShape, MapWork | None]:
    """The cluster to simulate a recorded flow run on (the recorded one, each figure given replaced) and the
    runner's per-map and per-task work the store measured (the cluster's ``map_start_seconds``,
    ``map_end_seconds`` and ``runner_task_seconds``)."""
    work = models.map_work()
    for k, v in (work.cluster_kwargs() if work is not None else {}).items():
        cluster_kw.setdefault(k, v)
    cluster = recorded.cluster_shape(workers=workers, memory_limit_bytes=_bytes(memory_limit, "memory_limit"),
                                     threads_per_worker=threads_per_worker,
                                     resting_bytes=_bytes(resting, "resting"), **cluster_kw)
    return cluster, work


def from_flow_run(store: Any = None, flow_run: str = "latest", *, shape: Sequence[int] | None = None,
                  workers: int | None = None, memory_limit: int | str | None = None,
                  threads_per_worker: int | None = None, resting: int | str | None = None,
                  strategies: Sequence[str] = ("memchunk",), runs: int = 20, seed: int = 0,
                  deadline: Deadline | None = None, confidence: float = 0.9, cold: bool = False,
                  prior: PriorKnowledge | None = None, settings: PolicySettings = DEFAULT_SETTINGS,
                  now: float | None = None, **cluster_kw: Any) -> FlowPlan:
    """Simulate a recorded flow run's maps ``runs`` times on ``shape`` (default: the recorded survey) and a
    cluster of ``workers`` x ``threads_per_worker`` with ``memory_limit`` each (bytes or ``"16GiB"``; each
    default: the recorded run's) and ``resting`` memory per worker; returns a :class:`FlowPlan`.

    ``store``: a store path, a :class:`~memchunk_prefect.learn.store.Store`, or None (the runner's default
    store); ``flow_run``: an id, its unique start, or ``"latest"``; ``strategies``: ``memchunk`` (the runner),
    ``static-N``, ``split``, ``dask-auto``; ``deadline``: see :func:`deadline_seconds`; ``cold``: plan as a first
    run on an empty store would (probing), chunks still drawn from the store's models; ``prior``: simulate keys
    with too little history from a stated prior instead of raising :class:`TooLittleHistoryError`;
    ``cluster_kw``: other :class:`ClusterShape` fields (``queue_wait``, ``walltime_seconds``, ``external``,
    ``restart_seconds``, ``per_task_overhead_seconds``...). Nothing is written to the store.
    """
    from memchunk_prefect.sim.simulate import simulate

    models, opened = _models(store, settings, prior, cold)
    try:
        recorded = recorded_flow(models.bank.store, flow_run)
        models.check_history([s.key for s in recorded.steps])
        cluster, work = flow_cluster(recorded, models, workers=workers, memory_limit=memory_limit,
                                     threads_per_worker=threads_per_worker, resting=resting, **cluster_kw)
        survey: Shape = _shape(shape) if shape is not None else recorded.shape
        limit = deadline_seconds(deadline, now)
        summaries = simulate(list(strategies), recorded.steps, survey, cluster, models.knowledge, runs=runs,
                             seed=seed, deadline=limit, truth_for=models.truth, settings=settings)
    finally:
        if opened:
            models.bank.store.close()
    notes = []
    if models.from_prior:
        prior_keys = ", ".join(sorted(models.from_prior))
        notes.append(f"simulated from the stated prior, not from what was learned: {prior_keys}")
    return FlowPlan(recorded, survey, cluster, summaries, limit, float(confidence), work, notes)


def recommend_flow_run(store: Any = None, flow_run: str = "latest", *, deadline: Deadline,
                       shape: Sequence[int] | None = None,
                       memory_options: Sequence[int | str] = ("2GiB", "4GiB", "8GiB", "16GiB", "32GiB"),
                       max_workers: int = 256, threads_per_worker: int | None = None, resting: int | str | None = None,
                       confidence: float = 0.9, runs: int = 20, seed: int = 0, objective: str = "time",
                       prior: PriorKnowledge | None = None, settings: PolicySettings = DEFAULT_SETTINGS,
                       now: float | None = None, **cluster_kw: Any) -> Recommendation:
    """The cluster to ask for to run a recorded flow run's maps on ``shape`` within ``deadline`` with the
    chance ``confidence``: :func:`memchunk_prefect.sim.recommend.recommend` over ``memory_options`` per worker
    (bytes or ``"16GiB"``), up to ``max_workers``, threads and resting memory as recorded unless given."""
    from memchunk_prefect.sim.recommend import recommend

    models, opened = _models(store, settings, prior, False)
    try:
        recorded = recorded_flow(models.bank.store, flow_run)
        models.check_history([s.key for s in recorded.steps])
        c = recorded.cluster
        threads = threads_per_worker if threads_per_worker is not None else (c.threads_per_worker if c else 1)
        rest = _bytes(resting, "resting")
        if rest is None and c is not None and c.resting_bytes is not None:
            rest = int(c.resting_bytes)
        if rest is not None:
            cluster_kw["resting_bytes"] = rest
        if c is not None and c.kill_fraction is not None:
            cluster_kw.setdefault("kill_fraction", float(c.kill_fraction))
        work = models.map_work()
        for k, v in (work.cluster_kwargs() if work is not None else {}).items():
            cluster_kw.setdefault(k, v)
        limit = deadline_seconds(deadline, now)
        assert limit is not None
        survey = _shape(shape) if shape is not None else recorded.shape
        return recommend(recorded.steps, survey, models.knowledge, deadline_seconds=limit,
                         memory_options=[parse_bytes(m, what="memory option") for m in memory_options],
                         max_workers=max_workers, threads_per_worker=threads, confidence=confidence, runs=runs,
                         seed=seed, truth_for=models.truth, objective=objective, settings=settings, **cluster_kw)
    finally:
        if opened:
            models.bank.store.close()
