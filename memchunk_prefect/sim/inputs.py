"""What a simulation is given: the cluster's shape, the steps, and the knowledge each chunk is drawn from.

- :class:`ClusterShape`: workers, threads, memory limit, the nanny's kill line, per-task and per-map costs,
  and an HPC allocation's queue wait and walltime;
- :class:`Step`: one map of the pipeline (operator key, halo, whole traces);
- :class:`Draws`: each chunk's peak memory, compute seconds and energy, drawn from the learned models;
- the knowledge a simulated map plans with: the store's models (:func:`store_models`), stated priors
  (:class:`PriorKnowledge`), or a model that learns from the simulated run itself (:class:`LearningKnowledge`).

Units: bytes, seconds, elements.
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from memchunk_prefect.core.chunks import Chunk, Shape
from memchunk_prefect.core.errors import SimulationInputError, TooLittleHistoryError, format_bytes
from memchunk_prefect.core.estimates import Knowledge
from memchunk_prefect.core.records import Observation, Prediction
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE, PolicySettings
from memchunk_prefect.learn.bank import BankKnowledge, ModelBank
from memchunk_prefect.sim.allocation import QueueWait

MiB = 2**20


#: z of the 95th percentile of a standard normal: the learned margin is a 95% quantile of needed / predicted.
Z95 = 1.6448536269514722


#: The 95% quantile of needed / predicted memory where the model has not learned its own (a stated figure: the
#: largest recent error this project's models are held to).
DEFAULT_MARGIN = 1.25


#: The standard deviation of the log-normal factor a whole run's compute seconds share, where the store has too
#: few flow runs to learn its own (:meth:`memchunk_prefect.learn.bank.ModelBank.run_spread`), and the least one
#: learned: two real runs of one flow on one fresh cluster of a 2-core machine were 3-15% apart at the median, over
#: five validation runs of the workload family (``real_spread`` in ``python -m benchmarks.sim_validation``'s
#: JSON), a factor's sigma of 0.04-0.15 (the median gap of two runs is 0.95 sigma).
RUN_SPREAD = 0.1


#: Seconds a killed worker is away before its nanny's new process runs a task as before: measured by
#: ``python -m benchmarks.sim_validation`` (a worker killed for memory on a 2-core machine rejoined the scheduler
#: 0.4-0.6 s after it was seen to go, and a task importing what a Prefect task run of the runner imports ended
#: there 1.9-2.4 s after); ``ClusterShape(restart_seconds=...)`` for another machine's figure.
RESTART_SECONDS = 2.0


@dataclass(frozen=True)
class ClusterShape:
    """The cluster to simulate: ``workers`` processes of ``threads_per_worker`` threads and ``memory_limit_bytes``.

    ``resting_bytes``: a worker's memory before a task (after the runner's
    imports; ~250 MiB measured on the demo's workers); ``kill_fraction``: the
    nanny's ``distributed.worker.memory.terminate``; ``per_task_overhead_seconds``:
    slot time a task of a plain Prefect flow (the baselines) costs beyond its compute (Prefect + Dask);
    ``runner_task_seconds``: the same for the runner's chunk tasks, where a store measured it
    (:func:`measured_map_work`; None: ``per_task_overhead_seconds``); ``map_start_seconds`` /
    ``map_end_seconds``: the runner's own work in the flow before a chunked map's first task
    (reading the budget from the workers, opening the output, the decision) and after its last
    (finalizing the output, the artifacts, reading pauses), while the slots wait: measured from a
    store's runs by :func:`measured_map_work` (0 when not given; a chained map's wait for its upstream
    is not in it); ``chained_map_offset_seconds``: from one map's start to the start of the map the flow calls
    after it (the flow's body calls each ``.map`` as the one before returns; None: ``map_start_seconds``). The
    maps of a flow run side by side, as the runner's do: a map over another map's output starts no earlier than
    that map's first decision and runs each chunk once the chunk's block is written. Only the ``memchunk``
    strategy pays them: the baselines are plain flows without that work.

    An HPC allocation: ``queue_wait`` (a :class:`~memchunk_prefect.sim.allocation.QueueWait`), each
    worker a batch job joining after its own wait; ``walltime_seconds``, each job leaving that long
    after it joined (None: no limit). Makespans then count from the jobs' submission. The runner
    plans each map for the workers requested when it started the cluster itself (``cluster_class``
    with ``scale`` or ``adapt``: it reads the cluster's plan); ``external``: the workers join a
    scheduler started elsewhere, so a map plans for the workers that have joined and follows them
    as more join or leave (``machine.SlotsChanged``).

    ``threads_per_core``: worker threads per CPU core where the workers' threads outnumber their cores (4 threads
    on 2 cores: 2.0; 1.0: a core each), which the runner's plans count
    (:func:`memchunk_prefect.core.estimates.estimate_seconds`) and the simulated cluster charges: a task that
    starts while more work runs than there are cores works as much longer than the learned seconds, and its
    per-task overhead as much longer as the tasks running outnumber the cores
    (:class:`memchunk_prefect.sim.cluster.SimulatedCluster`).
    """

    workers: int
    memory_limit_bytes: int
    threads_per_worker: int = 1
    resting_bytes: int = 256 * MiB
    kill_fraction: float = 0.95
    per_task_overhead_seconds: float = DEFAULT_SETTINGS.per_task_overhead_seconds
    restart_seconds: float = RESTART_SECONDS
    map_start_seconds: float = 0.0
    map_end_seconds: float = 0.0
    runner_task_seconds: float | None = None
    chained_map_offset_seconds: float | None = None
    queue_wait: QueueWait | None = None
    walltime_seconds: float | None = None
    external: bool = False
    threads_per_core: float = 1.0

    def __post_init__(self) -> None:
        if self.walltime_seconds is not None and not (float(self.walltime_seconds) > 0
                                                      and math.isfinite(float(self.walltime_seconds))):
            raise SimulationInputError(f"a walltime is a positive, finite number of seconds, got "
                                       f"{self.walltime_seconds}")
        if int(self.workers) < 1 or int(self.threads_per_worker) < 1:
            raise SimulationInputError(f"a cluster needs at least one worker and one thread per worker, got "
                                       f"workers={self.workers}, threads_per_worker={self.threads_per_worker}")
        if min(float(self.map_start_seconds), float(self.map_end_seconds), float(self.runner_task_seconds or 0.0),
               float(self.chained_map_offset_seconds or 0.0), float(self.per_task_overhead_seconds)) < 0:
            raise SimulationInputError(
                f"a map's own work and a task's overhead take zero seconds or more, got map_start_seconds="
                f"{self.map_start_seconds}, map_end_seconds={self.map_end_seconds}, per_task_overhead_seconds="
                f"{self.per_task_overhead_seconds}, runner_task_seconds={self.runner_task_seconds}, "
                f"chained_map_offset_seconds={self.chained_map_offset_seconds}")
        if not 0 < float(self.kill_fraction) <= 1:
            raise SimulationInputError(f"kill_fraction must be in (0, 1], got {self.kill_fraction}")
        if self.headroom_bytes <= 0:
            raise SimulationInputError(
                f"a worker of {format_bytes(self.memory_limit_bytes)} killed at {self.kill_fraction:g} of it has no "
                f"room above its resting {format_bytes(self.resting_bytes)}: give workers more memory")

    @property
    def slots(self) -> int:
        return int(self.workers) * int(self.threads_per_worker)

    @property
    def runner_task_overhead_seconds(self) -> float:
        """Slot time one of the runner's chunk tasks costs beyond its block function, seconds."""
        return float(self.per_task_overhead_seconds if self.runner_task_seconds is None else self.runner_task_seconds)

    @property
    def headroom_bytes(self) -> int:
        """What a worker's tasks together may use above its resting memory before the nanny kills it."""
        return int(self.kill_fraction * self.memory_limit_bytes) - int(self.resting_bytes)

    @property
    def budget_bytes(self) -> int:
        """The runner's budget per task: the headroom split among the worker's threads."""
        return self.headroom_bytes // int(self.threads_per_worker)


@dataclass(frozen=True)
class Step:
    """One operator of the flow: its name, model key, halo and whether it keeps traces whole.

    ``upstream``: the step whose output this one reads, whose chunking the runner then plans from (its
    ``incoming``): an index into the steps, negative counting back from this one (``-1``, the default: the step
    before, a chain); None: it reads the survey itself.
    """

    operator: str
    key: str
    halo: Shape
    whole_traces: bool = True
    upstream: int | None = -1

    def upstream_index(self, position: int) -> int | None:
        """The index of the step this one (at ``position``) reads, or None (the survey)."""
        if self.upstream is None:
            return None
        i = position + int(self.upstream) if int(self.upstream) < 0 else int(self.upstream)
        return i if 0 <= i < position else None

    @classmethod
    def of(cls, step: str | dict[str, Any]) -> "Step":
        """From a built-in operator's name or ``{"name": ..., **params}`` (as ``attribute_pipeline`` takes)."""
        from memchunk_prefect.operators.registry import OPERATORS
        from memchunk_prefect.operators.spec import operator_key, spec_of

        d = {"name": step} if isinstance(step, str) else dict(step)
        name = str(d.pop("name", ""))
        if name not in OPERATORS:
            raise SimulationInputError(f"unknown operator {name!r}: choose from {', '.join(sorted(OPERATORS))}")
        task = OPERATORS[name]
        params = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items()}
        spec = spec_of(task)
        return cls(name, operator_key(task, params, dtype="float32"), spec.halo_for(params), spec.whole_traces)


