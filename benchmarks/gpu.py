"""On the GPU, side by side: gst3d_dip over a survey too large for one GPU in one piece.

    python -m benchmarks.gpu [--shape IL XL NT] [--statics N ...] [--json PATH] [--workdir DIR] [--quick]

One local Dask cluster of one single-thread worker per GPU (each pinned to its
own, as the runner's own GPU cluster is: :mod:`memchunk_prefect.run.pinning`), a
real ``memory_limit`` on the host, ``allowed-failures`` 0. Every strategy
computes ``gst3d_dip`` with ``device="cuda"`` over the same survey, a zarr store
holding the synthetic survey's values (:func:`make_zarr_survey`: the values
:func:`memchunk_prefect.synthetic_survey` writes to SEG-Y, generated in parallel,
since writing 4 GiB of SEG-Y one inline at a time takes minutes):

- ``dask-auto``: what a Dask user with CuPy writes: the store opened with
  ``chunks="auto"`` (whole traces), each block moved to the GPU
  (``map_blocks(cupy.asarray)``: a CuPy-backed volume), ``map_overlap`` with the
  operator's halo, ``to_zarr``; computed on the cluster from a Prefect flow;
- ``static-N``: N iline slabs, one plain Prefect task each (read with halo, the
  operator on the GPU, trim, write its region);
- ``memchunk-cold`` / ``memchunk-warm``: ``MemoryAwareRunner`` on an empty store,
  then again on the same store (it learns host and GPU memory per chunk).

Every GPU call of every strategy runs inside :meth:`memchunk_prefect.operators.device.Backend.track`
(CuPy's pool freed before and after each task), so every strategy pays the same
pool bookkeeping, and each static task's GPU peak is measured as memchunk's are.
Before the first strategy, each worker runs the operator once on a small block:
CUDA's context, CuPy's kernels and cuFFT / cuSOLVER handles are loaded once per
process, and no strategy is charged for them. Between strategies each worker's
pool is emptied (:func:`reset_worker`) instead of starting a new cluster.

Checks (``targets`` in the JSON):

- the GPU model's prediction for the whole survey in one piece exceeds the
  device's memory (the survey does not fit the GPU unchunked);
- memchunk-warm: no out-of-memory event; memchunk-cold: at most one;
- memchunk-warm's wall within 1.2x the fastest static N of the sweep;
- memchunk-warm's output equals the CPU path (numpy / scipy) on sampled regions
  that straddle chunk boundaries, to float32 tolerance (degrees).

Without a GPU (no NVML device, or no CuPy) it says so and exits 0; with
``MEMCHUNK_FAKE_GPU_BYTES`` set it runs on the numpy-backed fake device
(:mod:`memchunk_prefect.operators.device`), which checks the paths, not a GPU's speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("DASK_LOGGING__DISTRIBUTED", "warning")

from prefect import flow, task, unmapped  # noqa: E402
from prefect.cache_policies import NO_CACHE  # noqa: E402

from memchunk_prefect.core.errors import format_bytes  # noqa: E402

GIB = 1 << 30
MIB = 1 << 20
OPERATOR = "gst3d_dip"


@dataclass(frozen=True)
class GpuConfig:
    shape: tuple[int, int, int]
    statics: tuple[int, ...]
    memory_limit: str  # host memory of each worker
    regions: int  # sampled regions checked against the CPU
    region_shape: tuple[int, int]  # (ilines, xlines) of each, whole traces


#: 1024 x 1024 x 600 float32 = 2.34 GiB: gst3d_dip holds ~8.6 GiB + ~56x its block on the GPU (CuPy 14.2 on an
#: H100); the GPU model learned on it predicted 148 GiB in one piece, over the 79.2 GiB card (static-1 ran out
#: after 60 GB, asking for 45 GB more). The full benchmark takes ~290 s of an H100 machine.
FULL = GpuConfig(shape=(1024, 1024, 600), statics=(1, 2, 4, 8, 16), memory_limit="48GiB", regions=2,
                 region_shape=(24, 24))
#: The fake device (CI): a 96 x 24 x 128 survey (1.1 MiB); gst3d_dip holds ~43x its block at once on it, and its
#: halo is 12 samples a side, so a slab of 16 ilines reads 40.
QUICK = GpuConfig(shape=(96, 24, 128), statics=(1, 6), memory_limit="1GiB", regions=2, region_shape=(8, 8))
#: The fake device's capacity in --quick where none is set: one piece (~48 MiB on it) does not fit, six slabs do.
QUICK_FAKE_BYTES = 32 * MIB
#: Warm within this multiple of the fastest static (the project's target).
WARM_WITHIN = 1.2
#: GPU against CPU (numpy / scipy): float32 tolerance, dips in degrees.
RTOL, ATOL_DEGREES = 1e-4, 1e-3


# =========================================================================== the survey


def _write_inlines(job: tuple[str, tuple[int, int, int], int, int, int]) -> int:
    """Generate inlines [a, b) of the synthetic survey and write them to the store (in a pool process)."""
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io.synthetic import _model, _synthetic_inline
    from memchunk_prefect.io.zarr_store import ZarrOutput

    path, shape, seed, a, b = job
    model = _model(shape, seed)
    data = np.stack([_synthetic_inline(model, i, shape, seed, 4.0, 25.0) for i in range(a, b)])
    ZarrOutput.open(path).write(Chunk((a, 0, 0), (b, shape[1], shape[2])), data)
    return b - a


def make_zarr_survey(path: Path, shape: Sequence[int], seed: int = 0, processes: int | None = None) -> str:
    """The synthetic survey's values (:func:`memchunk_prefect.io.synthetic.synthetic_volume` of ``shape``,
    ``seed``) in a complete zarr store at ``path``, written by ``processes`` processes (default: the CPUs; 1: in
    this one), each generating whole storage-chunk slabs of inlines. An existing complete store is kept."""
    from memchunk_prefect.io.zarr_store import ZarrOutput

    shape = tuple(int(s) for s in shape)
    if path.exists():
        try:
            out = ZarrOutput.open(path)
            out.finalize()
            if out.shape == shape:
                return str(path)
        except Exception:  # noqa: BLE001 - half written or another survey: write it anew
            pass
    out = ZarrOutput.create(path, shape, attrs={"synthetic_seed": seed}, overwrite=True)
    step = out.zarr_chunks[0]
    jobs = [(out.path, shape, seed, a, min(shape[0], a + step)) for a in range(0, shape[0], step)]
    processes = max(1, min(len(jobs), processes or os.cpu_count() or 1))
    if processes == 1:
        for j in jobs:
            _write_inlines(j)
    else:
        import multiprocessing

        with ProcessPoolExecutor(processes, mp_context=multiprocessing.get_context("spawn")) as pool:
            list(pool.map(_write_inlines, jobs))
    out.finalize()
    return str(path)


# =========================================================================== what runs on the workers


def reset_worker() -> int:
    """Free this worker's CuPy pools (a strategy starts with nothing cached on the device); returns the pid."""
    import ctypes
    import gc

    gc.collect()
    with contextlib.suppress(Exception):  # ImportError too: no CuPy on the fake device
        import cupy

        cupy.cuda.Device().synchronize()
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    return os.getpid()


