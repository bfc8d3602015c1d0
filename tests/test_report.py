"""Artifacts in the Prefect UI: pure rows and markdown, and real artifacts read back from a real server."""

from __future__ import annotations

import re

import numpy as np
import pytest
from prefect import flow

from memchunk_prefect import MemoryAwareRunner, chunked, open_segy, synthetic_survey
from memchunk_prefect.learn.store import Store
from memchunk_prefect.operators import operator_key
from memchunk_prefect.run.report import (
    Attempt,
    MapRecord,
    artifact_key,
    chunk_rows,
    map_summary,
    naive_chunking,
    summary_markdown,
)
from memchunk_prefect.testing import KILL_HOLD_S, memory_hog, seed_store, start_local_cluster

KEY_RE = re.compile(r"^[a-z0-9]+(-[a-z0-9]+)*$")
MiB = 2**20


def record_with_a_kill() -> MapRecord:
    r = MapRecord(operator="gst3d_dip", operator_key="gst3d_dip[sigma_gradient=1;sigma_tensor=2]|float32|cpu",
                  shape=(64, 10, 50), budget_bytes=512 * MiB, slots=2, output_path="/o/gst.zarr")
    r.decisions = [{"decision": "rechunk", "reason": "source has no chunking yet: 2 chunks", "chunk_shape": [32, 10, 50]},
                   {"decision": "retry-smaller", "reason": "iline 0:32 ran out of memory", "chunk_shape": None}]
    r.attempts = [
        Attempt("iline 0:32", "i0-32", (36, 10, 50), 18000, "rechunk", 300 * MiB, 400 * MiB, outcome="killed",
                measured_bytes=950 * MiB, censored=True, seconds=4.0),
        Attempt("iline 32:64", "i32-64", (36, 10, 50), 18000, "rechunk", 300 * MiB, 400 * MiB, outcome="ok",
                measured_bytes=330 * MiB, seconds=2.0, worker="tcp://w1", joules=20.0, energy_source="estimate"),
        Attempt("iline 0:16", "i0-16", (20, 10, 50), 10000, "retry-smaller", 200 * MiB, 260 * MiB, outcome="ok",
                measured_bytes=200 * MiB, seconds=1.0, worker="tcp://w2", joules=10.5, energy_source="estimate"),
    ]
    r.done_chunks, r.done_elements, r.ended_at = 2, 64 * 10 * 50, r.started_at + 9
    r.naive = {"n_chunks": 1, "chunk_shape": [64, 10, 50], "predicted_bytes": 2e9, "over_budget": 1}
    return r


def test_keys_are_valid_for_the_artifacts_page():
    for parts in [("memchunk", "gst3d_dip", "chunks"), ("memchunk-summary", "Seismic Attributes"), ("A__b", "--"),
                  ("", "")]:
        assert KEY_RE.match(artifact_key(*parts)), parts


def test_rows_have_every_column_and_mark_censored_peaks():
    rows = chunk_rows(record_with_a_kill())
    assert list(rows[0]) == ["chunk", "extents", "elements", "predicted MiB", "upper-bound MiB", "measured MiB",
                             "seconds", "energy J", "energy source", "decision", "outcome", "worker"]
    assert rows[0]["measured MiB"] == "over 950.0" and rows[0]["outcome"] == "worker killed"
    assert rows[1]["measured MiB"] == 330.0 and rows[1]["predicted MiB"] == 300.0 and rows[1]["extents"] == "36 x 10 x 50"
    assert [r["decision"] for r in rows] == ["rechunk", "rechunk", "retry-smaller"]
    assert [r["energy J"] for r in rows] == [None, 20.0, 10.5]
    assert [r["energy source"] for r in rows] == [None, "estimate", "estimate"]


def test_summary_shows_each_maps_energy_and_the_runs_total_labelled_by_source():
    s = map_summary(record_with_a_kill())
    assert s["energy"] == {"estimate": 30.5}
    md = summary_markdown("flow", [record_with_a_kill()])
    assert "Energy: 30.5 J (estimated)." in md
    assert md.count("| 30.5 J (estimated) |") == 1


def test_summary_counts_avoided_recovered_budget_model_error_and_retry_time():
    r = record_with_a_kill()
    s = map_summary(r)
    assert (s["oom_avoided"], s["oom_recovered"], s["retry_seconds"]) == (1, 1, 4.0)
    assert s["peak_bytes"] == 330 * MiB and s["budget_use"] == round(330 / 512, 3)
    assert s["model_error"] == {"n": 2, "median_abs_pct": 4.5, "within_upper": 1.0}
    md = summary_markdown("seismic-attributes", [r])
    for text in ("| gst3d_dip |", "rechunk → retry-smaller", "330.0 MiB / 512.0 MiB (64%)", "out-of-memory avoided",
                 "out-of-memory recovered", "4.0 s", "source has no chunking yet"):
        assert text in md, text
    assert summary_markdown("f", []).endswith("No chunked maps ran.")


