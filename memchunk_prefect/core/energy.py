"""Energy per task: measured where a counter exists, estimated (and labelled so) where none does.

Pure functions over plain data; no counters are read here (the worker reads
NVML and RAPL in :mod:`memchunk_prefect.run.monitor`).

Sources (``Observation.energy_source``):

- ``"nvml"``, ``"rapl"``, ``"nvml+rapl"`` — **measured**: the difference of a
  whole-device counter (a GPU by NVML, every CPU package by Linux RAPL) over the
  task's run. A device counter sees everything the device did: when other tasks
  ran on the same device at the same time, their energy is in it too
  (:func:`split_device_energy` shares it out).
- ``"estimate"`` — **estimated** where no counter can be read (RAPL's
  ``energy_uj`` is root-only on Linux >= 5.10; virtual machines expose none):
  the task's CPU seconds times a power figure per busy core, the constant-power
  fallback CodeCarbon uses when it cannot read a counter (it takes half the
  CPU's TDP: https://github.com/mlco2/codecarbon/issues/524). The default,
  :data:`DEFAULT_WATTS_PER_CORE`, is a stated assumption, not a measurement:
  set yours (``MemoryAwareRunner(watts_per_core=...)``) from your CPU's TDP over
  its cores.

Measured and estimated joules are never mixed: the model learns one kind per
operator key (measured once any measured run exists, see
:class:`memchunk_prefect.learn.energy.EnergyModel`), and reports say which it is.

>>> estimate_joules(cpu_seconds=2.0, watts_per_core=10.0)
20.0
>>> is_measured("rapl"), is_measured("estimate"), is_measured(None)
(True, False, False)
>>> round(kwh(3.6e6), 6)
1.0
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Hashable, Iterable, Mapping, Sequence

from memchunk_prefect.core.errors import EnergyInputError

#: Watts one busy core draws, assumed where no counter can be read: 10 W. A 2-socket server with two 200 W
#: TDP, 20-core CPUs at CodeCarbon's half-TDP constant is 5 W per core; a 65 W, 4-core desktop CPU at full
#: load about 16 W. Set your own figure: estimates scale with it.
DEFAULT_WATTS_PER_CORE = 10.0
#: Watts one allocated but idle core draws (a slot waiting for the last wave), assumed: 3 W (about a
#: third of the busy figure; idle package power of server CPUs is typically 25-40% of TDP).
DEFAULT_IDLE_WATTS_PER_CORE = 3.0
#: What ``Observation.energy_source`` says for an estimate.
ESTIMATE = "estimate"
#: Joules in one kilowatt-hour.
JOULES_PER_KWH = 3.6e6
#: The objectives the planner can minimise.
OBJECTIVES = ("time", "energy")


def is_measured(source: str | None) -> bool:
    """True for an energy figure read from a counter (``nvml``, ``rapl``, both), False for an estimate or none."""
    return bool(source) and source != ESTIMATE


def kwh(joules: float) -> float:
    """Kilowatt-hours in ``joules`` (WfFormat's ``energyInKWh``)."""
    return float(joules) / JOULES_PER_KWH


def check_watts(value: object, what: str = "watts_per_core") -> float:
    """A power figure in watts: a finite number above zero, else :class:`EnergyInputError`."""
    try:
        w = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        w = float("nan")
    if isinstance(value, bool) or not math.isfinite(w) or w <= 0:
        raise EnergyInputError(
            f"`{what}` must be a positive number of watts, got {value!r}; use your CPU's TDP divided by its "
            f"cores (the default is {DEFAULT_WATTS_PER_CORE:g} W per busy core)")
    return w


def check_objective(value: object) -> str:
    """``"time"`` or ``"energy"``, else :class:`EnergyInputError`."""
    if value not in OBJECTIVES:
        raise EnergyInputError(f"`objective` must be one of {OBJECTIVES}, got {value!r}: 'time' plans for the "
                               "shortest run, 'energy' for the least joules (within `deadline_seconds` if set)")
    return str(value)


def estimate_joules(cpu_seconds: float, watts_per_core: float = DEFAULT_WATTS_PER_CORE) -> float:
    """Energy of a task that kept cores busy for ``cpu_seconds`` (summed over its threads), joules."""
    return max(0.0, float(cpu_seconds)) * float(watts_per_core)


@dataclass(frozen=True)
class DeviceRun:
    """One task's run on a device whose energy counter it read: ``start``/``end`` epoch seconds,
    ``device_joules`` the counter's difference over the run, ``weight`` its share of the device while
    it ran (busy cores: CPU seconds / wall seconds; 1.0 for one task per GPU)."""

    start: float
    end: float
    device_joules: float
    weight: float = 1.0


def split_device_energy(runs: Sequence[DeviceRun]) -> list[float]:
    """Each run's own share of a whole-device counter read by several overlapping runs, joules.

    Every run read the device's counter over its own interval, so where runs
    overlap each counted the others' energy too; summing them counts it twice.
    The split: over each piece of time where the same runs are active, the
    device's power is taken from the run(s) measuring it (each run's mean power,
    ``device_joules / (end - start)``, averaged over the active runs) and shared
    among the active runs in proportion to their ``weight``. Runs alone on the
    device keep exactly what they read; the shares of overlapping runs add up to
    the device's energy over the union of their intervals (to the extent the
    device's power was steady within each run).

    Error of the split (documented, not hidden): power that varies *within* a
    run is averaged over it, so a short burst of one task while another idles
    is spread in proportion to busy cores, not to who caused it; and the idle
    power of the device is charged to whoever was running. Errors shrink as runs
    get shorter against the variation of power.

    >>> [round(j, 3) for j in split_device_energy([DeviceRun(0, 10, 100.0), DeviceRun(20, 30, 50.0)])]
    [100.0, 50.0]
    >>> [round(j, 3) for j in split_device_energy([DeviceRun(0, 10, 100.0), DeviceRun(0, 10, 100.0)])]
    [50.0, 50.0]
    >>> [round(j, 3) for j in split_device_energy([DeviceRun(0, 10, 100.0), DeviceRun(5, 10, 50.0)])]
    [75.0, 25.0]
    """
    n = len(runs)
    if n == 0:
        return []
    for r in runs:
        if not (math.isfinite(r.start) and math.isfinite(r.end) and r.end >= r.start):
            raise EnergyInputError(f"a device run must end at or after its start, got {r!r}")
        if not math.isfinite(r.device_joules) or r.device_joules < 0 or not r.weight > 0:
            raise EnergyInputError(f"a device run needs joules >= 0 and a weight > 0, got {r!r}")
    out = [0.0] * n
    power = [r.device_joules / (r.end - r.start) if r.end > r.start else 0.0 for r in runs]
    for i, r in enumerate(runs):
        if r.end <= r.start:
            out[i] = r.device_joules  # an instant: nothing to share
    edges = sorted({t for r in runs if r.end > r.start for t in (r.start, r.end)})
    for a, b in zip(edges, edges[1:]):
        active = [i for i, r in enumerate(runs) if r.start <= a and r.end >= b and r.end > r.start]
        if not active:
            continue
        watts = sum(power[i] for i in active) / len(active)
        total_weight = sum(runs[i].weight for i in active)
        for i in active:
            out[i] += watts * (b - a) * runs[i].weight / total_weight
    return out


def split_among_devices(devices: Sequence[Hashable], runs: Sequence[DeviceRun]) -> list[float]:
    """:func:`split_device_energy` within each device's runs: ``devices[i]`` names run ``i``'s device (a host
    and its counter, e.g. ``("node-a", "rapl")``); runs on different devices share nothing.

    >>> split_among_devices(["a", "a", "b"], [DeviceRun(0, 10, 100.0)] * 3)
    [50.0, 50.0, 100.0]
    """
    out = [0.0] * len(runs)
    groups: dict[Hashable, list[int]] = {}
    for i, device in enumerate(devices):
        groups.setdefault(device, []).append(i)
    for idx in groups.values():
        for i, j in zip(idx, split_device_energy([runs[i] for i in idx])):
            out[i] = j
    return out


def busy_weight(cpu_seconds: float | None, seconds: float | None) -> float:
    """A run's share of a device while it ran, for :class:`DeviceRun`: busy cores (CPU seconds over wall
    seconds), 1.0 where either is unknown or zero."""
    if cpu_seconds is None or seconds is None or cpu_seconds <= 0 or seconds <= 0:
        return 1.0
    return float(cpu_seconds) / float(seconds)


def plan_energy_joules(*, n_chunks: int, slots: int, chunk_seconds: float, overhead_seconds: float,
                       chunk_joules: float | None, watts_per_core: float = DEFAULT_WATTS_PER_CORE,
                       idle_watts_per_core: float = DEFAULT_IDLE_WATTS_PER_CORE) -> float:
    """Energy of running ``n_chunks`` equal chunks on ``slots`` slots (one core each), joules.

    - busy: each chunk's compute, ``chunk_joules`` where energy was learned for the
      operator, else ``chunk_seconds x watts_per_core``; plus its per-task overhead
      (Prefect and Dask bookkeeping) at the busy figure;
    - idle: slots allocated for the run but not busy (the last wave that leaves
      slots waiting) at ``idle_watts_per_core``: ``slots x makespan`` slot-seconds
      less the busy ones.

    >>> plan_energy_joules(n_chunks=3, slots=2, chunk_seconds=10.0, overhead_seconds=0.0, chunk_joules=None)
    330.0
    """
    n, s = max(1, int(n_chunks)), max(1, int(slots))
    per_chunk = (chunk_joules if chunk_joules is not None else chunk_seconds * watts_per_core)
    busy_seconds = n * (chunk_seconds + overhead_seconds)
    makespan = math.ceil(n / s) * (chunk_seconds + overhead_seconds)
    idle_seconds = max(0.0, s * makespan - busy_seconds)
    return n * (per_chunk + overhead_seconds * watts_per_core) + idle_seconds * idle_watts_per_core


def energy_by_source(items: Iterable[tuple[float | None, str | None]]) -> dict[str, float]:
    """Joules summed per source (``rapl``, ``nvml``, ``estimate``, ...): measured and estimated figures are
    kept apart, never added together. ``items``: ``(joules, source)`` pairs; those without joules are skipped.

    >>> energy_by_source([(1.0, "estimate"), (2.5, "estimate"), (4.0, "rapl"), (None, None)])
    {'estimate': 3.5, 'rapl': 4.0}
    """
    out: dict[str, float] = {}
    for joules, source in items:
        if joules is not None:
            key = source or "estimate"
            out[key] = out.get(key, 0.0) + float(joules)
    return dict(sorted(out.items()))


def energy_text(by_source: Mapping[str, float]) -> str:
    """Energy for a table cell, per source: measured by a counter, or estimated (never one sum of both).

    >>> energy_text({"estimate": 1534.0}), energy_text({"rapl": 12.5, "estimate": 3.0}), energy_text({})
    ('1.5 kJ (estimated)', '12.5 J (rapl) + 3.0 J (estimated)', 'n/a')
    """
    if not by_source:
        return "n/a"

    def figure(j: float) -> str:
        return f"{j / 1000:.1f} kJ" if j >= 1000 else f"{j:.1f} J"

    measured = [(s, j) for s, j in by_source.items() if s != "estimate"]
    parts = [f"{figure(j)} ({s})" for s, j in measured]
    if "estimate" in by_source:
        parts.append(f"{figure(by_source['estimate'])} (estimated)")
    return " + ".join(parts)
