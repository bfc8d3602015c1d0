"""One strategy over one workload, in a process of its own: what a deployment's flow run does.

``python -m benchmarks.family.child SPEC_JSON`` runs the workload's steps as one Prefect flow on a cluster
started for it (the runner's own cluster from its arguments, or one started here whose scheduler address is
passed: ``"cluster": "address"``), and prints one line of JSON with what it measured. Strategies:

- ``static-N``: a plain ``DaskTaskRunner`` flow; every step over N iline slabs, one Prefect task per slab
  (read the block with its halo, apply the operator's function, trim, write the region): what a user who
  chose a chunk size by hand runs. A slab whose worker dies fails the run.
- ``empty-N``: ``static-N``'s flow, tasks and arguments, each task returning at once: what a plain Prefect task
  costs beyond its work, per step (``steps_seconds``).
- ``memchunk``: the same steps chained with ``MemoryAwareRunner`` and ``chunked(...)``, on ``store``;
- ``split``: split-on-failure in a plain ``DaskTaskRunner`` flow: per step the whole volume first, an attempt
  that ran out of memory (worker killed, ``MemoryError``) halved and both halves resubmitted, queued pieces as
  large as one that failed halved before they run (:func:`benchmarks.strategies.split_flow`, on these operators,
  with every queued piece submitted at once).

``"allowed_failures": 0`` in the spec starts the plain flows' clusters with that many retries of a task whose
worker died (Dask's default is 3; the runner and the simulator assume 0: the first death is reported).

Measured: ``wall_seconds`` from the flow call to its return (the cluster's start included, as a deployment's run
pays it); ``first_task_seconds`` from the flow function's first line to the first operator call on a worker (the
fixed cost before any work), and ``first_task_from_call_seconds`` from the flow call (what the task runner's
entry costs as well; both start their cluster in the flow function: a plain ``DaskTaskRunner`` at its first
submission, the runner at its first chunked map); ``kills`` (chunks whose worker died
or that raised ``MemoryError``) and, per step, the chunks written; ``maps_seconds`` (static, split) from the first
step's start to the last step's end, once the workers imported what a task run imports (:func:`warm_workers`);
``flow_run_id`` (memchunk), whose maps the store recorded; ``exit_seconds`` from the flow body's return to the flow
call's (:data:`BODY_ENDED`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.family.archetypes import ARCHETYPES
from benchmarks.family.workloads import Workload


def cluster_kwargs(w: Workload) -> dict[str, Any]:
    return {"n_workers": w.workers, "threads_per_worker": w.threads, "processes": True,
            "memory_limit": f"{w.memory_limit_mib}MiB", "dashboard_address": "127.0.0.1:0"}


#: When each flow's body returned (epoch s): what follows, until the flow call returns, is Prefect's and the task
#: runner's exit (the final state, the runner's artifacts and store, the cluster's close, and the join of Prefect's
#: heartbeat thread, which sleeps in 1 s steps and so rounds every wall up to the next whole second of the run).
BODY_ENDED: list[float] = []

#: What a Prefect task run of these strategies imports on a worker (the runner's own list, and the operators).
WORKER_IMPORTS = ("memchunk_prefect.run.worker", "prefect.task_engine", "memchunk_prefect.io.zarr_store",
                  "benchmarks.family.archetypes")


def _import_all(modules: list[str]) -> None:
    import importlib

    for m in modules:
        importlib.import_module(m)


def warm_workers(client: Any) -> None:
    """Import on every worker what a task run will (as the runner does before its maps read the budget), so
    ``maps_seconds`` times the maps on a cluster ready for them, as the runner's recorded maps and the
    simulator's makespans are."""
    client.run(_import_all, list(WORKER_IMPORTS))


def _steps(w: Workload) -> list[tuple[Any, dict[str, Any]]]:
    return [(ARCHETYPES[s["op"]], {k: v for k, v in s.items() if k != "op"}) for s in w.steps]


def run_memchunk(w: Workload, source: str, out_dir: str, store: str, address: str | None) -> dict[str, Any]:
    from prefect import flow

    from memchunk_prefect import MemoryAwareRunner, chunked

    runner = (MemoryAwareRunner(address=address, store=store, output_dir=out_dir, progress=False) if address
              else MemoryAwareRunner(cluster_kwargs=cluster_kwargs(w), store=store, output_dir=out_dir,
                                     progress=False))
    started: list[float] = []

    run_ids: list[str] = []

    @flow(name=f"family-memchunk-{w.name}", task_runner=runner)
    def pipeline(path: str) -> list[dict]:
        from prefect.runtime import flow_run

        started.append(time.time())
        run_ids.append(str(flow_run.id))
        current: Any = path
        results = []
        for op, params in _steps(w):
            current = op.map(chunked(current), **params)
            results.append(current)
        summaries = [r.summary() for r in results]
        BODY_ENDED.append(time.time())
        return summaries

    t = time.perf_counter()
    summaries = pipeline(source)
    wall = time.perf_counter() - t
    return {"wall_seconds": wall, "flow_started": started[0], "completed": True, "flow_run_id": run_ids[0],
            "kills": sum(s["oom_events"] for s in summaries), "chunks": [s["chunks"] for s in summaries],
            "tasks": sum(s["tasks"] for s in summaries), "decisions": [s["decisions"] for s in summaries]}


