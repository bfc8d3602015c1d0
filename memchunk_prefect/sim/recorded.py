"""A recorded flow run, or an operator key, as what a simulation takes: steps, the survey and the cluster.

The store keeps each chunked map of a flow run (:class:`~memchunk_prefect.core.records.MapRun`): its
operator and key, halo, survey shape, what it read and wrote, and, from schema v11 on, its parameters, whether
it keeps traces whole and the cluster's shape. :func:`recorded_flow` turns a flow run's maps back into
:class:`~memchunk_prefect.sim.inputs.Step` objects, in the order the maps started, a map that read another
map's output chained to it (its ``source`` is that map's ``output_path``), so the simulator plans each from
its upstream's chunking as the runner did. :func:`step_for` makes a step of any operator key the store holds,
not only of the built-in operators: its halo and whole-traces flag come from that key's latest recorded map.

Pure reading of a :class:`~memchunk_prefect.learn.store.Store`: no Prefect, no Dask. Units: bytes, seconds.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

from memchunk_prefect.core.chunks import Shape, normalize_halo
from memchunk_prefect.core.errors import FlowRunRecordError, SimulationInputError, UnknownStepError, format_bytes
from memchunk_prefect.core.records import MapRun
from memchunk_prefect.sim.inputs import ClusterShape, Step

#: Keys listed by name in an error message (the rest are counted).
LISTED_KEYS = 12


@dataclass(frozen=True)
class RecordedCluster:
    """The cluster a flow run's maps read their budget from: workers, threads, memory limit (bytes), the nanny's
    kill fraction and the workers' median resting memory (bytes; None where not read); ``threads_per_core``: the
    workers' threads per CPU core, as the map's budget counted them (``MapRun.threads_per_core``: the cores each
    worker may run on), or, for maps before store v14, over the cores of the machines they ran on where those are
    recorded (:func:`recorded_threads_per_core`); None where neither is."""

    workers: int
    threads_per_worker: int
    memory_limit_bytes: int | None
    kill_fraction: float | None
    resting_bytes: int | None
    threads_per_core: float | None = None

    def describe(self) -> str:
        return (f"{self.workers} workers x {self.threads_per_worker} thread(s), "
                f"{format_bytes(self.memory_limit_bytes)} each")


@dataclass
class RecordedFlow:
    """What the store holds of one flow run, as a simulation's input.

    ``steps``: its maps in the order they started; ``params``: each map's other arguments as recorded (a
    dict, or None before store v11); ``shape``: the survey they mapped; ``cluster``: what they ran on (None
    when no map recorded it: maps before store v11); ``makespan_seconds``: from the first map's start to the
    last one's end, as it happened; ``outcomes``: each map's ("ok", "failed", "interrupted"); ``notes``: what
    had to be assumed, in words.
    """

    flow_run_id: str
    steps: list[Step]
    params: list[dict[str, Any] | None]
    shape: Shape
    cluster: RecordedCluster | None
    makespan_seconds: float
    outcomes: list[str]
    notes: list[str] = field(default_factory=list)

    def cluster_shape(self, *, workers: int | None = None, memory_limit_bytes: int | None = None,
                      threads_per_worker: int | None = None, resting_bytes: int | None = None,
                      **kw: Any) -> ClusterShape:
        """The cluster to simulate: the recorded one with any figure given replaced (``kw``: the other
        :class:`ClusterShape` fields). A figure the store did not record and that is not given is a
        :class:`FlowRunRecordError` naming it."""
        c = self.cluster
        workers = workers if workers is not None else (c.workers if c else None)
        memory = memory_limit_bytes if memory_limit_bytes is not None else (c.memory_limit_bytes if c else None)
        missing = [flag for flag, v in (("--workers (workers=)", workers), ("--memory-limit (memory_limit=)", memory))
                   if v is None]
        if missing:
            raise FlowRunRecordError(
                f"flow run {self.flow_run_id} was recorded without the cluster it ran on (its maps were recorded "
                f"before store schema v11, or by workers without a memory limit): give {' and '.join(missing)}")
        threads = threads_per_worker if threads_per_worker is not None else (c.threads_per_worker if c else 1)
        if resting_bytes is not None:
            kw["resting_bytes"] = int(resting_bytes)
        elif c is not None and c.resting_bytes is not None:
            kw["resting_bytes"] = int(c.resting_bytes)
        if c is not None and c.kill_fraction is not None:
            kw.setdefault("kill_fraction", float(c.kill_fraction))
        if c is not None and c.threads_per_core is not None and (int(workers), int(threads)) == (  # type: ignore[arg-type]
                c.workers, c.threads_per_worker):
            kw.setdefault("threads_per_core", float(c.threads_per_core))  # the same workers on the same machines
        return ClusterShape(workers=int(workers), memory_limit_bytes=int(memory),  # type: ignore[arg-type]
                            threads_per_worker=int(threads), **kw)

    def describe_steps(self) -> str:
        """Each step with its recorded parameters, ``->`` where it reads the step before, ``;`` where not."""
        text = ""
        for i, (s, p) in enumerate(zip(self.steps, self.params)):
            j = s.upstream_index(i)
            args = ", ".join(f"{k}={v}" for k, v in (p or {}).items())
            sep = "" if i == 0 else " -> " if j == i - 1 else "; "
            reads = "" if j is None or j == i - 1 else f" (reads {self.steps[j].operator})"
            text += f"{sep}{s.operator}({args}){reads}"
        return text


def flow_run_ids(store: Any) -> list[str]:
    """The flow runs with chunked maps in ``store``, the most recently ended last."""
    last: dict[str, float] = {}
    for m in store.maps():
        if m.flow_run_id:
            last[m.flow_run_id] = max(last.get(m.flow_run_id, 0.0), m.ended_at)
    return sorted(last, key=last.__getitem__)


def resolve_flow_run(store: Any, flow_run: str) -> str:
    """The flow run id ``flow_run`` means: ``latest`` (the flow run of the most recently ended map), an id, or
    the unique start of one (as ``prefect flow-run ls`` shortens them). :class:`FlowRunRecordError` otherwise."""
    ids = flow_run_ids(store)
    if not ids:
        raise FlowRunRecordError(f"no chunked maps are recorded in the store {store.path}: run your flow with "
                                 "MemoryAwareRunner once (chunked(...) maps are recorded), or pass --store (store=)")
    wanted = str(flow_run).strip()
    if wanted == "latest":
        return ids[-1]
    if wanted in ids:
        return wanted
    starts = [i for i in ids if i.startswith(wanted)] if wanted else []
    if len(starts) == 1:
        return starts[0]
    recent = ", ".join(reversed(ids[-5:]))
    what = f"{len(starts)} flow runs start with {wanted!r}" if starts else f"no flow run {wanted!r} is recorded"
    raise FlowRunRecordError(f"{what} in the store {store.path}; the most recent: {recent}. Give one of them, "
                             "`latest`, or --store (store=) for the store the run used")


def recorded_flow(store: Any, flow_run: str = "latest") -> RecordedFlow:
    """The steps, survey and cluster of one recorded flow run (see the module docstring)."""
    run_id = resolve_flow_run(store, flow_run)
    maps = sorted(store.maps(run_id), key=lambda m: (m.started_at, m.ended_at))
    shapes = sorted({m.shape for m in maps})
    if len(shapes) > 1:
        listed = ", ".join("x".join(map(str, s)) for s in shapes)
        raise FlowRunRecordError(
            f"flow run {run_id} mapped volumes of {len(shapes)} shapes ({listed}): a simulation takes one survey; "
            "simulate its maps of one shape with --steps (steps=) instead")
    notes: list[str] = []
    steps: list[Step] = []
    for i, m in enumerate(maps):
        upstream = next((j for j in range(i - 1, -1, -1) if m.source and maps[j].output_path == m.source), None)
        whole = m.whole_traces if m.whole_traces is not None else _registered_whole_traces(m.operator)
        if whole is None:
            whole = True
            notes.append(f"{m.operator}: whether it keeps traces whole was not recorded (a map before store "
                         "v11): assumed it does (the planner never cuts its time axis)")
        steps.append(Step(m.operator, m.operator_key, tuple(m.halo), bool(whole), upstream))
    unfinished = ", ".join(f"{m.operator} {m.outcome}" for m in maps if m.outcome != "ok")
    if unfinished:
        notes.append(f"flow run {run_id} did not finish every map ({unfinished}); the maps it started are "
                     "simulated to their end")
    cluster = _cluster(maps)
    if cluster is not None and cluster.threads_per_core is None:
        cluster = dataclasses.replace(cluster, threads_per_core=recorded_threads_per_core(store, run_id, cluster))
    return RecordedFlow(run_id, steps, [_params(m) for m in maps], shapes[0], cluster,
                        max(m.ended_at for m in maps) - min(m.started_at for m in maps), [m.outcome for m in maps],
                        notes)


def recorded_threads_per_core(store: Any, run_id: str, cluster: RecordedCluster) -> float | None:
    """The flow run's worker threads over the CPU cores they shared, counted as the runner counts them
    (:func:`memchunk_prefect.core.budget.threads_per_core`): per machine its chunks ran on, the workers seen there
    (their observations' ``worker`` and ``host``; at most the run's ``workers``, so a worker the nanny restarted
    under a new address is not counted twice) times ``threads_per_worker``, against that machine's recorded cores
    (``coreCount`` of ``Store.machines``). None where a machine's cores were not recorded or no chunk names its
    machine. For maps recorded before store v14, which do not carry the count their budget made: the machine's
    cores, not the worker's CPU affinity, so workers confined to fewer cores (a batch job's cpuset) shared fewer
    than this says.

    On a 2-core machine, 2 workers of 2 threads each share the 2 cores: 2.0, and each task there runs about twice
    its learned seconds while all four run (:class:`memchunk_prefect.sim.cluster.SimulatedCluster`)."""
    from memchunk_prefect.core.budget import threads_per_core

    workers: dict[str, set[str]] = {}
    for o in store.run_observations(run_id):
        if o.host and o.worker:
            workers.setdefault(o.host, set()).add(o.worker)
    if not workers:
        return None
    machines = store.machines()
    nthreads: dict[str, int] = {}
    placement: dict[str, tuple[str, Sequence[int]]] = {}
    for host, seen in workers.items():
        cores = (machines.get(host) or {}).get("cpu", {}).get("coreCount")
        if not cores:
            return None
        for i in range(min(len(seen), cluster.workers)):
            nthreads[f"{host}/{i}"] = cluster.threads_per_worker
            placement[f"{host}/{i}"] = (host, range(int(cores)))
    return threads_per_core(nthreads, placement)


def _params(m: MapRun) -> dict[str, Any] | None:
    try:
        return json.loads(m.params) if m.params else None
    except ValueError:
        return {"recorded": m.params}


def _cluster(maps: Sequence[MapRun]) -> RecordedCluster | None:
    """The cluster of the first map that recorded one (the maps of a flow run share their cluster), with the
    threads per core its budget counted (None before store v14: :func:`recorded_threads_per_core` then)."""
    for m in maps:
        if m.workers and m.threads_per_worker:
            return RecordedCluster(int(m.workers), int(m.threads_per_worker), m.memory_limit_bytes, m.kill_fraction,
                                   m.resting_bytes, None if m.threads_per_core is None else float(m.threads_per_core))
    return None


def _registered_whole_traces(name: str) -> bool | None:
    """A built-in operator's whole-traces flag (None: not a built-in operator)."""
    from memchunk_prefect.operators.registry import OPERATORS
    from memchunk_prefect.operators.spec import spec_of

    task = OPERATORS.get(name)
    return None if task is None else bool(spec_of(task).whole_traces)