class Draws:
    """Memory and seconds of one chunk, drawn from one operator's learned models (see the module docstring).

    A block's compute seconds stray from the model by a log-normal factor of the operator's learned spread
    (:meth:`memchunk_prefect.learn.time.TimeModel.time_spread`, how far its runs fell from the model on the
    machines they ran on), never less than the stated ``time_sigma``: measured in sample, a spread over few runs
    reads low. A cluster whose threads each have a core may vary less than the one the runs were learned on.
    ``run_factor`` multiplies every block's compute seconds: what the blocks of one simulated run share
    (:func:`run_factor`)."""

    def __init__(self, knowledge: Knowledge, key: str, per_task_overhead: float, time_sigma: float = 0.1,
                 watts_per_core: float = DEFAULT_SETTINGS.watts_per_core, run_factor: float = 1.0):
        if not run_factor > 0:
            raise SimulationInputError(f"a run's time factor must be above 0, got {run_factor!r}")
        self.run_factor = float(run_factor)
        self.knowledge = knowledge
        self.key = key
        self.per_task_overhead = float(per_task_overhead)
        learned = getattr(knowledge, "time_spread", None)
        spread = learned() if callable(learned) else None
        self.time_sigma = max(float(time_sigma), float(spread or 0.0))
        self.watts_per_core = float(watts_per_core)
        self._predictions: dict[Shape, Prediction] = {}
        self._first_calls: dict[int, float | None] = {}  # first_call_block_seconds by block size
        self.learned_energy = False  # whether any block's energy came from a learned figure

    def prediction(self, extents: Shape) -> Prediction:
        p = self._predictions.get(extents)
        if p is None:
            p = self._predictions[extents] = self.knowledge.predict(extents)
            if not p.ready:
                raise SimulationInputError(
                    f"{self.key} has too little history to simulate ({p.reason}); run it once on a small survey "
                    "(or `memchunk demo` for the demo's operators) so its memory and time are learned")
        return p

    def margin(self, p: Prediction) -> float:
        """The 95% quantile of needed / predicted mean: the learned margin (a property of the operator, not of the
        block's size); before it is learned, the tight bound's ratio where the block is within what was measured,
        else :data:`DEFAULT_MARGIN`. (The upper bound beyond the measured sizes widens for what the model does not
        know, not for how runs vary: drawn from, it would make every extrapolated chunk a gamble.)"""
        learned = getattr(self.knowledge, "margin", None)
        factor = learned() if callable(learned) else None
        if factor is None and p.tight_bytes is not None and p.tight_bytes < p.upper_bytes:
            factor = p.tight_bytes / max(p.mean_bytes, 1.0)
        return max(1.0, float(factor if factor is not None else DEFAULT_MARGIN))

    def memory(self, extents: Shape, rng: np.random.Generator) -> int:
        p = self.prediction(extents)
        sigma = math.log(self.margin(p)) / Z95
        return int(p.mean_bytes * math.exp(sigma * rng.standard_normal()))

    def compute_seconds(self, elements: int) -> float:
        """The learned compute seconds of a block (no spread, no overhead)."""
        compute = self.knowledge.seconds_for(elements)
        if compute is None:
            spe = self.knowledge.seconds_per_element()
            if spe is None:
                raise SimulationInputError(f"{self.key} has no measured compute time; run it once")
            compute = elements * spe
        return float(compute)

    def seconds(self, elements: int, rng: np.random.Generator) -> float:
        return self.compute_seconds(elements) * math.exp(self.time_sigma * rng.standard_normal()) * self.run_factor + \
            self.per_task_overhead

    def joules(self, elements: int, seconds: float) -> float:
        """Energy of a block that took ``seconds`` (drawn, overhead included), joules: see the module docstring."""
        compute = max(0.0, seconds - self.per_task_overhead)
        jf = self.knowledge.joules_for(elements)
        expected = self.compute_seconds(elements)
        if jf is not None and expected > 0:
            self.learned_energy = True
            busy = float(jf) * compute / expected
        else:
            busy = compute * self.watts_per_core
        return busy + self.per_task_overhead * self.watts_per_core

    def task(self, sid: int, chunk: Chunk, extents: Shape, rng: np.random.Generator) -> "_Task":
        """A simulated task of ``chunk`` reading a block of ``extents``, its memory, seconds and energy drawn.

        What it pays as its worker process's first task of the operator (``_Task.first_call_seconds``): where
        first calls of about its block's size were timed (:meth:`first_call_block_seconds`), what makes the task
        take what they took, drawn with the same factor as its compute seconds (below 0 where they ran faster than
        the model reads a later call; the task never takes less than its overhead); else the operator's learned
        first call times the run's factor (``run_factor``). On a fresh cluster per run, a warm plan of one or two
        chunks per worker and map runs nothing but first calls, which teach the rates nothing: over four validation
        runs of the workload family, 65-80% of the warm runs' chunks were first calls, and 30-53% read blocks over
        1.5x the largest the cold run timed after its first calls (the line "the warm runs' chunks" of
        ``python -m benchmarks.sim_validation``). What earlier warm runs' first calls took is then the only timing
        at the size the next one runs."""
        elements = math.prod(extents)
        memory = self.memory(extents, rng)  # drawn first, as before energy was simulated: the same seeds, the same runs
        seconds = self.seconds(elements, rng)
        first_call = self.first_call_seconds * self.run_factor
        whole = self.first_call_block_seconds(elements)
        if whole is not None:
            compute = self.compute_seconds(elements)
            factor = (seconds - self.per_task_overhead) / compute if compute > 0 else 1.0  # the drawn time factor
            first_call = (whole - compute) * factor
        return _Task(sid, chunk, extents, memory, seconds, joules=self.joules(elements, seconds), operator_key=self.key,
                     touch_seconds_per_byte=self.touch_seconds_per_byte, first_call_seconds=first_call,
                     overhead_seconds=self.per_task_overhead, rise=self.rise)

    def first_call_block_seconds(self, elements: int) -> float | None:
        """A worker process's first call of a block of ``elements``, one-off cost and compute together, as first calls
        of about that size took it (:meth:`memchunk_prefect.learn.time.TimeModel.first_call_block_seconds`; None
        where none was timed, or the knowledge keeps no such figure). Asked once per block size: the models do not
        learn during a simulation."""
        if elements not in self._first_calls:
            whole = getattr(self.knowledge, "first_call_block_seconds", None)
            self._first_calls[elements] = whole(elements) if callable(whole) else None
        return self._first_calls[elements]

    @functools.cached_property
    def touch_seconds_per_byte(self) -> float:
        """Kernel seconds per byte a task pays where it takes its worker above the most it has held (the learned
        figure, :meth:`memchunk_prefect.learn.time.TimeModel.touch_seconds_per_byte`; 0 where none is)."""
        return float(self.knowledge.touch_seconds_per_byte() or 0.0)

    @functools.cached_property
    def rise(self) -> tuple[float, float] | None:
        """When in its run a task's memory reaches half and 90% of its peak, shares of its seconds (the learned
        figure, :meth:`memchunk_prefect.learn.memory.MemoryModel.rise`; None where none is, or the knowledge keeps
        no such figure)."""
        learned = getattr(self.knowledge, "memory_rise", None)
        return learned() if callable(learned) else None

    @functools.cached_property
    def first_call_seconds(self) -> float:
        """Seconds a worker process's first task of this operator pays beyond its block's (the learned figure,
        :meth:`memchunk_prefect.learn.time.TimeModel.first_call_seconds`; 0 where none is)."""
        return float(self.knowledge.first_call_seconds() or 0.0)


