"""The observation store with real SQLite files and real concurrent processes."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
import os
import sqlite3
import stat
import subprocess
import sys

import pytest

from memchunk_prefect.core.errors import StoreError, StoreSchemaTooNewError
from memchunk_prefect.core.records import Observation
from memchunk_prefect.learn.store import (
    CREATE_V1,
    SCHEMA_VERSION,
    Store,
    StoreMovedAsideWarning,
    default_store_path,
    filesystem_type,
    is_network_filesystem,
)


def make_obs(i: int = 0, key: str = "envelope|float32|cpu", **kw) -> Observation:
    e = 10 * 10 * (10 + i)
    return Observation(key, e, (10, 10, 10 + i), 4 * e, 1000 + i, seconds=0.5, **kw)


def test_round_trip_keeps_every_field(tmp_path):
    full = Observation("gst3d_dip[sigma=2]|float32|cpu", 1200, (10, 12, 10), 4800, 99_000, seconds=1.25,
                       outcome="memory_error", censored=True, cpu_seconds=1.0, worker="tcp://w:1",
                       chunk="i0-8_x0-10_t0-10", budget_bytes=2**30, gpu_peak_bytes=None, energy_joules=3.5,
                       shared=True, method="vmhwm", flow_run_id="abc", created_at=1700000000.5,
                       baseline_bytes=250_000_000, resting_bytes=240_000_000)
    plain = make_obs()
    with Store(tmp_path / "s.sqlite") as s:
        s.add(full)
        s.add(plain)
        got = s.observations()
    assert got == [full, plain]


def test_insertion_order_keys_forget_and_count(tmp_path):
    with Store(tmp_path / "s.sqlite") as s:
        s.add_many([make_obs(i, key="b|float32|cpu") for i in range(3)])
        s.add(make_obs(9, key="a|float32|cpu"))
        s.add(make_obs(3, key="b|float32|cpu"))
        assert s.keys() == ["a|float32|cpu", "b|float32|cpu"]
        assert [o.peak_bytes for o in s.observations("b|float32|cpu")] == [1000, 1001, 1002, 1003]
        assert s.forget("b|float32|cpu") == 4
        assert s.forget("b|float32|cpu") == 0
        assert s.keys() == ["a|float32|cpu"] and s.count() == 1


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_export(tmp_path, fmt):
    with Store(tmp_path / "s.sqlite") as s:
        s.add_many([make_obs(i) for i in range(3)])
        text = s.export(fmt)
    if fmt == "csv":
        rows = list(csv.DictReader(io.StringIO(text)))
        assert [int(r["peak_bytes"]) for r in rows] == [1000, 1001, 1002]
        assert rows[0]["extent_twt"] == "10" and rows[0]["operator_key"] == "envelope|float32|cpu"
    else:
        rows = json.loads(text)
        assert [r["peak_bytes"] for r in rows] == [1000, 1001, 1002]
        assert rows[2]["extents"] == [10, 10, 12]


def test_export_unknown_format_says_what_is_accepted(tmp_path):
    with Store(tmp_path / "s.sqlite") as s, pytest.raises(StoreError, match="'csv' or 'json'.*'xml'"):
        s.export("xml")


def test_closed_store_raises_a_store_error(tmp_path):
    s = Store(tmp_path / "s.sqlite")
    s.close()
    with pytest.raises(StoreError, match="closed"):
        s.keys()


WRITER = """
import sys
from memchunk_prefect.core.records import Observation
from memchunk_prefect.learn.store import Store
path, tag, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
with Store(path) as s:
    print("ready", flush=True)
    sys.stdin.readline()  # start together
    for i in range(n):
        s.add(Observation(tag + "|float32|cpu", 100, (1, 10, 10), 400, 1000 + i))