# --------------------------------------------------------------------------- steps by operator key


def operator_name_of(key: str) -> str:
    """The operator name a key begins with: ``box[r=2]|float32|cpu`` -> ``box``."""
    return re.split(r"[\[|]", key, maxsplit=1)[0]


def match_key(name: str, keys: Sequence[str]) -> str | None:
    """The one key of ``keys`` that ``name`` means: the key itself, else the only key of operator ``name``;
    None when none is; :class:`UnknownStepError` when several are (listing them)."""
    if name in keys:
        return name
    candidates = [k for k in keys if operator_name_of(k) == name]
    if len(candidates) > 1:
        raise UnknownStepError(f"{name!r} names {len(candidates)} operator keys in the store: "
                               f"{', '.join(candidates)}; give the exact key (as `memchunk models` lists it)")
    return candidates[0] if candidates else None


def step_for(spec: str | Mapping[str, Any], store: Any | None = None) -> Step:
    """A step from a built-in operator's name (``"envelope"``, ``{"name": "gaussian_smooth", "sigma": 2}``) or
    from any operator key the store holds (``"my_box[r=2]|float32|cpu"``, or the name of an operator the store
    has one key of: ``"my_box"``; ``{"key": ..., "halo": [h, h, h], "whole_traces": false}`` to give what the
    store did not record). A key's halo and whole-traces flag are its latest recorded map's."""
    d: dict[str, Any] = {"name": spec} if isinstance(spec, str) else dict(spec)
    from memchunk_prefect.operators.registry import OPERATORS

    name = str(d.get("name", "") or "")
    if "key" not in d and name in OPERATORS:
        return Step.of(d)
    keys = list(store.keys()) if store is not None else []
    wanted = str(d.get("key") or name)
    key = match_key(wanted, keys)
    if key is None:
        where = f"the store {store.path}" if store is not None else "no store"
        held = ", ".join(keys[:LISTED_KEYS]) + (f" and {len(keys) - LISTED_KEYS} more" if len(keys) > LISTED_KEYS
                                                else "")
        raise UnknownStepError(
            f"unknown operator {wanted!r}: not a built-in operator ({', '.join(sorted(OPERATORS))}) and no "
            f"operator key in {where} is it or of it (it holds: {held or 'none'}); run a flow that maps it once, "
            "or give the exact key `memchunk models` lists")
    assert store is not None  # a key was matched among the store's
    latest = next((m for m in sorted(store.maps(), key=lambda m: m.ended_at, reverse=True)
                   if m.operator_key == key), None)
    halo = d.get("halo", latest.halo if latest is not None else None)
    if halo is None:
        raise SimulationInputError(
            f"no map of {key} is recorded in the store, so its halo is unknown: give it, e.g. --steps-json "
            f"'[{{\"key\": \"{key}\", \"halo\": [0, 0, 0]}}]'")
    whole = d.get("whole_traces", latest.whole_traces if latest is not None else None)
    return Step(operator_name_of(key), key, normalize_halo(halo), True if whole is None else bool(whole))