def run_static(w: Workload, source: str, out_dir: str, n: int, address: str | None,
               empty: bool = False) -> dict[str, Any]:
    """``static-N`` (see the module docstring); ``empty``: the same flow, tasks and arguments, but each task
    returns at once (nothing read, computed or written), and the result also holds each step's seconds
    (``steps_seconds``): what a plain Prefect task costs beyond its work."""
    from distributed import as_completed
    from prefect import flow, unmapped
    from prefect_dask import DaskTaskRunner

    from memchunk_prefect.core.chunks import balanced_grid
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.io.zarr_store import ZarrOutput
    from memchunk_prefect.operators import spec_of

    slab = _slab_task(empty)
    runner = DaskTaskRunner(address=address) if address else DaskTaskRunner(cluster_kwargs=cluster_kwargs(w))
    started: list[float] = []
    steps_seconds: list[float] = []

    @flow(name=f"family-static-{w.name}", task_runner=runner)
    def pipeline(path: str) -> dict:
        from prefect.context import get_run_context

        started.append(time.time())
        client = get_run_context().task_runner.client
        current: Any = as_source(path)
        warm_workers(client)
        t0 = time.time()
        for k, (op, params) in enumerate(_steps(w), start=1):
            step_started = time.time()
            chunks = balanced_grid(current.shape, (min(n, current.shape[0]), 1, 1))
            out = ZarrOutput.create(os.path.join(out_dir, f"{k:02d}-{op.name}.zarr"), current.shape,
                                    current.coords(), overwrite=True)
            futures = slab.map(unmapped(current), unmapped(out.path), chunks, unmapped(spec_of(op).halo_for(params)),
                               unmapped(op.name), unmapped(params))
            for df in as_completed([f.wrapped_future for f in futures], loop=client.loop):
                try:
                    state = df.result()
                except Exception as exc:  # noqa: BLE001 - a worker killed under it: the run failed
                    return {"completed": False, "failed": f"{op.name}: {type(exc).__name__}",
                            "kills": int(type(exc).__name__ in ("KilledWorker", "MemoryError"))}
                if not state.is_completed():  # the task run failed: say why, and count a worker's death
                    why = str(state.message or "")
                    return {"completed": False, "failed": f"{op.name}: {state.name}: {why}"[:300],
                            "kills": int(any(k in why for k in ("KilledWorker", "MemoryError")))}
            if not empty:  # nothing was written: the output stays unfinished, its input is the next step's
                out.finalize()
                current = out.to_source()
            steps_seconds.append(time.time() - step_started)
        BODY_ENDED.append(time.time())
        return {"completed": True, "maps_seconds": time.time() - t0, "steps_seconds": steps_seconds}

    t = time.perf_counter()
    try:
        result = pipeline(source)
    except Exception as exc:  # noqa: BLE001 - a failed static run is a result, not a crash of the benchmark
        result = {"completed": False, "failed": f"{type(exc).__name__}: {exc}"[:300]}
    wall = time.perf_counter() - t
    return {"wall_seconds": wall, "flow_started": started[0] if started else None, "kills": 0,
            "chunks": [min(n, w.survey_shape[0])] * len(w.steps), **result}


