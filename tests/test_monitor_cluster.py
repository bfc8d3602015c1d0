"""Accuracy of the monitor on a real Dask worker process, and figures coming home from a failure.

One worker process with one thread (the configuration that gives clean figures),
memory_limit 4 GiB so the nanny never interferes with a 1 GiB task.
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from memchunk_prefect.run import monitor as mon
from memchunk_prefect.run import probes
from memchunk_prefect.run import process_memory as pm
from memchunk_prefect.run.monitor import Monitor
from memchunk_prefect.run.process_memory import SharedMeasurementWarning

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

MiB = 2**20


@pytest.fixture(scope="module")
def client():
    distributed = pytest.importorskip("distributed")
    # Tasks defined here are pickled by reference as `tests.test_monitor_cluster`; spawned worker
    # processes inherit sys.path, so putting the repository on it lets them import this module.
    with pytest.MonkeyPatch.context() as mp:
        mp.syspath_prepend(str(Path(__file__).resolve().parents[1]))
        with distributed.LocalCluster(
            n_workers=1, threads_per_worker=1, processes=True, memory_limit="4GiB",
            dashboard_address=None, silence_logs=50,
        ) as cluster, distributed.Client(cluster) as c:
            yield c


def allocate_and_use(mib: int, method: str):
    """A task: allocate and touch ``mib`` MiB of numpy, compute on it, free it. Returns the measurement.

    The array is kept while it is summed for at least 5 sampling intervals: real work
    on the whole array, and long enough for the sampling path to see it. What the
    sampling path can miss is memory held for less than one interval (5 ms): an array
    allocated and freed between two samples, or the last few MiB of a fill that is
    freed right after (e.g. ``a = np.ones(n); a = None``). The exact (VmHWM) path
    misses neither; see tests/test_monitor.py for a spike freed before the run ends.
    """
    monitor = Monitor(method=method, gpu=False, energy=False)

    def work():
        a = np.ones(mib * MiB // 8)  # np.ones writes every page, so all of it becomes resident
        total, t0 = 0.0, time.perf_counter()
        while time.perf_counter() - t0 < 5 * monitor.interval_seconds:
            total += float(a.sum())
        return total

    _, m = monitor.measure(work)
    return m


@pytest.mark.parametrize("method, tolerance", [("vmhwm", 0.05), ("psutil", 0.10)])
@pytest.mark.parametrize("mib", [64, 256, 1024])
def test_a_worker_task_allocating_numpy_is_measured_within_tolerance(client, mib, method, tolerance):
    if method == "vmhwm" and not client.run(probes.clear_refs_writable).popitem()[1]:
        pytest.skip("/proc/self/clear_refs is not writable on the worker")
    m = client.submit(allocate_and_use, mib, method, pure=False).result()
    expected = mib * MiB
    error = (m.peak_bytes - expected) / expected
    print(f"{method:6s} {mib:5d} MiB: measured {m.peak_bytes / MiB:8.1f} MiB ({error:+.2%}), "
          f"{m.seconds:.3f} s, cpu {m.cpu_seconds:.3f} s")
    assert m.method == method
    assert abs(error) < tolerance, f"{method}: {m.peak_bytes} bytes measured for {expected} bytes allocated"
    assert not m.shared and m.threads == 1
    assert m.seconds > 0 and m.cpu_seconds > 0


def run_out_of_memory():
    return mon.measure(np.empty, 2**60, dtype=np.uint8)


def test_a_memory_error_on_the_worker_brings_its_measurement_to_the_caller(client):
    future = client.submit(run_out_of_memory, pure=False)
    with pytest.raises(MemoryError) as info:
        future.result()
    m = info.value.memchunk_measurement
    assert m.outcome == "memory_error" and m.censored and m.seconds >= 0


def test_a_worker_with_two_threads_marks_figures_shared(monkeypatch):
    distributed = pytest.importorskip("distributed")
    monkeypatch.setattr(pm, "_WARNED_SHARED", set())
    # processes=False: the worker runs in this process, so its warning reaches pytest.
    with distributed.LocalCluster(n_workers=1, threads_per_worker=2, processes=False,
                                  dashboard_address=":0", silence_logs=50) as cluster, \
            distributed.Client(cluster) as c:
        with pytest.warns(SharedMeasurementWarning, match="2 threads"):
            futures = [c.submit(mon.measure, sum, [i], pure=False) for i in range(4)]
            results = c.gather(futures)
    assert all(m.shared and m.threads == 2 for _, m in results)
