"""A survey of real size end to end: the demo pipeline over ~1 million traces of SEG-Y, cold then warm.

    python -m benchmarks.studies.real_size [--shape 1024 1024 500] [--reference 128 128 400]
                                           [--workers 2] [--memory-limit 1GiB] [--work DIR] [--json PATH]

Writes the survey with the project's synthetic generator (big-endian IEEE floats, inline-sorted; 1024 x 1024 x 500
is 1,048,576 traces and 2 GiB of samples), then measures, each part in a fresh process:

- ``scan``: the SEG-Y geometry scan (every trace header read), seconds per million traces;
- ``reads``: read throughput of the same file, page cache dropped before each where this process may (root on
  Linux), each read ``--read-repeats`` times in turn and its median kept: the disk's sequential read (16 MiB
  ``os.read`` calls), segyio's own inline reads (``f.iline[n]`` for every inline, its open included), and
  :class:`~memchunk_prefect.io.segy_source.SegySource` reading blocks of whole traces (the runner's chunks over
  SEG-Y: tiles of 128 x 128 traces, and slabs of 16 inlines, the shape the planner prefers where it fits, since
  it cuts inlines first) and the tiles cut in four along time (what a chunk cut in time costs: each trace is stored
  contiguous, so every piece reads its traces whole); then the conversion to zarr (the runner's storage chunks)
  and the same two block reads from the zarr store: what converting first costs and saves;
- ``pipeline``: envelope -> gaussian_smooth -> gst3d_dip with :class:`~memchunk_prefect.run.runner.
  MemoryAwareRunner` on a fresh local cluster of ``--workers`` single-thread workers with ``--memory-limit`` each
  (the demo's layout), through a local Prefect server started here: cold (an empty store) and then warm (the store
  the cold run left), for the reference survey and then the real-size one. Per run: the wall, time per element,
  each map's chunks, tasks and out-of-memory events, the flow process's resident memory sampled every 0.5 s (it
  must stay flat: no per-trace state in the flow), and the Prefect server's CPU seconds and peak memory over the
  run (its process tree, sampled the same way).

``--segy PATH`` measures a file of your own instead (its shape replaces ``--shape``; the reference stays synthetic).
Outputs (three attribute volumes the survey's size each) go under ``--work``, as does the survey (kept between
invocations: a second invocation reuses it). The full size needs ~9 GiB of disk and about an hour on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks.studies.children import run_child

MiB = 2**20


# --------------------------------------------------------------------------- sampling a process tree


class Sampler:
    """Resident memory (bytes) and CPU seconds of a process and its descendants, every ``every`` seconds, in a
    thread: ``peak_rss``, ``first_rss``, ``last_rss`` and ``cpu_seconds`` (over the sampling) once stopped."""

    def __init__(self, pid: int, every: float = 0.5, tree: bool = True):
        import psutil

        self.proc = psutil.Process(pid)
        self.every, self.tree = every, tree
        self.rss: list[int] = []
        self._stop = threading.Event()
        self._cpu0 = self._cpu()
        self.cpu_seconds = 0.0
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _procs(self) -> list[Any]:
        import psutil

        procs = [self.proc]
        if self.tree:
            try:
                procs += self.proc.children(recursive=True)
            except psutil.Error:
                pass
        return procs

    def _total(self, read: Any) -> float:
        """``read(process)`` summed over the process and (with ``tree``) its descendants; a process that ended
        between listing and reading counts nothing."""
        import psutil

        total = 0.0
        for p in self._procs():
            try:
                total += read(p)
            except psutil.Error:
                pass
        return total

    def _cpu(self) -> float:
        return self._total(lambda p: sum(p.cpu_times()[:2]))  # user + system seconds

    def _sample(self) -> None:
        self.rss.append(int(self._total(lambda p: p.memory_info().rss)))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self._sample()

    def __enter__(self) -> "Sampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        self.cpu_seconds = self._cpu() - self._cpu0

    def figures(self) -> dict[str, Any]:
        return {"first_rss": self.rss[0], "peak_rss": max(self.rss), "last_rss": self.rss[-1],
                "cpu_seconds": round(self.cpu_seconds, 2), "samples": len(self.rss)}


# --------------------------------------------------------------------------- reads


def drop_page_cache() -> bool:
    """Empty Linux's page cache so the next read comes from the disk; False where this process may not."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def _timed(fn: Any) -> tuple[float, Any]:
    dropped = drop_page_cache()
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, (out, dropped)