def run_spread(knowledge: Sequence[Knowledge]) -> float:
    """The sigma of the log-normal factor a simulated run's blocks share: the largest learned among ``knowledge``
    (:meth:`memchunk_prefect.learn.bank.ModelBank.run_spread`), never less than the stated :data:`RUN_SPREAD`
    (measured in sample over few flow runs, a spread reads low)."""
    learned = [f() for f in (getattr(k, "run_spread", None) for k in knowledge) if callable(f)]
    return max([RUN_SPREAD] + [float(x) for x in learned if x is not None])


def run_factor(knowledge: Sequence[Knowledge], quantile: float | None) -> float:
    """What every block's compute seconds in one simulated run is multiplied by: the ``quantile`` of a log-normal
    factor of median 1 and sigma :func:`run_spread` (1 where ``quantile`` is None: the median run).

    Blocks of one run stray from the models together (:meth:`memchunk_prefect.learn.time.TimeModel.run_offsets`):
    factors drawn one block at a time average out over a map's many chunks, so they leave the runs' p90 a few
    percent above their p50, where two real runs of one flow lie 3-15% apart at the median. A quantile, not a
    draw: the runs of a simulation take evenly spread quantiles (:func:`spread_quantiles`), so their median is
    the median run's and their p90 near the factor's 90th percentile (about its 88th over 20 runs, as
    ``np.percentile`` interpolates), with none of the sampling noise of as few draws."""
    if quantile is None:
        return 1.0
    if not 0.0 < quantile < 1.0:
        raise SimulationInputError(f"a run's quantile must be in (0, 1), got {quantile!r}")
    return math.exp(run_spread(knowledge) * statistics.NormalDist().inv_cdf(quantile))