def warm_gpu_worker() -> dict:
    """Load once what every process pays once (CUDA context, CuPy's kernels, cuFFT / cuSOLVER handles) by running
    the operator on a small block on the device, then :func:`reset_worker`; returns what the worker's GPU is."""
    from benchmarks.bench import warm_worker
    from memchunk_prefect import operators
    from memchunk_prefect.operators.device import CUDA, backend, gpu_status

    warm_worker()
    block = np.random.default_rng(0).standard_normal((16, 16, 64)).astype(np.float32)
    be = backend(CUDA).load()
    with be.track():
        operators.OPERATORS[OPERATOR].fn(block, device=CUDA)
    reset_worker()
    st = gpu_status()
    limit = None
    with contextlib.suppress(Exception):  # no CuPy on the fake device
        import cupy

        limit = int(cupy.get_default_memory_pool().get_limit()) or None
    return {"why": st.why, "total_bytes": st.total_bytes, "free_bytes": st.free_bytes, "fake": st.fake,
            "pool_limit_bytes": limit}


def on_gpu(block: np.ndarray, op_name: str = OPERATOR, **params: Any) -> np.ndarray:
    """The operator on this worker's GPU, measured as the runner measures its chunks (``Backend.track``): the
    device's out-of-memory is raised the same way (the fake device's at the end of the task)."""
    from memchunk_prefect import operators
    from memchunk_prefect.operators.device import CUDA, backend

    with backend(CUDA).track():
        return operators.OPERATORS[op_name].fn(block, device=CUDA, **params)


