"""What the cluster says about memory, as plain data: slots, kill line, budget (no cluster needed)."""

from __future__ import annotations

import dask
import pytest

from memchunk_prefect.core import budget as budget_mod
from memchunk_prefect.core.budget import kill_headroom_bytes, slots, task_budget, workers_from_info
from memchunk_prefect.core.errors import BudgetError
from memchunk_prefect.run.cluster import configured_kill_fraction

GiB = 2**30


def info(*workers):
    return {"workers": {f"tcp://w:{i}": w for i, w in enumerate(workers)}}


def worker(limit=4 * GiB, threads=1, resting=GiB // 4, nanny="tcp://n:1"):
    return {"nthreads": threads, "memory_limit": limit, "metrics": {"memory": resting}, "nanny": nanny}


@pytest.mark.parametrize("fractions, default, expect", [
    ({"tcp://w:0": 0.95}, 0.95, int(0.95 * 4 * GiB) - GiB // 4),   # the worker's own setting
    ({"tcp://w:0": 0.80}, 0.95, int(0.80 * 4 * GiB) - GiB // 4),   # a worker configured otherwise wins
    ({}, 0.90, int(0.90 * 4 * GiB) - GiB // 4),                    # not asked: this process's setting
    ({"tcp://w:0": False}, 0.95, None),                            # terminate: False, no kill line
])
def test_the_kill_headroom_comes_from_each_workers_own_setting(fractions, default, expect):
    assert kill_headroom_bytes(workers_from_info(info(worker()), fractions, default)) == expect


def test_a_worker_without_a_nanny_has_no_kill_line_and_the_smallest_headroom_counts():
    ws = workers_from_info(info(worker(nanny=None), worker(limit=2 * GiB, nanny="tcp://n:2")), {}, 0.95)
    assert [w.kill_fraction for w in ws] == [None, 0.95]
    assert kill_headroom_bytes(ws) == int(0.95 * 2 * GiB) - GiB // 4


def test_slots_and_budget_over_several_workers():
    ws = workers_from_info(info(worker(threads=2), worker(limit=2 * GiB)), {}, 0.95)
    assert slots(ws) == 3
    assert task_budget(ws, 0.75) == min(int(4 * GiB * 0.75 / 2), int(2 * GiB * 0.75)) - GiB // 4


def test_a_target_at_or_above_the_nannys_kill_fraction_is_refused_naming_the_setting():
    ws = workers_from_info(info(worker()), {"tcp://w:0": 0.7}, 0.95)
    with pytest.raises(BudgetError, match="distributed.worker.memory.terminate"):
        task_budget(ws, 0.75)


def test_the_kill_fraction_is_read_from_dasks_configuration():
    with dask.config.set({"distributed.worker.memory.terminate": False}):
        assert configured_kill_fraction() is None
    with dask.config.set({"distributed.worker.memory.terminate": 0.9}):
        assert configured_kill_fraction() == 0.9


@pytest.mark.cluster
def test_the_kill_fraction_is_read_from_the_workers_not_from_this_process():
    """Workers started with terminate 0.8 (their nanny kills at 0.8) while this process says 0.95."""
    from distributed import Client

    from memchunk_prefect.run.cluster import read_kill_fractions, scheduler_info
    from memchunk_prefect.testing import start_local_cluster

    with dask.config.set({"distributed.worker.memory.terminate": 0.8}):
        cluster = start_local_cluster(n_workers=1, memory_limit="1GiB")
    try:
        with Client(cluster.scheduler_address, set_as_default=False) as client:
            assert configured_kill_fraction() == 0.95
            info = scheduler_info(client)
            (w,) = workers_from_info(info, read_kill_fractions(client), configured_kill_fraction())
            assert w.kill_fraction == 0.8
            assert w.kill_headroom_bytes == int(0.8 * GiB) - w.resting_bytes
    finally:
        cluster.close()


def test_the_budget_is_the_kill_line_less_resting_and_a_users_figure_only_caps_it():
    from memchunk_prefect.core.budget import budget

    ws = workers_from_info(info(worker(), worker(limit=2 * GiB, resting=GiB // 2, nanny="tcp://n:2")), {}, 0.95)
    b = budget(ws)
    assert b.budget_bytes == int(0.95 * 2 * GiB) - GiB // 2, "the worker with the least headroom sets it"
    assert b.headroom_bytes == {"tcp://w:0": int(0.95 * 4 * GiB) - GiB // 4, "tcp://w:1": b.budget_bytes}
    assert "kill line" in b.reason and "resting" in b.reason
    assert budget(ws, target_fraction=0.5).budget_bytes == int(0.5 * 2 * GiB) - GiB // 2
    assert budget(ws, memory_budget=GiB // 8).budget_bytes == GiB // 8
    assert budget(ws, memory_budget=8 * GiB).budget_bytes == b.budget_bytes, "a budget above the line is capped"
    no_limit = workers_from_info(info(worker(limit=0)), {}, 0.95)
    assert budget(no_limit, memory_budget=GiB).budget_bytes == GiB, "no limit: the user's budget as given"
    with pytest.raises(BudgetError, match="memory_limit"):
        budget(no_limit)


def _hold(target_bytes: int, seconds: float) -> tuple[int, float]:
    """Run on a worker: grow the process to ``target_bytes`` for ``seconds``.

    Returns its memory while holding (bytes) and the time it let go (``time.time()``, the machine's clock, which
    the scheduler's status changes are stamped with too).
    """
    import time as _time

    import numpy as np
    import psutil

    block = np.ones(max(0, target_bytes - psutil.Process().memory_info().rss) // 8)
    rss = psutil.Process().memory_info().rss
    _time.sleep(seconds)
    del block
    return rss, _time.time()


@pytest.mark.cluster
def test_a_worker_above_its_pause_line_is_read_as_one_pause_with_its_duration():
    # A real pause: the worker grown to 0.875 of its 1 GiB limit, between Dask's pause line (0.8: 819 MiB) and the
    # nanny's kill line (0.95: 973 MiB), for 2 s.
    import time

    from distributed import Client

    from memchunk_prefect.core.records import paused_within, pauses_from
    from memchunk_prefect.run import cluster
    from memchunk_prefect.testing import start_local_cluster

    lc = start_local_cluster(n_workers=1, memory_limit="1GiB")
    client = Client(lc)
    try:
        before = time.time()
        rss, released = client.submit(_hold, int(0.875 * 2**30), 2.0, pure=False).result()
        time.sleep(0.5)  # the worker's memory monitor resumes it within its 100 ms interval
        after = time.time()
        pauses = pauses_from(cluster.read_status_changes(client) or [], after)
    finally:
        client.close()
        lc.close()
    assert 0.8 * 2**30 < rss < 0.95 * 2**30, f"the task held {rss / 2**20:.0f} MiB: not between the lines"
    n, seconds = paused_within(pauses, before, after)
    assert n == 1 and seconds > 0.3, pauses
    # The pause is the hold: it began while the memory was held and ended once it was let go. Its length is not
    # bounded by the 2 s asked for: on a loaded machine, growing the worker by 0.875 GiB takes time of its own.
    (pause,) = pauses
    assert before <= pause.start < released <= pause.end <= after, (before, pause, released, after)
    assert paused_within(pauses, after, after + 10) == (0, 0.0), "the pause ended"


def test_the_workers_a_cluster_was_asked_for_are_read_from_its_plan_and_its_adaptive_maximum():
    """A cluster the runner starts (dask-jobqueue, LocalCluster) says how many workers were asked for, before
    they have joined: a map plans for them (cluster.planned_slots); a scheduler started elsewhere says nothing."""
    from distributed import LocalCluster

    from memchunk_prefect.core.budget import planned_slots
    from memchunk_prefect.run.cluster import requested_workers

    assert requested_workers(None) is None
    with LocalCluster(n_workers=0, processes=False, dashboard_address=None) as cluster:
        assert requested_workers(cluster) is None, "asked for nothing yet"
        cluster.scale(3)
        assert requested_workers(cluster) == 3
        cluster.adapt(minimum=1, maximum=5)
        assert requested_workers(cluster) == 5
    assert planned_slots({"a": 2}, 5) == 10 and planned_slots({"a": 2, "b": 2, "c": 2}, 2) == 6
    assert planned_slots({}, 4) == 0, "no worker yet: nothing to plan for (the runner waits for one first)"


def _hold_tracked(nbytes: int, event_name: str) -> int:
    """Run on a worker: hold ``nbytes`` inside a tracked run (as a chunk's task run does) until the event is set."""
    import numpy as np
    import psutil
    from distributed import Event

    from memchunk_prefect.run.monitor import Monitor

    with Monitor(gpu=False, energy=False).track():
        block = np.ones(nbytes // 8)
        rss = psutil.Process().memory_info().rss
        Event(event_name).wait(60)
        del block
    return rss


@pytest.mark.cluster
def test_the_resting_memory_read_while_another_flows_chunk_peaks_on_the_worker_is_the_workers_own():
    """Another flow's chunk holds 400 MiB on one thread of a 2-thread worker when a map reads the budget.

    The memory is the other chunk's, in its own slot; read as resting it would shrink this flow's budget by
    400 MiB / 2 threads while that chunk runs (and every plan with it).
    """
    import time

    from distributed import Client, Event, LocalCluster

    from memchunk_prefect.run import cluster

    with LocalCluster(n_workers=1, threads_per_worker=2, processes=True, memory_limit="2GiB",
                      dashboard_address=None) as lc, Client(lc, set_as_default=False) as client:
        idle = next(iter(cluster.read_resting(client, ()).values()))
        gate = Event("release-the-chunk", client=client)
        held = client.submit(_hold_tracked, 400 * 2**20, "release-the-chunk", pure=False)
        rss = lambda: next(iter(client.run(lambda: __import__("psutil").Process().memory_info().rss).values()))  # noqa: E731
        deadline = time.monotonic() + 30
        while rss() < idle + 350 * 2**20 and time.monotonic() < deadline:
            time.sleep(0.1)
        busy_rss = rss()
        busy = next(iter(cluster.read_resting(client, ()).values()))
        gate.set()
        held.result(timeout=60)
    assert busy_rss >= idle + 350 * 2**20, f"the chunk never grew the worker ({busy_rss / 2**20:.0f} MiB)"
    assert abs(busy - idle) < 50 * 2**20, (
        f"read {busy / 2**20:.0f} MiB resting while the other chunk held the worker at {busy_rss / 2**20:.0f} MiB; "
        f"idle it rested at {idle / 2**20:.0f} MiB")


@pytest.mark.cluster
def test_a_workers_high_water_mark_is_read_with_its_resting_memory_and_outlasts_the_memory_it_freed():
    """A tracked run on a fresh worker holds 300 MiB and frees it: the worker rests low again, but its process
    has held that memory (a task reaching it again pays no first touch), and the budget says so per worker."""
    from distributed import Client, Event, LocalCluster

    from memchunk_prefect.run import cluster

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, memory_limit="2GiB",
                      dashboard_address=None) as lc, Client(lc, set_as_default=False) as client:
        ((address, (rest0, mark0)),) = cluster.read_marks(client, ()).items()
        Event("go-and-free", client=client).set()
        client.submit(_hold_tracked, 300 * 2**20, "go-and-free", pure=False).result(timeout=60)
        ((_, (rest, mark)),) = cluster.read_marks(client, ()).items()
        info = client.scheduler_info()
    assert mark0 == rest0, "no run measured yet: the mark is the resting memory"
    assert rest < rest0 + 100 * 2**20, f"the freed block is not resting memory ({rest0 / 2**20:.0f} -> {rest / 2**20:.0f} MiB)"
    assert mark >= rest + 250 * 2**20, f"mark {mark / 2**20:.0f} MiB, resting {rest / 2**20:.0f} MiB"
    (w,) = budget_mod.workers_from_info(info, {}, 0.95, {address: rest}, {address: mark})
    assert budget_mod.budget([w]).touched_bytes == {address: mark - rest}
    (unread,) = budget_mod.workers_from_info(info, {}, 0.95, {address: rest})
    assert unread.touched_bytes is None and budget_mod.budget([unread]).touched_bytes == {}


@pytest.mark.cluster
def test_the_budget_counts_worker_threads_per_cpu_core_from_what_the_workers_may_run_on():
    """2 workers x 2 threads on this machine: 4 threads on the cores the workers' affinity allows (2 in CI, so
    2 threads a core: a plan counts 4 chunks at once as no faster than 2, :func:`estimate_seconds`)."""
    import os

    from distributed import Client, LocalCluster

    from memchunk_prefect.core.budget import threads_per_core
    from memchunk_prefect.run.cluster import ClusterView

    cores = len(os.sched_getaffinity(0))
    with LocalCluster(n_workers=2, threads_per_worker=2, processes=True, memory_limit="1GiB",
                      dashboard_address=None) as lc, Client(lc, set_as_default=False) as client:
        b = ClusterView(lambda: client, lambda: lc).budget()
    assert b.slots == 4
    assert b.threads_per_core == pytest.approx(max(1.0, 4 / min(4, cores)))
    assert ("worker threads per CPU core" in b.reason) == (cores < 4), b.reason
    assert threads_per_core({"a": 2}, {}) == 1.0, "no placement read: each thread its own core"
