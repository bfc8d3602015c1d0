"""Thousands of chunks through one real Prefect server: does the map finish, and what does it cost?

    python -m benchmarks.many_chunks [--chunks 5000] [--budget 48MiB] [--json PATH]

One chunked map of the ``memory_hog`` test operator (it holds 1000x its input,
so a 48 MiB budget cuts a chunk to ~100 traces of 100 samples) over a synthetic
survey sized for about ``--chunks`` chunks, on a local cluster of 2
single-thread workers, through a local Prefect server (``prefect_test_harness``
unless ``PREFECT_API_URL`` is set). The store starts empty: the runner probes,
then plans the rest (``--seeded`` writes the operator's law into it first; with
it the bound of a single trace widened past 32 and 48 MiB budgets as real
measurements came in, and the map stopped with BudgetTooSmallError). Reports:

- the chunks planned and run, wall seconds, wall per chunk against the ~75 ms
  per task run Prefect + Dask cost on these 2 cores (200 no-op mapped task
  runs took 15.5 s), and slot-seconds per chunk;
- every task run of the flow run by state (all must be final);
- peak memory of the flow process (this process: ``ru_maxrss``) and of the
  Dask scheduler (sampled each second);
- the Prefect server's response time during the map (``GET /health`` each
  0.5 s: median, p95, max);
- a timeline (each 10 s: chunks written, flow-process RSS, the server's
  latest ``/health`` time) and the wall per chunk in each successive block of
  1,000 chunks, so a map that slows down as task runs pile up shows where.

``--timeout`` stops the map as Ctrl-C would and reports what it did (every
task run must still end final). The exit code is 0 when the map completed
with every task run final, 1 otherwise.
"""

from __future__ import annotations

import _thread
import argparse
import json
import math
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MiB = 2**20
MULTIPLE = 1000.0
SAMPLES = 100
FIXED_BYTES = 0  # measured: 7,600 elements peaked at 28.8 MiB, 15,200 at 61.3 MiB (~3.9 KiB/element, no fixed part)


class Poller(threading.Thread):
    """Call ``fn`` every ``period`` seconds until stopped; keep what it returns (None is skipped)."""

    def __init__(self, fn, period: float):
        super().__init__(daemon=True)
        self.fn, self.period, self.values = fn, period, []
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                v = self.fn()
            except Exception:  # noqa: BLE001 - a missed sample is not a failure of the map
                v = None
            if v is not None:
                self.values.append(v)
            self._halt.wait(self.period)

    def stop(self) -> list:
        self._halt.set()
        self.join(timeout=10)
        return self.values


def survey_shape(chunks: int, budget: int) -> tuple[int, int, int]:
    """A square survey of SAMPLES-sample traces with about ``chunks`` chunks' worth of traces at ``budget``."""
    per_trace = (MULTIPLE + 2) * 4 * SAMPLES  # bytes a trace costs the hog
    # The plan's upper bound sits ~25% above the mean with this history (measured: 76 traces at 32 MiB).
    traces_per_chunk = max(1, int((budget / 1.25 - FIXED_BYTES) / per_trace))
    side = math.ceil(math.sqrt(chunks * traces_per_chunk))
    return side, side, SAMPLES


def task_run_states(flow_run_id: str) -> dict[str, int]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    counts: dict[str, int] = {}
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])),
                                         limit=200, offset=offset)
            for r in page:
                name = r.state.type.value if r.state else "NONE"
                counts[name] = counts.get(name, 0) + 1
            if len(page) < 200:
                return counts
            offset += 200


#: Seconds the server is given to record every task run's final state after the map ends.
SETTLE_SECONDS = 120.0


