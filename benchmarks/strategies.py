"""The strategies of the side-by-side benchmark (``python -m benchmarks``), importable by Dask workers.

Every strategy runs the same work — :data:`flows.pipeline.DEFAULT_STEPS`
(envelope -> gaussian_smooth -> gst3d_dip) over one synthetic SEG-Y survey — on
the *same* local Dask cluster (single-thread worker processes, nanny-enforced
``memory_limit``, ``allowed-failures`` 0), against the same Prefect server:

- ``dask-auto``: ``open_segy(path).chunk(auto, auto, whole traces)`` -> ``map_overlap``
  with each operator's declared halo (``boundary="none"``: the halo is clipped at
  the volume's edge, as the operators expect) -> ``to_zarr``; the graph is
  computed *directly on the cluster's client* from the body of a Prefect flow
  whose task runner is a plain ``DaskTaskRunner`` on the same cluster (no
  Prefect tasks: the graph is Dask's own);
- ``static-N``: N iline slabs per operator, each slab one plain Prefect task
  (:func:`slab_task`) in a plain ``DaskTaskRunner`` flow: read the block with its
  halo from the previous step's output, apply the operator's ``.fn``, trim,
  write its region of a zarr store (``memchunk_prefect.io.volume`` APIs);
- ``split-on-failure``: the same plain tasks, starting from the whole volume per
  operator; an attempt that runs out of memory (worker killed -> KilledWorker,
  or MemoryError) is halved (iline, then xline) and both halves are resubmitted;
  once a size has failed, queued pieces larger than half of it are split before
  they are submitted (Coffea / Work Queue's dynamic task shaping, without the
  regression: it does not carry sizes across operators or runs);
- ``memchunk-cold`` / ``memchunk-warm``: ``flows.pipeline.attribute_pipeline``
  with ``MemoryAwareRunner(address=<the cluster>)`` on an empty store, then again
  on the same store;
- ``heuristic-cold`` / ``heuristic-warm``: the same with the learned policy off
  (``policy={"learned_policy": False}``: every plan fitted at the model's full
  upper bound), on a store of its own: the ablation.

Measurements (see :mod:`benchmarks.bench`: :class:`~benchmarks.bench.Sampler` and
:class:`~benchmarks.bench.AttemptLog`):

- ``wall_seconds``: measured inside each strategy's flow, from its first line to
  its last (every strategy is one Prefect flow); a strategy that failed keeps the
  time around the flow call. Around the call the wall also holds the flow run's
  creation and the heartbeat thread Prefect joins at flow exit (it sleeps in 1 s
  steps), which quantized every wall to whole seconds; that time is kept in
  ``extra["outer_seconds"]``.

- ``peak_memory_fraction``: the largest RSS of any worker process, sampled every
  20 ms by psutil from this process (workers are its children), divided by the
  worker ``memory_limit``. A killed worker reads about 0.95 or a little more (the
  nanny checks every 100 ms).
- ``oom_events``: worker processes that died during the strategy (their pid
  vanished; the nanny only kills for memory here) plus ``MemoryError`` raised in
  tasks.
- ``lost_worker_seconds``: slot-seconds of attempts whose work was thrown away:
  for each task that started executing on a worker that then died, from its start
  (recorded on the worker by :class:`~benchmarks.bench.AttemptLog`) to the death; for a strategy
  that did not complete, the whole run (wall x slots), since it produced nothing.
- ``tasks``: task attempts submitted (Prefect task runs), failed ones included;
  for ``dask-auto`` the Dask graph's tasks.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from prefect import flow, task, unmapped
from prefect.cache_policies import NO_CACHE

from benchmarks.bench import Bench, StrategyResult

STEPS_NOTE = "envelope -> gaussian_smooth(sigma 2,2,2) -> gst3d_dip (defaults)"


# =========================================================================== plain Prefect tasks and flows


def resolve_steps(steps: Sequence[dict]) -> list[tuple[str, Any, dict]]:
    from memchunk_prefect.operators.registry import resolve_step

    out = []
    for s in steps:
        op, params = resolve_step(dict(s))
        out.append((op.name, op, params))
    return out


def _slab_name(parameters: dict) -> str:
    c = parameters["chunk"]
    return f"{parameters['op_name']}[{c.key()}]"


@task(cache_policy=NO_CACHE, task_run_name=_slab_name)
def slab_task(source: Any, out_path: str, chunk: Any, halo: tuple, op_name: str, params: dict) -> int:
    """Read ``chunk`` with its halo from ``source``, apply the operator's ``.fn``, trim, write its region."""
    from memchunk_prefect import operators
    from memchunk_prefect.io.volume import read_block
    from memchunk_prefect.io.zarr_store import ZarrOutput

    block, trim = read_block(source, chunk, halo)
    out = operators.OPERATORS[op_name].fn(block, **params)
    del block
    ZarrOutput.open(out_path).write(chunk, np.ascontiguousarray(np.asarray(out)[trim], dtype=np.float32))
    return chunk.elements