def to_device(block: np.ndarray) -> Any:
    """A block on this worker's GPU (``cupy.asarray``; a copy on the fake device)."""
    from memchunk_prefect.operators.device import CUDA, backend

    return backend(CUDA).asarray(block)


def _slab_name(parameters: dict) -> str:
    return f"{OPERATOR}[{parameters['chunk'].key()}]"


@task(cache_policy=NO_CACHE, task_run_name=_slab_name)
def gpu_slab_task(source: Any, out_path: str, chunk: Any, halo: tuple) -> dict:
    """Read ``chunk`` with its halo, run the operator on the GPU (measured), trim, write its region."""
    from memchunk_prefect import operators
    from memchunk_prefect.io.volume import read_block
    from memchunk_prefect.io.zarr_store import ZarrOutput
    from memchunk_prefect.operators.device import CUDA, backend

    block, trim = read_block(source, chunk, halo)
    with backend(CUDA).track() as use:
        out = operators.OPERATORS[OPERATOR].fn(block, device=CUDA)
    del block
    ZarrOutput.open(out_path).write(chunk, np.ascontiguousarray(np.asarray(out)[trim], dtype=np.float32))
    return {"elements": chunk.elements, "gpu_peak_bytes": use.peak_bytes}


# =========================================================================== strategies


@flow(name="benchmark-gpu-static")
def gpu_static_flow(source_path: str, out_path: str, n: int) -> dict:
    """N iline slabs, one plain task each; a slab that ran out of (GPU) memory fails the strategy."""
    from benchmarks.strategies import _is_oom, iline_slabs
    from memchunk_prefect import operators
    from memchunk_prefect.io.volume import as_source
    from memchunk_prefect.io.zarr_store import ZarrOutput
    from memchunk_prefect.operators import spec_of

    t0 = time.perf_counter()
    source = as_source(source_path)
    halo = spec_of(operators.OPERATORS[OPERATOR]).halo_for({})
    out = ZarrOutput.create(out_path, source.shape, source.coords(), overwrite=True)
    chunks = iline_slabs(source.shape, n)
    futures = gpu_slab_task.map(unmapped(source), unmapped(out.path), chunks, unmapped(halo))
    peaks, errors = [], []
    for f in futures:
        try:
            peaks.append(f.result()["gpu_peak_bytes"] or 0)  # raises what the task raised (or KilledWorker)
        except Exception as exc:  # noqa: BLE001 - each is counted and the first reported
            errors.append(exc)
    if errors:
        oom = sum(1 for e in errors if _is_oom(e)[1])
        return {"completed": False, "tasks": len(chunks), "memory_errors": oom,
                "notes": f"{len(errors)} of {len(chunks)} slab(s) failed: {type(errors[0]).__name__}: "
                         f"{str(errors[0]).splitlines()[0][:120] if str(errors[0]) else ''}"}
    out.finalize()
    return {"completed": True, "tasks": len(chunks), "memory_errors": 0, "seconds": time.perf_counter() - t0,
            "notes": f"{n} slab(s), GPU peak {format_bytes(max(peaks))}",
            "extra": {"gpu_peak_bytes": max(peaks)}}