def settled_task_run_states(flow_run_id: str, tasks: int,
                            limit: float = SETTLE_SECONDS) -> tuple[dict[str, int], float]:
    """The flow run's task runs by state once the server has recorded ``tasks`` of them, every one final, or
    after ``limit`` seconds (whatever it holds then), and the seconds that took.

    The server records task runs from the events their workers emit, in batches on a service of its own
    (Prefect's task run recorder), so what it holds trails what ran: read at once after a map whose task runs
    ended 50 ms apart, 1,584 of 1,710 were there, two of them not yet final; a server stopped before it caught up
    drops the batch it was writing. A task run that never reaches a final state still shows after the limit."""
    final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
    t0 = time.monotonic()
    while True:
        counts = task_run_states(flow_run_id)
        waited = time.monotonic() - t0
        if (sum(counts.values()) >= tasks and all(k in final for k in counts)) or waited >= limit:
            return counts, waited
        time.sleep(2.0)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.many_chunks", description=__doc__.splitlines()[0])
    p.add_argument("--chunks", type=int, default=5000, help="about how many chunks (default 5000)")
    p.add_argument("--budget", default="48MiB", help="memory budget per task (default 48MiB; at 32MiB the bound of a "
                   "single trace, widened by the first real measurements, went over it: BudgetTooSmallError)")
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="stop the map after this long (as Ctrl-C would) and report what it did")
    p.add_argument("--seeded", action="store_true",
                   help="seed the store with the operator's law (default: a cold store; the runner probes first)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import httpx
    from distributed import Client
    from prefect import flow
    from prefect.settings import get_current_settings

    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect import MemoryAwareRunner, chunked, synthetic_survey
    from memchunk_prefect.core.units import parse_bytes
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.operators import operator_key
    from memchunk_prefect.testing import memory_hog, seed_store, start_local_cluster

    budget = parse_bytes(args.budget) or 48 * MiB
    shape = survey_shape(args.chunks, budget)
    work = Path(tempfile.mkdtemp(prefix="memchunk-many-"))
    survey = synthetic_survey(work / "survey.sgy", shape, seed=1)
    store = work / "store.sqlite"
    if args.seeded:
        with Store(store) as s:
            # Sizes around the chunks this budget makes (5 to 80 traces): a law seeded far from them would leave
            # the fixed overhead uncertain and the bound of a small chunk wide.
            seed_store(s, operator_key(memory_hog, {"multiple": MULTIPLE}), (MULTIPLE + 2) * 4,
                       fixed_bytes=FIXED_BYTES, sizes=tuple(range(1000, 40_001, 2000)), traces_of=SAMPLES)
    print(f"survey {shape[0]} x {shape[1]} x {shape[2]} ({math.prod(shape) * 4 / MiB:.0f} MiB), budget "
          f"{budget / MiB:.0f} MiB", flush=True)
    result: dict[str, Any] = {"shape": list(shape), "budget_bytes": budget, "target_chunks": args.chunks}
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        with _prefect_api(), Client(cluster.scheduler_address, set_as_default=False) as client:
            api = str(get_current_settings().api.url).rstrip("/")

            def health() -> float:
                t = time.perf_counter()
                httpx.get(f"{api}/health", timeout=30).raise_for_status()
                return time.perf_counter() - t

            def scheduler_rss() -> int:
                return int(client.run_on_scheduler(_rss))

            runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(store),
                                       output_dir=str(work / "out"), memory_budget=budget, progress=False)

            started: dict[str, str] = {}  # the flow run's id, known even when the map stops early

            @flow(name="many-chunks", task_runner=runner)
            def many(path: str) -> dict[str, Any]:
                from prefect.runtime import flow_run

                started["flow_run_id"] = str(flow_run.id)
                t = time.perf_counter()
                res = memory_hog.map(chunked(path), multiple=MULTIPLE)
                res.wait()
                s = res.summary()
                return {"flow_run_id": str(flow_run.id), "seconds": time.perf_counter() - t, "chunks": s["chunks"],
                        "tasks": s["tasks"], "decisions": s["decisions"], "oom_events": s["oom_events"]}

            done_dirs = work / "out"

            def progress_sample() -> dict[str, float]:
                written = sum(len(os.listdir(d)) for d in done_dirs.glob("*/*.zarr/.memchunk/done"))
                return {"t": time.perf_counter() - t0, "chunks_written": written, "flow_rss_bytes": _rss(),
                        "health_seconds": pings.values[-1] if pings.values else None}

            t0 = time.perf_counter()
            pings, sched = Poller(health, 0.5), Poller(scheduler_rss, 1.0)
            timeline = Poller(progress_sample, 10.0)
            # Past --timeout the map is stopped as by Ctrl-C (the runner cancels what runs and settles every
            # task run), and what it did until then is reported.
            timer = threading.Timer(args.timeout, _thread.interrupt_main) if args.timeout else None
            try:
                if timer is not None:
                    timer.start()
                out = many(str(survey))
                result.update(out, completed=True)
            except KeyboardInterrupt:
                result.update(completed=False, error=f"stopped at the {args.timeout:g} s timeout")
            except Exception as exc:  # noqa: BLE001 - reported, and the exit code says so
                result.update(completed=False, error=f"{type(exc).__name__}: {exc}"[:500])
            finally:
                if timer is not None:
                    timer.cancel()
            result["outer_seconds"] = time.perf_counter() - t0
            latencies, rss, result["timeline"] = pings.stop(), sched.stop(), timeline.stop()
            result["ms_per_chunk_by_thousand"] = per_thousand(result["timeline"])
            result["scheduler_in_this_process"] = client.run_on_scheduler(os.getpid) == os.getpid()
            result["chunks_written"] = sum(len(os.listdir(d)) for d in (work / "out").glob("*/*.zarr/.memchunk/done"))
            result.setdefault("flow_run_id", started.get("flow_run_id"))
            if result.get("flow_run_id"):
                result["task_runs"], result["states_settled_seconds"] = settled_task_run_states(
                    result["flow_run_id"], int(result.get("tasks") or 0))
    finally:
        cluster.close()
        shutil.rmtree(work, ignore_errors=True)
    result["flow_process_peak_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["scheduler_peak_bytes"] = max(rss, default=None)
    if latencies:
        q = statistics.quantiles(latencies, n=20) if len(latencies) >= 2 else latencies * 19
        result["server_health_seconds"] = {"median": statistics.median(latencies), "p95": q[18],
                                           "max": max(latencies), "samples": len(latencies)}
    final = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
    runs = result.get("task_runs", {})
    all_final = bool(runs) and all(k in final for k in runs)
    if result.get("completed"):
        n, wall = result["chunks"], result["seconds"]
        print(f"{n} chunks ({result['tasks']} tasks) in {wall:.1f} s: {1000 * wall / n:.0f} ms "
              f"of wall per chunk ({2000 * wall / n:.0f} slot-ms on 2 slots) against the ~75 ms per task "
              f"run Prefect + Dask cost here; decisions {'/'.join(result['decisions'])}; out of memory "
              f"{result['oom_events']}")
    else:
        written, outer = result["chunks_written"], result["outer_seconds"]
        print(f"the map did not complete: {result.get('error')}; {written} chunks written in {outer:.0f} s "
              f"({1000 * outer / max(written, 1):.0f} ms of wall per chunk, flow-run start included)")
    settled = result.get("states_settled_seconds", 0.0)
    print(f"task runs by state: {runs}; every one final: {all_final} (read {settled:.0f} s after the map's end, "
          "once the server had recorded them)")
    if result.get("ms_per_chunk_by_thousand"):
        print("wall per chunk in each block of 1,000 chunks (ms): "
              + ", ".join(f"{v:.0f}" for v in result["ms_per_chunk_by_thousand"]))
    where = " (a LocalCluster's scheduler runs in the flow process)" if result["scheduler_in_this_process"] else ""
    print(f"peak memory: flow process {result['flow_process_peak_bytes'] / MiB:.0f} MiB, scheduler "
          f"{(result['scheduler_peak_bytes'] or 0) / MiB:.0f} MiB{where}")
    if latencies:
        h = result["server_health_seconds"]
        print(f"Prefect server /health during the map: median {1000 * h['median']:.0f} ms, "
              f"p95 {1000 * h['p95']:.0f} ms, max {1000 * h['max']:.0f} ms ({h['samples']} samples)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result.get("completed") and all_final else 1


def per_thousand(timeline: list[dict[str, float]]) -> list[float]:
    """Milliseconds of wall per chunk in each successive block of 1,000 chunks written, from 10 s samples.

    The time a block took is interpolated between the samples either side of its edges (each sample holds
    the seconds since the map began and the chunks written by then); a block not finished is left out.

    >>> per_thousand([{"t": 0, "chunks_written": 0}, {"t": 100, "chunks_written": 1000},
    ...               {"t": 300, "chunks_written": 2000}, {"t": 310, "chunks_written": 2040}])
    [100.0, 200.0]
    """
    pts = [(s["t"], s["chunks_written"]) for s in timeline]

    def when(n: int) -> float | None:
        for (t1, c1), (t2, c2) in zip(pts, pts[1:]):
            if c1 <= n <= c2 and c2 > c1:
                return t1 + (t2 - t1) * (n - c1) / (c2 - c1)
        return None

    out, edge = [], 1000
    while pts and edge <= pts[-1][1]:
        a, b = when(edge - 1000), when(edge)
        if a is None or b is None:
            break
        out.append(1000 * (b - a) / 1000)
        edge += 1000
    return out


def _rss() -> int:
    import psutil

    return psutil.Process().memory_info().rss


if __name__ == "__main__":
    raise SystemExit(main())