def _create_output(source: Any, path: str, op_name: str):
    from memchunk_prefect.io.zarr_store import ZarrOutput

    return ZarrOutput.create(path, source.shape, source.coords(), attrs={"operator": op_name}, overwrite=True)


def _is_oom(exc: BaseException) -> tuple[bool, bool]:
    """(out of memory?, was it a MemoryError rather than a killed worker?)"""
    name = type(exc).__name__
    if isinstance(exc, MemoryError) or name in ("MemoryError", "_ArrayMemoryError"):
        return True, True
    if name == "KilledWorker":
        return True, False
    return False, False


def _mark_crashed(fut: Any, message: str) -> None:
    """A killed worker leaves its Prefect task run RUNNING forever (prefect #12968, #21638); say it crashed."""
    try:
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        with get_client(sync_client=True) as c:
            c.set_task_run_state(fut.task_run_id, Crashed(message=message), force=True)
    except Exception:
        pass


def _cancel(futures: Sequence[Any]) -> None:
    for f in futures:
        with contextlib.suppress(Exception):
            f.wrapped_future.cancel()


def _state_error(fut: Any) -> BaseException | None:
    """The exception a finished PrefectDaskFuture ended with, or None when it completed."""
    try:
        state = fut.wrapped_future.result()
    except BaseException as exc:  # noqa: BLE001 - KilledWorker and friends
        return exc
    finally:
        with contextlib.suppress(Exception):
            fut.wrapped_future.release()
    if getattr(state, "is_completed", lambda: True)():
        return None
    try:
        out = state.result(raise_on_failure=False)
    except BaseException as exc:  # noqa: BLE001
        return exc
    return out if isinstance(out, BaseException) else RuntimeError(f"task ended in state {state!r}")


@flow(name="benchmark-static")
def static_flow(source_path: str, steps: list[dict], out_dir: str, chunkings: list[list[Any]]) -> dict:
    """Each step over a fixed chunking (one plain task per chunk); stops at the first failure."""
    from distributed import as_completed

    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.operators import spec_of

    t0 = time.perf_counter()
    current: Any = as_source(source_path)
    n_tasks = 0
    step_seconds: list[float] = []  # each step that completed: from its output's creation to its finalize
    for n, ((op_name, op, params), chunks) in enumerate(zip(resolve_steps(steps), chunkings), start=1):
        t_step = time.perf_counter()
        halo = spec_of(op).halo_for(params)
        out = _create_output(current, os.path.join(out_dir, f"{n:02d}-{op_name}.zarr"), op_name)
        futures = slab_task.map(unmapped(current), unmapped(out.path), chunks, unmapped(halo),
                                unmapped(op_name), unmapped(params))
        n_tasks += len(futures)
        by_key = {f.wrapped_future.key: f for f in futures}
        for df in as_completed([f.wrapped_future for f in futures], loop=_flow_client().loop):
            fut = by_key[df.key]
            exc = _state_error(fut)
            if exc is not None:
                oom, merr = _is_oom(exc)
                if oom and not merr:
                    _mark_crashed(fut, f"worker died running {op_name}: {type(exc).__name__}")
                _cancel(futures)
                return {"completed": False, "tasks": n_tasks, "memory_errors": int(merr),
                        "notes": f"{op_name} failed: {type(exc).__name__}",
                        "extra": {"step_seconds": _rounded(step_seconds)}}
        out.finalize()
        current = out.to_source()
        step_seconds.append(time.perf_counter() - t_step)
    return {"completed": True, "tasks": n_tasks, "memory_errors": 0, "notes": "",
            "seconds": time.perf_counter() - t0, "extra": {"step_seconds": _rounded(step_seconds)}}


def _rounded(seconds: Sequence[float]) -> list[float]:
    return [round(x, 3) for x in seconds]


def _flow_client():
    from prefect.context import FlowRunContext

    return FlowRunContext.get().task_runner.client


def _halve(chunk: Any, whole_traces: bool) -> list[Any]:
    from memchunk_prefect.core.chunks import split

    return split(chunk, axes=(0, 1) if whole_traces else (0, 1, 2))


