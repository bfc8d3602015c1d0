"""Helpers for testing flows that use MemoryAwareRunner (importable by Dask workers).

- :func:`memory_hog`: an operator whose memory is a known multiple of its input,
  so tests can cause real out-of-memory events at a chosen chunk size;
- :func:`seed_store`: write observations that make the model believe an operator
  needs a different multiple (e.g. under-predict 4x), to provoke a real failure;
- :func:`limit_address_space`: cap a worker's virtual memory so large allocations
  raise a real ``MemoryError`` inside the task instead of getting the worker killed;
- :func:`limit_file_size`: cap the size of files a worker writes, so output writes
  fail with a real ``OSError`` as on a full disk;
- :class:`Throttle`: stop and continue a worker process at a duty cycle, so it is
  slow rather than dead (a straggler).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from memchunk_prefect.core.records import Observation
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, ITEMSIZE
from memchunk_prefect.operators.device import backend
from memchunk_prefect.operators.spec import operator

# How long a hog meant to be killed for memory holds its peak, in seconds. A Dask nanny samples
# its worker's RSS every 100 ms (distributed.worker.memory.monitor-interval); a peak held for
# less than that can fall between two samples, and then no kill happens (seen in CI: a 960 MB
# hog on a 1 GiB worker finished untouched). Five samples leave no gap for it to hide in.
KILL_HOLD_S = 0.5


@operator(halo=0, memory_params=("multiple",), whole_traces=True)
def memory_hog(block, multiple: float = 10.0, seconds: float = 0.0, busy_seconds: float = 0.0, device: str = "cpu",
               seconds_per_element: float = 0.0, busy_seconds_per_element: float = 0.0):
    """Return a copy of ``block`` after holding ``multiple`` x its bytes of touched memory for ``seconds`` plus
    ``seconds_per_element`` x its elements (a wall time that grows with the block, as an operator's does).

    Memory: about (multiple + 2) x the block's bytes (the scratch buffer, the block, the copy); the scratch
    buffer is held on ``device`` (see :mod:`memchunk_prefect.operators.device`), the rest in host memory.
    ``seconds`` (wall time the buffer is held) gives fault tests a window to kill a
    worker mid-task; ``busy_seconds`` plus ``busy_seconds_per_element`` x its elements is
    CPU time spent computing (a loop on the thread's CPU clock), so a worker the OS slows
    (stopped, throttled, sharing its cores) takes proportionally longer in wall time, as a
    real operator would.
    None of these is a memory parameter, so none changes the model's key.
    """
    xp = backend(device).xp
    scratch = xp.ones(int(block.nbytes * multiple) // 8 + 1, dtype=xp.float64)  # ones() touches every page
    if seconds > 0 or seconds_per_element > 0:
        time.sleep(seconds + seconds_per_element * block.size)
    t0 = time.thread_time()
    busy = busy_seconds + busy_seconds_per_element * block.size
    while time.thread_time() - t0 < busy:
        pass
    out = np.array(block, dtype=np.float32, copy=True)
    out += np.float32(float(scratch[0]) - 1.0)  # use the buffer so it cannot be optimised away
    del scratch
    return out


_FIRST_USE: list[np.ndarray] = []  # what first_use_hog's first call keeps in its process, as a library would


@operator(halo=0, memory_params=("multiple", "first_use_mib"), whole_traces=True)
def first_use_hog(block, multiple: float = 4.0, first_use_mib: float = 150.0, device: str = "cpu"):
    """Return a copy of ``block`` after holding ``multiple`` x its bytes; the first call in a process also keeps
    ``first_use_mib`` MiB of touched memory for the rest of the process's life.

    It stands for a library's first use inside a task: a GPU task's host side creating its CUDA context and
    loading cuFFT / NVRTC (memory the worker then keeps, needed by no later task), or a JIT compiler's first
    compile. On an H100 the demo's host model of a GPU key bounded a chunk of 1 x 26 traces at 178.6 MiB after each
    worker's first chunk: first chunks of ~150 MiB and later ones of ~1 MiB give that bound.
    Memory: ``first_use_mib`` MiB once per process, kept; about (multiple + 2) x the block's bytes each call.
    """
    kept = sys.modules[__name__]._FIRST_USE  # the module's, not a copy a by-value pickle of this function carries
    if not kept:
        kept.append(np.ones(int(first_use_mib * 2**20) // 8, dtype=np.float64))  # ones() touches every page
    scratch = np.ones(int(block.nbytes * multiple) // 8 + 1, dtype=np.float64)
    out = np.array(block, dtype=np.float32, copy=True)
    out += np.float32(float(scratch[0]) - 1.0)
    del scratch
    return out


@operator(halo=0, memory_params=("table_mib",), whole_traces=True)
def table_hog(block, table_mib: float = 300.0, multiple: float = 2.0, seconds: float = 0.0):
    """Return a copy of ``block`` after building a ``table_mib`` MiB table (touched, freed at the end of the call)
    beside ``multiple`` x the block's bytes, held for ``seconds``: an operator whose smallest chunk needs more than
    a thread's share of a multi-threaded worker (a lookup table, a wavelet bank, a velocity model built per call).

    Memory: ``table_mib`` MiB plus about (multiple + 2) x the block's bytes, each call.
    """
    table = np.ones(int(table_mib * 2**20) // 8, dtype=np.float64)  # ones() touches every page
    scratch = np.ones(int(block.nbytes * multiple) // 8 + 1, dtype=np.float64)
    if seconds > 0:
        time.sleep(seconds)
    out = np.array(block, dtype=np.float32, copy=True)
    out += np.float32(float(table[-1]) + float(scratch[0]) - 2.0)
    del table, scratch
    return out


@operator(halo=0, whole_traces=True)
def breaks_gpu_context(block, marker: str = "", always: bool = False, device: str = "cpu"):
    """Return a copy of ``block``, breaking the worker's CUDA context instead in the first chunk to run (the one
    that creates the file ``marker``), or in every chunk with ``always``. For the tests of the runner's worker
    restart. On a real GPU a kernel writes to an illegal address, and CuPy raises ``CUDARuntimeError``
    (cudaErrorIllegalAddress, 700) at the next synchronisation: every later CUDA call of this process fails.
    On the fake device it raises the fake's error of that status
    (:class:`~memchunk_prefect.operators.device.FakeGpuContextError`), which breaks nothing."""
    import os

    from memchunk_prefect.operators.device import FakeGpuContextError

    be = backend(device)
    first = False
    if not always:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))  # atomic: one chunk wins
            first = True
        except FileExistsError:
            pass
    if (always or first) and be.on_gpu and be.fake_capacity is None:
        poke = be.xp.RawKernel(r'''extern "C" __global__ void poke(int* unused) { *((int*)8) = 1; }''', "poke")
        poke((1,), (1,), (be.xp.zeros(1, dtype=be.xp.int32),))
        be.xp.cuda.Device().synchronize()  # raises the illegal address here
    if always or first:
        raise FakeGpuContextError("CUDARuntimeError: cudaErrorIllegalAddress: an illegal memory access was "
                                  "encountered (fake)", 700)
    return np.array(block, dtype=np.float32, copy=True)


def seed_store(store, key: str, bytes_per_element: float, *, sizes=(20_000, 50_000, 100_000, 200_000, 400_000),
               fixed_bytes: int = 0, traces_of: int = 100,
               seconds_per_element: float = DEFAULT_SETTINGS.seconds_per_element) -> None:
    """Add one observation per size claiming ``fixed_bytes + bytes_per_element x elements`` of memory and
    ``seconds_per_element x elements`` of time (the settings' default rate; proportional to size, so the seeded
    rows say nothing of a cost per block: the planner reads their time at the median rate)."""
    for n in sizes:
        traces = max(1, n // traces_of)
        store.add(Observation(operator_key=key, elements=traces * traces_of, extents=(1, traces, traces_of),
                              bytes_in=traces * traces_of * ITEMSIZE,
                              peak_bytes=int(fixed_bytes + bytes_per_element * traces * traces_of),
                              seconds=seconds_per_element * traces * traces_of, outcome="ok", method="seeded"))


def dask_cli(command: str) -> list[str]:
    """``dask scheduler`` / ``dask worker`` as ``python -m distributed.cli.dask_<command>``: this interpreter's
    Dask, wherever its console scripts were installed (``--user``, a system Python, a conda env)."""
    return [sys.executable, "-m", f"distributed.cli.dask_{command}"]


def limit_address_space(headroom_bytes: int) -> int:
    """Cap this process's virtual memory at its current size plus ``headroom_bytes``; returns the cap.

    Run it on workers with ``client.run(limit_address_space, n)``: an allocation past
    the cap fails with a real ``MemoryError`` (numpy's) and the worker survives.
    """
    import resource

    import psutil

    cap = int(psutil.Process().memory_info().vms + headroom_bytes)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    return cap


def limit_file_size(max_bytes: int) -> int:
    """Cap the size of any file this process writes at ``max_bytes`` (``ulimit -f``); returns the cap.

    Run it on workers with ``client.run(limit_file_size, n)``: a write past the cap
    fails with a real ``OSError`` (EFBIG; Python ignores SIGXFSZ), as a full disk
    fails a write with ENOSPC. ``client.restart()`` gives fresh, unlimited workers.
    """
    import resource

    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(max_bytes), hard))
    return int(max_bytes)


class Throttle:
    """Slow a process down by stopping it most of the time: SIGSTOP / SIGCONT at a duty cycle (a real straggler).

    ``duty``: the share of each ``period_seconds`` the process runs (0.1: about
    10x slower in wall time at everything it does, heartbeats included, as a node
    throttled or starved by a neighbour). Use as a context manager; leaving it
    always continues the process.
    """

    def __init__(self, pid: int, duty: float = 0.1, period_seconds: float = 0.2):
        import threading

        if not 0 < duty < 1:
            raise ValueError(f"duty must be in (0, 1), got {duty!r}")
        self.pid, self.duty, self.period = int(pid), float(duty), float(period_seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"throttle-{pid}")

    def _run(self) -> None:
        import os
        import signal

        try:
            while not self._stop.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._stop.wait(self.period * (1 - self.duty))
                os.kill(self.pid, signal.SIGCONT)
                self._stop.wait(self.period * self.duty)
        except ProcessLookupError:
            return
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def __enter__(self) -> "Throttle":
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)


def start_local_cluster(n_workers: int = 2, memory_limit: str | int = "1GiB", threads_per_worker: int = 1, **kwargs):
    """A real LocalCluster of worker processes (one thread each unless told) that reports a worker's death at once.

    ``allowed-failures`` is 0 so the first death raises KilledWorker instead of
    killing one worker after another (Dask retries a task whose worker died
    ``distributed.scheduler.allowed-failures`` times, default 3); the dashboard is off.
    """
    import dask
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 0}):
        return LocalCluster(n_workers=n_workers, threads_per_worker=threads_per_worker, processes=True,
                            memory_limit=memory_limit,
                            dashboard_address="127.0.0.1:0", **kwargs)