def spread_quantiles(runs: int) -> list[float]:
    """The quantiles ``runs`` simulated runs take of the run factor (:func:`run_factor`), run ``i`` the
    ``(i + 1/2) / runs``-th: evenly over (0, 1), so the runs' median is the median run's and their p90 near the
    factor's 90th percentile, without the sampling noise of as many draws (:func:`run_factor`)."""
    return [(i + 0.5) / int(runs) for i in range(int(runs))]


class PriorKnowledge:
    """A stated prior for an operator with no history: peak = ``multiple`` x its input bytes, ``seconds_per_element``
    compute; a margin of :data:`DEFAULT_MARGIN`. What chunks are drawn from when nothing was learned (flagged)."""

    def __init__(self, multiple: float, seconds_per_element: float, itemsize: int = ITEMSIZE):
        if not multiple > 0 or not seconds_per_element > 0:
            raise SimulationInputError(f"a prior needs a positive memory multiple and seconds per element, got "
                                       f"{multiple} and {seconds_per_element}")
        self.multiple, self.spe, self.itemsize = float(multiple), float(seconds_per_element), int(itemsize)

    def predict(self, extents: Shape) -> Prediction:
        mean = self.multiple * math.prod(extents) * self.itemsize
        return Prediction(mean, mean * DEFAULT_MARGIN, 0, True, f"prior: {self.multiple:g}x the input",
                          tight_bytes=mean * DEFAULT_MARGIN)

    def predict_gpu(self, extents: Shape) -> Prediction:
        raise SimulationInputError("a prior multiple is of host memory; the simulator plans host memory only "
                                   "(a map on the GPU is simulated without its GPU budget)")

    def seconds_per_element(self) -> float | None:
        return self.spe

    def seconds_for(self, elements: int) -> float | None:
        return None

    def joules_for(self, elements: int) -> float | None:
        return None  # no energy is learned for a prior: the planner counts its seconds at watts_per_core

    def touch_seconds_per_byte(self) -> float | None:
        return None  # the simulated workers pay nothing for memory they never held: a plan counts none

    def first_call_seconds(self) -> float | None:
        return None  # nor anything for a first call

    def margin(self) -> float:
        return DEFAULT_MARGIN

    def choose_arm(self, groups: list[tuple[str, ...]]) -> Any:
        raise SimulationInputError("internal: a prior is what chunks are drawn from, not what the runner plans with")


