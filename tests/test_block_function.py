"""What a chunk's task ships to its worker: the user's function, found again by name where it can be.

A function decorated as a Prefect task is pickled by value by cloudpickle (the module's attribute is the task, not
the function), and each copy gets fresh module globals: an operator that keeps a cache at module level would
rebuild (and hold again) its cache at every chunk. These run the round trip in a fresh process, as a worker does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import cloudpickle
import numpy as np

from memchunk_prefect.run.worker import BlockFunction

REPO = Path(__file__).resolve().parents[1]

WORKER = """
import pickle, sys
import numpy as np
a, b = (pickle.loads(open(p, "rb").read()) for p in sys.argv[1:3])
from benchmarks.family import archetypes
for f in (a, b):
    f.fn(np.zeros((2, 2, 8), np.float32), lib_mib=1)
print(a.fn is archetypes.fam_first_use.fn, b.fn is a.fn, len(archetypes._LIBRARY))
"""


def test_an_operator_in_an_importable_module_keeps_one_module_state_per_worker(tmp_path):
    from benchmarks.family import archetypes

    paths = []
    for i in range(2):  # two chunks' tasks, pickled apart as the runner submits them
        p = tmp_path / f"chunk{i}.pkl"
        p.write_bytes(cloudpickle.dumps(BlockFunction(archetypes.fam_first_use.fn, "block")))
        paths.append(str(p))
    out = subprocess.run([sys.executable, "-c", WORKER, *paths], cwd=REPO, capture_output=True, text=True,
                         timeout=120, env={"PYTHONPATH": str(REPO), "PATH": ""})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "1"]  # the module's function, its library loaded once


def test_a_function_no_module_can_find_again_travels_by_value():
    def local_op(block, scale: float = 2.0):
        return block * scale

    f = cloudpickle.loads(cloudpickle.dumps(BlockFunction(local_op, "block")))
    assert f.fn is not local_op and f.__name__ == "local_op"
    assert f(np.ones((1, 1, 2), np.float32)).tolist() == [[[2.0, 2.0]]]  # called outside the runner: the plain function