@flow(name="benchmark-split-on-failure")
def split_flow(source_path: str, steps: list[dict], out_dir: str, max_in_flight: int = 4) -> dict:
    """Per step: start with the whole volume; halve an attempt that ran out of memory and resubmit the halves."""
    from distributed import as_completed

    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.operators import spec_of

    t0 = time.perf_counter()
    current: Any = as_source(source_path)
    n_tasks = memory_errors = 0
    sizes: dict[str, int] = {}
    for n, (op_name, op, params) in enumerate(resolve_steps(steps), start=1):
        spec = spec_of(op)
        halo = spec.halo_for(params)
        out = _create_output(current, os.path.join(out_dir, f"{n:02d}-{op_name}.zarr"), op_name)
        queue = [Chunk.whole(current.shape)]
        limit = None  # elements of the smallest chunk that failed, halved
        in_flight: dict[Any, tuple[Any, Any]] = {}
        ac = as_completed(loop=_flow_client().loop)
        while queue or in_flight:
            while queue and len(in_flight) < max_in_flight:
                c = queue.pop(0)
                if limit is not None and c.elements > limit:
                    pieces = _halve(c, spec.whole_traces)
                    if pieces:
                        queue[:0] = pieces
                        continue
                fut = slab_task.submit(current, out.path, c, halo, op_name, params)
                n_tasks += 1
                in_flight[fut.wrapped_future.key] = (c, fut)
                ac.add(fut.wrapped_future)
            df = next(ac)
            c, fut = in_flight.pop(df.key)
            exc = _state_error(fut)
            if exc is None:
                continue
            oom, merr = _is_oom(exc)
            if not oom:
                _cancel([f for _, f in in_flight.values()])
                raise exc
            memory_errors += int(merr)
            if not merr:
                _mark_crashed(fut, f"worker died running {op_name}[{c.key()}]: split in two and retried")
            pieces = _halve(c, spec.whole_traces)
            if not pieces:
                _cancel([f for _, f in in_flight.values()])
                raise MemoryError(f"{op_name}: chunk {c} ran out of memory and cannot be split")
            limit = min(limit or c.elements, max(p.elements for p in pieces))
            queue[:0] = pieces
        out.finalize()
        sizes[op_name] = n_tasks
        current = out.to_source()
    return {"completed": True, "tasks": n_tasks, "memory_errors": memory_errors, "notes": "",
            "extra": {"tasks_after_step": sizes}, "seconds": time.perf_counter() - t0}


def dask_auto_graph(source_path: str, steps: list[dict], out_path: str):
    """(the delayed to_zarr, the input's chunks): chunks="auto" with whole traces, map_overlap per step."""
    import dask.array as da

    from memchunk_prefect import open_segy
    from memchunk_prefect.operators import spec_of

    x = open_segy(source_path).chunk({"iline": "auto", "xline": "auto", "twt": -1}).data
    chunks = x.chunks
    for _name, op, params in resolve_steps(steps):
        halo = spec_of(op).halo_for(params)
        x = da.map_overlap(op.fn, x, depth=dict(enumerate(halo)), boundary="none", dtype=np.float32,
                           meta=np.empty((0, 0, 0), np.float32), **params)
    return da.to_zarr(x, out_path, overwrite=True, compute=False), chunks


@flow(name="benchmark-dask-auto")
def dask_auto_flow(source_path: str, steps: list[dict], out_path: str, address: str) -> dict:
    """What a Dask user writes: chunks="auto" (whole traces), map_overlap with the declared halos, to_zarr."""
    t0 = time.perf_counter()
    return compute_on(address, *dask_auto_graph(source_path, steps, out_path), t0)


def compute_on(address: str, store: Any, chunks: tuple, t0: float) -> dict:
    """Compute ``store`` (a delayed ``to_zarr``) on the cluster at ``address``, directly on a client of its own;
    a completed strategy's result, its seconds counted from ``t0`` (``time.perf_counter``)."""
    import dask
    from distributed import Client

    n_tasks = len(store.__dask_graph__())
    client = Client(address, set_as_default=False)
    try:
        with dask.config.set(scheduler=client):
            client.compute(store).result()
    finally:
        client.close()
    return {"completed": True, "tasks": n_tasks, "memory_errors": 0, "seconds": time.perf_counter() - t0,
            "notes": f"chunks {tuple(len(c) for c in chunks)} of up to {tuple(max(c) for c in chunks)}"}