KnowledgeFor = Callable[[str], Knowledge]


class LearningKnowledge(BankKnowledge):
    """The knowledge of an operator with no history in a simulation: an in-memory bank taught by the simulated
    run's own chunks (the store is never written)."""

    def learn(self, obs: Observation) -> None:
        self.bank.learn(obs)


@dataclass
class StoreModels:
    """What a simulation reads from a store: each key's knowledge (what the runner plans with) and truth (what
    chunks are drawn from). A key with no usable history is simulated from a stated prior
    (:class:`PriorKnowledge`) when ``prior`` is given: the runner then starts cold (probes) and learns from the
    run's own chunks, as it would; such keys are listed in ``from_prior``. Without a prior it is an error."""

    bank: Any
    settings: PolicySettings = DEFAULT_SETTINGS
    prior: PriorKnowledge | None = None
    from_prior: set[str] = field(default_factory=set)
    #: Plan as a first run would (an empty store: the runner probes and learns from the simulated run's own
    #: chunks) while chunks are still drawn from the store's models: what a run on a fresh store costs.
    cold: bool = False

    def _has_history(self, key: str) -> bool:
        return bool(self.bank.predict(key, (1, 1, 1)).ready)

    def history(self, key: str) -> tuple[int, int]:
        """``(flow runs, finished observations)`` of ``key`` in the store: what a model is learned from."""
        store = self.bank.store
        if store is None:
            return 0, 0
        obs = [o for o in store.observations(key) if o.outcome == "ok"]
        return len({o.flow_run_id for o in obs if o.flow_run_id}), len(obs)

    def check_history(self, keys: Sequence[str]) -> None:
        """Raise :class:`TooLittleHistoryError` for the first of ``keys`` whose model is not ready to plan with
        (and no prior stands in for it), saying how many runs it has and what to do."""
        for key in keys:
            if self.prior is not None or self._has_history(key):
                continue
            runs, n = self.history(key)
            reason = self.bank.predict(key, (1, 1, 1)).reason
            where = f" in {self.bank.store.path}" if self.bank.store is not None else ""
            raise TooLittleHistoryError(
                f"{key} has too little history to simulate: {runs} flow run(s) and {n} finished chunk(s) of it"
                f"{where} ({reason}); run a flow that maps it once more, on a small survey if you like (a cold "
                "run probes two chunk sizes, which is what its memory and time are learned from), or simulate it "
                "cold from a stated prior (--prior-multiple, prior= in Python)",
                key=key, runs=runs, observations=n, reason=reason)

    def map_work(self) -> MapWork | None:
        """The runner's per-map work as this store's runs measured it (:func:`measured_map_work`)."""
        return measured_map_work(self.bank.store) if self.bank.store is not None else None

    def knowledge(self, key: str) -> Knowledge:
        if not self.cold and (self.prior is None or self._has_history(key)):
            return BankKnowledge(self.bank, key, self.settings)
        if not self.cold:
            self.from_prior.add(key)
        return LearningKnowledge(ModelBank(None), key, self.settings)  # learns from this run's chunks only

    def truth(self, key: str) -> Knowledge:
        if self.prior is not None and not self._has_history(key):
            self.from_prior.add(key)
            return self.prior
        return BankKnowledge(self.bank, key, self.settings)