def read_disk(path: str) -> int:
    n = 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while chunk := os.read(fd, 16 * MiB):
            n += len(chunk)
    finally:
        os.close(fd)
    return n


def open_segyio(path: str) -> int:
    """segyio's open of the file (it reads every trace header); the bytes of samples it could then read."""
    import segyio

    with segyio.open(path, iline=189, xline=193) as f:
        return int(f.tracecount * len(f.samples) * 4)


def read_segyio_inlines(path: str) -> int:
    import segyio

    n = 0
    with segyio.open(path, iline=189, xline=193) as f:
        for il in f.ilines:
            n += f.iline[il].nbytes
    return n


def blocks(shape: tuple[int, int, int], block: tuple[int, int], t_pieces: int) -> Iterator[Any]:
    """The survey's chunks of ``block`` inlines x crosslines, each cut in ``t_pieces`` along time."""
    from memchunk_prefect.core.chunks import Chunk

    ni, nx, nt = shape
    step_t = -(-nt // t_pieces)
    for i in range(0, ni, block[0]):
        for j in range(0, nx, block[1]):
            for k in range(0, nt, step_t):
                yield Chunk((i, j, k), (min(i + block[0], ni), min(j + block[1], nx), min(k + step_t, nt)))


def read_blocks(source: Any, block: tuple[int, int], t_pieces: int) -> int:
    """Every sample of ``source`` through its ``read``, in blocks of ``block`` inlines x crosslines, each block
    whole (``t_pieces`` 1) or cut in ``t_pieces`` along time; bytes of float32 samples returned."""
    return sum(source.read(c).nbytes for c in blocks(source.shape, block, t_pieces))


def convert(path: str, store: str) -> int:
    """The SEG-Y file as a zarr array (the runner's storage chunks: whole traces, ~8 MiB each), block by block."""
    import zarr

    from memchunk_prefect.io.segy_source import SegySource
    from memchunk_prefect.io.zarr_store import default_zarr_chunks

    src = SegySource(path)
    shutil.rmtree(store, ignore_errors=True)
    arr = zarr.create_array(store, shape=src.shape, chunks=default_zarr_chunks(src.shape), dtype="float32")
    ci, cx, _ = arr.chunks
    n = 0
    for c in blocks(src.shape, (ci * max(1, 128 // ci), cx * max(1, 128 // cx)), 1):
        data = src.read(c)
        arr[c.slices()] = data
        n += data.nbytes
    return n


def reads_child(path: str, cache: str, repeats: int = 3) -> dict:
    """Each read of the survey ``repeats`` times, in turn (a virtual disk's rate moves by 2x from one minute to the
    next): per read, the median seconds and every round's."""
    os.environ["MEMCHUNK_CACHE_DIR"] = cache
    from memchunk_prefect.io.segy_cache import cached_scan
    from memchunk_prefect.io.segy_source import SegySource
    from memchunk_prefect.io.zarr_store import ZarrSource

    cached_scan(path)  # kept by the scan step: what a map pays is reading it back
    segy = SegySource(path)
    store = os.path.join(os.path.dirname(cache), "survey.zarr")
    reads = [("disk sequential", lambda: read_disk(path)),
             ("segyio open (its geometry scan)", lambda: open_segyio(path)),
             ("segyio inlines (open included)", lambda: read_segyio_inlines(path)),
             ("SEG-Y, whole-trace blocks 128 x 128", lambda: read_blocks(segy, (128, 128), 1)),
             ("SEG-Y, whole-trace blocks of 16 inlines", lambda: read_blocks(segy, (16, segy.shape[1]), 1)),
             ("SEG-Y, blocks 128 x 128 cut in 4 along time", lambda: read_blocks(segy, (128, 128), 4)),
             ("SEG-Y to zarr (read and write)", lambda: convert(path, store)),
             ("zarr, whole-trace blocks 128 x 128", lambda: read_blocks(ZarrSource(store), (128, 128), 1)),
             ("zarr, blocks 128 x 128 cut in 4 along time", lambda: read_blocks(ZarrSource(store), (128, 128), 4))]
    times: dict[str, list[float]] = {name: [] for name, _ in reads}
    sizes: dict[str, int] = {}
    dropped = True
    for _ in range(max(1, repeats)):
        for name, fn in reads:
            seconds, (nbytes, was_dropped) = _timed(fn)
            times[name].append(round(seconds, 3))
            sizes[name], dropped = nbytes, dropped and was_dropped
    shutil.rmtree(store, ignore_errors=True)
    rows = []
    for name, _ in reads:
        seconds = statistics.median(times[name])
        rows.append({"read": name, "seconds": round(seconds, 3), "rounds": times[name], "bytes": sizes[name],
                     "mib_per_s": round(sizes[name] / MiB / seconds, 1), "page_cache_dropped": dropped})
    return {"rows": rows}


# --------------------------------------------------------------------------- the pipeline, one run


def pipeline_child(path: str, store: str, out: str, workers: int, memory_limit: str) -> dict:
    """The demo pipeline over ``path`` on a fresh cluster (the demo's layout), the flow process sampled."""
    from memchunk_prefect.cli.demo import demo_layout
    from memchunk_prefect.core.units import parse_bytes
    from memchunk_prefect.operators.registry import DEFAULT_STEPS
    from memchunk_prefect.pipeline import attribute_pipeline
    from memchunk_prefect.run.logs import quiet
    from memchunk_prefect.run.runner import MemoryAwareRunner

    quiet()
    cluster_kwargs, _, _ = demo_layout(workers, parse_bytes(memory_limit), env={})
    runner = MemoryAwareRunner(cluster_kwargs=cluster_kwargs, store=store, output_dir=out, device="cpu")
    flow = attribute_pipeline.with_options(task_runner=runner)  # type: ignore[arg-type]
    began = time.time()
    with Sampler(os.getpid(), tree=False) as flow_mem:
        t = time.perf_counter()
        state = flow(path, DEFAULT_STEPS, None, return_state=True)
        wall = time.perf_counter() - t
    summaries = state.result()
    maps = [{"operator": s["operator"], "chunks": s["chunks"], "tasks": s["tasks"], "oom_recovered": s["oom_events"],
             "decisions": s["decisions"], "peak_bytes": s["peak_bytes"], "budget_bytes": s["budget_bytes"]}
            for s in summaries]
    return {"wall": round(wall, 2), "chunk_span": chunk_span(store, began), "maps": maps,
            "kills": sum(m["oom_recovered"] for m in maps), "flow_memory": flow_mem.figures()}


def chunk_span(store: str, since: float) -> float | None:
    """Seconds from the first chunk's start to the last chunk's end of the run that began at ``since`` (epoch
    seconds): the run's wall without its fixed costs (the cluster's start, the flow's set-up and end)."""
    from memchunk_prefect.learn.store import Store

    with Store(store) as st:
        spans = [(o.started_at, o.started_at + o.seconds) for o in st.observations()
                 if o.started_at is not None and o.started_at >= since]
    return round(max(e for _, e in spans) - min(s for s, _ in spans), 2) if spans else None


def run_pipeline(path: Path, store: Path, out: Path, args: argparse.Namespace, env: dict[str, str],
                 server_pid: int | None) -> dict:
    """One run in a fresh process; the server's load over it; the outputs removed after it (9 GiB at full size)."""
    import subprocess
    import sys

    from benchmarks.studies.children import ROOT, WORKER_ENV

    child_env = dict(env, **WORKER_ENV)
    child_env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "benchmarks.studies.real_size", "--child-pipeline", str(path), str(store),
           str(out), str(args.workers), args.memory_limit]
    with contextlib.ExitStack() as stack:
        server = None if server_pid is None else stack.enter_context(Sampler(server_pid))
        try:
            proc = subprocess.run(cmd, env=child_env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=args.timeout)
        except subprocess.TimeoutExpired:
            shutil.rmtree(out, ignore_errors=True)
            return {"error": f"timed out after {args.timeout:.0f} s (--timeout)"}
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-4000:]}
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    row["server"] = None if server is None else server.figures()
    return row


# --------------------------------------------------------------------------- the study


def survey(work: Path, shape: tuple[int, int, int]) -> tuple[Path, float | None]:
    """The survey of ``shape`` under ``work`` (written once); seconds it took to write, None when reused."""
    from memchunk_prefect import synthetic_survey

    path = work / f"survey-{shape[0]}x{shape[1]}x{shape[2]}.sgy"
    if path.exists():
        return path, None
    t = time.perf_counter()
    synthetic_survey(path, shape, seed=0)
    return path, time.perf_counter() - t


def per_element(row: dict, shape: tuple[int, int, int], key: str) -> float | None:
    """Nanoseconds per element of the survey of ``row[key]`` (the wall, or the chunks' span)."""
    n = shape[0] * shape[1] * shape[2]
    return None if row.get(key) is None else round(row[key] / n * 1e9, 2)


@contextlib.contextmanager
def _server(work: Path, settle: float) -> Iterator[tuple[dict[str, str], int | None]]:
    """The children's environment and the Prefect server's process id: the server of ``PREFECT_API_URL`` where
    one is set (its load is not measured: it may serve others), else a local server started here."""
    if os.environ.get("PREFECT_API_URL"):
        yield dict(os.environ), None
        return
    from deployments.local_server import local_server

    with local_server(work / "prefect-home") as srv:
        time.sleep(settle)  # the server's own start-up work (migrations, services) before the first run
        yield dict(srv.env), srv.process.pid


def runs(work: Path, surveys: list[tuple[tuple[int, int, int], Path | None]], args: argparse.Namespace
         ) -> Iterator[dict]:
    """Cold then warm over each ``(shape, path)`` (path None: the synthetic survey of that shape)."""
    with _server(work, args.settle) as (env, server_pid):
        for shape, given in surveys:
            path = given or survey(work, shape)[0]
            store = work / f"store-{shape[0]}x{shape[1]}x{shape[2]}.sqlite"
            store.unlink(missing_ok=True)
            for mode in args.modes:
                row = run_pipeline(path, store, work / "runs", args, env, server_pid)
                row.update(shape=list(shape), mode=mode, ns_per_element=per_element(row, shape, "wall"),
                           ns_per_element_chunks=per_element(row, shape, "chunk_span"))
                print(describe(row), flush=True)
                yield row


def describe(row: dict) -> str:
    shape = " x ".join(map(str, row["shape"]))
    if "error" in row:
        return f"{shape} {row['mode']}: FAILED\n{row['error']}"
    maps = "; ".join(f"{m['operator']} {m['chunks']} chunks ({m['tasks']} tasks, {m['oom_recovered']} OOM)"
                     for m in row["maps"])
    fm, sv = row["flow_memory"], row["server"]
    server = "" if sv is None else f"; server {sv['cpu_seconds']:.1f} CPU s, peak {sv['peak_rss'] / MiB:.0f} MiB"
    return (f"{shape} {row['mode']}: {row['wall']:.1f} s, {row['ns_per_element']:.1f} ns per element "
            f"(chunks first start to last end {row['chunk_span']} s, {row['ns_per_element_chunks']} ns per element), "
            f"{row['kills']} kills; flow process {fm['first_rss'] / MiB:.0f} -> peak {fm['peak_rss'] / MiB:.0f} "
            f"MiB{server}\n    {maps}")


#: The study's parts, by the name ``--skip`` takes, and the key of the JSON each fills.
PARTS = {"scan": "scan", "reads": "reads", "pipeline": "runs"}


def merge(doc: dict, earlier: dict, skipped: list[str]) -> None:
    """Fill ``doc``'s skipped parts from ``earlier`` (the JSON of a run over the same survey), each with the commit
    that measured it; ValueError when the surveys differ."""
    if earlier.get("shape") != doc["shape"] or earlier.get("survey", {}).get("bytes") != doc["survey"]["bytes"]:
        raise ValueError(f"--merge: that run measured a {earlier.get('shape')} survey of "
                         f"{earlier.get('survey', {}).get('bytes')} bytes, this one {doc['shape']} of "
                         f"{doc['survey']['bytes']} bytes: merge runs of the same survey only")
    by = earlier.get("measured_by") or {p: earlier.get("machine", {}).get("commit", "") for p in PARTS}
    for part in skipped:
        if PARTS[part] in earlier:
            doc[PARTS[part]] = earlier[PARTS[part]]
            doc["measured_by"][part] = by.get(part, "")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.real_size", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=int, nargs=3, default=[1024, 1024, 500])
    p.add_argument("--segy", default=None, help="measure this SEG-Y file (yours) instead of a synthetic survey")
    p.add_argument("--reference", type=int, nargs=3, default=[128, 128, 400])
    p.add_argument("--modes", nargs="+", default=["cold", "warm"], choices=["cold", "warm"],
                   help="the runs per survey, in order (cold: on an empty store; warm: on the store the runs "
                        "before left)")
    p.add_argument("--no-reference", action="store_true", help="run only --shape (the suite's scaled-down form)")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--memory-limit", default="1GiB")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one pipeline run may take")
    p.add_argument("--settle", type=float, default=10.0, help="seconds to let the Prefect server settle")
    p.add_argument("--skip", nargs="*", default=[], choices=["scan", "reads", "pipeline"])
    p.add_argument("--work", default=None, help="where the surveys, stores and outputs go (default: a temporary dir)")
    p.add_argument("--json", default=None)
    p.add_argument("--merge", default=None, metavar="JSON",
                   help="take the parts skipped here (--skip) from an earlier run's JSON of the same survey; each "
                        "part keeps the commit that measured it")
    p.add_argument("--child-pipeline", nargs=5, help=argparse.SUPPRESS)
    p.add_argument("--read-repeats", type=int, default=3, help="rounds of the reads (each read's median is kept)")
    p.add_argument("--child-reads", nargs=3, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.child_pipeline:
        path, store, out, workers, limit = args.child_pipeline
        print(json.dumps(pipeline_child(path, store, out, int(workers), limit)))
        return 0
    if args.child_reads:
        path, cache, repeats = args.child_reads
        print(json.dumps(reads_child(path, cache, int(repeats))))
        return 0
    from benchmarks.__main__ import machine_info

    work = Path(args.work or tempfile.mkdtemp(prefix="memchunk-real-size-"))
    work.mkdir(parents=True, exist_ok=True)
    shape, reference = tuple(args.shape), tuple(args.reference)
    if args.segy:
        from memchunk_prefect.io.segy_source import SegySource

        path, written, shape = Path(args.segy).absolute(), None, SegySource(args.segy).shape
    else:
        path, written = survey(work, shape)
    doc: dict[str, Any] = {"benchmark": "real_size", "machine": machine_info(), "shape": list(shape),
                           "reference": list(reference), "workers": args.workers, "memory_limit": args.memory_limit}
    doc["survey"] = {"path": str(path), "bytes": path.stat().st_size, "traces": shape[0] * shape[1],
                     "write_seconds": written, "synthetic": not args.segy}
    print(f"survey {path} ({path.stat().st_size / MiB:,.0f} MiB, {shape[0] * shape[1]:,} traces"
          + (f", written in {written:.0f} s)" if written else ", reused)"), flush=True)
    time.sleep(2.5)  # a file changed in the last seconds is scanned, not kept (segy_cache.SETTLE_SECONDS)
    cache = str(work / "cache")
    shutil.rmtree(cache, ignore_errors=True)
    if "scan" not in args.skip:
        doc["scan"] = [run_child("benchmarks.studies.segy_scan", ["--child", str(path), mode, cache])
                       for mode in ("scan", "first", "kept")]
        for r in doc["scan"]:
            print(f"scan {r['mode']:<5} {r['seconds']:6.2f} s ({r['seconds'] / r['traces'] * 1e6:.2f} s per million "
                  "traces)", flush=True)
    if "reads" not in args.skip:
        doc["reads"] = run_child("benchmarks.studies.real_size",
                                 ["--child-reads", str(path), cache, str(args.read_repeats)])["rows"]
        for r in doc["reads"]:
            print(f"read {r['read']:<46} {r['mib_per_s']:8.1f} MiB/s ({r['seconds']:.1f} s"
                  f"{'' if r['page_cache_dropped'] else ', page cache not dropped'})", flush=True)
    if "pipeline" not in args.skip:
        doc["runs"] = []
        surveys = [(reference, None), (shape, path)]
        for row in runs(work, surveys[1:] if args.no_reference else surveys, args):
            doc["runs"].append(row)
            if args.json:  # written after every run: a long study keeps what it measured if it is stopped
                Path(args.json).write_text(json.dumps(doc, indent=1))
    doc["machine"]["loadavg_end"] = list(os.getloadavg())
    commit = doc["machine"].get("commit", "")
    doc["measured_by"] = {part: commit for part in PARTS if part not in args.skip}
    if args.merge:
        merge(doc, json.loads(Path(args.merge).read_text()), args.skip)
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