def run_dask_auto(bench: Bench, survey: str, steps: list[dict]) -> dict:
    from prefect_dask import DaskTaskRunner

    out = str(bench.workdir / "out-dask-auto.zarr")
    graph, ch = dask_auto_graph(survey, steps, out + ".count")  # the same graph, to count its tasks
    n_tasks = len(graph.__dask_graph__())
    shutil.rmtree(out + ".count", ignore_errors=True)
    where = f"chunks {tuple(len(c) for c in ch)} of up to {tuple(max(c) for c in ch)}"
    f = dask_auto_flow.with_options(task_runner=DaskTaskRunner(address=bench.address))
    try:
        return f(survey, steps, out, bench.address)
    except BaseException as exc:  # noqa: BLE001
        oom, merr = _is_oom(exc)
        return {"completed": False, "tasks": n_tasks, "memory_errors": int(merr),
                "notes": f"{where}; failed: {type(exc).__name__}" + (" (out of memory)" if oom else f": {exc}"[:160])}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def static_best(statics: Sequence[StrategyResult]) -> StrategyResult:
    """The ``static-best`` row: the fastest ``static-N`` that completed (the hand tuner's oracle), or a failed row."""
    done = [r for r in statics if r.completed]
    if not done:
        return StrategyResult(name="static-best", wall_seconds=float("nan"), completed=False, oom_events=0, tasks=0,
                              lost_worker_seconds=0.0, peak_memory_fraction=None,
                              notes="no static chunking completed")
    b = min(done, key=lambda r: r.wall_seconds)
    return StrategyResult(name="static-best", wall_seconds=b.wall_seconds, completed=True, oom_events=b.oom_events,
                          tasks=b.tasks, lost_worker_seconds=b.lost_worker_seconds,
                          peak_memory_fraction=b.peak_memory_fraction, notes=f"= {b.name}", extra={"of": b.name})


def per_operator_best(statics: Sequence[StrategyResult], step_names: Sequence[str]) -> dict | None:
    """What a hand tuner who chose each operator's N apart would take: per step, the least of the sweep's
    step walls (each static's per-step median over its rounds, steps a failed static completed before its
    failure included), summed over the steps. Derived from the sweep's runs, not run as one flow; step walls
    include reading the previous step's output, written in that run's own slabs.

    Where every static N reached every step, it reads what choosing chunk counts among the sweep's N could gain
    over ``static-best``, in hindsight and with the sweep's noise in its favour (a least of several noisy walls
    reads low); with several rounds, a sum of per-step medians is not the median run's total, and can read
    above ``static-best``'s. Where a coarse N failed before a step (trace_correlation kills the workers at
    N = 1 and 2 in the heterogeneous benchmark), that step's best is over the N that completed it only, and a
    runner that cuts that step coarser can beat it: each step lists those N in ``not_reached``. None when a step
    has no wall in any static run (older runs did not record them).
    """
    steps = []
    for i, name in enumerate(step_names):
        walls = [(r.extra["step_seconds"][i], r.name) for r in statics
                 if len(r.extra.get("step_seconds") or []) > i]
        if not walls:
            return None
        seconds, of = min(walls)
        steps.append({"step": name, "of": of, "seconds": seconds,
                      "not_reached": [r.name for r in statics if len(r.extra.get("step_seconds") or []) <= i]})
    return {"seconds": round(sum(s["seconds"] for s in steps), 3), "steps": steps}


#: A static N whose first wall is over this many times the fastest first wall is not run again: it cannot be
#: the best (run-to-run spread on the 2-core machine was at most ~25%), and the sweep's slow end is most of
#: its time.
REPEAT_WITHIN = 1.5


def in_rounds(bench: Bench, statics: Sequence[tuple[str, Callable[[], dict]]],
              others: Sequence[tuple[str, Callable[[int], dict]]], repeats: int) -> list[StrategyResult]:
    """Each strategy ``repeats`` times, round by round (every strategy once per round, in order), each row the
    median of its runs (:func:`median_of`).

    One run of each on a 2-core machine that also hosts the Prefect server moved by 10-20% from run to run
    with identical plans (memchunk-warm 8.3-10.9 s, static-2 8.3-10.1 s on the same survey), as much as the
    targets' margins; rounds spread slow spells over every strategy instead of one. ``others`` get the round's
    index (a cold run needs a store of its own each round). Statics that did not complete, or whose first wall
    is over ``REPEAT_WITHIN`` x the fastest static's, run once.
    """
    repeats = max(1, int(repeats))
    runs: dict[str, list[StrategyResult]] = {}

    def label(name: str, r: int) -> str:
        return name if repeats == 1 else f"{name} #{r + 1}"

    for r in range(repeats):
        fastest = min((runs[name][0].wall_seconds for name, _ in statics
                       if name in runs and runs[name][0].completed), default=math.inf)
        for name, fn in statics:
            first = runs.get(name)
            if first and (not first[0].completed or first[0].wall_seconds > REPEAT_WITHIN * fastest):
                continue
            runs.setdefault(name, []).append(bench.measure(label(name, r), fn))
        for name, fn_r in others:
            runs.setdefault(name, []).append(bench.measure(label(name, r), lambda fn_r=fn_r, r=r: fn_r(r)))
    return [median_of(name, runs[name]) for name, _ in [*statics, *others]]


