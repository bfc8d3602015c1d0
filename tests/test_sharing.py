"""A map whose chunks need more than a thread's share of a multi-threaded worker runs one task per worker.

The rules, as table rows on the pure machine (no cluster); the placement on a real cluster is in
tests/test_runner.py, and the simulator's in the last test here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest

from memchunk_prefect.core.budget import WorkerMemory, budget
from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.errors import BudgetTooSmallError
from memchunk_prefect.core.messages import (
    ChunkDone,
    ChunkOutOfMemory,
    Decided,
    Fail,
    SlotsChanged,
    Submit,
)
from memchunk_prefect.core.records import Prediction
from memchunk_prefect.sim.cluster import SimulatedCluster
from memchunk_prefect.sim.inputs import ClusterShape, _Task
from tests.test_machine import Linear, machine, obs, of, started

MiB = 2**20


@dataclass
class Table(Linear):
    """A fake model of an operator holding a fixed ``table`` (bytes) beside ``bytes_per_element``; its bound is
    ``spread`` x its mean."""

    table: float = 150 * MiB
    spread: float = 1.2

    def predict(self, extents):
        mean = self.table + self.bytes_per_element * math.prod(extents)
        return Prediction(mean, self.spread * mean, 10 if self.ready else 0, self.ready, "")


def alone_start(m, *, slots=4, budget=100 * MiB, worker_budget=200 * MiB, threads=2):
    return started(m, slots=slots, budget=budget, headroom_bytes=budget, threads_per_worker=threads,
                   worker_budget_bytes=worker_budget)


def test_a_table_larger_than_a_threads_share_runs_one_task_per_worker_planned_for_the_whole_worker():
    # 150 MiB of table: over a 100 MiB share of a 2-thread worker, inside the worker's 200 MiB alone.
    m = machine((16, 8, 10), knowledge=Table(bytes_per_element=1000))
    first, submitted = alone_start(m)
    assert not of(Fail, first)
    (d,) = of(Decided, first)
    assert d.record.reason.startswith("one task per worker (2 slots, not 2 x 2 threads): even the smallest chunk")
    assert "a task alone on its worker has 200.0 MiB, a thread's share 100.0 MiB" in d.record.reason
    assert m.slots == 2 and m.budget_bytes == 200 * MiB
    assert d.record.upper_bound_bytes <= 200 * MiB
    subs = of(Submit, submitted)
    assert len(subs) == 2, "alone: exactly one chunk in flight per worker, none queued on a worker's free thread"
    assert all(s.per_worker == 1 for s in subs)


def test_without_the_workers_whole_budget_or_on_one_thread_workers_nothing_changes():
    for kwargs in ({"worker_budget": None}, {"threads": 1, "slots": 2}):
        m = machine((16, 8, 10), knowledge=Table(bytes_per_element=1000))
        first, submitted = alone_start(m, **kwargs)
        (fail,) = of(Fail, first)
        assert isinstance(fail.error, BudgetTooSmallError) and submitted == []


def test_a_map_that_fits_a_threads_share_keeps_every_thread():
    m = machine((16, 8, 10), knowledge=Table(table=10 * MiB, bytes_per_element=1000))
    first, submitted = alone_start(m)
    (d,) = of(Decided, first)
    assert "one task per worker" not in d.record.reason and m.slots == 4 and m.budget_bytes == 100 * MiB
    assert all(s.per_worker is None for s in of(Submit, submitted))


def test_a_ready_model_whose_bound_for_the_smallest_chunk_is_over_a_threads_share_runs_alone_not_probing():
    # Mean 60 MiB fits a 100 MiB share, the bound (3x: noisy runs of a 2-thread worker) does not: without the
    # whole worker this would probe wave after wave; alone its 200 MiB holds the bound.
    m = machine((16, 8, 10), knowledge=Table(table=60 * MiB, bytes_per_element=1000, spread=3.0))
    first, _ = alone_start(m, budget=100 * MiB, worker_budget=250 * MiB)
    (d,) = of(Decided, first)
    assert d.record.decision == "rechunk", d.record.reason
    assert "the model's bound for the smallest chunk is over a thread's share" in d.record.reason
    assert m.sharing.per_worker == 1


def test_a_plan_far_faster_alone_takes_the_whole_worker():
    # 90 MiB of table leaves 10 MiB of a 100 MiB share for data (~100 traces a chunk at 1000 B/element): ~160
    # chunks at 0.15 s of overhead each over 4 slots; alone, 110 MiB a chunk: ~15 chunks over 2.
    m = machine((128, 128, 100), knowledge=Table(table=90 * MiB, bytes_per_element=1000, spread=1.0),
                max_counts=4096)
    first, _ = alone_start(m)
    (d,) = of(Decided, first)
    assert "one task per worker" in d.record.reason and "its plan is estimated at" in d.record.reason, \
        d.record.reason
    assert d.record.n_chunks < 100


def test_a_chunk_that_cannot_be_split_runs_again_alone_on_its_worker_before_the_map_fails():
    m = machine((1, 1, 10), knowledge=Table(table=10 * MiB, bytes_per_element=1000))
    alone_start(m, slots=2, threads=2)
    (sid,) = m.in_flight
    out = m.handle(ChunkOutOfMemory(sid, None))
    assert not of(Fail, out)
    (d,) = of(Decided, out)
    assert d.record.decision == "retry-smaller" and "cannot be split further" in d.record.reason
    assert m.sharing.per_worker == 1 and m.budget_bytes == 200 * MiB
    (again,) = of(Submit, m.advance())
    assert again.chunk == Chunk((0, 0, 0), (1, 1, 10)) and again.per_worker == 1
    # A second time alone: the map fails as before, with the whole worker's budget in its error.
    (fail,) = of(Fail, m.handle(ChunkOutOfMemory(again.id, None)))
    assert "200.0 MiB" in str(fail.error)


def test_every_unsplittable_chunk_that_ran_on_a_threads_share_runs_again_alone_not_only_the_first():
    # Both threads of a worker die together: both chunks ran on a thread's share.
    m = machine((1, 2, 10), knowledge=Table(table=10 * MiB, bytes_per_element=1000))
    alone_start(m, slots=2, threads=2, budget=100 * MiB, worker_budget=200 * MiB)
    first, second = sorted(m.in_flight)
    assert not of(Fail, m.handle(ChunkOutOfMemory(first, None)))
    out = m.handle(ChunkOutOfMemory(second, None))
    assert not of(Fail, out) and "runs again alone" in of(Decided, out)[0].record.reason
    again = of(Submit, m.advance())
    assert len(again) == 1 and again[0].per_worker == 1, "alone: one at a time on the map's 1 slot"
    (fail,) = of(Fail, m.handle(ChunkOutOfMemory(again[0].id, None)))
    assert "200.0 MiB" in str(fail.error)


def test_workers_joining_a_map_that_runs_alone_count_as_workers_not_threads():
    m = machine((64, 8, 10), knowledge=Table(bytes_per_element=50_000))  # ~20 traces a chunk alone
    alone_start(m)
    assert len(m.in_flight) == 2 and len(m.queue) > 2
    m.handle(SlotsChanged(8))  # 4 workers x 2 threads
    assert m.slots == 4
    assert len(m.in_flight) + len(of(Submit, m.advance())) == 4


def test_the_budget_of_a_task_alone_on_its_worker_is_its_kill_line_less_its_resting_memory():
    w = [WorkerMemory("tcp://a:1", 2, 1000 * MiB, 200 * MiB, 0.95),
         WorkerMemory("tcp://b:1", 2, 1000 * MiB, 300 * MiB, 0.95)]
    b = budget(w)
    assert (b.budget_bytes, b.worker_budget_bytes) == (325 * MiB, 650 * MiB)
    assert budget(w, memory_budget=500 * MiB).worker_budget_bytes == 500 * MiB
    assert budget(w, target_fraction=0.8).worker_budget_bytes == 500 * MiB  # 0.8 x 1000 MiB less 300 resting


@pytest.mark.parametrize("per_worker, running, pending", [(0, [1, 2], 0), (1, [1, 1], 1)])
def test_the_simulator_places_a_map_that_runs_alone_one_task_per_worker(per_worker, running, pending):
    sim = SimulatedCluster(ClusterShape(workers=2, memory_limit_bytes=1000 * MiB, threads_per_worker=2),
                           np.random.default_rng(0))
    for sid in range(3):
        task = _Task(sid, Chunk((sid, 0, 0), (sid + 1, 1, 1)), (1, 1, 1), memory=10 * MiB, seconds=1.0)
        task.per_worker = per_worker
        sim.submit(task)
    assert sorted(len(tasks) for tasks in sim.running.values()) == running
    assert len(sim.pending) == pending


@pytest.mark.parametrize("threads_per_core, chunks", [(1.0, 4), (2.0, 2)])
def test_threads_beyond_the_cpu_cores_are_not_counted_as_parallel_compute(threads_per_core, chunks):
    # 2 workers x 2 threads: 4 slots. Each thread with a core of its own, 4 chunks finish in half the time of 2;
    # 4 threads on 2 cores run 4 chunks at half speed each: no faster than 2 chunks, and 4 tasks' overhead.
    m = machine((16, 8, 10), knowledge=Linear(bytes_per_element=100, spe=1e-2))
    first, _ = started(m, slots=4, budget=200 * 1024, threads_per_worker=2, threads_per_core=threads_per_core)
    (d,) = of(Decided, first)
    assert d.record.n_chunks == chunks, d.record.reason


def test_a_cold_starts_probes_on_workers_of_several_threads_run_alone_and_its_plan_one_task_per_thread():
    """A probe measures the operator: beside another task on its worker its peak would hold the other's memory
    (Observation.alone), so each probe asks for its whole worker; the plan after them shares the threads again."""
    k = Linear(bytes_per_element=100, ready=False)
    m = machine((64, 8, 10), knowledge=k)
    first, submitted = started(m, slots=4, budget=100 * 1024, threads_per_worker=2)
    probes = of(Submit, submitted)
    assert probes and all(s.decision == "probe" and s.per_worker == 1 for s in probes), probes
    k.ready = True
    for s in probes:
        m.handle(ChunkDone(s.id, obs(s.chunk, peak=100 * s.chunk.elements)))
    planned = of(Submit, m.advance())
    assert planned and all(s.decision != "probe" and s.per_worker is None for s in planned), planned
    one_thread = machine((64, 8, 10), knowledge=Linear(bytes_per_element=100, ready=False))
    _, submitted = started(one_thread, slots=2, budget=100 * 1024, threads_per_worker=1)
    assert all(s.per_worker is None for s in of(Submit, submitted))


@pytest.mark.parametrize("threads_per_core, alone", [(1.0, False), (2.0, True)])
def test_on_threads_that_share_cores_a_plan_alone_estimated_no_longer_takes_the_whole_worker(threads_per_core, alone):
    """A 40 MiB table fits a thread's 100 MiB share, so one task per thread can be planned; alone, a chunk has
    200 MiB. With a core per thread, 4 chunks at once compute twice as fast as 2 and the threads are kept. With
    the two threads of a worker on one core, the 4 chunks compute no sooner than 2 alone, and pay twice the
    per-task overhead: the plan alone is taken, without the gain asked of it where the threads add parallelism."""
    m = machine((64, 16, 100), knowledge=Table(table=40 * MiB, bytes_per_element=100, spread=1.0, spe=1e-5))
    first, submitted = started(m, slots=4, budget=100 * MiB, headroom_bytes=100 * MiB, threads_per_worker=2,
                               worker_budget_bytes=200 * MiB, threads_per_core=threads_per_core)
    (d,) = of(Decided, first)
    assert (m.sharing.per_worker == 1) is alone, d.record.reason
    assert ("one task per worker" in d.record.reason) is alone, d.record.reason
    assert all((s.per_worker == 1) is alone for s in of(Submit, submitted))