def store_models(store_path: str | Path | None = None, settings: PolicySettings = DEFAULT_SETTINGS,
                 prior: PriorKnowledge | None = None, *, cold: bool = False) -> StoreModels:
    """The models of the store at ``store_path`` (default: the runner's default store), read as the runner reads
    them. No observation or reward is written; opening the store is what a run does (an older schema is migrated,
    a foreign file moved aside). A store that does not exist is an error, not a new empty store."""
    from memchunk_prefect.learn.store import Store, default_store_path

    path = default_store_path() if store_path is None else Path(store_path).expanduser()
    if not path.is_file():
        raise SimulationInputError(f"no observation store at {path}: run your flow (or `memchunk demo`) once so "
                                   "there is something learned to simulate from, or pass --store")
    return StoreModels(ModelBank(Store(path)), settings, prior, cold=cold)


def store_knowledge(store_path: str | None = None, settings: PolicySettings = DEFAULT_SETTINGS) -> KnowledgeFor:
    """Each key's knowledge as the runner would read it from the store (see :func:`store_models`)."""
    return store_models(store_path, settings).knowledge


@dataclass
class _Task:
    sid: int  # the submitter's id (a map's submission id)
    chunk: Chunk
    extents: Shape
    memory: int
    seconds: float
    joules: float = 0.0  # energy of the whole run, joules (a killed task is charged for the share it ran)
    started: float = 0.0
    worker: int = -1
    key: int = 0  # the simulated cluster's own, unique over the whole run
    operator_key: str = ""  # whose task it is (for traces of a simulated run)
    touch_seconds_per_byte: float = 0.0  # what taking its worker above the most it has held costs it, s per byte
    #: What it pays beyond its seconds as its worker process's first task of its operator, seconds (below 0 where
    #: first calls of its size ran faster than the model reads a later call: :meth:`Draws.task`).
    first_call_seconds: float = 0.0
    per_worker: int = 0  # placed only on a worker running fewer tasks than this (0: any free thread)
    #: When in its run its memory reaches half and 90% of its peak, shares of its seconds (None: unknown, taken to
    #: rise evenly to its peak half way: :func:`memchunk_prefect.sim.cluster.kill_share`).
    rise: tuple[float, float] | None = None
    owner: int = -1  # the position of the step whose map submitted it (-1: a baseline's, or none)
    #: Of its seconds, what the task costs beyond its block function (the cluster's per-task overhead), seconds
    #: before the core share: a real run's observation times the block function alone.
    overhead_seconds: float = 0.0
    #: Set as it starts on a worker: whether it is its worker process's first task of its operator; how far it took
    #: its worker above the most it had held, bytes, and the kernel seconds that cost; the core share its work ran
    #: at, and the one its overhead ran at (:class:`memchunk_prefect.sim.cluster.SimulatedCluster`).
    first_call: bool = False
    grew_bytes: int = 0
    touch_seconds: float = 0.0
    share: float = 1.0
    overhead_share: float = 1.0


