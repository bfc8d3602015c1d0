"""Every tunable number of memchunk-prefect, with its unit, default and why, in one place.

Two groups:

- :class:`PolicySettings`: what the decision core weighs (per-task overhead,
  tolerances, probe sizing, the in-flight cap, the memory-kill rule). They
  change *decisions*; a runner carries them (``MemoryAwareRunner(policy=...)``)
  and so does every simulated run of the same policy.
- :class:`RunnerSettings`: how long the executor waits on the cluster and on
  the Prefect API. They never change a decision, only how patient the glue is.

What is read from the cluster instead of set here: each worker's
``memory_limit``, threads and resting memory (from the scheduler), and the
nanny's kill line (``distributed.worker.memory.terminate``; see
:mod:`memchunk_prefect.run.cluster`).

>>> PolicySettings().in_flight_cap(2), PolicySettings().in_flight_cap(1)
(4, 2)
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from memchunk_prefect.core.energy import (
    DEFAULT_IDLE_WATTS_PER_CORE,
    DEFAULT_WATTS_PER_CORE,
    check_objective,
    check_watts,
)
from memchunk_prefect.core.errors import EnergyInputError, MemchunkError, RunnerConfigError
from memchunk_prefect.core.units import parse_seconds

#: Every volume is processed as float32 (``DTYPE``); ``ITEMSIZE`` bytes per element.
DTYPE = "float32"
ITEMSIZE = 4


@dataclass(frozen=True)
class PolicySettings:
    """The decision core's tunables, with their defaults and units.

    - ``per_task_overhead_seconds``: slot time one task costs beyond its compute
      (Prefect + Dask bookkeeping: 200 mapped no-op task runs on a 2-core machine
      with a local Prefect server took 15.5 s, ~75 ms each, ~0.15 s of one worker
      slot). Too low over-splits, too high under-uses slots.
    - ``seconds_per_element``: compute time per element (incl. halo) used until
      the runner has measured the operator; only the ratio to the overhead matters.
    - ``continue_tolerance``: keep the incoming chunking when its estimated
      makespan is within this fraction of the best plan's (avoids rechunking for
      a few percent).
    - ``replan_threshold``: re-plan the unsubmitted remainder when the upper bound
      for the planned chunk moved by more than this fraction.
    - ``replan_gain``: a mid-map re-plan replaces the queued chunks only when its
      estimated time is shorter by this fraction (or the queued chunks no longer
      fit the budget), so plans do not go back and forth with each observation.
    - ``alone_gain``: on workers of several threads, a map runs one task per worker
      (:mod:`memchunk_prefect.core.sharing`) when its plan so is estimated this much shorter than one task per
      thread (estimates of a plan not yet run are rough; a smallest chunk over a thread's share runs alone
      regardless). Scaled by the parallelism a worker's further threads add on its CPU cores, to none where
      they share one (:meth:`memchunk_prefect.core.sharing.Sharing.alone_gain`).
    - ``probe_multiple``: the memory multiple (peak bytes / input bytes) assumed
      for an unknown operator when sizing probes; 100 covers the heaviest
      operator known (GST3D, about 60x), so probes fit on the first try.
    - ``probe_first_share``: the first probe wave's blocks as a share of the largest
      block an operator needing ``probe_multiple`` x its input fits (small: an
      operator whose memory grows faster than its size can outgrow any multiple).
    - ``probe_growth_budget``: the second probe wave grows its blocks as far as
      would keep the first wave's largest peak within this share of the budget if
      memory grew with the square of the block (the steepest form the model fits),
      up to the largest block the multiple allows; where that is not 1.5x larger,
      it probes 1.5x smaller instead (a fixed overhead and a slope need two sizes).
    - ``max_counts``: largest number of pieces per axis the planner considers.
    - ``in_flight_per_slot``: chunks submitted ahead per worker slot (at least one
      more than the slots, so a slot never waits for the flow); the rest of the
      queue stays unsubmitted and can still be re-planned.
    - ``memory_kill_fraction``: a worker that died running a chunk whose upper
      bound was *below* this fraction of the kill line is taken as lost for
      another reason (a node lost, a SIGKILL): the same chunk runs once more and
      nothing is learned. Above it, or on a second death of the same chunk, the
      death is taken as out of memory and the chunk is split.
    - ``memory_error_splits``: a chunk split this many times (1/16 of what was
      planned, at 4) that still raises ``MemoryError`` while the model puts it
      under ``memory_kill_fraction`` of the budget is not short of chunk size:
      the map stops with ``MemoryNotChunkSizeError`` instead of splitting on
      (seen on a 16-core machine under an address-space limit: BLAS thread
      pools took the allowance and chunks failed down to 3 x 3 traces).
    - ``gpu_context_restarts``: workers one map may restart after a CUDA error
      left their GPU context unusable (each such chunk runs once more on the
      restarted worker; a chunk that breaks a context twice fails the map at once):
      past it the map stops with ``GpuContextError``, never retrying without end.
    - ``many_chunks``: a plan of at least this many chunks whose estimated
      per-task bookkeeping (``per_task_overhead_seconds`` each, over the slots)
      is at least half its estimated time is logged as a warning naming the
      budget that forces it and what to change (the planner already weighs the
      overhead: this is for when the budget leaves it no better choice).
    - ``learned_policy``: choose the risk level a plan is fitted at with the
      learned bandit (``bandit.py``); False plays the fixed heuristic (the
      model's full upper bound) every time, for ablations and for users who
      want the conservative plan whatever was learned.
    - ``granularity_arms``: with ``learned_policy``, also offer the bandit the
      ``finer`` and ``coarser`` plans (a chunk count either side of the one the
      time model chose). Off by default: rewards are per map, and in
      ``python -m benchmarks.studies.nights`` a finer trace_correlation,
      as efficient in its own map, left the growth of each fresh worker's
      memory to the gst3d_dip after it (440 MiB grown per chunk instead of
      333, ~1 s more per chunk), so the flow ran 1.04-1.13x the heuristic's
      time on settled nights. On for studies of the policy.
    - ``oom_penalty``: reward taken off a plan per chunk of it that ran out of
      memory (rewards are slot efficiencies, 0..1: one event costs a whole map).
    - ``objective``: what :func:`~memchunk_prefect.core.policy.plan` minimises among the
      chunkings that fit: ``"time"`` (estimated makespan) or ``"energy"`` (estimated
      joules: busy slots at ``watts_per_core`` or the operator's learned joules per
      element, allocated idle slots at ``idle_watts_per_core``, per-task overhead;
      see :func:`memchunk_prefect.core.energy.plan_energy_joules`).
    - ``deadline_seconds``: with ``objective="energy"``, only plans whose estimated
      makespan is within this many seconds are considered (the least energy that
      meets it; the fastest plan when none does). None: no limit.
    - ``watts_per_core`` / ``idle_watts_per_core``: power of one busy / one
      allocated idle core, watts, where no counter measured it: energy estimates
      (``energy_source="estimate"``) and the energy objective use them
      (:mod:`memchunk_prefect.core.energy` states the defaults' reasoning).
    - ``slow_worker_factor`` / ``slow_worker_runs`` / ``slow_worker_seconds``: a
      worker whose median seconds per element over ``slow_worker_runs`` finished
      chunks of a map is at least ``slow_worker_factor`` x the other workers', and
      at least ``slow_worker_seconds`` a chunk slower, is named as slow rather than
      dead in the flow's log and the map's summary (:mod:`memchunk_prefect.core.stragglers`).
      4x lies above the first-touch cost a worker's first run pays (up to 4.7x on
      one run, diluted by the median of two). ``slow_worker_factor=None`` never looks.
    """

    per_task_overhead_seconds: float = 0.15
    seconds_per_element: float = 1e-7
    continue_tolerance: float = 0.15
    replan_threshold: float = 0.2
    replan_gain: float = 0.1
    alone_gain: float = 0.2
    probe_multiple: float = 100.0
    probe_first_share: float = 0.125
    probe_growth_budget: float = 0.8
    max_counts: int = 4096
    in_flight_per_slot: int = 2
    memory_kill_fraction: float = 0.5
    memory_error_splits: int = 4
    gpu_context_restarts: int = 2
    many_chunks: int = 1000
    learned_policy: bool = True
    granularity_arms: bool = False
    oom_penalty: float = 1.0
    objective: str = "time"
    deadline_seconds: float | None = None
    watts_per_core: float = DEFAULT_WATTS_PER_CORE
    idle_watts_per_core: float = DEFAULT_IDLE_WATTS_PER_CORE
    slow_worker_factor: float | None = 4.0
    slow_worker_runs: int = 2
    slow_worker_seconds: float = 1.0

    def __post_init__(self) -> None:
        check_objective(self.objective)
        if self.slow_worker_factor is not None and not float(self.slow_worker_factor) > 1:
            raise RunnerConfigError(f"`slow_worker_factor` must be above 1 (a worker's seconds per element over the "
                                    f"others') or None to never look for slow workers, got {self.slow_worker_factor!r}")
        check_watts(self.watts_per_core, "watts_per_core")
        check_watts(self.idle_watts_per_core, "idle_watts_per_core")
        if self.deadline_seconds is not None:
            try:
                ok = math.isfinite(float(self.deadline_seconds)) and float(self.deadline_seconds) > 0
            except (TypeError, ValueError):
                ok = False
            if not ok:
                raise EnergyInputError(
                    f"`deadline_seconds` must be a positive number of seconds or None, got {self.deadline_seconds!r}"
                )

    def in_flight_cap(self, slots: int) -> int:
        """Most chunks in flight at once for ``slots`` worker slots."""
        slots = max(1, int(slots))
        return max(self.in_flight_per_slot * slots, slots + 1)


DEFAULT_SETTINGS = PolicySettings()


@dataclass(frozen=True)
class RunnerSettings:
    """How patient the executor is with the cluster and the Prefect API (seconds unless named otherwise).

    - ``workers_wait_seconds`` / ``workers_poll_seconds``: how long a map waits for
      an adaptive or external cluster to get its first worker, and how often it looks.
    - ``harvest_timeout_seconds``: when a map stops early, how long to wait for the
      result of a chunk Dask already reports finished (its measurement is kept).
    - ``settle_missing_seconds`` / ``settle_poll_seconds``: when a map stops early,
      a task a worker started just before the cancellation reached it creates its
      Prefect task run a moment later; runs not found yet are looked for again for
      this long, this often, so none is left RUNNING.
    - ``task_run_page``: task runs read from the Prefect API per request when
      settling runs after a worker death.
    - ``allowed_failures``: ``distributed.scheduler.allowed-failures`` on clusters
      the runner starts. Dask's default (3) re-runs a task whose worker died on
      another worker, killing one worker per retry for a task that needs too much
      memory; 0 reports the first death, and the runner splits the chunk instead.
    - ``slots_poll_seconds``: how often, at most, a running map asks the scheduler how
      many worker threads it has (one small ``nthreads`` request, between chunk
      events): batch jobs that join from the queue mid-map, or an adaptive cluster
      scaling, raise the map's in-flight cap (``machine.SlotsChanged``).
    - ``store_keep_per_key``: observations (and policy rewards) kept per operator key;
      a map's end trims its key's older rows (``Store.compact``). A model replays its
      key's rows at a flow run's first map, about 0.5 ms a row on these machines:
      5,000 rows cost ~2.5 s, and a nightly map of thousands of chunks would
      otherwise grow that without end (``memchunk compact`` does the same by hand).
    - ``report_wait_seconds``: at the end of a flow run, how long the runner waits for
      the artifact calls its maps' reports left to their writer's thread (one round
      trip to the Prefect API each) before leaving them behind with a warning.
    - ``worker_restart_seconds``: how long a map waits for a worker it restarts (its GPU
      context broken by a CUDA error) to come back.
    - ``paused_stall_seconds`` / ``pause_poll_seconds``: a worker over Dask's pause line
      takes no new task until its memory falls; one paused this long with no task
      running is said (once per map), and when every worker is, the map stops with
      ``WorkersPausedError`` instead of waiting for ever; how often, at most, a waiting map
      asks the scheduler (one small request). What such a worker holds is kept by its
      process: on an NVIDIA H100 a GPU worker's first chunk left CUDA's host libraries
      (~280 MiB) held, over the pause line of a 1 GiB worker.
    """

    workers_wait_seconds: float = 60.0
    workers_poll_seconds: float = 0.5
    harvest_timeout_seconds: float = 5.0
    settle_missing_seconds: float = 2.0
    settle_poll_seconds: float = 0.25
    task_run_page: int = 200
    allowed_failures: int = 0
    slots_poll_seconds: float = 2.0
    store_keep_per_key: int = 5000
    report_wait_seconds: float = 30.0
    worker_restart_seconds: float = 120.0
    paused_stall_seconds: float = 30.0
    pause_poll_seconds: float = 2.0


RUNNER_SETTINGS = RunnerSettings()


def deadline_seconds(deadline: float | str) -> float:
    """A map deadline in seconds from ``90``, ``"90s"``, ``"10min"``; EnergyInputError for anything else."""
    try:
        return parse_seconds(deadline)
    except (MemchunkError, TypeError, ValueError) as exc:
        raise EnergyInputError(
            f"`deadline` must be seconds (90) or a duration ('90s', '10min', '2h'), got {deadline!r}: {exc}"
        ) from exc


def check_target_fraction(target_fraction: Any, kill: float | None) -> None:
    """``target_fraction`` must be in (0, the nanny's kill fraction] (1 where it is unknown)."""
    ceiling = kill if kill is not None else 1.0
    try:
        ok = 0 < float(target_fraction) <= ceiling
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise RunnerConfigError(
            f"`target_fraction` must be in (0, {ceiling:g}], got {target_fraction!r}"
            + (
                f" (Dask's nanny kills a worker at {kill:g} of its memory_limit: distributed.worker.memory.terminate)"
                if kill is not None
                else ""
            )
        )


def policy_settings(policy: PolicySettings | Mapping[str, Any] | None, **energy: Any) -> PolicySettings:
    """The runner's policy settings: ``policy`` (settings or a dict of their fields) with the energy arguments
    given (``objective``, ``watts_per_core``, ``idle_watts_per_core``, ``deadline``) set over it."""
    if policy is None:
        policy = PolicySettings()
    elif isinstance(policy, Mapping):
        try:
            policy = PolicySettings(**policy)
        except TypeError as exc:
            raise RunnerConfigError(f"`policy` has an unknown setting: {exc}") from exc
    elif not isinstance(policy, PolicySettings):
        raise RunnerConfigError(f"`policy` must be a PolicySettings or a dict, got {type(policy).__name__}")
    if energy.get("deadline") is not None:
        energy["deadline_seconds"] = deadline_seconds(energy["deadline"])
    given = {k: v for k, v in energy.items() if v is not None and k != "deadline"}
    return dataclasses.replace(policy, **given) if given else policy  # validated by PolicySettings
