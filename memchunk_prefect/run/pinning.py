"""One worker process per GPU on one machine: which GPUs there are, and pinning each local worker to one.

A GPU's memory is the budget of the tasks on it, so two workers sharing a GPU
would each plan for memory the other is using. The runner's own local cluster
therefore has, on the GPU, one single-thread worker per GPU:

- with dask-cuda installed (``pip install 'memchunk-prefect[gpu-cluster]'``),
  its ``LocalCUDACluster``, which starts one worker per GPU, each seeing only
  its own (``CUDA_VISIBLE_DEVICES`` rotated per worker);
- without it, a ``distributed.LocalCluster`` of as many workers as GPUs, each
  pinned by this module loaded as a worker preload (:func:`dask_setup`): the
  worker named ``i`` sets ``CUDA_VISIBLE_DEVICES`` to the ``i``-th GPU of the
  machine (of those the flow's process was given, when it was given some)
  before anything on it initialises CUDA, which reads the variable once.

GPUs are counted through NVML (``pynvml``), which does not create a CUDA
context in the flow's process (CuPy would, holding ~0.5 GiB of the first GPU
for the whole run). A cluster the user starts or points at (``address=``,
``cluster_class=``) is theirs to lay out: nothing here applies to it.

>>> visible_devices({"CUDA_VISIBLE_DEVICES": "2,3"}, nvml_count=lambda: 8)
['2', '3']
>>> device_for("1", ["2", "3"])
'3'
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

from memchunk_prefect.operators.device import FAKE_GPU_ENV

#: The worker preload that pins a local worker to one GPU (see :func:`dask_setup`).
PRELOAD = "memchunk_prefect.run.pinning"


def _nvml_count() -> int:
    """GPUs NVML sees on this machine (0 without a driver or without ``pynvml``)."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetCount())
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no driver, no library: no GPU to lay workers out on
        return 0


def visible_devices(env: Mapping[str, str] | None = None, nvml_count: Callable[[], int] = _nvml_count) -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries: those it was given when the variable
    is set (``""`` or ``"-1"``: none), else every GPU NVML counts, else one fake GPU when the fake device is set
    (:data:`memchunk_prefect.operators.device.FAKE_GPU_ENV`), else none."""
    env = os.environ if env is None else env
    given = env.get("CUDA_VISIBLE_DEVICES")
    if given is not None:
        entries = [d.strip() for d in given.split(",") if d.strip()]
        # CUDA stops at the first invalid entry; "-1" is the usual way to hide every GPU.
        return [] if not entries or entries[0] == "-1" else entries
    n = nvml_count()
    if n > 0:
        return [str(i) for i in range(n)]
    return ["0"] if env.get(FAKE_GPU_ENV) else []


def usable_gpus(env: Mapping[str, str] | None = None) -> tuple[list[str], str]:
    """``(devices, why)``: the GPUs work can be laid out on here (:func:`visible_devices`, when CuPy is installed
    or the fake device set), and in words what was found; no devices, and why, otherwise. Asks NVML and whether
    CuPy is installed, nothing that creates a CUDA context."""
    import importlib.util

    env = os.environ if env is None else env
    devices = visible_devices(env)
    if not devices:
        return [], "no GPU found"
    if env.get(FAKE_GPU_ENV):
        return devices, f"{len(devices)} fake GPU(s) ({FAKE_GPU_ENV})"
    if importlib.util.find_spec("cupy") is None:
        return [], f"{len(devices)} GPU(s) but CuPy is not installed (pip install 'memchunk-prefect[gpu]')"
    return devices, f"{len(devices)} GPU(s) ({', '.join(devices)})"


def device_for(worker_name: Any, devices: list[str]) -> str | None:
    """The GPU (a ``CUDA_VISIBLE_DEVICES`` entry) of the local worker named ``worker_name`` (LocalCluster names
    its workers 0, 1, ...): the name's place among ``devices``, wrapping round; None for a name that is not a
    whole number (a worker this module did not lay out) or without devices."""
    try:
        index = int(str(worker_name))
    except ValueError:
        return None
    return devices[index % len(devices)] if devices and index >= 0 else None


def local_gpu_cluster(devices: list[str], dashboard_address: str = "127.0.0.1:0") -> tuple[str | None, dict]:
    """``(cluster_class, cluster_kwargs)`` of the runner's own cluster on ``devices``: dask-cuda's
    ``LocalCUDACluster`` where it is installed, else a LocalCluster pinned by :func:`dask_setup`; one
    single-thread worker per GPU either way (``cluster_class`` None: prefect-dask's LocalCluster)."""
    common = {"threads_per_worker": 1, "dashboard_address": dashboard_address}
    try:
        import dask_cuda  # noqa: F401 - only whether it is there
    except Exception:  # noqa: BLE001 - not installed, or built for another CUDA: pin the workers ourselves
        return None, {**common, "n_workers": len(devices), "processes": True, "preload": [PRELOAD]}
    return "dask_cuda.LocalCUDACluster", {**common, "CUDA_VISIBLE_DEVICES": ",".join(devices)}


def dask_setup(worker: Any) -> None:
    """Worker preload: pin this worker to its GPU (``CUDA_VISIBLE_DEVICES``), before any CUDA call on it."""
    device = device_for(getattr(worker, "name", None), visible_devices())
    if device is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = device
