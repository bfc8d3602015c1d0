"""`memchunk doctor`: each misconfiguration created for real (clusters, servers, paths), found and named with a fix."""

from __future__ import annotations

import glob
import json
import os
import sqlite3

import dask
import pytest

from memchunk_prefect.cli import app as cli
from memchunk_prefect.learn.store import SCHEMA_VERSION, Store
from memchunk_prefect.run import doctor
from memchunk_prefect.run.doctor import FAIL, OK, WARN
from memchunk_prefect.testing import start_local_cluster


def _by_name(checks) -> dict[str, doctor.Check]:
    return {c.name: c for c in checks}


def _doctor_json(capsys, *argv: str) -> tuple[int, dict[str, doctor.Check]]:
    code = cli.main(["doctor", "--json", *argv])
    out = json.loads(capsys.readouterr().out)
    return code, {c["name"]: doctor.Check(**c) for c in out["checks"]}


# --------------------------------------------------------------------------- paths


def test_a_store_that_cannot_be_created_fails_and_a_new_one_is_not_created_by_looking(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = doctor.check_store(blocker / "store.sqlite")
    assert bad.status == FAIL and str(blocker) in bad.detail and "MEMCHUNK_STORE" in bad.fix
    new = doctor.check_store(tmp_path / "deep" / "store.sqlite")
    assert new.status == OK and "new" in new.detail
    assert not (tmp_path / "deep").exists(), "the doctor changes nothing"


def test_an_existing_store_reports_its_schema_and_keys_and_a_read_only_one_fails(tmp_path):
    path = tmp_path / "store.sqlite"
    Store(path).close()
    ok = doctor.check_store(path)
    assert ok.status == OK and f"schema {SCHEMA_VERSION}" in ok.detail and "0 operator key(s)" in ok.detail
    with sqlite3.connect(path) as con:
        con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    newer = doctor.check_store(path)
    assert newer.status == FAIL and "newer" in newer.detail and "upgrade" in newer.fix
    if os.geteuid() != 0:  # root writes through file modes
        path.chmod(0o444)
        assert doctor.check_store(path).status == FAIL


def test_prefect_home_under_a_file_fails_for_the_home_and_the_temporary_servers_database(tmp_path):
    from prefect.settings import (
        PREFECT_API_URL,
        PREFECT_HOME,
        PREFECT_SERVER_DATABASE_CONNECTION_URL,
        temporary_settings,
    )

    home = tmp_path / "a-file" / "prefect"
    (tmp_path / "a-file").write_text("")
    # Both back to their defaults: the session's test server (prefect_test_harness) sets the API URL and a
    # database in a temporary directory, and the default database is the one under PREFECT_HOME.
    with temporary_settings(updates={PREFECT_HOME: home},
                            restore_defaults={PREFECT_API_URL, PREFECT_SERVER_DATABASE_CONNECTION_URL}):
        checks = _by_name([doctor.check_prefect_home(), doctor.check_prefect_api()])
    assert checks["prefect home"].status == FAIL and str(home) in checks["prefect home"].detail
    assert checks["prefect api"].status == FAIL and "prefect.db" in checks["prefect api"].detail
    assert "PREFECT_HOME" in checks["prefect api"].fix


# --------------------------------------------------------------------------- Prefect API


def test_an_unreachable_prefect_api_fails_naming_the_address():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        check = doctor.check_prefect_api(timeout=2.0)
    assert check.status == FAIL and "http://127.0.0.1:9/api" in check.detail and "memchunk ui" in check.fix


@pytest.mark.server
def test_a_running_prefect_server_answers(prefect_server):
    check = doctor.check_prefect_api()
    assert check.status == OK and "answers" in check.detail


# --------------------------------------------------------------------------- clusters


@pytest.mark.cluster
def test_a_cluster_without_memory_limits_with_two_threads_and_retries_is_named_on_each_count(capsys):
    # Three misconfigurations at once, made for real: no memory_limit, two threads per worker, and a scheduler
    # that retries a dead worker's task three times.
    from distributed import LocalCluster

    with dask.config.set({"distributed.scheduler.allowed-failures": 3}):
        cluster = LocalCluster(n_workers=1, threads_per_worker=2, processes=True, memory_limit=0,
                               dashboard_address="127.0.0.1:0")
    try:
        code, checks = _doctor_json(capsys, "--address", cluster.scheduler_address)
    finally:
        cluster.close()
    assert code == cli.EXIT_FAILURE
    assert checks["memory limits"].status == FAIL and "--memory-limit" in checks["memory limits"].fix
    assert checks["threads"].status == WARN and "[2]" in checks["threads"].detail
    assert "memchunk-slots offered: None" in checks["threads"].detail and "--resources memchunk-slots=THREADS" \
        in checks["threads"].fix
    assert checks["allowed-failures"].status == WARN and "allowed-failures=3" in checks["allowed-failures"].detail
    assert "ALLOWED_FAILURES=0" in checks["allowed-failures"].fix


@pytest.mark.cluster
def test_a_cluster_as_the_runner_wants_it_passes_with_its_lines_resting_memory_and_its_hosts_memory_reuse(
        capsys, monkeypatch):
    # With --address, memory reuse is timed as a task on one worker of each host, not in doctor's process (the
    # local check, made to fail here, shows it): two worker processes of one host measure once, since they
    # would take each other's freed memory.
    def not_here(*args, **kwargs):
        raise AssertionError("timed in doctor's own process")

    monkeypatch.setattr(doctor, "check_memory_reuse", not_here)
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        code, checks = _doctor_json(capsys, "--memory-reuse", "--address", cluster.scheduler_address)
    finally:
        cluster.close()
    for name in ("cluster", "memory limits", "threads", "kill line", "allowed-failures", "resting memory"):
        assert checks[name].status == OK, checks[name]
    assert "1.0 GiB" in checks["memory limits"].detail and "0.95" in checks["kill line"].detail
    reuse = checks["memory reuse"]
    assert reuse.status in (OK, WARN), reuse
    assert reuse.detail.startswith(f"{int(reuse.status == WARN)} of 1 machine(s) give freed memory back; the "
                                   "dearest: on host 127.0.0.1: 128.0 MiB touched again took "), reuse.detail
    assert code == cli.EXIT_OK, [c for c in checks.values() if c.status == FAIL]


def test_an_address_with_no_scheduler_fails_naming_it():
    check, = doctor.check_cluster("tcp://127.0.0.1:9", timeout=2.0)
    assert check.status == FAIL and "tcp://127.0.0.1:9" in check.detail


# --------------------------------------------------------------------------- versions, GPU, energy


def test_a_package_outside_its_declared_range_fails_naming_the_range(monkeypatch):
    from importlib import metadata

    real = metadata.version
    # The one fake here: installing another fastapi is not possible offline. The range is the package's own.
    monkeypatch.setattr(metadata, "version", lambda name: "0.151.0" if name == "fastapi" else real(name))
    packages = _by_name(doctor.check_versions())["packages"]
    assert packages.status == FAIL and "fastapi 0.151.0 (needs <0.151,>=0.139)" in packages.detail


def test_versions_of_this_install_are_in_range():
    assert all(c.status == OK for c in doctor.check_versions())


def test_gpu_and_energy_counters_are_reported_as_this_machine_has_them():
    try:
        import pynvml

        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        nvml = True
    except Exception:  # noqa: BLE001
        nvml = False
    gpu = _by_name(doctor.check_gpu())
    assert (gpu["gpu (nvml)"].status == OK) == nvml, gpu
    readable = [p for p in glob.glob("/sys/class/powercap/intel-rapl:*/energy_uj") if os.access(p, os.R_OK)]
    assert (doctor.check_energy().status == OK) == bool(readable)


def test_doctor_on_this_machine_prints_a_line_per_check_and_exits_zero(capsys, tmp_path):
    code = cli.main(["doctor", "--store", str(tmp_path / "s.sqlite"), "--output-dir", str(tmp_path / "out")])
    out = capsys.readouterr().out.splitlines()
    assert code == cli.EXIT_OK, out
    assert out[-1] == "nothing stops a run"
    assert {line.split(":")[0].split(None, 1)[1] for line in out[:-1]} >= {
        "python", "packages", "prefect home", "prefect api", "store", "outputs", "cluster", "gpu (nvml)",
        "energy (rapl)"}


def test_a_corrupt_store_is_a_warning_not_a_stop_since_a_run_moves_it_aside(tmp_path):
    path = tmp_path / "store.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    check = doctor.check_store(path)
    assert check.status == WARN and "moves it aside" in check.detail


def test_an_empty_store_file_another_flow_is_creating_is_fine(tmp_path):
    path = tmp_path / "store.sqlite"
    path.write_bytes(b"")
    assert doctor.check_store(path).status == OK


def test_checking_a_store_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "store.sqlite"
    Store(path).close()
    before = sorted(p.name for p in tmp_path.iterdir())
    assert doctor.check_store(path).status == OK
    assert sorted(p.name for p in tmp_path.iterdir()) == before


# --------------------------------------------------------------------------- memory reuse


def _touches(*seconds_per_gib: float):
    """A fake ``touch``: each call takes the next of ``seconds_per_gib`` for the bytes asked (wall and kernel)."""
    left = list(seconds_per_gib)

    def touch(nbytes: int) -> tuple[float, float]:
        seconds = left.pop(0) * nbytes / 2**30
        return seconds, seconds
    return touch


def test_memory_freed_seconds_ago_that_costs_far_more_to_touch_again_is_a_warning_with_both_figures():
    slept = []
    check = doctor.check_memory_reuse(2**30, 2.5, touch=_touches(9.0, 0.15, 10.2), sleep=slept.append, rounds=1)
    assert slept == [2.5]
    assert check.status == WARN and check.name == "memory reuse"
    assert "10.20 s per GiB after 2.5 s free, 0.15 s per GiB right after its release" in check.detail
    assert "gives freed memory back to its host" in check.detail and "--track-record" in check.fix


def test_memory_that_stays_cheap_to_reuse_or_costs_little_either_way_is_fine():
    same = doctor.check_memory_reuse(2**28, 2.5, touch=_touches(0.3, 0.2, 0.25), sleep=lambda s: None, rounds=1)
    assert same.status == OK and "stays cheap" in same.detail and not same.fix
    # Ten times dearer after the gap, but under a second per GiB: not worth a warning.
    cheap = doctor.check_memory_reuse(2**28, 2.5, touch=_touches(0.5, 0.05, 0.5), sleep=lambda s: None, rounds=1)
    assert cheap.status == OK


def test_the_reuse_check_counts_its_dearest_gap_since_a_host_does_not_take_back_every_release():
    # Three rounds: right after a release 0.15, 0.2 and 0.1 s per GiB (median 0.15); after the gap 0.16 (the kernel
    # kept those pages), 6.0 and 0.3. One cheap gap does not hide the machine.
    slept = []
    check = doctor.check_memory_reuse(2**30, 2.5, touch=_touches(9.0, 0.15, 0.16, 0.2, 6.0, 0.1, 0.3),
                                      sleep=slept.append)
    assert slept == [2.5] * doctor.REUSE_ROUNDS == [2.5, 2.5, 2.5]
    assert check.status == WARN and "up to 6.00 s per GiB after 2.5 s free, 0.15 s per GiB right after" in check.detail


def test_doctor_times_memory_reuse_only_when_asked(capsys, tmp_path):
    argv = ["--store", str(tmp_path / "s.sqlite"), "--output-dir", str(tmp_path / "out")]
    _, plain = _doctor_json(capsys, *argv)
    assert "memory reuse" not in plain
    code, asked = _doctor_json(capsys, "--memory-reuse", *argv)
    assert code == cli.EXIT_OK
    reuse = asked["memory reuse"]
    assert reuse.status in (OK, WARN) and "after 2.5 s free" in reuse.detail, reuse


class _Done:
    """A finished task's future, as distributed's Future answers ``result``: its value, or its error raised."""

    def __init__(self, value):
        self.value = value

    def result(self, timeout=None):
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


class _ReuseClient:
    """A client of a cluster of several machines (which cannot exist here): each worker's machine identity, and each
    worker's memory reuse figures (s per GiB right after a release, after the gap) or the error its task raised."""

    def __init__(self, machines: dict[str, str], figures: dict[str, object]):
        self.machines, self.figures, self.asked = machines, figures, []

    def run(self, fn, *, workers):
        assert fn is doctor.machine_identity
        return {w: self.machines[w] for w in workers}

    def submit(self, fn, nbytes, gap, *, workers, pure, **kwargs):
        assert fn is doctor.measure_memory_reuse and (nbytes, gap) == (doctor.REUSE_BYTES, 2.5) and pure is False
        self.asked.extend(workers)
        return _Done(self.figures[workers[0]])


def _workers(addresses) -> dict[str, dict]:
    return {a: {"host": a.split("//")[1].split(":")[0]} for a in addresses}


def test_the_reuse_check_on_a_cluster_is_its_dearest_warning_machine_and_counts_the_machines_that_warn():
    # Two workers of 10.0.0.1, and 10.0.0.9 under the same kernel (one machine, another address), measure once.
    machines = {"tcp://10.0.0.1:1": "m1", "tcp://10.0.0.1:2": "m1", "tcp://10.0.0.9:1": "m1",
                "tcp://10.0.0.2:1": "m2", "tcp://10.0.0.3:1": "m3", "tcp://10.0.0.4:1": "m4"}
    # 10.0.0.4 is the dearest after the gap but 3x its cost right after a release: fine. 10.0.0.3 warns.
    figures = {"tcp://10.0.0.1:1": (0.2, 0.3), "tcp://10.0.0.2:1": (0.2, 0.25), "tcp://10.0.0.3:1": (0.2, 2.0),
               "tcp://10.0.0.4:1": (3.0, 10.0)}
    client = _ReuseClient(machines, figures)
    check = doctor.check_memory_reuse_on_workers(client, _workers(machines))
    assert client.asked == ["tcp://10.0.0.1:1", "tcp://10.0.0.2:1", "tcp://10.0.0.3:1", "tcp://10.0.0.4:1"]
    assert check.status == WARN and check.detail.startswith("1 of 4 machine(s) give freed memory back; the dearest: "
                                                            "on host 10.0.0.3: 128.0 MiB touched again took up to 2.00 s")
    assert "--track-record" in check.fix
    # None warns: the dearest after the gap is named, and the check is fine.
    calm = doctor.check_memory_reuse_on_workers(_ReuseClient(machines, {**figures, "tcp://10.0.0.3:1": (0.2, 0.3)}),
                                                _workers(machines))
    assert calm.status == OK and calm.detail.startswith("0 of 4 machine(s) give freed memory back; the dearest: "
                                                        "on host 10.0.0.4: ")


def test_a_worker_that_cannot_time_memory_reuse_is_named_beside_the_machines_that_did():
    machines = {"tcp://10.0.0.1:1": "m1", "tcp://10.0.0.2:1": "m2"}
    lost = {"tcp://10.0.0.1:1": (0.2, 0.3), "tcp://10.0.0.2:1": ModuleNotFoundError("No module named 'memchunk_prefect'")}
    check = doctor.check_memory_reuse_on_workers(_ReuseClient(machines, lost), _workers(machines))
    assert check.status == WARN and check.detail.startswith("0 of 1 machine(s) give freed memory back; ")
    assert check.detail.endswith("; not measured on 1 worker(s): tcp://10.0.0.2:1 (ModuleNotFoundError: No module "
                                 "named 'memchunk_prefect')") and "memchunk-prefect installed" in check.fix
    none = doctor.check_memory_reuse_on_workers(_ReuseClient({"tcp://10.0.0.2:1": "m2"}, lost),
                                                _workers(["tcp://10.0.0.2:1"]))
    assert none.status == WARN and none.detail.startswith("no worker measured memory reuse; not measured on 1")


def test_memory_reuse_asked_of_a_cluster_that_cannot_be_reached_says_it_was_not_measured():
    checks = _by_name(doctor.check_cluster("tcp://127.0.0.1:9", timeout=2.0, memory_reuse=True))
    assert checks["cluster"].status == FAIL
    assert checks["memory reuse"].status == WARN and "not measured" in checks["memory reuse"].detail
