"""The workload family: pipelines of user operators over surveys and clusters drawn from a seed.

A workload is plain data (JSON in and out of the child processes that run it): its steps (archetype
operators with parameters, :mod:`benchmarks.family.archetypes`), its survey (shape, SEG-Y with IBM floats and
odd line steps, or zarr) and its cluster (two workers, their memory limit and threads). :func:`family` draws
them from a seed, so the same seed gives the same family on any machine.

>>> for w in family(seed=0, count=3):
...     print(w.name)
w0-fam_autocorr-fam_linear-fam_autocorr-fam_gram
w1-fam_first_use-fam_table
w2-fam_gram-fam_gram-fam_table-fam_first_use
>>> family(seed=0, count=3) == family(seed=0, count=3)
True
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field, replace
from typing import Any

#: What each archetype's parameters are drawn from.
_PARAMS = {
    "fam_linear": lambda r: {"k": r.choice([2.0, 4.0, 8.0, 12.0]), "h": r.choice([0, 1, 2, 4]),
                             "passes": r.choice([1, 2, 3])},
    "fam_table": lambda r: {"table_mib": r.choice([64, 128, 192]), "k": r.choice([2.0, 3.0]), "h": r.choice([0, 1, 3])},
    "fam_gram": lambda r: {"h": r.choice([0, 0, 2])},
    "fam_autocorr": lambda r: {"h": r.choice([0, 2, 6, 12])},
    "fam_first_use": lambda r: {"lib_mib": r.choice([100, 150]), "k": r.choice([2.0, 3.0]), "h": r.choice([0, 1])},
}


@dataclass(frozen=True)
class Workload:
    """One member of the family: steps over a survey on a cluster.

    ``shape``: (ilines, crosslines, samples) at 1x; ``scale``: the survey's traces over the 1x survey's, a
    square (4: twice the ilines and crosslines; the family draws 1 or 4, ``--scale`` multiplies it);
    ``source``: ``"segy"`` (IBM floats, inline numbers stepping by 2 and crosslines by 4) or ``"zarr"``;
    ``memory_limit_mib``: each worker's limit; ``threads``: threads per worker (two workers).
    """

    name: str
    steps: tuple[dict[str, Any], ...]
    shape: tuple[int, int, int]
    scale: int = 1
    source: str = "segy"
    memory_limit_mib: int = 800
    threads: int = 1
    seed: int = 0
    workers: int = 2

    @property
    def survey_shape(self) -> tuple[int, int, int]:
        f = math.isqrt(int(self.scale))
        if f < 1 or f * f != int(self.scale):
            raise ValueError(f"a workload's scale is a square (1, 4, 16...): its traces over the 1x survey's, got "
                             f"{self.scale}")
        return (self.shape[0] * f, self.shape[1] * f, self.shape[2])

    def scaled(self, factor: int) -> "Workload":
        """The same workload on a survey of ``factor`` times its traces (a square: 4 doubles both line axes)."""
        w = replace(self, scale=int(self.scale) * int(factor))
        w.survey_shape  # noqa: B018 - raises on a factor that is not a square
        return w

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["steps"] = [dict(s) for s in self.steps]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Workload":
        d = dict(d)
        d["steps"] = tuple(dict(s) for s in d["steps"])
        d["shape"] = tuple(d["shape"])
        return cls(**d)


@dataclass
class _Draw:
    rng: random.Random
    steps: list[dict[str, Any]] = field(default_factory=list)


def family(seed: int = 0, count: int = 6) -> list[Workload]:
    """``count`` workloads drawn from ``seed``: 2 to 4 steps each, every archetype appearing across the family,
    surveys at 1x and 4x, workers of 600 MiB to 2 GiB with 1 or 2 threads, SEG-Y and zarr inputs."""
    rng = random.Random(seed)
    names = sorted(_PARAMS)
    out = []
    for i in range(count):
        n_steps = rng.choice([2, 2, 3, 4])
        first = names[i % len(names)]  # every archetype leads a workload in turn
        chosen = [first] + [rng.choice(names) for _ in range(n_steps - 1)]
        steps = tuple({"op": name, **_PARAMS[name](rng)} for name in chosen)
        shape = (rng.choice([60, 80, 100]), rng.choice([60, 80, 100]), rng.choice([100, 150, 200]))
        out.append(Workload(
            name=f"w{i}-" + "-".join(chosen), steps=steps, shape=shape, scale=(1, 4)[i % 2],
            source=("segy", "zarr")[(i // 2) % 2], memory_limit_mib=rng.choice([600, 800, 1200, 2048]),
            threads=rng.choice([1, 1, 2]), seed=seed * 1000 + i))
    return out


def quick() -> Workload:
    """The family's smallest member, for CI: two steps on a small SEG-Y survey."""
    return Workload(name="quick-fam_linear-fam_gram", steps=({"op": "fam_linear", "k": 4.0, "h": 1, "passes": 1},
                                                             {"op": "fam_gram", "h": 0}),
                    shape=(24, 20, 60), scale=1, source="segy", memory_limit_mib=800, threads=1, seed=7)
