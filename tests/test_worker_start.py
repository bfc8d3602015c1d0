"""How the workers of a local cluster the runner starts come to life: forked from one server that imported what a
task run needs (memchunk_prefect.run.worker_start), with the environment a spawned worker would have."""

from __future__ import annotations

import os

import dask
import pytest
from distributed import LocalCluster

from memchunk_prefect.core.errors import RunnerConfigError
from memchunk_prefect.run.runner import MemoryAwareRunner
from memchunk_prefect.run.worker_start import FORKSERVER, METHOD_KEY, PRELOAD, START_ENV, method_for

pytestmark = pytest.mark.skipif(FORKSERVER not in __import__("multiprocessing").get_all_start_methods(),
                                reason="no forkserver start method on this platform (Windows)")


@pytest.mark.parametrize("address, cluster_class, kwargs, env, configured, expect", [
    (None, None, {"n_workers": 2}, {}, "spawn", FORKSERVER),                      # the runner's own local cluster
    (None, LocalCluster, {}, {}, "spawn", FORKSERVER),                            # named as the class itself
    (None, "distributed.LocalCluster", {}, {}, "spawn", FORKSERVER),              # or by its name
    ("tcp://scheduler:8786", None, None, {}, "spawn", None),                      # a scheduler started elsewhere
    (None, "dask_jobqueue.SLURMCluster", {"cores": 1}, {}, "spawn", None),        # batch jobs start their own
    (None, None, {"processes": False}, {}, "spawn", None),                         # threads: no processes
    (None, None, {"preload": ["memchunk_prefect.run.pinning"]}, {}, "spawn", None),  # GPU pinning runs first
    (None, None, {}, {START_ENV: "spawn"}, "spawn", None),                        # the user asked for Dask's own
    (None, None, {}, {START_ENV: "FORKSERVER"}, "spawn", FORKSERVER),
    (None, None, {}, {}, "fork", None),                                           # a method the user configured
])
def test_the_runner_forks_only_the_workers_of_a_local_cluster_it_starts(address, cluster_class, kwargs, env,
                                                                         configured, expect):
    with dask.config.set({METHOD_KEY: configured}):
        assert method_for(address, cluster_class, kwargs, environ=env) == expect


def test_an_unknown_start_method_is_refused_when_the_runner_is_made_naming_the_value(monkeypatch):
    monkeypatch.setenv(START_ENV, "fork-please")
    with pytest.raises(RunnerConfigError, match=r"MEMCHUNK_WORKER_START is 'fork-please'.*'forkserver'.*'spawn'"):
        MemoryAwareRunner(cluster_kwargs={"n_workers": 1})
    MemoryAwareRunner(address="tcp://scheduler:8786")  # a cluster it does not start: nothing to choose


def _start(tmp_path, **kw) -> tuple[MemoryAwareRunner, dict]:
    """Start a runner's own cluster of 2 workers; what each worker has before any task ran (a function made
    here is sent by value: the workers need not import this module)."""
    names, me = list(PRELOAD), os.getpid()

    def state() -> dict:
        import os as worker_os
        import sys as worker_sys

        return {"imported": [n for n in names if n in worker_sys.modules], "forked": worker_os.getppid() != me,
                "env": {k: worker_os.environ.get(k)
                        for k in ("MEMCHUNK_TEST_LATE", "OMP_NUM_THREADS", "MALLOC_TRIM_THRESHOLD_")}}

    runner = MemoryAwareRunner(cluster_kwargs={"n_workers": 2, "memory_limit": "1GiB"}, progress=False,
                               store=str(tmp_path / "s.sqlite"), output_dir=str(tmp_path / "out"), **kw)
    runner.__enter__()
    try:
        return runner, runner.client.run(state)
    finally:
        runner.__exit__(None, None, None)


@pytest.mark.cluster
def test_forked_workers_have_imported_a_task_runs_modules_and_get_the_environment_a_spawned_one_would(
        tmp_path, monkeypatch):
    """Before any task: every worker of the runner's own cluster has Prefect's task engine and the runner imported
    (the server imported them once), Dask's pre-spawn environment (one OpenMP thread, the malloc trim threshold),
    and an environment variable set after a first cluster started the server (a later flow run of the same
    process). The control: with ``$MEMCHUNK_WORKER_START=spawn`` the workers import nothing before their first task.
    """
    monkeypatch.delenv(START_ENV, raising=False)
    _, first = _start(tmp_path / "a")
    monkeypatch.setenv("MEMCHUNK_TEST_LATE", "set-after-the-server-started")
    _, second = _start(tmp_path / "b")
    for state in [*first.values(), *second.values()]:
        assert state["forked"] and state["imported"] == list(PRELOAD)
        assert state["env"]["OMP_NUM_THREADS"] == "1" and state["env"]["MALLOC_TRIM_THRESHOLD_"]
    assert [s["env"]["MEMCHUNK_TEST_LATE"] for s in second.values()] == ["set-after-the-server-started"] * 2
    assert dask.config.get(METHOD_KEY) == "spawn", "the method is set only while the runner's cluster starts"

    monkeypatch.setenv(START_ENV, "spawn")
    _, spawned = _start(tmp_path / "c")
    for state in spawned.values():
        assert not state["forked"] and "prefect.task_engine" not in state["imported"]


def _job_others(_: object) -> int:
    from memchunk_prefect.run.job_memory import _family_rss

    return _family_rss(os.getpid())


def test_a_worker_forked_from_a_forkserver_counts_the_process_that_started_the_server_in_its_jobs_others():
    """Under a Slurm ``--mem`` with no cgroup, a worker's job holds what its nanny's process and that process's
    other children hold. A worker forked from a forkserver is the server's child: the process that started the
    server (this one) is counted, not only the server."""
    import multiprocessing

    import psutil

    me = psutil.Process().memory_info().rss
    with multiprocessing.get_context(FORKSERVER).Pool(1) as pool:
        (others,) = pool.map(_job_others, [0])
    assert others >= me