"""


@pytest.mark.parametrize("journal", ["wal", "delete"])
def test_two_processes_writing_at_once_lose_nothing(tmp_path, journal, monkeypatch):
    monkeypatch.setenv("MEMCHUNK_STORE_JOURNAL", journal)
    path = str(tmp_path / "s.sqlite")
    Store(path).close()
    procs = [subprocess.Popen([sys.executable, "-c", WRITER, path, tag, "200"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for tag in ("p1", "p2")]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        assert p.wait(60) == 0
    with Store(path) as s:
        assert s.count() == 400
        assert s.count("p1|float32|cpu") == s.count("p2|float32|cpu") == 200


def test_wal_locally_and_files_are_user_only(tmp_path):
    path = tmp_path / "new" / "deeper" / "s.sqlite"
    with Store(path) as s:
        assert s.journal_mode == "wal" and s.journal_mode_in_effect == "wal"
        s.add(make_obs())
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(path.parent).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(path.parent.parent).st_mode) == 0o700


MOUNTS = """\
/dev/sda1 / ext4 rw 0 0
server:/export /shared nfs4 rw 0 0
lustre@o2ib:/fs /lustre lustre rw 0 0
/dev/sdb1 /shared/local ext4 rw 0 0
"""


@pytest.mark.parametrize("path, fstype, network", [
    ("/home/u/x.sqlite", "ext4", False),
    ("/shared/team/x.sqlite", "nfs4", True),
    ("/shared/local/x.sqlite", "ext4", False),
    ("/lustre/proj/x.sqlite", "lustre", True),
    ("/sharedness/x.sqlite", "ext4", False),
])
def test_network_filesystems_are_detected_from_mounts(tmp_path, path, fstype, network):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS)
    assert filesystem_type(path, str(mounts)) == fstype
    assert is_network_filesystem(path, str(mounts)) is network


def test_delete_journal_when_asked(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMCHUNK_STORE_JOURNAL", "delete")
    with Store(tmp_path / "s.sqlite") as s:
        assert s.journal_mode_in_effect == "delete"
        s.add(make_obs())
        assert s.count() == 1


def test_bad_journal_mode_is_refused(tmp_path):
    with pytest.raises(StoreError, match="'auto', 'wal' or 'delete'.*'fast'"):
        Store(tmp_path / "s.sqlite", journal_mode="fast")


def test_schema_version_is_recorded(tmp_path):
    with Store(tmp_path / "s.sqlite") as s:
        assert s.schema_version() == SCHEMA_VERSION
    con = sqlite3.connect(tmp_path / "s.sqlite")
    assert con.execute("PRAGMA user_version").fetchone()[0] == SCHEMA_VERSION
    con.close()


def test_a_v1_store_migrates_to_the_current_schema_keeping_its_rows(tmp_path):
    path = tmp_path / "old.sqlite"
    con = sqlite3.connect(path)
    con.executescript(CREATE_V1)
    con.execute("INSERT INTO meta VALUES ('application', 'memchunk-prefect')")
    con.execute("INSERT INTO observations (operator_key, elements, extents, bytes_in, peak_bytes, seconds, outcome, "
                "censored, worker, created_at) VALUES ('envelope|float32|cpu', 8000, '10x20x40', 32000, 500000, "
                "1.5, 'ok', 0, 'w1', 1700000000)")
    con.execute("INSERT INTO observations (operator_key, elements, extents, bytes_in, peak_bytes, seconds, outcome, "
                "censored, worker, created_at) VALUES ('envelope|float32|cpu', 16000, '20x20x40', 64000, 2000000, "
                "0.5, 'killed', 1, '', 1700000001)")
    con.execute("PRAGMA user_version = 1")
    con.commit()
    con.close()
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        old = s.observations()
        s.add(make_obs())
        assert len(s.observations()) == 3
    assert [(o.extents, o.peak_bytes, o.outcome, o.censored, o.worker) for o in old] == [
        ((10, 20, 40), 500000, "ok", False, "w1"), ((20, 20, 40), 2000000, "killed", True, "")]
    assert old[0].method == "" and old[0].cpu_seconds is None


def v2_store(tmp_path):
    """A schema-v2 store (as migrate_1_to_2 wrote it) holding one observation."""
    from memchunk_prefect.learn.store import _CREATE_V2, _execute_script

    path = tmp_path / "v2.sqlite"
    con = sqlite3.connect(path)
    _execute_script(con, _CREATE_V2)
    con.execute("INSERT INTO meta VALUES ('application', 'memchunk-prefect')")
    con.execute("INSERT INTO observations (operator_key, elements, extent_iline, extent_xline, extent_twt, bytes_in, "
                "peak_bytes, seconds, outcome, censored, worker, chunk, shared, method, flow_run_id, created_at) "
                "VALUES ('envelope|float32|cpu', 8000, 10, 20, 40, 32000, 500000, 1.5, 'ok', 0, 'w1', '', 0, 'vmhwm', "
                "'', 1700000000)")
    con.execute("PRAGMA user_version = 2")
    con.commit()
    con.close()
    return path


def test_a_v2_store_gains_the_v3_columns_and_keeps_its_rows(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(baseline_bytes=300, resting_bytes=200))
        new = s.observations()[-1]
        assert s.rewards() == []  # v4: the policy's rewards table exists, empty
    assert (old.peak_bytes, old.baseline_bytes, old.resting_bytes, old.unseen_bytes) == (500000, None, None, 0)
    assert (new.baseline_bytes, new.resting_bytes, new.unseen_bytes) == (300, 200, 100)


def test_the_v6_column_keeps_what_other_runs_held_and_the_unseen_memory_leaves_it_out(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        (old,) = s.observations()
        s.add(make_obs(baseline_bytes=700, resting_bytes=200, others_bytes=450))
        new = s.observations()[-1]
    assert old.others_bytes is None and old.unseen_bytes == 0
    # 700 at the start: 450 of it another run's (its own slot), 50 the worker gained beyond the 200 assumed.
    assert (new.others_bytes, new.unseen_bytes) == (450, 50)


def test_the_v7_column_keeps_how_far_a_run_grew_the_worker_and_old_rows_say_unknown(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(grew_bytes=300 * 2**20))
        s.add(make_obs(grew_bytes=0))
        grew, same = s.observations()[-2:]
    assert old.grew_bytes is None
    assert (grew.grew_bytes, same.grew_bytes) == (300 * 2**20, 0)


def test_the_v8_columns_keep_a_gpu_maps_budget_and_its_out_of_memory_and_old_rows_have_neither(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(gpu_peak_bytes=5 * 2**30, gpu_budget_bytes=4 * 2**30, gpu_out_of_memory=True,
                       outcome="memory_error", censored=True))
        s.add(make_obs(gpu_peak_bytes=2**30, gpu_budget_bytes=4 * 2**30))
        ran_out, fine = s.observations()[-2:]
    assert (old.gpu_budget_bytes, old.gpu_out_of_memory) == (None, False)
    assert (ran_out.gpu_budget_bytes, ran_out.gpu_out_of_memory, ran_out.gpu_peak_bytes) == (4 * 2**30, True,
                                                                                              5 * 2**30)
    assert (fine.gpu_budget_bytes, fine.gpu_out_of_memory) == (4 * 2**30, False)


def test_the_v9_column_keeps_a_runs_kernel_time_and_old_rows_do_not_know_it(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(sys_seconds=0.3, grew_bytes=500 * 2**20))
        (new,) = s.observations()[-1:]
    assert old.sys_seconds is None and new.sys_seconds == 0.3


def test_the_v10_column_keeps_what_a_run_left_held_and_old_rows_do_not_know_it(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(retained_bytes=150 * 2**20))
        s.add(make_obs(retained_bytes=0))
        first_use, plain = s.observations()[-2:]
    assert (old.retained_bytes, first_use.retained_bytes, plain.retained_bytes) == (None, 150 * 2**20, 0)


def test_the_v12_column_keeps_whether_a_run_was_its_workers_first_call_and_old_rows_do_not_know_it(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(first_call=True))
        s.add(make_obs(first_call=False))
        first, later = s.observations()[-2:]
    assert (old.first_call, first.first_call, later.first_call) == (None, True, False)


def test_the_v13_column_keeps_when_the_runner_submitted_a_run_and_old_rows_do_not_know_it(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(submitted_at=98.5, started_at=99.0))
        (new,) = s.observations()[-1:]
    assert (old.submitted_at, new.submitted_at, new.started_at) == (None, 98.5, 99.0)


def test_the_v15_columns_keep_when_a_runs_memory_rose_and_old_rows_do_not_know_it(tmp_path):
    path = v2_store(tmp_path)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        (old,) = s.observations()
        s.add(make_obs(rise_50=0.25, rise_90=0.8))
        (new,) = s.observations()[-1:]
    assert (old.rise_50, old.rise_90, new.rise_50, new.rise_90) == (None, None, 0.25, 0.8)

def test_the_v2_store_reaches_v5_with_empty_maps_and_machines_and_old_rows_lack_trace_fields(tmp_path):
    from memchunk_prefect.core.records import MapRun

    path = v2_store(tmp_path)
    run = MapRun("fr1", "envelope", "envelope|float32|cpu", "/s.sgy", "/o.zarr", (4, 5, 6), (0, 1, 2), 4, 2,
                 1000, 10.0, 12.5, source_bytes=480, map_id="m1")
    with Store(path) as s:
        (old,) = s.observations()
        assert (old.energy_source, old.started_at, old.task_run_id, old.host) == (None, None, "", "")
        assert s.maps() == [] and s.machines() == {}
        s.add(make_obs(energy_joules=3.5, energy_source="estimate", started_at=9.0, task_run_id="t1", host="h",
                       flow_run_id="fr1", map_id="m1"))
        s.add_map(run)
        s.put_machines({"h": {"nodeName": "h", "cpu": {"coreCount": 2}}})
        s.put_machines({"h": {"nodeName": "h", "cpu": {"coreCount": 4}}})  # a newer description replaces it
        assert s.maps("fr1") == [run] and s.maps("other") == []
        assert s.machines() == {"h": {"nodeName": "h", "cpu": {"coreCount": 4}}}
        (new,) = s.run_observations("fr1")
    assert (new.energy_joules, new.energy_source, new.started_at, new.task_run_id, new.host, new.map_id) == (
        3.5, "estimate", 9.0, "t1", "h", "m1")


def store_with_a_map(tmp_path, run, version=10):
    """A store of schema ``version`` (10 or later; migrated forward from v2 as an older version did) holding
    ``run`` in the map columns that version has."""
    from memchunk_prefect.learn.store import MIGRATIONS

    path = v2_store(tmp_path)
    con = sqlite3.connect(path, isolation_level=None)
    for v in range(2, version):
        MIGRATIONS[v](con)
    con.execute(f"PRAGMA user_version = {int(version)}")
    columns = [c for c in run.to_dict() if c in {r[1] for r in con.execute("PRAGMA table_info(maps)")}]
    row = {**run.to_dict(), "shape": ",".join(map(str, run.shape)), "halo": ",".join(map(str, run.halo))}
    con.execute(f"INSERT INTO maps ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))})",
                [row[c] for c in columns])
    con.close()
    return path


def test_the_v11_map_columns_keep_what_a_simulation_needs_and_old_maps_do_not_know_it(tmp_path):
    from memchunk_prefect.core.records import MapRun

    old = MapRun("fr0", "envelope", "envelope|float32|cpu", "/s.sgy", "/o.zarr", (4, 5, 6), (0, 1, 2), 4, 2,
                 1000, 10.0, 12.5, map_id="m0")
    path = store_with_a_map(tmp_path, old)
    new = MapRun("fr1", "box", "box[r=2]|float32|cpu", "", "/b.zarr", (4, 5, 6), (2, 2, 2), 4, 4, 1000, 13.0, 14.0,
                 map_id="m1", params='{"r": 2}', whole_traces=False, workers=2, threads_per_worker=2,
                 memory_limit_bytes=2**30, kill_fraction=0.95, resting_bytes=250 * 2**20)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        s.add_map(new)
        got_old, got_new = s.maps()
    assert got_old == old and (got_old.params, got_old.whole_traces, got_old.workers) == (None, None, None)
    assert got_new == new and got_new.whole_traces is False


def test_the_v14_map_column_keeps_the_threads_per_core_the_budget_counted_and_old_maps_do_not_know_it(tmp_path):
    from memchunk_prefect.core.records import MapRun

    old = MapRun("fr0", "box", "box[r=2]|float32|cpu", "", "/a.zarr", (4, 5, 6), (2, 2, 2), 4, 4, 1000, 10.0, 12.0,
                 map_id="m0", workers=2, threads_per_worker=2)
    path = store_with_a_map(tmp_path, old, version=13)
    new = dataclasses.replace(old, flow_run_id="fr1", map_id="m1", started_at=13.0, ended_at=14.0,
                              threads_per_core=2.0)
    with Store(path) as s:
        assert s.schema_version() == SCHEMA_VERSION
        s.add_map(new)
        got_old, got_new = s.maps()
    assert got_old == old and got_old.threads_per_core is None
    assert got_new == new and got_new.threads_per_core == 2.0


def test_policy_rewards_round_trip_and_are_forgotten_with_their_key(tmp_path):
    from memchunk_prefect.core.records import Reward

    with Store(tmp_path / "s.sqlite") as s:
        a = Reward("envelope|float32|cpu", "bold", ("bold", "mid"), 0.4, 0.4, 1000, 2.5, 2, n_chunks=4)
        b = Reward("gst3d|float32|cpu", "safe", ("safe",), -0.3, 0.7, 500, 9.0, 2, out_of_memory=1)
        s.add_reward(a)
        s.add_reward(b)
        assert s.rewards("envelope|float32|cpu") == [a]
        assert s.rewards() == [a, b]
        s.add(make_obs(key="gst3d|float32|cpu"))
        s.forget("gst3d|float32|cpu")
        assert s.rewards() == [a]


def test_a_newer_store_is_refused_and_left_untouched(tmp_path):
    path = tmp_path / "s.sqlite"
    with Store(path) as s:
        s.add(make_obs())
    con = sqlite3.connect(path)
    con.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    con.commit()
    con.close()
    before = path.read_bytes()
    with pytest.raises(StoreSchemaTooNewError, match=rf"version {SCHEMA_VERSION + 1}.*upgrade memchunk-prefect"):
        Store(path)
    assert path.read_bytes() == before
    assert list(tmp_path.glob("*.corrupt-*")) == []


def _foreign_sqlite(path):
    con = sqlite3.connect(path)
    con.execute("CREATE TABLE customers (id INTEGER, name TEXT)")
    con.commit()
    con.close()


@pytest.mark.parametrize("make", [
    lambda p: p.write_bytes(os.urandom(8192)),
    lambda p: p.write_bytes(b"SQLite format 3\x00" + os.urandom(4000)),
    _foreign_sqlite,
], ids=["random-bytes", "truncated-sqlite-header", "foreign-sqlite"])
def test_a_corrupt_or_foreign_file_is_moved_aside_and_a_fresh_store_begins(tmp_path, make):
    path = tmp_path / "s.sqlite"
    make(path)
    original = path.read_bytes()
    with pytest.warns(StoreMovedAsideWarning, match="moved to"):
        s = Store(path)
    with s:
        assert s.count() == 0
        s.add(make_obs())
        assert s.count() == 1
    aside = list(tmp_path.glob("s.sqlite.corrupt-*"))
    assert len(aside) == 1 and aside[0].read_bytes() == original


def test_an_empty_file_becomes_a_store(tmp_path):
    path = tmp_path / "s.sqlite"
    path.touch()
    with Store(path) as s:
        assert s.count() == 0


@pytest.mark.parametrize("env, expected", [
    ({"MEMCHUNK_STORE": "/x/obs.sqlite"}, "/x/obs.sqlite"),
    ({"MEMCHUNK_STORE": "", "PREFECT_HOME": "/ph"}, "/ph/memchunk/observations.sqlite"),
])
def test_default_store_path(monkeypatch, env, expected):
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert str(default_store_path()) == expected


def test_default_store_path_falls_back_to_prefect_default_home(monkeypatch, tmp_path):
    monkeypatch.delenv("MEMCHUNK_STORE", raising=False)
    monkeypatch.delenv("PREFECT_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delitem(__import__("sys").modules, "prefect.settings", raising=False)
    assert default_store_path() == tmp_path / ".prefect" / "memchunk" / "observations.sqlite"


def test_store_uses_the_environment_when_no_path_is_given(monkeypatch, tmp_path):
    monkeypatch.setenv("MEMCHUNK_STORE", str(tmp_path / "env.sqlite"))
    with Store() as s:
        assert s.path == tmp_path / "env.sqlite"


def test_a_directory_path_is_refused_not_moved(tmp_path):
    with pytest.raises(StoreError, match="is a directory"):
        Store(tmp_path)
    assert tmp_path.is_dir()


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads anything")
def test_an_unreadable_store_is_an_error_not_moved_aside(tmp_path):
    path = tmp_path / "s.sqlite"
    Store(path).close()
    path.chmod(0)
    try:
        with pytest.raises(StoreError, match="permissions"):
            Store(path)
        assert list(tmp_path.glob("*.corrupt-*")) == []
    finally:
        path.chmod(0o600)


def test_an_interrupt_after_commit_is_not_replaced_by_a_failed_rollback(tmp_path):
    """Ctrl-C landing after COMMIT: the KeyboardInterrupt must reach the caller (a ROLLBACK with no
    transaction raised OperationalError instead, which the runner swallowed as a store error)."""
    import sqlite3

    from memchunk_prefect.learn.store import _rollback

    con = sqlite3.connect(tmp_path / "x.sqlite", isolation_level=None)
    con.execute("CREATE TABLE t (v INTEGER)")
    with pytest.raises(KeyboardInterrupt):
        try:
            con.execute("BEGIN IMMEDIATE")
            con.execute("INSERT INTO t VALUES (1)")
            con.execute("COMMIT")
            raise KeyboardInterrupt  # arrives after the commit
        except BaseException:
            _rollback(con)
            raise
    assert con.execute("SELECT count(*) FROM t").fetchone()[0] == 1
    con.execute("BEGIN IMMEDIATE")
    con.execute("INSERT INTO t VALUES (2)")
    _rollback(con)  # an open transaction is rolled back
    assert con.execute("SELECT count(*) FROM t").fetchone()[0] == 1


def test_compact_keeps_the_newest_rows_of_each_key_and_the_maps_they_belong_to(tmp_path):
    from memchunk_prefect.core.records import MapRun, Reward

    a, b = "envelope|float32|cpu", "gst3d|float32|cpu"

    def a_map(key: str, ended_at: float) -> MapRun:
        return MapRun("fr", "op", key, "/s.sgy", "/o.zarr", (4, 5, 6), (0, 0, 0), 4, 2, 1000, ended_at - 1, ended_at)

    with Store(tmp_path / "s.sqlite") as s:
        s.add_many([make_obs(i, key=a, created_at=100.0 + i) for i in range(10)])
        s.add_many([make_obs(i, key=b, created_at=100.0 + i) for i in range(3)])
        for i in range(6):
            s.add_reward(Reward(a, "bold", ("bold",), 0.1 * i, 0.5, 1000, 1.0, 2))
        s.add_map(a_map(a, 104.5))  # its chunks (created at 100..104) all go: so does it
        s.add_map(a_map(a, 107.5))  # chunk 107 is kept
        s.add_map(a_map(b, 100.5))  # b keeps every row
        assert s.compact(4) == {"observations": 6, "rewards": 2, "maps": 1}
        assert [o.peak_bytes for o in s.observations(a)] == [1006, 1007, 1008, 1009]
        assert [o.peak_bytes for o in s.observations(b)] == [1000, 1001, 1002]
        assert [round(r.reward, 1) for r in s.rewards(a)] == [0.2, 0.3, 0.4, 0.5]
        assert sorted(m.ended_at for m in s.maps()) == [100.5, 107.5]
        assert s.compact(4) == {"observations": 0, "rewards": 0, "maps": 0}
        assert s.compact(1, key=b)["observations"] == 2 and s.count(a) == 4
        with pytest.raises(StoreError, match=r"keep must be .* at least 1, got 0"):
            s.compact(0)


def test_a_store_compacted_after_every_run_stops_growing(tmp_path):
    """SQLite reuses the pages compaction frees: after the first rounds the file's size is flat."""
    path = tmp_path / "s.sqlite"
    sizes = []
    for night in range(12):  # a process a night, as a nightly flow run opens and closes it
        with Store(path) as s:
            s.add_many([make_obs(i % 50, key=k, chunk=f"n{night}-{i}") for k in ("a|f|cpu", "b|f|cpu")
                        for i in range(300)])
            s.compact(600)
            assert s.count("a|f|cpu") == min(600, 300 * (night + 1))
        sizes.append(sum(os.path.getsize(f"{path}{x}") for x in ("", "-wal", "-shm") if os.path.exists(f"{path}{x}")))
    assert max(sizes[4:]) <= 1.05 * sizes[3], sizes
    assert sizes[-1] < 0.5 * sizes[0] * 12, "without compaction the file would hold 12 nights"


