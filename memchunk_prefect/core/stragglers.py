"""Workers that are slow rather than dead: told apart from the others by their own runs in one map.

A node throttled by heat or a noisy neighbour, swapping, or with a failing disk runs
every task several times slower than its peers without ever dying, so nothing in
Dask's failure handling notices it; a map then waits on every chunk it holds. This
module only decides (pure functions over observations); the executor names the
worker in the flow's log and the map's summary. Steering later chunks away from it
was tried and measured no better (``python -m benchmarks.studies.straggler``; see
``ChunkedMap.look_for_slow_workers``).

The figure compared is seconds per element (halo included) of the map's finished
runs, each worker's median against the median of every other worker's runs: one
map's chunks are of one operator and similar size, so a ratio far above 1 is the
worker, not the chunk. A worker's first run of an operator pays the kernel for
memory the process never had (``python -m benchmarks.studies.first_touch``: 0.8-1.4 s
against 0.3 s for the same block later, up to 4.7x), so one run never flags a
worker: ``min_runs`` of them must agree (their median), and the excess must be
worth acting on (``min_seconds`` a chunk).

>>> from memchunk_prefect.core.records import Observation
>>> obs = [Observation("k", 1000, (1, 1, 1000), 4000, 1, seconds=s, worker=w)
...        for w, s in [("a", 1.0), ("a", 1.1), ("b", 0.1), ("b", 0.12), ("b", 0.1)]]
>>> [(s.worker, round(s.ratio, 1)) for s in slow_workers(obs, factor=4.0, min_runs=2, min_seconds=0.5)]
[('a', 10.5)]
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Iterable

from memchunk_prefect.core.records import Observation


@dataclass(frozen=True)
class SlowWorker:
    """One worker found slow: its median seconds per element over the others' (``ratio``), from ``runs`` runs.

    ``seconds`` and ``others_seconds``: its median seconds per chunk and the others'.
    """

    worker: str
    ratio: float
    runs: int
    seconds: float
    others_seconds: float
    at: float = 0.0  # when it was found (epoch seconds; set by whoever acts on it)

    def to_dict(self) -> dict:
        return {"worker": self.worker, "ratio": self.ratio, "runs": self.runs, "seconds": self.seconds,
                "others_seconds": self.others_seconds, "found_at": self.at, "message": self.describe()}

    def describe(self) -> str:
        return (f"{self.worker} ran {self.runs} chunk(s) {self.ratio:.1f}x slower per element than the other "
                f"workers (median {self.seconds:.2f} s a chunk against {self.others_seconds:.2f} s)")


def slow_workers(observations: Iterable[Observation], *, factor: float, min_runs: int,
                 min_seconds: float) -> list[SlowWorker]:
    """The workers whose median seconds per element is at least ``factor`` x the other workers' (slowest first).

    Only finished runs count (outcome "ok", a worker, positive seconds and
    elements). A worker needs ``min_runs`` runs and the others ``min_runs``
    between them; its median chunk must also take ``min_seconds`` more than the
    others' (a sub-second difference is not worth a warning).
    """
    rates: dict[str, list[float]] = {}
    secs: dict[str, list[float]] = {}
    for o in observations:
        if o.outcome != "ok" or not o.worker or o.seconds <= 0 or o.elements <= 0:
            continue
        rates.setdefault(o.worker, []).append(o.seconds / o.elements)
        secs.setdefault(o.worker, []).append(o.seconds)
    out = []
    for w, mine in rates.items():
        if len(mine) < min_runs:
            continue
        others = [r for v, rs in rates.items() if v != w for r in rs]
        others_s = [s for v, ss in secs.items() if v != w for s in ss]
        if len(others) < min_runs:
            continue
        ratio = statistics.median(mine) / statistics.median(others)
        seconds, theirs = statistics.median(secs[w]), statistics.median(others_s)
        if ratio >= factor and seconds - theirs >= min_seconds:
            out.append(SlowWorker(w, ratio, len(mine), seconds, theirs))
    return sorted(out, key=lambda s: -s.ratio)
