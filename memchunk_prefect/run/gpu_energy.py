"""GPU memory through NVML, and whole-device energy counters (NVML, Intel RAPL), as the monitor reads them.

**GPU memory**: when ``pynvml`` (package ``nvidia-ml-py``) imports and ``nvmlInit()``
succeeds, this process's GPU memory (the sum over all devices of
``nvmlDeviceGetComputeRunningProcesses`` entries whose pid is ``os.getpid()``, bytes)
is sampled on a thread during a run (:class:`_GpuWatch`); its peak is absolute, not
above a resting level: CUDA contexts and memory pools stay allocated between runs. In a
container with its own PID namespace NVML may report host pids and the process then
shows 0 bytes. No NVML, no GPU, or ``NVMLError`` at init means no GPU figures; that is
decided once per process and cached, and never raises or warns. The GPU path is tested
with a fake ``pynvml`` module (tests/test_monitor.py) that reports a process using a
known number of bytes and an energy counter.

**Energy**: the difference of whole-device counters over a run, not a per-process
share: NVML ``nvmlDeviceGetTotalEnergyConsumption`` (millijoules, every GPU) and Intel
RAPL ``/sys/class/powercap/intel-rapl:N/energy_uj`` (microjoules, every CPU package;
wrap-around handled with ``max_energy_range_uj``). :func:`energy_since` gives joules
and what was summed: ``"nvml"``, ``"rapl"``, ``"nvml+rapl"``, or ``None`` where neither
is readable (``energy_uj`` is root-only on kernels >= 5.10).
"""

from __future__ import annotations

import glob
import os
import threading
from typing import Any

__all__ = ["energy_readings", "energy_since", "rapl_delta_uj"]

#: Where the RAPL zones are (one directory per CPU package; ``intel-rapl:N:M`` are sub-zones of package N).
_RAPL_GLOB = "/sys/class/powercap/intel-rapl:*"


class _Nvml:
    """NVML, initialised once per process; ``handles`` is empty when there is no usable NVIDIA GPU."""

    def __init__(self) -> None:
        self.pynvml: Any = None
        self.handles: list[Any] = []
        self.names: list[str] = []
        self.energy_ok = False
        try:
            import pynvml  # from nvidia-ml-py

            pynvml.nvmlInit()
            handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
            names = []
            for h in handles:
                name = pynvml.nvmlDeviceGetName(h)
                names.append(name.decode() if isinstance(name, bytes) else str(name))
        except Exception:  # ImportError, NVMLError (no driver / no GPU), anything odd: no GPU metrics
            return
        self.pynvml, self.handles, self.names = pynvml, handles, names
        try:
            for h in handles:
                pynvml.nvmlDeviceGetTotalEnergyConsumption(h)
            self.energy_ok = bool(handles)
        except Exception:  # pre-Volta GPUs have no energy counter
            self.energy_ok = False

    @property
    def available(self) -> bool:
        return bool(self.handles)

    def process_bytes(self, pid: int) -> tuple[int, set[int]]:
        """GPU memory (bytes) held by ``pid`` summed over devices, and the device indices holding it."""
        total, used_on = 0, set()
        for i, h in enumerate(self.handles):
            try:
                procs = self.pynvml.nvmlDeviceGetComputeRunningProcesses(h)
            except Exception:
                continue
            for p in procs:
                if p.pid == pid and p.usedGpuMemory:  # None when the driver cannot tell
                    total += int(p.usedGpuMemory)
                    used_on.add(i)
        return total, used_on

    def energy_millijoules(self) -> int | None:
        if not self.energy_ok:
            return None
        try:
            return sum(int(self.pynvml.nvmlDeviceGetTotalEnergyConsumption(h)) for h in self.handles)
        except Exception:
            return None


_NVML: dict[int, _Nvml] = {}
_NVML_LOCK = threading.Lock()


def _nvml() -> _Nvml:
    pid = os.getpid()
    with _NVML_LOCK:
        n = _NVML.get(pid)
        if n is None:
            n = _NVML[pid] = _Nvml()
    return n