def test_compact_keeps_the_sizes_a_model_needs_and_every_arms_latest_rewards(tmp_path):
    """Once warm, nights repeat one chunk size: the newest rows alone would leave the model one size (not ready)
    and the arms played early no reward (untried again)."""
    from memchunk_prefect.core.records import Reward
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.testing import seed_store

    key = "envelope|float32|cpu"
    with Store(tmp_path / "s.sqlite") as s:
        seed_store(s, key, 16.0, fixed_bytes=3 * 2**20)  # the cold night's probes: 5 sizes
        s.add(make_obs(0, key=key, outcome="memory_error", censored=True))
        s.add_many([Observation(key, 400_000, (10, 100, 400), 1_600_000, 3 * 2**20 + 16 * 400_000, seconds=0.1)
                    for _ in range(40)])  # 40 warm nights of one size
        for arm, n in (("safe", 3), ("mid", 2), ("bold", 30)):
            for i in range(n):
                s.add_reward(Reward(key, arm, ("bold", "mid", "safe"), 0.5, 0.5, 1000, 1.0, 2))
        assert ModelBank(s).predict(key, (10, 100, 400)).ready
        deleted = s.compact(10)
        kept = s.observations(key)
        # The 10 newest (one size) + the newest of each other (size, outcome): 4 probe sizes and the kill.
        assert deleted["observations"] == 46 - 15 and len(kept) == 15
        assert {o.elements for o in kept} >= {20_000, 50_000, 100_000, 200_000, 400_000}
        assert any(o.censored for o in kept)
        assert ModelBank(s).predict(key, (10, 100, 400)).ready, "the compacted history must keep the model ready"
        assert sorted(r.arm for r in s.rewards(key)).count("bold") == 10
        assert {r.arm for r in s.rewards(key)} == {"bold", "mid", "safe"} and deleted["rewards"] == 20