def dask_auto_graph(source_path: str, out_path: str):
    """(the delayed to_zarr, the chunks): the store with chunks="auto" (whole traces), CuPy-backed, map_overlap."""
    import dask.array as da

    from memchunk_prefect import operators
    from memchunk_prefect.io.zarr_store import open_result
    from memchunk_prefect.operators import spec_of

    x = open_result(source_path).chunk({"iline": "auto", "xline": "auto", "twt": -1}).data
    chunks = x.chunks
    # meta given: dask must not call to_device in this process to learn the block type (that would start a CUDA
    # context here, holding ~0.5 GiB of the GPU the worker budgets from).
    x = x.map_blocks(to_device, dtype=np.float32, meta=np.empty((0, 0, 0), np.float32))
    halo = spec_of(operators.OPERATORS[OPERATOR]).halo_for({})
    y = da.map_overlap(on_gpu, x, depth=dict(enumerate(halo)), boundary="none", dtype=np.float32,
                       meta=np.empty((0, 0, 0), np.float32))
    return da.to_zarr(y, out_path, overwrite=True, compute=False), chunks


@flow(name="benchmark-gpu-dask-auto")
def gpu_dask_auto_flow(source_path: str, out_path: str, address: str) -> dict:
    from benchmarks.strategies import compute_on

    t0 = time.perf_counter()
    return compute_on(address, *dask_auto_graph(source_path, out_path), t0)


