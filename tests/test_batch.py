"""What a batch job says about memory, without a batch system: the rules (tables), the readings (a cgroup tree
written in a temporary directory, a real LocalCluster's workers and nannies).

The same readings on a real Slurm are in tests/test_slurm.py.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from memchunk_prefect.core.budget import (
    JOB,
    LIMIT,
    NANNY,
    NONE,
    WorkerMemory,
    budget,
    job_line_bytes,
    kill_line,
    workers_from_info,
)
from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.deaths import LOST, MEMORY, UNKNOWN, DeathEvidence, death_cause, worker_death
from memchunk_prefect.core.machine import MapMachine
from memchunk_prefect.core.messages import ChunkEnded, MapSpec, Record, Start, Submit, WorkerDied
from memchunk_prefect.core.records import Prediction
from memchunk_prefect.run import batch
from memchunk_prefect.run.cluster import ClusterView, jobqueue_job
from memchunk_prefect.run.job_memory import (
    NO_LIMIT_BYTES,
    job_memory,
    memory_cgroup_dirs,
    read_job_memory,
    run_on_nanny,
)

MiB = 2**20


# =========================================================================== the rules


@pytest.mark.parametrize("evidence, cause, says", [
    (DeathEvidence(nanny_memory_kill=True, job_state="CANCELLED"), MEMORY, "nanny killed it"),
    (DeathEvidence(oom_kills=2, job_state="RUNNING"), MEMORY, "OOM killer ran 2 time(s)"),
    (DeathEvidence(oom_kills=0, job_state="OUT_OF_MEMORY", job_id="5", source="scontrol"), MEMORY,
     "batch job 5 ended OUT_OF_MEMORY (scontrol)"),
    (DeathEvidence(oom_kills=0, job_state="TIMEOUT", job_id="5"), LOST, "ended TIMEOUT, not for memory"),
    (DeathEvidence(job_state="CANCELLED by 0", job_id="5"), LOST, "ended CANCELLED"),
    (DeathEvidence(job_state="PREEMPTED"), LOST, "ended PREEMPTED"),
    (DeathEvidence(job_state="NODE_FAIL"), LOST, "ended NODE_FAIL"),
    (DeathEvidence(nanny_memory_kill=False, oom_kills=0, job_state="RUNNING", job_id="5"), UNKNOWN,
     "batch job 5 is RUNNING, no OOM kill in its job cgroup"),
    (DeathEvidence(job_state="COMPLETED"), UNKNOWN, "is COMPLETED"),
    (DeathEvidence(job_state="FAILED", job_signal=9, job_id="5", source="scontrol"), MEMORY,
     "batch job 5 ended FAILED, killed by signal 9 (scontrol): over its --mem"),
    (DeathEvidence(job_state="FAILED", job_signal=15), UNKNOWN, "is FAILED"),
    (DeathEvidence(job_state="FAILED"), UNKNOWN, "is FAILED"),
    (DeathEvidence(job_state="CANCELLED", job_signal=9), LOST, "ended CANCELLED"),
    (DeathEvidence(), UNKNOWN, "nothing was read about it"),
])
def test_the_death_rule(evidence, cause, says):
    got, reason = death_cause(evidence)
    assert got == cause and says in reason, reason


@pytest.mark.parametrize("evidence, upper, attempt, memory", [
    (DeathEvidence(job_state="TIMEOUT"), None, 0, False),        # the job's walltime: lost, whatever the model
    (DeathEvidence(job_state="PREEMPTED"), None, 3, False),       # lost again and again: still not memory
    (DeathEvidence(oom_kills=1), 10.0, 0, True),                  # far below the line, yet the kernel killed it
    (DeathEvidence(job_state="RUNNING", oom_kills=0), None, 0, True),   # nothing says why: the model's guess
    (DeathEvidence(job_state="RUNNING", oom_kills=0), 100.0, 0, False),
    (None, 100.0, 1, True),                                        # nothing read, the chunk's second death
])
def test_the_evidence_decides_before_the_models_guess(evidence, upper, attempt, memory):
    got, reason = worker_death(evidence, upper, 1000, attempt)
    assert got is memory, reason
    assert ("treated as" in reason) == (evidence is None or death_cause(evidence)[0] == UNKNOWN)


class NoModel:
    """An operator nothing was learned about (a cold start): no ready bound for any block."""

    def predict(self, extents):
        return Prediction(0.0, 0.0, 0, False, "nothing learned")

    def predict_gpu(self, extents):
        return self.predict(extents)

    def seconds_per_element(self):
        return None

    def seconds_for(self, elements):
        return None

    def joules_for(self, elements):
        return None

    def touch_seconds_per_byte(self):
        return None

    def first_call_seconds(self):
        return None

    def choose_arm(self, groups):
        raise AssertionError("a cold start probes: no arm is chosen")


def _probing():
    m = MapMachine(MapSpec(operator="op", operator_key="op|float32|cpu", shape=(8, 8, 10), halo=(0, 0, 0),
                           whole_traces=True), NoModel())
    out = m.handle(Start(2, 10 * MiB))
    out += m.advance()
    return m, [s for s in out if isinstance(s, Submit)]


def test_a_cold_chunk_whose_job_was_cancelled_runs_again_unsplit_and_nothing_is_learned_about_memory():
    m, (sub, *_) = _probing()
    out = m.handle(WorkerDied(sub.id, "KilledWorker", kill_headroom_bytes=MiB,
                              evidence=DeathEvidence(job_state="CANCELLED", job_id="42", source="scontrol")))
    ended = [i for i in out if isinstance(i, ChunkEnded)][0]
    assert ended.outcome == "lost" and "ended CANCELLED (scontrol)" in out[0].marks[0][2]
    assert [r.observation.outcome for r in out if isinstance(r, Record)] == ["error"]
    assert (m.queue[0].chunk, m.queue[0].attempt) == (sub.chunk, 1), "the same chunk, first in the queue"


def test_a_cold_chunk_the_kernel_killed_is_split_and_its_reason_says_what_was_read():
    m, (sub, *_) = _probing()
    out = m.handle(WorkerDied(sub.id, "KilledWorker", kill_headroom_bytes=MiB, evidence=DeathEvidence(oom_kills=1)))
    (rec,) = [r.observation for r in out if isinstance(r, Record)]
    assert (rec.outcome, rec.censored, rec.peak_bytes) == ("killed", True, MiB)
    (decided,) = [i for i in out if type(i).__name__ == "Decided"]
    assert decided.record.decision == "retry-smaller"
    assert "the kernel's OOM killer ran 1 time(s) in the worker's job cgroup" in decided.record.reason


def test_job_line_table():
    assert job_line_bytes(1000, 100, 200) == 900.0
    assert job_line_bytes(1000, 300, 200, workers=2) == 450.0
    assert job_line_bytes(1000, 0, 0, workers=0) == 1000.0, "no workers read: as one"


def test_kill_line_table():
    assert kill_line(1000, 0.95, None) == (950.0, NANNY)
    assert kill_line(1000, 0.95, 500) == (500.0, JOB)
    assert kill_line(1000, 0.95, 960) == (950.0, NANNY)
    assert kill_line(1000, None, None) == (1000.0, LIMIT)
    assert kill_line(1000, None, 1200) == (1200.0, JOB), "without a nanny, the job is what kills"
    assert kill_line(0, None, 700) == (700.0, JOB)
    assert kill_line(0, None, None) == (0.0, NONE)


def test_a_job_limit_below_the_nanny_line_is_the_budgets_line_and_says_so():
    info = {"workers": {"tcp://w:1": {"nthreads": 1, "memory_limit": 3 * 2**30, "nanny": "tcp://n:1",
                                      "metrics": {"memory": 200 * MiB}}}}
    (w,) = workers_from_info(info, {}, 0.95, jobs={"tcp://w:1": (1200 * 10**6, 100 * MiB, "cgroup memory.max", 1)})
    b = budget([w])
    assert b.budget_bytes == int(1200 * 10**6 - 100 * MiB - 200 * MiB)
    assert w.kill_headroom_bytes == b.budget_bytes and b.headroom_bytes["tcp://w:1"] == b.budget_bytes
    assert b.reason.startswith("budget ") and "the job's memory limit 1.1 GiB (cgroup memory.max) less 100.0 MiB " \
        "held by the job's other processes, below the kill line 2.8 GiB" in b.reason, b.reason
    (no_job,) = workers_from_info(info, {}, 0.95)
    assert budget([no_job]).budget_bytes == int(0.95 * 3 * 2**30) - 200 * MiB
    (no_limit,) = workers_from_info({"workers": {"tcp://w:1": {**info["workers"]["tcp://w:1"], "memory_limit": 0}}},
                                    {}, 0.95, jobs={"tcp://w:1": (600 * MiB, 0, "Slurm --mem", 1)})
    assert budget([no_limit]).budget_bytes == 400 * MiB, "a job limit alone is a line to plan for"


def test_workers_sharing_one_jobs_limit_share_what_is_free_of_it():
    """Two workers in one job (dask-jobqueue's processes=2) or one container: each plans for half of what is free
    of the limit, not for all of it."""
    one = {"nthreads": 1, "memory_limit": 4 * 2**30, "nanny": "tcp://n:1", "metrics": {"memory": 200 * MiB}}
    info = {"workers": {"tcp://w:1": one, "tcp://w:2": one}}
    # Each reads the other worker at rest (200 MiB) and the nanny (100 MiB) as the job's other processes.
    jobs = {a: (2 * 2**30, 300 * MiB, "cgroup memory.max", 2) for a in info["workers"]}
    b = budget(workers_from_info(info, {}, 0.95, jobs=jobs))
    assert b.budget_bytes == (2 * 2**30 - 300 * MiB - 200 * MiB) // 2
    assert "its free part shared by 2 workers" in b.reason, b.reason


# =========================================================================== the readings


def _tree(tmp_path: Path, version: int, limits: dict[str, str], oom: dict[str, int]) -> tuple[str, str]:
    """A cgroup mount and a /proc for one process in ``job/step/task``: limits and OOM counts per level."""
    root = tmp_path / "cgroup"
    base = root / "memory" if version == 1 else root
    base.mkdir(parents=True)
    if version == 2:
        (root / "cgroup.controllers").write_text("cpu memory\n")
    levels = ["job", "job/step", "job/step/task"]
    for level in levels:
        d = base / level
        d.mkdir()
        limit_file = "memory.limit_in_bytes" if version == 1 else "memory.max"
        (d / limit_file).write_text(limits.get(level, str(NO_LIMIT_BYTES + 1) if version == 1 else "max") + "\n")
        events = "memory.oom_control" if version == 1 else "memory.events"
        (d / events).write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom.get(level, 0)}\n")
        (d / "cgroup.procs").write_text(f"{os.getpid()}\n" if level == levels[-1] else "")
    proc = tmp_path / "proc" / "self"
    proc.mkdir(parents=True)
    line = "4:memory:/job/step/task" if version == 1 else "0::/job/step/task"
    (proc / "cgroup").write_text(f"12:cpu:/x\n{line}\n")
    return str(root), str(tmp_path / "proc")


@pytest.mark.parametrize("version", [1, 2])
def test_a_workers_job_limit_is_the_lowest_of_its_groups_and_its_oom_count_is_its_own_groups(tmp_path, version):
    root, proc = _tree(tmp_path, version, {"job": str(700 * MiB), "job/step": str(900 * MiB)},
                       {"job/step/task": 1})
    got = job_memory(root, proc, {"SLURM_JOB_ID": "17", "SLURM_MEM_PER_NODE": "800"})
    assert got["limit_bytes"] == 700 * MiB and got["cgroup"].endswith("/job"), got
    assert got["source"] == ("cgroup memory.limit_in_bytes" if version == 1 else "cgroup memory.max")
    assert (got["oom_kills"], got["job_id"], got["batch"]) == (1, "17", "slurm")
    assert got["others_bytes"] == 0, "the only process in the job's groups is this one"
    assert memory_cgroup_dirs(open(Path(proc) / "self" / "cgroup").read(), root)[0].endswith("job/step/task")


def test_a_slurm_request_below_any_cgroup_limit_is_the_jobs_limit(tmp_path):
    root, proc = _tree(tmp_path, 1, {}, {})
    got = job_memory(root, proc, {"SLURM_JOB_ID": "3", "SLURM_MEM_PER_CPU": "256", "SLURM_CPUS_ON_NODE": "2"})
    assert (got["limit_bytes"], got["source"], got["cgroup"]) == (512 * MiB, "Slurm --mem", None)
    none = job_memory(root, proc, {})
    assert none["limit_bytes"] is None and none["job_id"] is None and none["oom_kills"] == 0


def test_no_cgroup_mount_reads_no_limit(tmp_path):
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "cgroup").write_text("0::/\n")
    got = job_memory(str(tmp_path / "nothing"), str(tmp_path / "proc"), {})
    assert got["limit_bytes"] is None and got["oom_kills"] is None


def test_the_job_state_reader_says_nothing_where_there_is_no_slurm(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert batch.slurm_job_state("1") == (None, "", None)


class _Cluster:
    def __init__(self, jobs):
        self.workers = jobs


class SLURMCluster(_Cluster):
    pass


def test_a_jobqueue_workers_job_is_found_by_its_name():
    job = type("Job", (), {"job_id": "77"})()
    assert jobqueue_job(SLURMCluster({"SLURMCluster-0": job}), "SLURMCluster-0") == ("77", "slurm")
    assert jobqueue_job(SLURMCluster({}), "SLURMCluster-0") == (None, None)
    assert jobqueue_job(None, "x") == (None, None)


@pytest.mark.cluster
def test_a_local_clusters_workers_and_nannies_answer_the_job_reading():
    """On a plain LocalCluster: every worker reads its job memory (no batch job; a limit only where this machine's
    cgroup has one), its nanny answers the same reading after its worker is gone, and a death read there is
    judged by what it says."""
    from distributed import Client

    from memchunk_prefect.testing import start_local_cluster

    with start_local_cluster(n_workers=1, memory_limit="1GiB") as cluster, Client(cluster) as client:
        (address, read), = read_job_memory(client).items()
        assert read["job_id"] is None or read["batch"] is not None
        assert read["limit_bytes"] is None or read["limit_bytes"] > 0
        nanny = client.scheduler_info()["workers"][address]["nanny"]
        at_nanny = run_on_nanny(client, nanny, job_memory)
        assert at_nanny["oom_kills"] == read["oom_kills"], (at_nanny, read)
        view = ClusterView(lambda: client, lambda: None)
        view.workers()  # what a map's start reads: each worker's job, its nanny, its cgroup's OOM count
        evidence = view.death_evidence(address)
        assert evidence.nanny_memory_kill is False and evidence.job_state is None and view.death_evidence(address) \
            is evidence, "read once per dead worker"
        assert death_cause(evidence)[0] == UNKNOWN
        gone = lambda: run_on_nanny(client, "tcp://127.0.0.1:9", job_memory, timeout_s=1)  # noqa: E731
        assert batch.death_evidence(address, lambda: [], gone, None, None, wait_seconds=0)[1] is None


def test_a_death_read_from_a_job_that_ended_waits_for_its_final_state_and_names_it():
    states = iter([("COMPLETING", "scontrol", None), ("OUT_OF_MEMORY", "scontrol", None)])
    evidence, now = batch.death_evidence("tcp://w:1", lambda: None, None, {"job_id": "12", "batch": "slurm"}, None,
                                         wait_seconds=5, job_state=lambda job: next(states))
    assert now is None and death_cause(evidence) == (MEMORY, "its batch job 12 ended OUT_OF_MEMORY (scontrol)")
    evidence, now = batch.death_evidence("tcp://w:1", lambda: ["tcp://w:1"], lambda: {"oom_kills": 3, "job_id": "12",
                                                                                     "batch": "slurm"}, None, 2,
                                         job_state=lambda job: ("RUNNING", "scontrol", None))
    assert (evidence.oom_kills, evidence.nanny_memory_kill, evidence.job_state, now) == (1, True, None, 3), \
        "the nanny's kill says why: the batch system is not asked"
    logs = iter([[], [], ["tcp://w:1"]])  # the nanny's event reaches the scheduler's log after the death
    evidence, _ = batch.death_evidence("tcp://w:1", lambda: next(logs), lambda: {"oom_kills": 0}, None, 0)
    assert death_cause(evidence)[0] == MEMORY and evidence.oom_kills == 0


def test_a_worker_memory_without_a_job_keeps_its_old_line():
    w = WorkerMemory("tcp://w:1", 1, 1000, 100, 0.95)
    assert w.line == (950.0, NANNY) and w.kill_headroom_bytes == 850
    assert Chunk((0, 0, 0), (1, 1, 1)).elements == 1