def median_of(name: str, runs: Sequence[StrategyResult]) -> StrategyResult:
    """One row for repeated runs of a strategy: the run with the median wall (the lower middle of an even
    count), with every run's wall in ``extra["walls"]`` and out-of-memory events summed over the runs (a
    target of none holds only if no run had one). A strategy that failed in any run is the first failed run."""
    walls = [round(r.wall_seconds, 3) for r in runs]
    failed = [r for r in runs if not r.completed]
    if failed:
        row = failed[0]
    else:
        ordered = sorted(runs, key=lambda r: r.wall_seconds)
        row = ordered[(len(ordered) - 1) // 2]
    extra = dict(row.extra, walls=walls) if len(runs) > 1 else dict(row.extra)
    steps_of_runs = [r.extra["step_seconds"] for r in runs if r.extra.get("step_seconds") is not None]
    if len(steps_of_runs) > 1:
        # Per step, the median over the runs that reached it (a failed run stops early; they run once anyway).
        extra["step_seconds_runs"] = steps_of_runs
        extra["step_seconds"] = [round(float(np.median([r[i] for r in steps_of_runs if len(r) > i])), 3)
                                 for i in range(max(len(r) for r in steps_of_runs))]
    plans = [plan_of(r.extra) for r in runs]
    if len(runs) > 1 and all(plans):
        extra["plans_runs"] = plans
    return StrategyResult(name=name, wall_seconds=row.wall_seconds, completed=row.completed,
                          oom_events=sum(r.oom_events for r in runs), tasks=row.tasks,
                          lost_worker_seconds=row.lost_worker_seconds, peak_memory_fraction=max(
                              (r.peak_memory_fraction for r in runs if r.peak_memory_fraction is not None),
                              default=None),
                          notes=row.notes + (f" (median of {len(runs)}: {', '.join(f'{w:.1f}' for w in walls)} s)"
                                             if len(runs) > 1 else ""), extra=extra)


def plan_of(extra: dict) -> dict[str, int]:
    """The chunks each operator ran in, from a memchunk run's ``extra["operators"]`` (empty for other rows)."""
    return {op: int(v["chunks"]) for op, v in (extra.get("operators") or {}).items() if "chunks" in v}


def same_plans(a: dict, b: dict) -> bool:
    """Whether two rows (JSON form: ``extra`` with ``plans_runs`` over their rounds, else the one run's
    ``operators``) ran one and the same plan, chunks per operator, in every run of both: their walls then
    differ by the host, not by the policy that chose the plans."""
    def runs(row: dict) -> list[dict[str, int]] | None:
        extra = row.get("extra") or {}
        if extra.get("plans_runs"):
            return extra["plans_runs"]
        # Several rounds whose plans were not kept (JSON before plans_runs): unknown.
        return None if len(extra.get("walls") or ()) > 1 else [plan_of(extra)]

    ra, rb = runs(a), runs(b)
    if ra is None or rb is None:
        return False
    plans = ra + rb
    return all(plans) and all(p == plans[0] for p in plans)


def iline_slabs(shape: Sequence[int], n: int) -> list[Any]:
    from memchunk_prefect.core.chunks import balanced_grid

    return balanced_grid(tuple(shape), (min(n, shape[0]), 1, 1))


def run_static(bench: Bench, survey: str, steps: list[dict], n: int, tag: str) -> dict:
    from prefect_dask import DaskTaskRunner

    from memchunk_prefect.io.volume import as_source

    shape = as_source(survey).shape
    out_dir = bench.workdir / f"out-{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    f = static_flow.with_options(task_runner=DaskTaskRunner(address=bench.address))
    try:
        return f(survey, steps, str(out_dir), [iline_slabs(shape, n) for _ in steps])
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def run_split(bench: Bench, survey: str, steps: list[dict]) -> dict:
    from prefect_dask import DaskTaskRunner

    out_dir = bench.workdir / "out-split"
    out_dir.mkdir(parents=True, exist_ok=True)
    f = split_flow.with_options(task_runner=DaskTaskRunner(address=bench.address))
    try:
        return f(survey, steps, str(out_dir), max(2, 2 * bench.slots))
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


ARM_WHY = re.compile(r"learned policy: arm \w+(?: \(same plan as [^)]*\))?, ([a-z -]+),")
"""Why the learned policy played its arm (``bandit.ArmChoice.describe``): burn-in, explore, best, only plan."""


@flow(name="benchmark-memchunk")
def memchunk_flow(source_path: str, steps: list[dict], out_dir: str) -> dict:
    """flows.pipeline.attribute_pipeline: each map's summary and its out-of-memory event kinds, and the seconds."""
    from memchunk_prefect import chunked

    t0 = time.perf_counter()
    current: Any = source_path
    out = []
    t_step = t0
    for n, (op_name, op, params) in enumerate(resolve_steps(steps), start=1):
        current = op.map(chunked(current, output=os.path.join(out_dir, f"{n:02d}-{op_name}.zarr")), **params)
        s = current.summary()
        # Each map's wall from the previous map's end to its own (summary() waits for it): the maps run one
        # after another here, as the static flow's steps do, so the two sides' step walls compare.
        s["step_seconds"] = round(time.perf_counter() - t_step, 3)
        t_step = time.perf_counter()
        s["memory_errors"] = sum(1 for e in current.events if e.get("event") == "memory_error")
        s["killed"] = sum(1 for e in current.events if e.get("event") == "killed")
        s["arms"] = sorted({d["arm"] for d in current.decisions if d.get("arm")})
        s["arm_why"] = sorted({m.group(1) for d in current.decisions if (m := ARM_WHY.search(d.get("reason") or ""))})
        out.append(s)
    _wait_for_reports()
    return {"summaries": out, "seconds": time.perf_counter() - t0}


def _wait_for_reports() -> None:
    """Wait, inside the timed region, for the artifact calls the runner's reports made off the flow's thread
    (the runner would wait for them when the flow run ends, after the flow's last line): the wall counts all
    of the runner's work, the saving is only what overlapped with the maps."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    runner = getattr(ctx, "task_runner", None) if ctx is not None else None
    if hasattr(runner, "wait_for_reports"):
        runner.wait_for_reports()


def run_memchunk(bench: Bench, survey: str, steps: list[dict], store: str, tag: str, *,
                 learned_policy: bool = True, **policy: Any) -> dict:
    """The pipeline under MemoryAwareRunner; ``learned_policy=False`` is the ablation (the fixed heuristic);
    other keywords are further ``PolicySettings`` fields (e.g. ``objective="energy"``)."""
    from memchunk_prefect import MemoryAwareRunner

    out_dir = bench.workdir / f"out-{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = MemoryAwareRunner(address=bench.address, store=store, output_dir=str(out_dir / "runs"),
                               policy={"learned_policy": learned_policy, **policy})
    try:
        result = memchunk_flow.with_options(task_runner=runner)(survey, steps, str(out_dir))
        summaries = result["summaries"]
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    per_op = {s["operator"]: {"decisions": s["decisions"], "tasks": s["tasks"], "chunks": s["chunks"],
                              "oom_events": s["oom_events"], "peak_bytes": s["peak_bytes"],
                              "budget_bytes": s["budget_bytes"], "arms": s.get("arms", []),
                              "arm_why": s.get("arm_why", []),
                              "operator_key": s["operator_key"], "bound_over_peak": s.get("bound_over_peak"),
                              "mean_error": s.get("mean_error"), "step_seconds": s["step_seconds"]}
              for s in summaries}
    return {"completed": True, "tasks": sum(s["tasks"] for s in summaries), "seconds": result["seconds"],
            "memory_errors": sum(s["memory_errors"] for s in summaries),
            "notes": "; ".join(f"{s['operator']}: {'/'.join(s['decisions'])}, {s['chunks']} chunks"
                               for s in summaries),
            "extra": {"operators": per_op, "runner_oom_events": sum(s["oom_events"] for s in summaries),
                      "runner_killed_events": sum(s["killed"] for s in summaries),
                      "step_seconds": [s["step_seconds"] for s in summaries]}}


# =========================================================================== learning quality


QUALITY_GOALS = {"coverage": 0.95, "mape": 0.10, "bound_over_peak": 1.25}
"""The goals for what was learned on real runs: share of next runs within the upper bound, mean absolute
error of the predicted mean after 5 runs, upper bound over the measured peak at the chunk size chosen (at most
this, and at least 1: a bound under the peak at the chunks chosen did not hold what they needed, however few
of the replayed runs fell outside it)."""


def learning_quality(store: str, chosen: dict | None = None) -> list[dict]:
    """Per operator key in ``store``: its whole history replayed in order, each run scored before it is learned
    (:func:`benchmarks.quality.replay_quality`: coverage, and MAPE after 5 runs), and the upper bound over
    the measured peak at the chunks a run chose (``chosen``: a memchunk strategy's result, whose maps recorded
    the model's figures when each chunk was submitted; else the replay's figure). ``met`` holds the goals.
    ``floor_mape`` and ``floor_bound_over_peak``: the same figures for blocks of one shape run again
    (:func:`benchmarks.quality.repeatability`), which no model that predicts from the block's shape can
    beat: a goal under its floor is out of reach on these measurements, whatever the model."""
    from benchmarks.quality import repeatability, replay_quality
    from memchunk_prefect.learn.store import Store

    by_key = {op["operator_key"]: (name, op) for name, op in ((chosen or {}).get("extra", {})
                                                              .get("operators", {}).items())
              if op.get("operator_key")}
    rows = []
    with Store(store) as s:
        for key in s.keys():
            history = [o for _, o in s.rows(key)]
            q = replay_quality(history, key)
            floor = repeatability(history, key)
            q["floor_mape"], q["floor_bound_over_peak"] = floor["floor_mape"], floor["floor_bound_over_peak"]
            q["repeated_runs"] = floor["runs"]
            name, op = by_key.get(key, (key.split("|")[0], {}))
            q["operator"] = name
            q["bound_at_chosen"] = op.get("bound_over_peak") if op.get("bound_over_peak") is not None \
                else q["bound_over_peak"]
            q["met"] = (q["scored"] > 0 and q["coverage"] >= QUALITY_GOALS["coverage"]
                        and q["mape"] <= QUALITY_GOALS["mape"]
                        and 1.0 <= q["bound_at_chosen"] <= QUALITY_GOALS["bound_over_peak"])
            rows.append(q)
    return rows


def quality_table(rows: list[dict]) -> str:
    """The learning-quality rows as a text table."""
    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v * 100:.1f}%"

    lines = [f"{'operator':34s} {'runs':>5s} {'scored':>6s} {'within bound':>12s} {'MAPE after 5':>12s} "
             f"{'bound/peak chosen':>17s}  goals   floor (repeated blocks: MAPE, bound/peak)"]
    for q in rows:
        b = "-" if q["bound_at_chosen"] is None else f"{q['bound_at_chosen']:.2f}x"
        fb = q.get("floor_bound_over_peak")
        floor = (f"{pct(q.get('floor_mape'))}, {fb:.2f}x over {q.get('repeated_runs')} runs" if fb is not None
                 else "- (no block shape ran twice)")
        lines.append(f"{q['operator'][:34]:34s} {q['observations']:5d} {q['scored']:6d} {pct(q['coverage']):>12s} "
                     f"{pct(q['mape']):>12s} {b:>17s}  {'met   ' if q['met'] else 'MISSED'}  {floor}")
    return "\n".join(lines)


# =========================================================================== the overhead pair


class _Incoming:
    """Build an upstream ChunkedResult over an existing zarr input with a given chunking.

    The runner keeps an incoming chunking (``continue``) when it fits and its
    estimated makespan is within ``continue_tolerance`` of the best plan; with a
    huge tolerance it keeps any chunking that fits. This is how the benchmark
    gives the runner the same fixed chunking as the plain flow (there is no
    public way to force one).
    """

    @staticmethod
    def make(zarr_path: str, shape: Sequence[int], chunks: list[Any]):
        from memchunk_prefect.run.chunked import ChunkedResult

        return ChunkedResult([], output_path=zarr_path, shape=tuple(shape), chunks=list(chunks), operator="input",
                             operator_key="input|float32|cpu", decisions=[], events=[], observations=[],
                             budget_bytes=0)


@flow(name="benchmark-overhead-memchunk")
def overhead_memchunk_flow(zarr_path: str, shape: list[int], chunks: list[Any], out_path: str) -> dict:
    from memchunk_prefect import chunked, operators

    t = time.perf_counter()
    incoming = _Incoming.make(zarr_path, shape, chunks)  # built here: a ChunkedResult is no flow parameter
    res = operators.envelope.map(chunked(incoming, output=out_path))
    s = res.summary()
    _wait_for_reports()
    return {"decisions": s["decisions"], "chunks": [c.key() for c in res.chunks], "tasks": s["tasks"],
            "seconds": time.perf_counter() - t}


def convert_to_zarr(survey: str, path: str) -> str:
    """The survey as a ZarrOutput store (both sides of the overhead pair read it)."""
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.io.zarr_store import ZarrOutput

    src = as_source(survey)
    out = ZarrOutput.create(path, src.shape, src.coords(), attrs={"operator": "input"}, overwrite=True)
    from memchunk_prefect.core.chunks import Chunk

    out.write(Chunk.whole(src.shape), src.read(Chunk.whole(src.shape)))
    out.finalize()
    return out.path


def overhead_pairs(bench: Bench, survey: str, store: str, n_chunks: int, pairs: int) -> dict:
    """MemoryAwareRunner vs plain DaskTaskRunner, envelope on the same ``n_chunks`` iline slabs, ``pairs`` times.

    The order alternates within pairs; one unmeasured warm-up of each side first
    (it also teaches the runner envelope, so it keeps the incoming chunking). Both sides share the cluster, and
    the runner's first chunk on a worker changes how Prefect hydrates every later task run there
    (``memchunk_prefect.run.hydration``, plain Prefect tasks included): each run of either side starts with it taken
    out of the workers, so the plain side runs on Prefect as installed and the runner's side pays its first chunk
    per worker as on workers that never ran it.
    """
    from prefect_dask import DaskTaskRunner

    from memchunk_prefect import MemoryAwareRunner
    from memchunk_prefect.io.volume import as_source

    bench.fresh()
    src_zarr = convert_to_zarr(survey, str(bench.workdir / "overhead-input.zarr"))
    shape = as_source(src_zarr).shape
    chunks = iline_slabs(shape, n_chunks)
    steps = [{"name": "envelope"}]
    runner = MemoryAwareRunner(address=bench.address, store=store, output_dir=str(bench.workdir / "ovh-runs"),
                               policy={"continue_tolerance": 1e9, "replan_threshold": 1e9})
    mem_flow = overhead_memchunk_flow.with_options(task_runner=runner)
    plain_flow = static_flow.with_options(task_runner=DaskTaskRunner(address=bench.address))

    # Each side is timed inside its flow (the map and all its task runs). Prefect's flow start and teardown
    # are the same on both sides and add 0-1 s at random (the flow run's heartbeat thread sleeps in 1 s steps
    # and is joined at exit), which on ~1 s of work made single ratios read anywhere from 0.5 to 2.
    def as_installed() -> None:
        from memchunk_prefect.run import hydration

        bench.client.run(hydration.uninstall)

    def run_memchunk_once() -> tuple[float, dict]:
        as_installed()
        out = str(bench.workdir / "ovh-mem.zarr")
        shutil.rmtree(out, ignore_errors=True)
        info = mem_flow(src_zarr, list(shape), chunks, out)
        return float(info["seconds"]), info

    def run_plain_once() -> float:
        as_installed()
        out_dir = bench.workdir / "ovh-plain"
        out_dir.mkdir(exist_ok=True)
        r = plain_flow(src_zarr, steps, str(out_dir), [chunks])
        shutil.rmtree(out_dir, ignore_errors=True)
        if not r.get("completed"):
            raise RuntimeError(f"plain envelope run failed: {r}")
        return float(r["seconds"])

    run_memchunk_once()  # warm-up (and, on a store that has not seen envelope, the probe)
    run_plain_once()
    ratios, mem_walls, plain_walls, same = [], [], [], True
    expected = sorted(c.key() for c in chunks)
    for i in range(pairs):
        if i % 2 == 0:
            m, info = run_memchunk_once()
            p = run_plain_once()
        else:
            p = run_plain_once()
            m, info = run_memchunk_once()
        same = same and sorted(info["chunks"]) == expected and info["decisions"] == ["continue"]
        mem_walls.append(m)
        plain_walls.append(p)
        ratios.append(m / p)
        print(f"  overhead pair {i + 1}/{pairs}: memchunk {m:.2f} s, plain {p:.2f} s, ratio {m / p:.3f} "
              f"({'/'.join(info['decisions'])})", flush=True)
    ratios_sorted = sorted(ratios)
    median = ratios_sorted[len(ratios) // 2] if len(ratios) % 2 else 0.5 * (
        ratios_sorted[len(ratios) // 2 - 1] + ratios_sorted[len(ratios) // 2])
    return {"overhead_ratio": median, "ratios": ratios, "memchunk_seconds": mem_walls, "plain_seconds": plain_walls,
            "chunks": len(chunks), "identical_chunking": same, "operator": "envelope", "shape": list(shape),
            "total_ratio": sum(mem_walls) / sum(plain_walls)}


# =========================================================================== helpers for the driver


def make_survey(path: Path, shape: Sequence[int]) -> str:
    from memchunk_prefect import synthetic_survey

    if not path.exists():
        synthetic_survey(path, tuple(shape), seed=0)
    return str(path)


def volume_elements(shape: Sequence[int]) -> int:
    return int(math.prod(int(s) for s in shape))
