"""The README's main job, end to end, as a new user runs it: `memchunk demo` with no Prefect server configured."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_demo_runs_on_local_defaults_with_one_prefect_api_and_reports_decisions(tmp_path):
    memchunk = shutil.which("memchunk", path=os.path.dirname(sys.executable)) or shutil.which("memchunk")
    assert memchunk, "the memchunk console script is installed with the package"
    # A user's shell: no API and no logging settings another test's imports left in this process's environment
    # (benchmarks.__main__ sets PREFECT_LOGGING_LEVEL=WARNING when imported, which hid every decision line).
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "PREFECT_LOGGING"))}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), MEMCHUNK_STORE=str(tmp_path / "store.sqlite"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    # A small survey and budget keep this test short; the shape of the run is the README's.
    cmd = [memchunk, "demo", "--dir", str(tmp_path / "demo"), "--shape", "24", "24", "200",
           "--memory-limit", "1GiB"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    rows: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if line.startswith("  ") and line.split():
            rows.setdefault(line.split()[0], line)  # the summary table's row comes first
    for operator in ("envelope", "gaussian_smooth", "gst3d_dip"):
        assert operator in rows and " recovered " in rows[operator], proc.stdout
        # The energy column: no counter is readable on these machines, so it is an estimate and says so.
        assert rows[operator].rstrip().endswith("(estimated)") or "(rapl)" in rows[operator], proc.stdout
        # Not a terminal: one progress line per map, when it ends.
        assert f"{operator}  " in proc.stderr and " chunks, 24 x 24 x 200 in " in proc.stderr, proc.stderr
    # Cold, each operator probes first (on a survey this small the probes cover it all: nothing is left to plan).
    for operator in ("envelope", "gaussian_smooth", "gst3d_dip"):
        assert f"memchunk {operator}: probe — " in out, ("the runner's decisions are in the flow's log lines:\n"
                                                          + out[-6000:])
    assert "/runs/flow-run/" in proc.stdout
    assert "database is locked" not in out
    # One temporary Prefect server for the flow and all its workers, not one per worker process.
    assert out.count("Starting temporary server") == 1, out[-4000:]
    # Quiet: no Dask INFO chatter, no line per task run, and the whole run fits on a screen.
    assert "distributed.scheduler" not in out and "distributed.nanny" not in out, out
    assert "Task run '" not in out, out
    assert len(out.splitlines()) <= 40, out
    outputs = sorted(Path(tmp_path / "demo" / "runs").glob("*/*.zarr"))
    assert len(outputs) == 3


def _demo_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


@pytest.mark.parametrize("case", ["prefect home under a file", "unreachable api", "read-only store"])
def test_demo_stops_in_seconds_naming_what_it_cannot_work_without(tmp_path, case):
    memchunk = shutil.which("memchunk", path=os.path.dirname(sys.executable)) or shutil.which("memchunk")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    if case == "prefect home under a file":
        # A directory that cannot exist (its parent is a file): true for root too, unlike a chmod.
        env = _demo_env(tmp_path, PREFECT_HOME=str(blocker / "prefect"), MEMCHUNK_STORE=str(tmp_path / "s.sqlite"))
        expected = [str(blocker / "prefect"), "PREFECT_HOME"]
    elif case == "unreachable api":
        env = _demo_env(tmp_path, PREFECT_HOME=str(tmp_path / "home"), MEMCHUNK_STORE=str(tmp_path / "s.sqlite"),
                        PREFECT_API_URL="http://127.0.0.1:9/api")
        expected = ["http://127.0.0.1:9/api", "memchunk ui"]
    else:
        env = _demo_env(tmp_path, PREFECT_HOME=str(tmp_path / "home"), MEMCHUNK_STORE=str(blocker / "s.sqlite"))
        expected = [str(blocker), "MEMCHUNK_STORE"]
    t0 = time.monotonic()
    proc = subprocess.run([memchunk, "demo", "--dir", str(tmp_path / "demo")], env=env, capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    elapsed = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert all(e in proc.stderr for e in expected), proc.stderr
    assert len(out.splitlines()) <= 4 and "Traceback" not in out, out  # one line per problem
    assert not list(tmp_path.glob("demo/*.sgy")), "no survey is generated before the checks pass"
    assert elapsed < 60, f"took {elapsed:.0f} s"  # seconds, not Prefect's minutes of retries


def test_the_demo_runs_on_the_gpu_where_there_is_one_and_says_which_device_it_used():
    from memchunk_prefect.cli.demo import demo_layout
    from memchunk_prefect.operators.device import FAKE_GPU_ENV
    from memchunk_prefect.run.pinning import PRELOAD

    kwargs, device, words = demo_layout(2, 2**30, {"CUDA_VISIBLE_DEVICES": ""})
    assert (kwargs["n_workers"], device, "preload" in kwargs) == (2, "cpu", False)
    assert words.startswith("on the CPU (no GPU found)")
    kwargs, device, words = demo_layout(2, 2**30, {"CUDA_VISIBLE_DEVICES": "0,1,2", FAKE_GPU_ENV: str(2**30)})
    assert (kwargs["n_workers"], kwargs["threads_per_worker"], kwargs["preload"], device) == (3, 1, [PRELOAD], "auto")
    assert words.startswith("on the GPU: 3 fake GPU(s)")
    # No --memory-limit: 1 GiB on the CPU (the structure tensor cannot run in one piece); 4 GiB on the GPU, where a
    # worker keeps CUDA's host libraries after its first chunk (on an H100, a 1 GiB worker stayed paused for good).
    assert demo_layout(2, None, {"CUDA_VISIBLE_DEVICES": ""})[0]["memory_limit"] == 2**30
    assert demo_layout(2, None, {"CUDA_VISIBLE_DEVICES": "0", FAKE_GPU_ENV: str(2**30)})[0]["memory_limit"] == 4 * 2**30
    import importlib.util

    if importlib.util.find_spec("cupy") is None:  # CI: a GPU listed but nothing to drive it with
        _, device, words = demo_layout(2, 2**30, {"CUDA_VISIBLE_DEVICES": "0"})
        assert device == "cpu" and "CuPy is not installed" in words