def run_split(w: Workload, source: str, out_dir: str, address: str | None) -> dict[str, Any]:
    """Split-on-failure over the workload's steps (see the module docstring)."""
    from distributed import as_completed
    from prefect import flow
    from prefect.context import get_run_context
    from prefect_dask import DaskTaskRunner

    from benchmarks.strategies import _cancel, _halve, _is_oom, _mark_crashed, _state_error
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.io.zarr_store import ZarrOutput
    from memchunk_prefect.operators import spec_of

    runner = DaskTaskRunner(address=address) if address else DaskTaskRunner(cluster_kwargs=cluster_kwargs(w))
    started: list[float] = []
    slab = _slab_task()

    @flow(name=f"family-split-{w.name}", task_runner=runner)
    def pipeline(path: str) -> dict:
        started.append(time.time())
        client = get_run_context().task_runner.client
        current: Any = as_source(path)
        warm_workers(client)
        kills, chunks, t0 = 0, [], time.time()
        for k, (op, params) in enumerate(_steps(w), start=1):
            spec = spec_of(op)
            halo = spec.halo_for(params)
            out = ZarrOutput.create(os.path.join(out_dir, f"{k:02d}-{op.name}.zarr"), current.shape,
                                    current.coords(), overwrite=True)
            queue, limit, written = [Chunk.whole(current.shape)], None, 0
            in_flight: dict[Any, tuple[Any, Any]] = {}
            ac = as_completed(loop=client.loop)
            while queue or in_flight:
                while queue:
                    c = queue.pop(0)
                    if limit is not None and c.elements > limit and _halve(c, spec.whole_traces):
                        queue[:0] = _halve(c, spec.whole_traces)
                        continue
                    fut = slab.submit(current, out.path, c, halo, op.name, params)
                    in_flight[fut.wrapped_future.key] = (c, fut)
                    ac.add(fut.wrapped_future)
                c, fut = in_flight.pop(next(ac).key)
                exc = _state_error(fut)
                if exc is None:
                    written += 1
                    continue
                oom, merr = _is_oom(exc)
                pieces = _halve(c, spec.whole_traces) if oom else []
                if not pieces:
                    _cancel([f for _, f in in_flight.values()])
                    return {"completed": False, "kills": kills + int(oom), "chunks": chunks,
                            "failed": f"{op.name}: {type(exc).__name__}"}
                kills += 1
                if not merr:
                    _mark_crashed(fut, f"worker died running {op.name}[{c.key()}]: split in two and retried")
                limit = min(limit or c.elements, max(p.elements for p in pieces))
                queue[:0] = pieces
            out.finalize()
            chunks.append(written)
            current = out.to_source()
        BODY_ENDED.append(time.time())
        return {"completed": True, "kills": kills, "chunks": chunks, "maps_seconds": time.time() - t0}

    t = time.perf_counter()
    try:
        result = pipeline(source)
    except Exception as exc:  # noqa: BLE001 - a failed run is a result, not a crash of the benchmark
        result = {"completed": False, "failed": f"{type(exc).__name__}: {exc}"[:300]}
    return {"wall_seconds": time.perf_counter() - t, "flow_started": started[0] if started else None, **result}


def _slab_task(empty: bool = False):
    """The plain Prefect task the static and split strategies run per chunk: read the block with its halo,
    apply the operator's function, trim, write its region. ``empty``: a task of the same arguments that returns
    at once."""
    from prefect import task
    from prefect.cache_policies import NO_CACHE

    if empty:
        @task(cache_policy=NO_CACHE, name="slab")
        def nothing(src: Any, out_path: str, chunk: Any, halo: tuple, op_name: str, params: dict) -> int:
            return chunk.elements

        return nothing

    @task(cache_policy=NO_CACHE)
    def slab(src: Any, out_path: str, chunk: Any, halo: tuple, op_name: str, params: dict) -> int:
        # The operators are imported here, on the worker, as a user's task imports their module: the task is
        # pickled by value (a closure), and a module-level ARCHETYPES would travel with every task, each copy
        # with module globals of its own (fam_first_use's library then loaded by every task, never shared).
        from benchmarks.family.archetypes import ARCHETYPES as operators
        from memchunk_prefect.io.volume import read_block
        from memchunk_prefect.io.zarr_store import ZarrOutput

        block, trim = read_block(src, chunk, halo)
        out = operators[op_name].fn(block, **params)
        ZarrOutput.open(out_path).write(chunk, np.ascontiguousarray(np.asarray(out)[trim], dtype=np.float32))
        return chunk.elements

    return slab


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    w = Workload.from_dict(spec["workload"])
    marks = tempfile.mkdtemp(prefix="family-marks-")
    os.environ["FAMILY_MARKS"] = marks  # inherited by the worker processes started below
    out_dir = spec["out_dir"]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    cluster = None
    address = None
    with contextlib.ExitStack() as stack:
        if spec.get("allowed_failures") is not None and spec["strategy"] != "memchunk":
            import dask

            stack.enter_context(dask.config.set({"distributed.scheduler.allowed-failures":
                                                 int(spec["allowed_failures"])}))
        if spec.get("cluster") == "address":
            from distributed import LocalCluster

            cluster = LocalCluster(**cluster_kwargs(w))
            address = cluster.scheduler_address
        called = time.time()
        try:
            if spec["strategy"] == "memchunk":
                out = run_memchunk(w, spec["source"], out_dir, spec["store"], address)
            elif spec["strategy"] == "split":
                out = run_split(w, spec["source"], out_dir, address)
            else:
                kind, n = spec["strategy"].split("-")
                out = run_static(w, spec["source"], out_dir, int(n), address, empty=kind == "empty")
            returned = time.time()
            if BODY_ENDED and out.get("completed"):
                out["exit_seconds"] = returned - BODY_ENDED[-1]
        finally:
            if cluster is not None:
                cluster.close()
    starts = sorted(int(p.name.split("-")[1]) / 1e9 for p in Path(marks).iterdir())
    if starts and out.get("flow_started"):
        out["first_task_seconds"] = starts[0] - out["flow_started"]
        out["first_task_from_call_seconds"] = starts[0] - called
    print("FAMILY-RESULT " + json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
