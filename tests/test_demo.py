"""The README's main job, end to end, as a new user runs it: `memchunk demo` with no Prefect server configured."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.cluster, pytest.mark.slow]


def test_demo_runs_on_local_defaults_with_one_prefect_api_and_reports_decisions(tmp_path):
    memchunk = shutil.which("memchunk", path=os.path.dirname(sys.executable))
    assert memchunk, "the memchunk console script is installed with the package"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), MEMCHUNK_STORE=str(tmp_path / "store.sqlite"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    # A small survey and budget keep this test short; the shape of the run is the README's.
    cmd = [memchunk, "demo", "--dir", str(tmp_path / "demo"), "--shape", "24", "24", "200",
           "--memory-limit", "1GiB"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    for operator in ("envelope", "gaussian_smooth", "gst3d_dip"):
        assert f"  {operator} (" in proc.stdout
    assert "probe" in proc.stdout and "rechunk" in proc.stdout
    assert "out-of-memory events recovered" in proc.stdout
    assert "/runs/flow-run/" in proc.stdout
    assert "database is locked" not in out
    # One temporary Prefect server for the flow and all its workers, not one per worker process.
    assert out.count("Starting temporary server") == 1, out[-4000:]
    outputs = sorted(Path(tmp_path / "demo" / "runs").glob("*/*.zarr"))
    assert len(outputs) == 3