@dataclass(frozen=True)
class MapWork:
    """The runner's own work per chunked map, seconds (medians over ``maps`` maps of a store): before its
    first task starts and after its last ends; and per chunk task, beyond its block function (``task_seconds``,
    the median of ``gaps`` hand-overs; None with fewer than :data:`MIN_TASK_GAPS`). See :class:`ClusterShape`."""

    start_seconds: float
    end_seconds: float
    maps: int
    task_seconds: float | None = None
    gaps: int = 0
    #: From the start of a map's upstream (a map of the same flow run whose output it reads) to its own start:
    #: what the flow's body takes from one ``.map`` call to the next (None: no such map recorded).
    chained_offset_seconds: float | None = None

    def cluster_kwargs(self) -> dict[str, Any]:
        """What a :class:`ClusterShape` takes of it."""
        return {"map_start_seconds": self.start_seconds, "map_end_seconds": self.end_seconds,
                "runner_task_seconds": self.task_seconds, "chained_map_offset_seconds": self.chained_offset_seconds}


#: Hand-overs between a map's tasks on one worker a store needs before its median counts as the runner's
#: per-task cost (fewer: the stated ``per_task_overhead_seconds`` stands).
MIN_TASK_GAPS = 5


def measured_map_work(store: Any) -> MapWork | None:
    """The runner's per-map work as a store's runs measured it: for every finished map whose observations
    name it (``map_id``), its first task's start less the time it could start, and the map's end less its last
    task's end; the medians. None when the store has no such map (runs before store v5).

    A map over another map's result in the same flow run (its ``source`` is that map's ``output_path``) is
    called while the upstream map still runs and waits for its writes: the simulator runs it beside its
    upstream, gated on the upstream's writes as the runner's chained maps are, so what it takes of such a map is
    the time from its upstream's start to its own (``chained_offset_seconds``: the flow body's next ``.map``
    call), not its wait. ``start_seconds`` is the first maps' wait for their first task: the cluster's budget
    read, the output opened, the first decision (on the workload family's four-map flows 0.4-0.6 s, and 0.2 s
    from one map's call to the next; ``memchunk simulate --store DIR/<workload>.sqlite --flow-run latest``
    prints both for the stores ``python -m benchmarks.sim_validation --work DIR`` leaves). Where only chained
    maps were recorded, their own wait counted from their upstream's end stands for it.

    Per task: on each worker, the seconds from one of a flow run's chunk tasks ending (its observation written)
    to the next of them, of any of its maps, starting its block function on the thread it freed (a worker of
    several threads runs some side by side: those are not hand-overs; the maps of a flow run share the
    workers, so one map's next task there may come after another map's): Prefect's task-run work after one block
    and before the next, and Dask's hand-over. A gap also holds any wait for the runner's next decision (a cold
    map's probes), so the median, not the mean."""
    maps = [m for m in store.maps() if m.map_id]
    writers: dict[tuple[str, str], list[Any]] = {}  # (flow run, output path): the maps that wrote it
    for m in maps:
        writers.setdefault((m.flow_run_id, m.output_path), []).append(m)
    before: list[float] = []  # first maps' wait for their first task, s
    chained: list[float] = []  # chained maps', from their upstream's end, s
    offsets: list[float] = []  # chained maps' start less their upstream's start, s
    after: list[float] = []
    runs: dict[str, list[Any]] = {}  # flow run -> the chunk tasks of its finished maps
    for m in maps:
        if m.outcome != "ok":
            continue
        obs = [o for o in store.run_observations(m.flow_run_id) if o.map_id == m.map_id and o.started_at]
        if not obs:
            continue
        runs.setdefault(m.flow_run_id, []).extend(obs)
        ups = [u for u in writers.get((m.flow_run_id, m.source), ())
               if u.map_id != m.map_id and u.started_at <= m.started_at] if m.source else []
        could_start = max([m.started_at, *(u.ended_at for u in ups)])
        (chained if ups else before).append(max(0.0, min(float(o.started_at) for o in obs) - could_start))
        offsets += [float(m.started_at - max(u.started_at for u in ups))] if ups else []
        after.append(max(0.0, m.ended_at - max(o.created_at for o in obs)))
    if not after:
        return None
    gaps = [g for obs in runs.values() for g in _hand_overs(obs)]
    task = float(np.median(gaps)) if len(gaps) >= MIN_TASK_GAPS else None
    first = float(np.median(before)) if before else float(np.median(chained))
    return MapWork(first, float(np.median(after)), len(after), task, len(gaps),
                   float(np.median(offsets)) if offsets else None)


def _hand_overs(obs: Sequence[Any]) -> list[float]:
    """One map's observations: per worker, each task's start less the latest end before it not yet handed over
    (the thread that took it; a task with no such end started on a thread that was free)."""
    by_worker: dict[str, list[Any]] = {}
    for o in obs:
        if o.worker and o.created_at:
            by_worker.setdefault(o.worker, []).append(o)
    out = []
    for mine in by_worker.values():
        free: list[float] = []  # ends not yet followed by a start on their thread
        for o in sorted(mine, key=lambda o: o.started_at):
            before = [e for e in free if e <= o.started_at]
            if before:
                free.remove(max(before))
                out.append(float(o.started_at - max(before)))
            free.append(float(o.created_at))
    return out
