"""Plan before you run: a discrete-event simulation of chunked maps on a cluster, from what was learned.

"How long will tonight's run take on 40 workers of 8 GiB, and will anything
die?" The simulator answers from the store: each chunk's peak memory and
compute seconds are drawn from the operator's learned models, chunks run on
simulated worker slots, a worker whose tasks cross its nanny's kill line dies
(and restarts), and the runner's decisions are the runner's own: the
``memchunk`` strategy drives the real map state machine
(:class:`~memchunk_prefect.core.machine.MapMachine`, the same object the executor
drives on Dask), so probes, continue / rechunk, re-plans, retry-smaller and the
learned policy's arm behave as in a real run. Baselines: ``static-N`` (N iline
slabs per operator, a run fails at the first worker killed, as Dask reports
``KilledWorker``), ``split`` (split-on-failure: the whole volume first, a killed
chunk split in two and resubmitted, and chunks as large as one that failed
halved before they run) and ``dask-auto`` (Dask's ``chunks="auto"``; fails like static).

What is drawn, per chunk (``rng``: numpy's Generator, seeded per run):

- peak memory above the worker's resting level: the model's mean for the
  block it reads (halo included) times a log-normal factor whose 95th percentile
  is the operator's learned margin (the conformal quantile of needed /
  predicted; see :meth:`Draws.margin` before it is learned);
- compute seconds: the learned time (``seconds_for``, or seconds per element x
  elements) times a log-normal factor of the operator's learned spread (how far its
  runs fell from the model, :meth:`memchunk_prefect.learn.time.TimeModel.time_spread`;
  never less than ``time_sigma``, a stated 0.1, which stands alone before five timed runs),
  times the factor every block of the run shares (:func:`~memchunk_prefect.sim.inputs.run_factor`: how far
  whole flow runs strayed from the models, :meth:`memchunk_prefect.learn.bank.ModelBank.run_spread`, never
  less than a stated 0.1; run ``i`` of ``n`` takes its ``(i + 1/2) / n``-th quantile, so the runs' p90 covers
  runs that are slow as a whole, as real repeats of one flow are),
  plus the per-task overhead; a task that
  takes its worker above the most that worker process has held runs longer by the
  growth at the operator's learned kernel seconds per byte (a first touch, paid once
  per worker process: :meth:`SimulatedCluster._dispatch`), and the simulated map
  plans knowing each worker's mark, as the runner does; a worker process's first
  task of an operator takes what first calls of about its block's size took, one-off cost and compute together
  (:meth:`memchunk_prefect.learn.time.TimeModel.first_call_block_seconds`), and where none was timed, its
  compute seconds and the operator's learned first call
  (:meth:`memchunk_prefect.learn.time.TimeModel.first_call_seconds`);
- energy: the operator's learned joules for the block (scaled by the same time
  factor: a slower run draws power longer), else its compute seconds x
  ``watts_per_core``; the overhead at ``watts_per_core``; a killed task's share by
  the time it ran. A run's energy adds the slots it held idle at
  ``idle_watts_per_core`` (:mod:`memchunk_prefect.core.energy`).

An HPC allocation (:class:`ClusterShape` ``queue_wait`` / ``walltime_seconds``): each worker
is a batch job that joins after a wait drawn from the queue-wait distribution and leaves at its
walltime (the tasks running there are lost and rerun; a job that leaves is not replaced);
makespans count from submission and core-hours from each job's start. The allocation's
utilisation over a window, simulated and by the model of :mod:`memchunk_prefect.sim.allocation`:
:func:`allocation_check`.

A warm run is simulated: the models are read from the store and not taught by
simulated chunks (no observation or reward is written to the store). An operator with no
usable history cannot be simulated (:class:`SimulationInputError`); run it once.

Pure apart from reading the store: no Prefect, no Dask, no clock. Units: bytes,
seconds (simulated, from 0), elements.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, Sequence

import numpy as np

from memchunk_prefect.core.chunks import Shape
from memchunk_prefect.core.errors import SimulationInputError
from memchunk_prefect.sim.allocation import AllocationCheck, QueueWait, held_fraction
from memchunk_prefect.sim.inputs import ClusterShape, KnowledgeFor, Step, spread_quantiles
from memchunk_prefect.sim.runs import SimResult, run_strategy

# =========================================================================== Monte Carlo


@dataclass
class Summary:
    """Repeated runs of one strategy: completion, makespan percentiles, the chance of meeting a deadline."""

    strategy: str
    runs: int
    completed: int
    makespan_p50: float | None
    makespan_p90: float | None
    p_deadline: float | None  # P(completed and makespan <= deadline); None without a deadline
    out_of_memory_mean: float
    lost_worker_seconds_mean: float
    slot_utilisation_p50: float | None
    core_hours_p50: float | None
    peak_bytes_max: int
    failure: str = ""  # the first failure's reason, if any run failed
    energy_joules_p50: float | None = None  # completed runs' energy (tasks and idle slots), joules
    energy_basis: str = ""  # "learned", "estimated from seconds" or "mixed" (see SimResult.energy_basis)
    walltime_losses_mean: float = 0.0  # tasks lost per run with a worker that reached its walltime
    #: The allocation's utilisation over a window, simulated and by the model (:func:`allocation_check`).
    allocation: AllocationCheck | None = None
    #: Per map of the flow, in order: the median of the chunks it wrote over the runs that finished it.
    chunks_per_map: list[float] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "allocation"}
        d["allocation"] = self.allocation.to_dict() if self.allocation is not None else None
        return d


def window_utilisation(result: SimResult, cluster: ClusterShape, window: float) -> tuple[float, list[float]]:
    """One simulated run's allocation utilisation over ``[0, window]`` and its jobs' own (see
    :mod:`memchunk_prefect.sim.allocation`): ``U(T0)``, busy slot-seconds within the window over
    ``slots x min(W, T0)``; and for each worker that joined within the window, its busy slot-seconds there
    over ``threads x min(W, T0 - its wait)``."""
    joins = result.joins or [0.0] * cluster.workers
    busy = [0.0] * cluster.workers
    for e in result.ended:
        t = e.task
        if t.sid >= 0 and 0 <= t.worker < cluster.workers:
            busy[t.worker] += max(0.0, min(e.at, window) - min(t.started, window))
    c, wall = cluster.threads_per_worker, cluster.walltime_seconds
    full = min(math.inf if wall is None else float(wall), float(window))
    held = held_fraction(np.asarray(joins), window, wall) * full * c
    u = [min(1.0, b / h) for b, h in zip(busy, held) if h > 0]
    return sum(busy) / (cluster.slots * full), u


def allocation_check(results: Sequence[SimResult], cluster: ClusterShape, *, window: float,
                     target: float) -> AllocationCheck:
    """The simulated runs' ``U(T0)`` beside the model's ``P(U(T0) >= U0)`` from the cluster's queue waits and
    the per-job utilisation those runs measured (:func:`memchunk_prefect.sim.allocation.check`)."""
    from memchunk_prefect.sim.allocation import check

    wait = cluster.queue_wait if cluster.queue_wait is not None else QueueWait("fixed", 0.0)
    return check(wait, [window_utilisation(r, cluster, window) for r in results], jobs=cluster.workers,
                 window=window, target=target, walltime=cluster.walltime_seconds)


def summarize(strategy: str, results: Sequence[SimResult], deadline: float | None = None) -> Summary:
    done = [r for r in results if r.completed]
    spans = np.array([r.makespan_seconds for r in done]) if done else None

    def pct(values: np.ndarray | None, q: float) -> float | None:
        return None if values is None or not len(values) else float(np.percentile(values, q))

    util = np.array([r.slot_utilisation for r in done]) if done else None
    hours = np.array([r.core_hours for r in done]) if done else None
    energy = np.array([r.energy_joules for r in done]) if done else None
    met = None if deadline is None else sum(r.makespan_seconds <= deadline for r in done) / len(results)
    return Summary(strategy, len(results), len(done), pct(spans, 50), pct(spans, 90), met,
                   float(np.mean([r.out_of_memory for r in results])),
                   float(np.mean([r.lost_worker_seconds for r in results])), pct(util, 50), pct(hours, 50),
                   max((r.peak_bytes for r in results), default=0),
                   next((r.failure for r in results if r.failure), ""), pct(energy, 50),
                   next((r.energy_basis for r in results if r.energy_basis), ""),
                   float(np.mean([r.walltime_losses for r in results])),
                   chunks_per_map=_chunks_per_map(results))


def _chunks_per_map(results: Sequence[SimResult]) -> list[float]:
    """Per map position, the median chunks written over the runs that finished that map."""
    out: list[float] = []
    for i in range(max((len(r.maps) for r in results), default=0)):
        done = [r.maps[i].chunks for r in results
                if len(r.maps) > i and (r.completed or i < len(r.maps) - 1)]
        if not done:
            break
        out.append(float(np.median(done)))
    return out


def simulate(strategies: Sequence[str], steps: Sequence[Step], shape: Shape, cluster: ClusterShape,
             knowledge_for: KnowledgeFor, *, runs: int = 20, seed: int = 0, deadline: float | None = None,
             window: float | None = None, target_utilisation: float | None = None, **kw: Any) -> list[Summary]:
    """``runs`` simulated runs of each strategy (run ``i`` draws from seed ``seed + i``, the same for every
    strategy), summarized; with ``window`` and ``target_utilisation``, each summary carries the allocation's
    utilisation over the window, simulated and by the model (:func:`allocation_check`)."""
    if int(runs) < 1:
        raise SimulationInputError(f"runs must be at least 1, got {runs}")
    if (window is None) != (target_utilisation is None):
        raise SimulationInputError(f"the allocation's utilisation needs both a window and a target, got window="
                                   f"{window}, target_utilisation={target_utilisation}")
    out = []
    for strategy in strategies:
        results = [run_strategy(strategy, steps, shape, cluster, knowledge_for, np.random.default_rng(seed + i),
                                run_quantile=q, **kw) for i, q in enumerate(spread_quantiles(runs))]
        summary = summarize(strategy, results, deadline)
        if window is not None and target_utilisation is not None:
            summary.allocation = allocation_check(results, cluster, window=window, target=target_utilisation)
        out.append(summary)
    return out


