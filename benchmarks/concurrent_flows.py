"""Several flows at once on one external Dask cluster and one store: what happens today.

    python -m benchmarks.concurrent_flows [--flows 3] [--threads 2] [--memory-limit 1.5GiB] [--shape 96 96 300]
                                          [--json PATH]

An external cluster as a user starts it (``dask scheduler`` and 2 ``dask worker``
processes of ``--threads`` threads and ``--memory-limit`` each, ``allowed-failures``
0), one warm store (one flow run alone first, so the model is learned), then
``--flows`` flow processes started together, each mapping ``gst3d_dip`` (the heavy
operator, ~60x its input) over the same survey into its own output. Each flow's
runner reads the workers' resting memory and budgets every slot as its own; with
several flows the workers' threads run other flows' chunks beside its own. Reports
per flow: wall, chunks, the budget it read, out-of-memory events (the runner's
own count: a kill it recovered from, a MemoryError), and whether its output equals
the lone run's; and the cluster's worker deaths (worker processes replaced).

A measurement, not a test: whether concurrent flows stay within memory, how often
they re-plan and why (each decision's reason), and the largest drift any run
recorded (memory its worker held above the resting level the budget read, other
runs' memory left out): the figure that shrank every plan when another flow's chunk
peaking on a worker was read as that worker's resting memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHAPE = (96, 96, 300)

FLOW = r"""
import json, sys, time
sys.path.insert(0, {repo!r})
import numpy as np
from prefect import flow
from memchunk_prefect import operators
from memchunk_prefect import MemoryAwareRunner, chunked

@flow(name="concurrent-gst3d")
def one(path, out):
    t = time.perf_counter()
    res = operators.gst3d_dip.map(chunked(path, output=out))
    s = res.summary()
    return {{"seconds": time.perf_counter() - t, "chunks": s["chunks"], "decisions": s["decisions"],
             "oom_events": s["oom_events"], "recovered": s["recovered"],
             "budget_bytes": s["budget_bytes"], "peak_bytes": s["peak_bytes"],
             "reasons": [d.get("reason", "") for d in res.decisions],
             "unseen_bytes": max((o.unseen_bytes for o in res.observations), default=0)}}

runner = MemoryAwareRunner(address={address!r}, store={store!r}, output_dir={outdir!r}, progress=False)
print("RESULT " + json.dumps(one.with_options(task_runner=runner)({survey!r}, sys.argv[1])))
"""


def start_cluster(logdir: Path, threads: int, memory_limit: str) -> tuple[list[subprocess.Popen], str]:
    from deployments.local_server import free_port
    from memchunk_prefect.testing import dask_cli

    address = f"tcp://127.0.0.1:{free_port()}"
    env = {**os.environ, "DASK_DISTRIBUTED__SCHEDULER__ALLOWED_FAILURES": "0"}
    procs = [subprocess.Popen([*dask_cli("scheduler"), "--host", "127.0.0.1", "--port", address.rsplit(":", 1)[1],
                               "--dashboard-address", "127.0.0.1:0"], env=env,
                              stdout=open(logdir / "scheduler.log", "wb"), stderr=subprocess.STDOUT)]
    for i in range(2):
        procs.append(subprocess.Popen([*dask_cli("worker"), address, "--nthreads", str(threads), "--memory-limit",
                                       memory_limit, "--no-dashboard"], env=env,
                                      stdout=open(logdir / f"worker-{i}.log", "wb"), stderr=subprocess.STDOUT))
    return procs, address


def worker_pids(address: str) -> set[int]:
    from distributed import Client

    with Client(address, timeout=60) as c:
        return set(c.run(os.getpid).values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.concurrent_flows", description=__doc__.splitlines()[0])
    p.add_argument("--flows", type=int, default=3, help="flow processes started together (default 3)")
    p.add_argument("--threads", type=int, default=2, help="threads per worker (default 2)")
    p.add_argument("--memory-limit", default="1.5GiB", help="memory limit per worker (default 1.5GiB)")
    p.add_argument("--shape", type=int, nargs=3, default=list(SHAPE), metavar=("IL", "XL", "T"),
                   help="survey shape (default 96 96 300)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(REPO))
    import numpy as np
    from distributed import Client

    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect import synthetic_survey
    from memchunk_prefect.io.zarr_store import open_result

    work = Path(tempfile.mkdtemp(prefix="memchunk-concurrent-"))
    survey = synthetic_survey(work / "survey.sgy", tuple(args.shape), seed=4)
    store = str(work / "store.sqlite")
    procs, address = start_cluster(work, args.threads, args.memory_limit)
    result: dict[str, Any] = {"flows": args.flows, "threads": args.threads, "memory_limit": args.memory_limit,
                              "shape": list(args.shape)}
    try:
        with Client(address, timeout=60) as c:
            c.wait_for_workers(2, timeout=120)
        with _prefect_api():
            from prefect.settings import get_current_settings

            env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url), "PYTHONPATH": str(REPO)}
            script = work / "flow.py"
            script.write_text(FLOW.format(repo=str(REPO), address=address, store=store, outdir=str(work / "runs"),
                                          survey=str(survey)))

            def launch(out: str) -> subprocess.Popen:
                return subprocess.Popen([sys.executable, str(script), out], env=env, cwd=work, text=True,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)

            def collect(proc: subprocess.Popen) -> dict[str, Any]:
                text, _ = proc.communicate(timeout=1200)
                line = next((x for x in text.splitlines() if x.startswith("RESULT ")), None)
                if proc.returncode != 0 or line is None:
                    return {"completed": False, "rc": proc.returncode, "tail": text[-1500:]}
                return {"completed": True, **json.loads(line[len("RESULT "):])}

            pids0 = worker_pids(address)
            alone = collect(launch(str(work / "alone.zarr")))
            print(f"alone: {alone}", flush=True)
            reference = open_result(str(work / "alone.zarr")).values if alone["completed"] else None
            t0 = time.perf_counter()
            procs_f = [launch(str(work / f"flow{i}.zarr")) for i in range(args.flows)]
            together = [collect(pr) for pr in procs_f]
            wall = time.perf_counter() - t0
            for i, r in enumerate(together):
                if r["completed"] and reference is not None:
                    r["equal_to_alone"] = bool(np.array_equal(open_result(str(work / f"flow{i}.zarr")).values,
                                                              reference))
                print(f"flow {i}: {r}", flush=True)
            pids1 = worker_pids(address)
            result.update(alone=alone, together=together, together_wall_seconds=wall,
                          worker_processes_replaced=len(pids0 - pids1))
    finally:
        for pr in procs:
            with contextlib.suppress(ProcessLookupError):
                pr.kill()
            pr.wait(timeout=30)
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    ooms = sum(r.get("oom_events", 0) for r in result.get("together", []))
    print(f"{args.flows} flows together: {result.get('together_wall_seconds', 0):.1f} s; out-of-memory events "
          f"{ooms}; worker processes replaced {result.get('worker_processes_replaced')}; all completed and equal: "
          f"{all(r.get('completed') and r.get('equal_to_alone') for r in result.get('together', []))}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
