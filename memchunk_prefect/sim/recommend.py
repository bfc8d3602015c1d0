"""What cluster to ask for: the cheapest workers x memory whose simulated runs meet a deadline.

:func:`recommend` screens cluster shapes with a few simulated runs each, then confirms the candidates with
more; the objective is core-hours, energy or time. :func:`frontier` is the Pareto set of what was tried.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from memchunk_prefect.core.chunks import Shape
from memchunk_prefect.core.errors import SimulationInputError, format_bytes
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings
from memchunk_prefect.sim.inputs import ClusterShape, KnowledgeFor, Step, spread_quantiles
from memchunk_prefect.sim.runs import SimResult, run_strategy
from memchunk_prefect.sim.simulate import Summary, summarize


@dataclass
class Candidate:
    """One cluster shape tried by :func:`recommend`, with what the simulator says of it."""

    workers: int
    memory_limit_bytes: int
    threads_per_worker: int
    summary: Summary
    screened: bool = False  # one run only, while searching (not a verdict on the shape)

    def to_dict(self) -> dict[str, Any]:
        return {"workers": self.workers, "memory_limit_bytes": self.memory_limit_bytes,
                "threads_per_worker": self.threads_per_worker, "screened": self.screened,
                **self.summary.to_dict()}


@dataclass
class Recommendation:
    """The cluster shape that meets the deadline with the asked confidence at the least core-hours (None: none
    of those tried), every candidate tried, and the dask-jobqueue arguments for the chosen one."""

    best: Candidate | None
    tried: list[Candidate]
    deadline_seconds: float
    confidence: float
    objective: str = "time"
    walltime_seconds: float | None = None  # the jobs' walltime as simulated (None: none was given)

    def jobqueue_kwargs(self) -> dict[str, Any] | None:
        """``cores``, ``processes``, ``memory``, ``walltime`` for a dask-jobqueue cluster of one worker per job,
        and the number of jobs to ``scale`` to (the walltime as simulated, else the deadline: a job outliving
        it is of no use)."""
        b = self.best
        if b is None:
            return None
        t = int(math.ceil(self.walltime_seconds if self.walltime_seconds is not None else self.deadline_seconds))
        return {"cores": b.threads_per_worker, "processes": 1,
                "memory": format_bytes(b.memory_limit_bytes).replace(" ", ""),
                "walltime": f"{t // 3600:02d}:{t % 3600 // 60:02d}:{t % 60:02d}", "jobs": b.workers}


def recommend(steps: Sequence[Step], shape: Shape, knowledge_for: KnowledgeFor, *, deadline_seconds: float,
              memory_options: Sequence[int], max_workers: int = 256, threads_per_worker: int = 1,
              confidence: float = 0.9, runs: int = 20, seed: int = 0, truth_for: KnowledgeFor | None = None,
              objective: str = "time", settings: PolicySettings = DEFAULT_SETTINGS,
              **cluster_kw: Any) -> Recommendation:
    """The cluster that finishes ``steps`` on ``shape`` within the deadline with probability at least
    ``confidence`` (memchunk strategy, ``runs`` simulated runs per shape) at the least core-hours
    (``objective="time"``) or the least energy (``objective="energy"``: the simulated runs' p50 joules, tasks and
    idle slots; learned per operator where it was, else seconds x ``settings.watts_per_core``).

    For each memory size, the fewest workers (up to ``max_workers``) that meet the deadline are found by
    a search on one run per shape (from the previous memory size's answer: galloping, then bisection;
    makespan falls as workers are added, up to the survey's parallelism), then confirmed with ``runs`` runs,
    adding a few percent of workers while the confidence is not met. No run is simulated past the
    deadline, and a shape's runs stop once more miss it than the confidence allows. With one thread per
    core, fewer workers meeting the deadline is fewer core-hours, and fewer slots left idle.
    """
    from memchunk_prefect.core.energy import check_objective

    check_objective(objective)
    if deadline_seconds <= 0:
        raise SimulationInputError(f"the deadline must be a positive number of seconds, got {deadline_seconds}")
    if not 0 < confidence <= 1:
        raise SimulationInputError(f"confidence must be in (0, 1], got {confidence}")
    if not memory_options:
        raise SimulationInputError("give at least one memory size per worker to try")
    search = _Search(steps, shape, knowledge_for, deadline_seconds, threads_per_worker, confidence, int(runs), seed,
                     truth_for, settings, cluster_kw)
    best: Candidate | None = None
    start = 1  # where the search for the next memory size begins: the previous size's answer
    for memory in sorted(set(int(m) for m in memory_options)):
        try:
            ClusterShape(workers=1, memory_limit_bytes=memory, **cluster_kw)
        except SimulationInputError:
            continue  # no room above the resting memory: not a candidate
        hi = search.fewest_screened(start, memory, max_workers)
        if hi is None:
            continue
        found = search.confirm(hi, memory, max_workers)
        if found is None:
            continue
        start = found.workers
        if best is None or _cost(found, objective) < _cost(best, objective):
            best = found
    return Recommendation(best, search.tried, float(deadline_seconds), float(confidence), objective,
                          cluster_kw.get("walltime_seconds"))


@dataclass
class _Search:
    """The simulated trials :func:`recommend` runs, and every candidate they tried (in the order tried)."""

    steps: Sequence[Step]
    shape: Shape
    knowledge_for: KnowledgeFor
    deadline_seconds: float
    threads_per_worker: int
    confidence: float
    runs: int
    seed: int
    truth_for: KnowledgeFor | None
    settings: PolicySettings
    cluster_kw: dict[str, Any]
    tried: list[Candidate] = field(default_factory=list)

    @property
    def allowed_misses(self) -> int:
        """Runs that may miss the deadline before a shape fails the confidence.

        A shape fails once more runs miss the deadline than the confidence allows: its remaining runs are not
        simulated, and no run is simulated past the deadline (what the search needs is only whether it is met).
        """
        return int(math.floor((1.0 - self.confidence) * self.runs + 1e-9))

    def trial(self, workers: int, memory: int, n: int | None = None) -> Candidate:
        """Up to ``n`` simulated runs (default ``runs``; seeds ``seed``, ``seed + 1``...) of one cluster shape."""
        n = self.runs if n is None else n
        cluster = ClusterShape(workers=workers, memory_limit_bytes=memory, threads_per_worker=self.threads_per_worker,
                               **self.cluster_kw)
        allowed_misses = self.allowed_misses
        results: list[SimResult] = []
        quantiles = spread_quantiles(n)  # run i: seed + i at quantile i, as simulate() pairs them
        # From the middle of the runs' shared factors outwards, the slower of each two first: the runs of a shape
        # that stops early (too many missed the deadline) are as fast and as slow as a whole set's.
        for i in sorted(range(n), key=lambda i: (abs(2 * i + 1 - n), -i)):
            results.append(run_strategy("memchunk", self.steps, self.shape, cluster, self.knowledge_for,
                                        np.random.default_rng(self.seed + i), run_quantile=quantiles[i],
                                        truth_for=self.truth_for, settings=self.settings,
                                        stop_after=self.deadline_seconds))
            if sum(not r.completed or r.makespan_seconds > self.deadline_seconds for r in results) > allowed_misses:
                break
        c = Candidate(workers, memory, self.threads_per_worker,
                      summarize("memchunk", results, self.deadline_seconds), screened=n < self.runs)
        self.tried.append(c)
        return c

    def ok(self, c: Candidate) -> bool:
        """The candidate met the deadline with the asked confidence."""
        return c.summary.p_deadline is not None and c.summary.p_deadline >= self.confidence

    def screen(self, workers: int, memory: int) -> bool:
        """One run (seed ``seed``) meets the deadline: the search's cheap question."""
        s = self.trial(workers, memory, 1).summary
        return s.completed == 1 and s.p_deadline == 1.0

    def fewest_screened(self, start: int, memory: int, max_workers: int) -> int | None:
        """The fewest workers (up to ``max_workers``) whose first run meets the deadline; None when none does.

        Brackets the answer in (lo, hi]: gallops down from ``start`` (halving) while it passes, or up (doubling)
        while it fails; then bisects.
        """
        hi: int | None
        if self.screen(start, memory):
            hi, lo = start, start // 2
            while lo >= 1 and self.screen(lo, memory):
                hi, lo = lo, lo // 2
        else:
            lo, hi = start, None
            while hi is None and lo < max_workers:
                nxt = min(max_workers, lo * 2)
                if self.screen(nxt, memory):
                    hi = nxt
                else:
                    lo = nxt
            if hi is None:
                return None
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if self.screen(mid, memory):
                hi = mid
            else:
                lo = mid
        return hi

    def confirm(self, workers: int, memory: int, max_workers: int) -> Candidate | None:
        """The first shape from ``workers`` up that meets the confidence with every run, adding a few percent of
        workers at a time where it falls short; None when ``max_workers`` does not."""
        hi = workers
        while True:
            c = self.trial(hi, memory)
            if self.ok(c):
                return c
            if hi >= max_workers:
                return None
            hi = min(max_workers, hi + max(1, hi // 20))


def frontier(rec: Recommendation) -> list[Candidate]:
    """Per memory size tried, the fewest workers that met the deadline (what :func:`recommend` chose among),
    by memory size: the trade-off a plot of makespan, core-hours and energy against memory per worker shows."""
    best: dict[int, Candidate] = {}
    for c in rec.tried:
        if c.screened:
            continue
        met = c.summary.p_deadline is not None and c.summary.p_deadline >= rec.confidence
        if met and (c.memory_limit_bytes not in best or c.workers < best[c.memory_limit_bytes].workers):
            best[c.memory_limit_bytes] = c
    return [best[m] for m in sorted(best)]


def plot_recommendation(rec: Recommendation, path: str | Path, title: str = "") -> Path:
    """A PNG of :func:`frontier`: makespan p50, core-hours and (where simulated) energy against memory per
    worker, the workers each needs written at its point, the recommended shape marked. Needs matplotlib
    (``pip install 'memchunk-prefect[plot]'``)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SimulationInputError(f"the plot needs matplotlib ({exc}): pip install 'memchunk-prefect[plot]'") from exc
    points = frontier(rec)
    if not points:
        raise SimulationInputError("no cluster shape met the deadline: nothing to plot")
    gib = [c.memory_limit_bytes / 2**30 for c in points]
    series = [("makespan p50 (s)", [c.summary.makespan_p50 for c in points]),
              ("core-hours", [c.summary.core_hours_p50 for c in points])]
    if all(c.summary.energy_joules_p50 is not None for c in points):
        series.append(("energy p50 (kJ)", [c.summary.energy_joules_p50 / 1e3 for c in points]))  # type: ignore
    fig, axes = plt.subplots(len(series), 1, sharex=True, figsize=(6, 2.2 * len(series)))
    for ax, (label, values) in zip(axes, series):
        ax.plot(gib, values, marker="o")
        for x, y, c in zip(gib, values, points):
            ax.annotate(f"{c.workers} w", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
            if rec.best is not None and c is rec.best:
                ax.plot([x], [y], marker="*", markersize=14, color="tab:red")
        ax.set_ylabel(label)
        ax.set_xscale("log", base=2)
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("memory per worker (GiB)")
    axes[0].set_title(title or f"fewest workers meeting {rec.deadline_seconds:.0f} s "
                               f"(p >= {rec.confidence:g}); * = recommended ({rec.objective})", fontsize=9)
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def _cost(c: Candidate, objective: str) -> float:
    """What :func:`recommend` minimises: core-hours, or joules (p50 of the simulated runs)."""
    value = c.summary.energy_joules_p50 if objective == "energy" else c.summary.core_hours_p50
    return math.inf if value is None else float(value)
