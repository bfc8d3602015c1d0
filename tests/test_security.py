"""Security (issue 8): the store holds plain data, files are user-only, nothing listens beyond loopback,
and output paths stay inside their output directory."""

from __future__ import annotations

import ast
import os
import pickle
import stat
from pathlib import Path

import numpy as np
import pytest

from memchunk_prefect.core.records import Observation
from memchunk_prefect.learn.store import Store

PACKAGE = Path(__file__).resolve().parents[1] / "memchunk_prefect"
DANGEROUS_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "joblib"}
DANGEROUS_CALLS = {"eval", "exec", "compile", "__import__"}


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)
    yield
    os.umask(old)


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# =========================================================================== the store is plain data


@pytest.mark.parametrize("module", sorted(str(p.relative_to(PACKAGE)) for p in (PACKAGE / "learn").glob("*.py"))
                         + ["core/records.py"])
def test_store_and_model_code_never_unpickle_or_evaluate(module):
    tree = ast.parse((PACKAGE / module).read_text())
    imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not imported & DANGEROUS_MODULES, f"{module} imports {imported & DANGEROUS_MODULES}"
    calls = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert not calls & DANGEROUS_CALLS, f"{module} calls {calls & DANGEROUS_CALLS}"


class _Boom:
    def __reduce__(self):
        return (os.system, ("touch /tmp/memchunk-pwned",))


def test_rows_holding_pickles_and_sql_are_read_back_as_plain_text(tmp_path):
    payload = pickle.dumps(_Boom()).decode("latin-1")
    sql = "x'); DROP TABLE observations; --"
    path = tmp_path / "s.sqlite"
    with Store(path) as s:
        s.add(Observation(sql + "|float32|cpu", 100, (1, 10, 10), 400, 1000, worker=payload, chunk=sql,
                          flow_run_id="'; DELETE FROM meta; --"))
    with Store(path) as s:
        (obs,) = s.observations()
        assert s.keys() == [sql + "|float32|cpu"]
        assert obs.worker == payload and obs.chunk == sql and obs.flow_run_id == "'; DELETE FROM meta; --"
        assert isinstance(obs.worker, str)
        s.forget(sql + "|float32|cpu")
        assert s.count() == 0
    assert not Path("/tmp/memchunk-pwned").exists()


# =========================================================================== user-only files


def test_store_files_and_folders_are_user_only_under_a_permissive_umask(tmp_path, permissive_umask):
    path = tmp_path / "a" / "b" / "obs.sqlite"
    with Store(path) as s:
        s.add(Observation("k|float32|cpu", 100, (1, 10, 10), 400, 1000))
        side = [p for p in path.parent.iterdir() if p.name != path.name]
        assert mode(path) == 0o600
        for p in side:  # -wal / -shm while open
            assert mode(p) & 0o077 == 0, f"{p.name} is {oct(mode(p))}"
    assert mode(path.parent) == 0o700 and mode(path.parent.parent) == 0o700


def test_zarr_output_is_user_only_under_a_permissive_umask(tmp_path, permissive_umask):
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io.zarr_store import ZarrOutput

    out = ZarrOutput.create(tmp_path / "out.zarr", (4, 4, 8), zarr_chunks=(3, 3, 8))
    out.write(Chunk((0, 0, 0), (4, 2, 8)), np.ones((4, 2, 8), np.float32))  # partial storage chunks: locks
    # A 0700 root hides everything inside it; nothing inside may be writable by others either.
    assert mode(tmp_path / "out.zarr") == 0o700, oct(mode(tmp_path / "out.zarr"))
    writable = [str(p.relative_to(tmp_path)) for p in (tmp_path / "out.zarr").rglob("*") if mode(p) & 0o022]
    assert writable == []


def test_runner_default_output_folders_are_user_only(tmp_path, permissive_umask, monkeypatch):
    from memchunk_prefect.run.runner import MemoryAwareRunner

    monkeypatch.delenv("MEMCHUNK_OUTPUT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    path = Path(MemoryAwareRunner(address="tcp://127.0.0.1:1").next_output_path("envelope"))
    base = tmp_path / "memchunk-outputs"
    assert path.is_relative_to(base)
    for d in (path.parent, base):
        assert mode(d) == 0o700, f"{d} is {oct(mode(d))}"


# =========================================================================== loopback only


def test_zero_argument_runner_dashboard_is_on_loopback():
    from memchunk_prefect.run.runner import MemoryAwareRunner

    kw = MemoryAwareRunner().cluster_kwargs
    assert kw["dashboard_address"].startswith("127.0.0.1:")
    assert kw.get("host") in (None, "127.0.0.1", "localhost")


def test_a_runner_given_its_own_cluster_kwargs_keeps_the_dashboard_on_loopback_unless_told_otherwise():
    """Dask's default dashboard address is port 8787 on every interface: a user who sizes their workers must not
    expose the cluster by doing so, nor clash with a second flow's cluster on the port."""
    from memchunk_prefect.run.runner import MemoryAwareRunner

    sized = MemoryAwareRunner(cluster_kwargs={"n_workers": 2, "memory_limit": "1GiB"}).cluster_kwargs
    assert sized["dashboard_address"] == "127.0.0.1:0"
    chosen = MemoryAwareRunner(cluster_kwargs={"n_workers": 2, "dashboard_address": ":8799"}).cluster_kwargs
    assert chosen["dashboard_address"] == ":8799"


@pytest.mark.cluster
def test_a_cluster_from_the_zero_argument_runner_listens_on_loopback_only():
    import psutil

    from memchunk_prefect.run.runner import MemoryAwareRunner

    runner = MemoryAwareRunner(cluster_kwargs={**MemoryAwareRunner().cluster_kwargs, "n_workers": 1})
    with runner:
        client = runner.client
        info = client.scheduler_info()
        addresses = [client.scheduler.address, *info["workers"]]
        assert all(a.startswith(("tcp://127.0.0.1:", "inproc://")) for a in addresses), addresses
        dash = client.dashboard_link
        assert "127.0.0.1" in dash or "localhost" in dash, dash
        me = psutil.Process()
        pids = {me.pid, *(c.pid for c in me.children(recursive=True))}
        listening = [c for c in psutil.net_connections(kind="inet")
                     if c.status == psutil.CONN_LISTEN and c.pid in pids]
        assert listening, "expected the scheduler, workers and dashboard to listen somewhere"
        wide = [(c.pid, c.laddr) for c in listening if c.laddr.ip not in ("127.0.0.1", "::1")]
        assert wide == [], f"listening beyond loopback: {wide}"


# =========================================================================== output paths stay inside


@pytest.mark.parametrize("name", ["x/../../../../escape", "x/../../../../../../tmp/escape"])
def test_an_operator_name_cannot_move_the_output_out_of_the_output_dir(tmp_path, name):
    from memchunk_prefect.core.errors import OutputPathError
    from memchunk_prefect.run.runner import MemoryAwareRunner

    base = tmp_path / "outputs"
    runner = MemoryAwareRunner(address="tcp://127.0.0.1:1", output_dir=str(base))
    try:
        path = Path(runner.next_output_path(name)).resolve()
    except OutputPathError:
        return
    assert path.is_relative_to(base.resolve()), path