def test_compact_deletes_the_map_records_whose_observations_all_went_and_keeps_recent_ones(tmp_path):
    from memchunk_prefect.core.records import MapRun

    key = "envelope|float32|cpu"

    def a_map(map_id: str, ended_at: float) -> MapRun:
        return MapRun("fr", "envelope", key, "/s.sgy", "/o.zarr", (4, 5, 6), (0, 0, 0), 4, 2, 1000, ended_at - 1,
                      ended_at, map_id=map_id)

    with Store(tmp_path / "s.sqlite") as s:
        s.add(make_obs(1, key=key, map_id="probe", created_at=10.0))  # a size of its own: kept
        for night in range(6):  # one size a night, two chunks each
            s.add_many([make_obs(0, key=key, map_id=f"n{night}", created_at=100.0 + 10 * night + c)
                        for c in range(2)])
            s.add_map(a_map(f"n{night}", 101.5 + 10 * night))
        s.add_map(a_map("probe", 10.5))
        s.add_map(a_map("resumed", 155.0))  # recent, nothing to measure (every chunk was already written)
        s.add_map(a_map("old-resumed", 50.0))  # old, nothing left
        assert s.compact(4)["maps"] == 5  # n0..n3 (their chunks went) and old-resumed
        assert sorted(m.map_id for m in s.maps()) == ["n4", "n5", "probe", "resumed"]