class _GpuWatch:
    """Samples this process's GPU memory on a thread for one run."""

    def __init__(self, nvml: _Nvml, interval_seconds: float) -> None:
        self.nvml, self.interval_seconds = nvml, interval_seconds
        self.pid = os.getpid()
        self.peak, self.devices = nvml.process_bytes(self.pid)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="memchunk-gpu-sampler", daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        used, devices = self.nvml.process_bytes(self.pid)
        with self._lock:
            self.peak = max(self.peak, used)
            self.devices |= devices

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_seconds):
            self._sample()

    def finish(self) -> tuple[int, str]:
        self._stop.set()
        self._thread.join()
        self._sample()
        names = self.nvml.names
        chosen = [names[i] for i in sorted(self.devices)] or names
        return self.peak, ", ".join(dict.fromkeys(chosen))


class _Rapl:
    """Intel RAPL package counters (microjoules), once per process; empty when unreadable."""

    def __init__(self) -> None:
        self.zones: list[tuple[str, int]] = []  # (energy_uj path, max_energy_range_uj)
        for zone in sorted(glob.glob(_RAPL_GLOB)):
            if os.path.basename(zone).count(":") != 1:  # intel-rapl:0:0 are sub-zones of package 0
                continue
            try:
                with open(os.path.join(zone, "max_energy_range_uj")) as f:
                    top = int(f.read())
                with open(os.path.join(zone, "energy_uj")) as f:
                    int(f.read())
            except (OSError, ValueError):  # root-only since Linux 5.10
                continue
            self.zones.append((os.path.join(zone, "energy_uj"), top))

    def read(self) -> list[int] | None:
        if not self.zones:
            return None
        try:
            out = []
            for path, _ in self.zones:
                with open(path) as f:
                    out.append(int(f.read()))
            return out
        except (OSError, ValueError):
            return None

    def joules(self, before: list[int] | None, after: list[int] | None) -> float | None:
        if before is None or after is None:
            return None
        return sum(rapl_delta_uj(b, a, top) for b, a, (_, top) in zip(before, after, self.zones)) / 1e6


def rapl_delta_uj(before_uj: int, after_uj: int, max_energy_range_uj: int) -> int:
    """Energy (µJ) between two RAPL readings; the counter wraps to 0 after ``max_energy_range_uj``.

    >>> rapl_delta_uj(100, 250, 1000), rapl_delta_uj(900, 50, 1000)
    (150, 150)
    """
    if after_uj >= before_uj:
        return after_uj - before_uj
    return after_uj + max_energy_range_uj - before_uj


_RAPL: dict[int, _Rapl] = {}


def _rapl() -> _Rapl:
    pid = os.getpid()
    r = _RAPL.get(pid)
    if r is None:
        r = _RAPL[pid] = _Rapl()
    return r


def energy_readings(nvml: bool) -> tuple[int | None, list[int] | None]:
    """The counters at a run's start: NVML's millijoules summed over GPUs (only when ``nvml``; None where
    unreadable) and each RAPL package's microjoules (None where unreadable)."""
    nvml_mj = _nvml().energy_millijoules() if nvml else None
    return nvml_mj, _rapl().read()


def energy_since(nvml_mj0: int | None, rapl0: list[int] | None) -> tuple[float | None, str | None]:
    """Joules the devices used since :func:`energy_readings` gave ``nvml_mj0`` and ``rapl0``, and the counters
    summed (``"nvml"``, ``"rapl"``, ``"nvml+rapl"``); ``(None, None)`` when neither could be read.

    >>> energy_since(None, None)
    (None, None)
    """
    energy, sources = 0.0, []
    if nvml_mj0 is not None:
        mj1 = _nvml().energy_millijoules()
        if mj1 is not None:
            energy += (mj1 - nvml_mj0) / 1e3
            sources.append("nvml")
    if rapl0 is not None:
        j = _rapl().joules(rapl0, _rapl().read())
        if j is not None:
            energy += j
            sources.append("rapl")
    return (energy if sources else None), ("+".join(sources) if sources else None)