def run_dask_auto(bench: Any, survey: str) -> dict:
    from prefect_dask import DaskTaskRunner

    from benchmarks.strategies import _is_oom

    out = str(bench.workdir / "out-dask-auto.zarr")
    f = gpu_dask_auto_flow.with_options(task_runner=DaskTaskRunner(address=bench.address))
    try:
        return f(survey, out, bench.address)
    except BaseException as exc:  # noqa: BLE001
        oom, merr = _is_oom(exc)
        return {"completed": False, "tasks": 0, "memory_errors": int(merr),
                "notes": f"failed: {type(exc).__name__}" + (" (out of memory)" if oom else f": {exc}"[:200])}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_static(bench: Any, survey: str, n: int) -> dict:
    from prefect_dask import DaskTaskRunner

    out = str(bench.workdir / f"out-static-{n}.zarr")
    f = gpu_static_flow.with_options(task_runner=DaskTaskRunner(address=bench.address))
    try:
        return f(survey, out, n)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def check_against_cpu(source_path: str, result_path: str, chunks: Sequence[str], cfg: GpuConfig) -> dict:
    """The result on ``cfg.regions`` regions of whole traces centred on boundaries between the result's chunks
    (``chunks``: their keys; the volume's centre where there was one chunk), against the operator on the CPU
    (numpy / scipy) over the same region read with its halo. Max absolute difference, and whether it is within
    float32 tolerance."""
    from memchunk_prefect import operators
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io.volume import as_source, read_block
    from memchunk_prefect.io.zarr_store import ZarrOutput
    from memchunk_prefect.operators import spec_of
    from memchunk_prefect.operators.device import CPU

    op = operators.OPERATORS[OPERATOR]
    source = as_source(source_path)
    shape = source.shape
    halo = spec_of(op).halo_for({})
    starts = sorted({_chunk_start(k) for k in chunks} - {(0, 0)}) or [(shape[0] // 2, shape[1] // 2)]
    starts = starts[:: max(1, len(starts) // cfg.regions)][: cfg.regions]  # spread over the volume
    out = ZarrOutput.open(result_path)
    rows = []
    for ci, cx in starts:
        di, dx = cfg.region_shape
        a = (max(0, min(shape[0] - di, ci - di // 2)), max(0, min(shape[1] - dx, cx - dx // 2)), 0)
        region = Chunk(a, (a[0] + di, a[1] + dx, shape[2]))
        block, trim = read_block(source, region, halo)
        expected = np.asarray(op.fn(block, device=CPU))[trim]
        got = out.read_locked(region)
        diff = np.abs(got.astype(np.float64) - expected.astype(np.float64))
        ok = bool(np.allclose(got, expected, rtol=RTOL, atol=ATOL_DEGREES, equal_nan=True))
        rows.append({"region": region.key(), "max_abs_diff": float(np.nanmax(diff)) if diff.size else 0.0,
                     "within_tolerance": ok})
    return {"regions": rows, "exact": all(r["within_tolerance"] for r in rows)}


def _chunk_start(key: str) -> tuple[int, int]:
    """(iline, xline) start of a chunk key ``i0-9_x0-64_t0-400``."""
    spans = [part[1:].split("-") for part in key.split("_")]
    return int(spans[0][0]), int(spans[1][0])


def run_memchunk(bench: Any, survey: str, store: str, tag: str, cfg: GpuConfig, check: bool) -> dict:
    """gst3d_dip under MemoryAwareRunner on the GPU; the GPU peaks and budget from its store rows, and (``check``)
    the output against the CPU before it is removed."""
    from benchmarks.strategies import memchunk_flow
    from memchunk_prefect import MemoryAwareRunner
    from memchunk_prefect.learn.store import Store

    out_dir = bench.workdir / f"out-{tag}"
    out_dir.mkdir(parents=True, exist_ok=True)
    runner = MemoryAwareRunner(address=bench.address, store=store, output_dir=str(out_dir / "runs"), device="cuda")
    started = time.time()
    try:
        result = memchunk_flow.with_options(task_runner=runner)(survey, [{"name": OPERATOR, "device": "cuda"}],
                                                                str(out_dir))
        s = result["summaries"][0]
        with Store(store) as st:
            rows = [r for r in st.observations() if r.created_at >= started]
        ok = [r for r in rows if r.outcome == "ok"]
        gpu_oom = sum(1 for r in rows if r.gpu_out_of_memory)
        extra = {"operator_key": s["operator_key"], "decisions": s["decisions"], "chunks": s["chunks"],
                 "gpu_peak_bytes": max((r.gpu_peak_bytes or 0 for r in ok), default=None),
                 "gpu_budget_bytes": min((r.gpu_budget_bytes for r in rows if r.gpu_budget_bytes), default=None),
                 "host_peak_bytes": max((r.peak_bytes for r in ok), default=None),
                 "gpu_out_of_memory": gpu_oom, "runner_oom_events": s["oom_events"]}
        if check:
            extra["check"] = check_against_cpu(survey, str(out_dir / f"01-{OPERATOR}.zarr"),
                                               [r.chunk for r in ok], cfg)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return {"completed": True, "tasks": s["tasks"], "seconds": result["seconds"],
            "memory_errors": s["memory_errors"],
            "notes": f"{'/'.join(dict.fromkeys(s['decisions']))}, {s['chunks']} chunks, GPU peak "
                     f"{format_bytes(extra['gpu_peak_bytes'])} of a {format_bytes(extra['gpu_budget_bytes'])} budget, "
                     f"{gpu_oom} GPU out-of-memory",
            "extra": extra}


def one_piece(store: str, key: str, shape: Sequence[int], total_bytes: int | None) -> dict:
    """The GPU model's prediction for the whole survey in one piece (halo clipped at the edges: none), against
    the device's memory."""
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.learn.store import Store

    with Store(store) as st:
        bank = ModelBank(st)
        p = bank.predict_gpu(key, tuple(shape))
    return {"mean_bytes": int(p.mean_bytes), "upper_bytes": int(p.upper_bytes), "ready": bool(p.ready),
            "device_bytes": total_bytes,
            "over_device": bool(total_bytes and p.mean_bytes > total_bytes)}


# =========================================================================== the driver


def evaluate(rows: list[dict], piece: dict) -> dict[str, dict]:
    by = {r["name"]: r for r in rows}
    statics = [r for r in rows if r["name"].startswith("static-") and r["completed"]]
    warm, cold = by.get("memchunk-warm"), by.get("memchunk-cold")
    out: dict[str, dict] = {}
    out["one_piece"] = {"met": piece.get("over_device"),
                        "figure": f"{format_bytes(piece['mean_bytes'])} predicted on the GPU in one piece, device "
                                  f"{format_bytes(piece.get('device_bytes'))}"}
    if warm:
        out["warm_oom"] = {"met": warm["completed"] and warm["oom_events"] == 0, "figure": f"{warm['oom_events']}"}
        check = warm.get("extra", {}).get("check")
        if check:
            worst = max(r["max_abs_diff"] for r in check["regions"])
            out["exact"] = {"met": check["exact"], "figure": f"max |GPU - CPU| {worst:.2e} degrees over "
                                                             f"{len(check['regions'])} region(s)"}
    if cold:
        out["cold_oom"] = {"met": cold["completed"] and cold["oom_events"] <= 1, "figure": f"{cold['oom_events']}"}
    if warm and warm["completed"] and statics:
        best = min(statics, key=lambda r: r["wall_seconds"])
        ratio = warm["wall_seconds"] / best["wall_seconds"]
        out["warm_vs_best"] = {"met": ratio <= WARM_WITHIN,
                               "figure": f"{ratio:.2f}x ({warm['wall_seconds']:.1f} s vs {best['name']} "
                                         f"{best['wall_seconds']:.1f} s)"}
    return out


def run(cfg: GpuConfig, workdir: Path, quick: bool, prefect_api: bool = True) -> dict:
    """The benchmark (see the module docstring); ``prefect_api=False`` where a Prefect API is already set up
    (``python -m benchmarks``' GPU section), else a local server is started unless PREFECT_API_URL is set."""
    from benchmarks import strategies as st
    from benchmarks.__main__ import _prefect_api
    from memchunk_prefect.run.pinning import PRELOAD, usable_gpus

    devices, found = usable_gpus()
    print(f"GPU benchmark: {found}", flush=True)
    if not devices:
        return {"skipped": found}
    t = time.perf_counter()
    survey = make_zarr_survey(workdir / f"survey-{'x'.join(map(str, cfg.shape))}.zarr", cfg.shape,
                              processes=1 if quick else None)
    made = time.perf_counter() - t
    print(f"survey {cfg.shape} ({np.prod(cfg.shape) * 4 / GIB:.2f} GiB float32, zarr) ready in {made:.1f} s; "
          f"{len(devices)} worker(s), one per GPU, host memory_limit {cfg.memory_limit}", flush=True)

    class GpuBench(st.Bench):
        """The benchmark's cluster, one worker per GPU pinned by the runner's preload."""

        def _start_cluster(self) -> None:
            from distributed import Client

            from benchmarks.bench import AttemptLog
            from memchunk_prefect.testing import start_local_cluster

            self.cluster = start_local_cluster(n_workers=self.n_workers, memory_limit=self.memory_limit_setting,
                                               preload=[PRELOAD])
            self.address = self.cluster.scheduler_address
            self.client = Client(self.address, set_as_default=False)
            self.client.wait_for_workers(self.n_workers, timeout=120)
            self.client.register_plugin(AttemptLog(self.attempts_dir))

    with _prefect_api() if prefect_api else contextlib.nullcontext():
        bench = GpuBench(len(devices), cfg.memory_limit, workdir)
        rows: list[st.StrategyResult] = []
        try:
            gpus = bench.client.run(warm_gpu_worker)
            # The memory a task could have: the device's, or CuPy's pool limit where one is set (--gpu-memory-limit).
            total = min(int(g["pool_limit_bytes"] or g["total_bytes"] or 0) for g in gpus.values()) or None
            print("workers: " + "; ".join(f"{w}: {g['why']}" for w, g in gpus.items()), flush=True)

            def measure(name: str, fn) -> st.StrategyResult:
                bench.client.run(reset_worker)
                return bench.measure(name, fn, fresh=False)

            rows.append(measure("dask-auto", lambda: run_dask_auto(bench, survey)))
            for n in cfg.statics:
                rows.append(measure(f"static-{n}", lambda n=n: run_static(bench, survey, n)))
            statics = [r for r in rows if r.name.startswith("static-")]
            rows.append(st.static_best(statics))
            store = str(workdir / "gpu-store.sqlite")
            for path in Path(store).parent.glob(Path(store).name + "*"):
                path.unlink()
            for phase in ("cold", "warm"):
                r = measure(f"memchunk-{phase}", lambda phase=phase: run_memchunk(
                    bench, survey, store, f"memchunk-{phase}", cfg, check=phase == "warm"))
                r.oom_events = max(r.oom_events, int(r.extra.get("runner_oom_events", 0)))
                rows.append(r)
            key = next((r.extra.get("operator_key") for r in rows if r.extra.get("operator_key")), None)
            piece = one_piece(store, key, cfg.shape, total) if key else {"mean_bytes": 0, "over_device": None}
        finally:
            bench.close()
    result = [r.to_dict() for r in rows]
    return {"found": found, "config": {"shape": list(cfg.shape), "statics": list(cfg.statics),
                                       "memory_limit": cfg.memory_limit, "quick": quick, "workers": len(devices),
                                       "gpu_memory_limit": os.environ.get("CUPY_GPU_MEMORY_LIMIT")},
            "workers": gpus, "survey_seconds": round(made, 1), "strategies": result, "one_piece": piece,
            "targets": evaluate(result, piece)}


def format_report(result: dict) -> str:
    if "skipped" in result:
        return f"GPU benchmark skipped: {result['skipped']}"
    cap = result["config"].get("gpu_memory_limit")
    lines = [f"gst3d_dip on the GPU ({result['found']}"
             + (f", CuPy's pool capped at {format_bytes(int(cap))}" if cap else "")
             + f"), survey {' x '.join(map(str, result['config']['shape']))}",
             "", f"{'strategy':<16} {'ok':<4} {'wall s':>8} {'OOM':>4} {'tasks':>6}  notes"]
    for r in result["strategies"]:
        lines.append(f"{r['name']:<16} {'yes' if r['completed'] else 'NO':<4} {r['wall_seconds']:8.1f} "
                     f"{r['oom_events']:>4} {r['tasks']:>6}  {r['notes']}")
    lines += ["", "targets:"]
    for k, v in result["targets"].items():
        lines.append(f"  {k:<14} {'met' if v['met'] else 'MISSED' if v['met'] is False else '-':<7} {v['figure']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the small survey (the fake device's, for CI)")
    parser.add_argument("--shape", type=int, nargs=3, metavar=("IL", "XL", "NT"), help="survey shape")
    parser.add_argument("--statics", type=int, nargs="+", help="slab counts of the static sweep")
    parser.add_argument("--memory-limit", help="host memory of each worker (e.g. 48GiB)")
    parser.add_argument("--gpu-memory-limit", metavar="BYTES",
                        help="cap each worker's CuPy pool (CUPY_GPU_MEMORY_LIMIT, e.g. 17179869184 for 16 GiB): a "
                             "smaller GPU on a large one, so a smaller survey does not fit it in one piece")
    parser.add_argument("--json", type=Path, help="write the result here")
    parser.add_argument("--workdir", type=Path, help="where the survey and outputs go (default: a temporary dir)")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    if args.quick and not os.environ.get("MEMCHUNK_FAKE_GPU_BYTES"):
        from memchunk_prefect.run.pinning import usable_gpus

        if not usable_gpus()[0]:
            os.environ["MEMCHUNK_FAKE_GPU_BYTES"] = str(QUICK_FAKE_BYTES)
            print(f"--quick without a GPU: the fake device of {QUICK_FAKE_BYTES // MIB} MiB", flush=True)
    if args.gpu_memory_limit:
        os.environ["CUPY_GPU_MEMORY_LIMIT"] = str(int(float(args.gpu_memory_limit)))  # workers inherit it
    from dataclasses import replace

    cfg = replace(cfg, **{k: v for k, v in (("shape", tuple(args.shape) if args.shape else None),
                                            ("statics", tuple(args.statics) if args.statics else None),
                                            ("memory_limit", args.memory_limit)) if v})
    tmp = None
    workdir = args.workdir
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="memchunk-gpu-bench-")
        workdir = Path(tmp)
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        result = run(cfg, workdir, args.quick)
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    print(format_report(result), flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))
        print(f"JSON written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