def test_a_copy_as_of_a_time_holds_what_the_store_held_then_and_the_kept_flow_runs_maps(tmp_path):
    from memchunk_prefect.core.records import MapRun, Reward

    def obs(t: float, run: str) -> Observation:
        return Observation("k", 100, (1, 1, 100), 400, 4000, seconds=0.1, flow_run_id=run, created_at=t)

    def map_of(run: str, t: float) -> MapRun:
        return MapRun(run, "op", "k", "/s", f"/o/{run}", (1, 1, 100), (0, 0, 0), 4, 1, 2**30, t, t + 5,
                      map_id=f"{run}-m")

    with Store(tmp_path / "s.sqlite") as s:
        s.add_many([obs(10.0, "a"), obs(20.0, "b"), obs(30.0, "c")])
        s.add_reward(Reward("k", "safe", ("safe",), 0.5, 0.5, 100, 5.0, 1, flow_run_id="a", created_at=11.0))
        s.add_reward(Reward("k", "safe", ("safe",), 0.5, 0.5, 100, 5.0, 1, flow_run_id="c", created_at=31.0))
        for run, t in (("a", 5.0), ("b", 15.0), ("c", 25.0), ("d", 18.0)):  # d overlaps: it ends at 23 s
            s.add_map(map_of(run, t))
        copy = s.copy_as_of(tmp_path / "copy.sqlite", 20.0, keep_flow_run="c")
        assert len(s.observations()) == 3  # the store itself is untouched
        with pytest.raises(StoreError, match="cannot replace the store itself"):
            s.copy_as_of(s.path, 20.0)
    with Store(copy) as c:
        assert [o.flow_run_id for o in c.observations()] == ["a", "b"]  # written by t = 20 s
        assert [r.flow_run_id for r in c.rewards()] == ["a"]
        # Maps that had ended by then (d, started before but ending after, had no record yet), and c's, kept.
        assert [m.flow_run_id for m in c.maps()] == ["a", "b", "c"]
    with Store(tmp_path / "s.sqlite") as s, Store(s.copy_as_of(copy, 12.0)) as c:  # replaced; nothing beyond it
        assert [m.flow_run_id for m in c.maps()] == ["a"] and len(c.observations()) == 1
