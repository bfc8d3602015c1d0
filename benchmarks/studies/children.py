"""Run a benchmark's measuring half in a fresh process set up as a Dask worker process is, and read its result.

Measurements of memory and first-call costs depend on the process's history (the allocator's
state, pages it has touched), so the benchmarks that take them run each measurement in a fresh
``python -m benchmarks.<module> --child ...`` process and print one JSON line. The environment is
what distributed's nanny gives its workers by default (``distributed.nanny.pre-spawn-environ``:
``MALLOC_TRIM_THRESHOLD_`` 65536, one OpenMP / OpenBLAS / MKL thread), with the repository on
``PYTHONPATH`` so ``tasks`` and ``benchmarks`` import.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER_ENV = {"MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
              "MKL_NUM_THREADS": "1"}


def run_child(module: str, args: list[str]) -> Any:
    """``python -m <module> <args>`` in a fresh worker-like process; the JSON of its last line of output.

    Raises ``subprocess.CalledProcessError`` (with the child's output) when the child fails.
    """
    env = dict(os.environ, **WORKER_ENV)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=ROOT, capture_output=True, text=True,
                          check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])