def test_naive_chunking_is_dasks_auto_and_counts_chunks_over_budget():
    class P:
        ready = True

        def __init__(self, n):
            self.mean_bytes = 60 * 4 * n

    n = naive_chunking((64, 64, 100), (1, 1, 1), 100 * MiB, lambda e: P(e[0] * e[1] * e[2]))
    assert n["n_chunks"] == 1 and n["over_budget"] == 0
    n = naive_chunking((512, 512, 400), (0, 0, 0), 100 * MiB, lambda e: P(e[0] * e[1] * e[2]))
    assert n["n_chunks"] > 1 and n["over_budget"] == n["n_chunks"]
    assert naive_chunking((4, 4, 4), (0, 0, 0), 1, lambda e: type("U", (), {"ready": False})()) == {}


# --------------------------------------------------------------------------- on a real server and cluster


@pytest.fixture(scope="module")
def cluster():
    c = start_local_cluster(n_workers=2, memory_limit="1GiB")
    yield c
    c.close()


def artifacts_of(flow_run_id) -> list:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_a_real_run_leaves_table_progress_and_summary_artifacts_with_a_recovered_kill(cluster, tmp_path):
    """memory_hog at 450x its input, held for KILL_HOLD_S, with the model seeded to believe 100x: a chunk is really killed."""
    import json

    path = tmp_path / "s.sgy"
    synthetic_survey(path, (48, 50, 500), seed=5)
    key = operator_key(memory_hog, {"multiple": 450})
    store = Store(tmp_path / "store.sqlite")
    seed_store(store, key, 4 * 100.0)
    store.close()
    runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"),
                               output_dir=str(tmp_path / "out"))

    @flow(name="Report Test", task_runner=runner)
    def hog(p: str):
        from prefect.runtime import flow_run

        out = memory_hog.map(chunked(p), multiple=450, seconds=KILL_HOLD_S)
        return flow_run.id, out.events, out.result().values

    run_id, events, values = hog(str(path))
    np.testing.assert_array_equal(values, open_segy(path).values)
    assert any(e["event"] == "killed" for e in events)

    arts = artifacts_of(run_id)
    by_type = {}
    for a in arts:
        assert a.key and KEY_RE.match(a.key), a.key
        by_type.setdefault(a.type, []).append(a)
    (table,) = by_type["table"]
    (progress,) = by_type["progress"]
    (summary,) = by_type["markdown"]
    assert (table.key, progress.key, summary.key) == ("memchunk-memory-hog-chunks", "memchunk-memory-hog-progress",
                                                      "memchunk-summary-report-test")
    rows = json.loads(table.data) if isinstance(table.data, str) else table.data
    assert len(rows) == len(events)
    killed = [r for r in rows if r["outcome"] == "worker killed"]
    assert killed and all(str(r["measured MiB"]).startswith("over ") for r in killed)
    assert any(r["decision"] == "retry-smaller" and r["outcome"] == "ok" for r in rows)
    assert all(r["worker"] for r in rows if r["outcome"] == "ok")
    ok_pred = [r for r in rows if r["outcome"] == "ok" and r["decision"] != "probe"]
    assert ok_pred and all(r["predicted MiB"] is not None and r["upper-bound MiB"] is not None for r in ok_pred)
    assert float(progress.data) == 100.0
    md = summary.data
    assert "| memory_hog |" in md and "out-of-memory recovered" in md and "retry-smaller" in md


def test_a_map_of_many_chunks_makes_a_table_the_server_publishes_and_keeps_what_matters():
    """16,641 task runs (the 20k many_chunks map) made a 5.5 MB table whose creation event the server refused
    (its limit, PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES, is 1.5 MB): the table shows at most TABLE_ROWS runs,
    every one not ok among them, the first of each decision and the highest peak."""
    import json

    from memchunk_prefect.run.report import TABLE_ROWS, Attempt

    r = record_with_a_kill()
    r.attempts = [Attempt(f"iline {i}:{i + 1}", f"k{i}", (1, 11, 100), 1100, "rechunk", 40 * MiB, 47 * MiB,
                          outcome="ok", measured_bytes=(40 + (i % 7)) * MiB, seconds=0.1, worker="tcp://w1")
                  for i in range(16_641)]
    r.attempts[5000].outcome, r.attempts[5000].censored = "killed", True
    r.attempts[9000].decision = "retry-smaller"
    r.attempts[12_345].measured_bytes = 47 * MiB
    assert len(json.dumps(chunk_rows(r, limit=len(r.attempts)))) > 1_500_000  # all of them: over the limit
    rows = chunk_rows(r)
    assert len(rows) == TABLE_ROWS and len(json.dumps(rows)) < 1_500_000 / 3
    chunks = [row["chunk"] for row in rows]
    assert chunks == sorted(chunks, key=lambda c: int(c.split()[1].split(":")[0]))  # submission order
    for must in ("iline 0:1", "iline 5000:5001", "iline 9000:9001", "iline 12345:12346"):
        assert must in chunks
    # The rest spread over the map: no stretch of it left without a row.
    starts = sorted(int(c.split()[1].split(":")[0]) for c in chunks)
    assert max(b - a for a, b in zip(starts, starts[1:])) <= 2 * 16_641 / TABLE_ROWS
    small = record_with_a_kill()
    assert len(chunk_rows(small)) == len(small.attempts)  # a map that fits shows every run
