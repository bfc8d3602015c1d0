"""WfCommons traces (memchunk_prefect/sim/trace.py, `memchunk export --format wfcommons`).

(a) the pure builder on hand-made maps and observations: edges from halos, failed attempts, energy shares,
ids, validation with the vendored schema and loading back with wfcommons.Instance; (b) bad input: nothing is
ever written; (c) one real flow on a real Dask cluster and Prefect server, exported through the CLI.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import os
import sys
import uuid
import warnings
from pathlib import Path

import pytest

if sys.version_info < (3, 11):  # wfcommons 1.6 (and tomllib) need Python >= 3.11: the `trace` extra skips 3.10
    pytest.skip("the WfCommons export needs Python >= 3.11 (wfcommons 1.6 does not install on 3.10)",
                allow_module_level=True)

import tomllib  # noqa: E402

from memchunk_prefect.cli.app import main
from memchunk_prefect.core.chunks import Chunk, with_halo
from memchunk_prefect.core.energy import kwh
from memchunk_prefect.core.errors import TraceExportError
from memchunk_prefect.core.records import MapRun, Observation
from memchunk_prefect.learn.store import Store
from memchunk_prefect.sim import trace, trace_compare

with warnings.catch_warnings():  # importing wfcommons runs warnings.filterwarnings("ignore") for the whole process
    import wfcommons  # the `trace` extra, in the `test` extra too

# wfcommons.Instance validates with the vendored 1.5 schema, whose "$schema" names no draft: jsonschema warns and
# uses the latest (trace.validate silences the same warning).
pytestmark = pytest.mark.filterwarnings("ignore:The metaschema specified by .schema was not found:DeprecationWarning")

REPO = Path(__file__).resolve().parents[1]
RUN = "3c1f5a52-0d7e-4c1e-9a8a-9a52f0f0c0de"
FLOW_RUN = {"id": RUN, "name": "brave-otter", "flow_name": "pipeline", "start_time": 1000.0, "end_time": 1100.0,
            "state": "Completed"}
MACHINES = {"node-a": {"nodeName": "node-a", "system": "linux", "architecture": "x86_64", "release": "6.1",
                       "memoryInBytes": 8 * 2**30,
                       "cpu": {"coreCount": 4, "speedInMHz": 2600, "vendor": "GenuineIntel", "model": "Xeon"}},
            "unused-host": {"nodeName": "unused-host"}}
SHAPE = (9, 4, 10)


def a_map(operator, source, output, halo=(0, 0, 0), *, started=1000.0, ended=1050.0, shape=SHAPE, source_bytes=None):
    return MapRun(flow_run_id=RUN, operator=operator, operator_key=f"{operator}|float32|cpu", source=source,
                  output_path=output, shape=shape, halo=halo, itemsize=4, slots=2, budget_bytes=2**30,
                  started_at=started, ended_at=ended, source_bytes=source_bytes)


def attempt(m: MapRun, key: str, start: float, *, outcome="ok", seconds=1.0, cpu=0.5, joules=None, source="estimate",
            host="node-a", run_id=None, started=True, baseline=100_000_000, peak=5_000_000):
    read, _ = with_halo(Chunk.from_key(key), m.halo, m.shape)
    if joules is None and source == "estimate":
        joules = cpu * 10.0
    return Observation(operator_key=m.operator_key, elements=read.elements, extents=read.shape,
                       bytes_in=read.elements * 4, peak_bytes=peak, seconds=seconds, outcome=outcome,
                       cpu_seconds=cpu, chunk=key, energy_joules=joules, energy_source=source if joules else None,
                       baseline_bytes=baseline, flow_run_id=RUN, created_at=start + seconds,
                       started_at=start if started else None, task_run_id=str(uuid.uuid4()) if run_id is None else run_id, host=host,
                       worker="tcp://127.0.0.1:1")


def slabs(*bounds):
    """Chunk keys cut along iline at ``bounds`` (whole xline and twt of SHAPE)."""
    return [f"i{a}-{b}_x0-{SHAPE[1]}_t0-{SHAPE[2]}" for a, b in zip(bounds, bounds[1:])]


def spec_tasks(doc):
    return {t["id"]: t for t in doc["workflow"]["specification"]["tasks"]}


def exec_tasks(doc):
    return {t["id"]: t for t in doc["workflow"]["execution"]["tasks"]}


def edges(doc):
    return {(p, t["id"]) for t in doc["workflow"]["specification"]["tasks"] for p in t["parents"]}


def load_back(doc, tmp_path):
    """Validate, write, and read back with wfcommons.Instance against the vendored schema."""
    trace.validate(doc)
    path = tmp_path / "t.wfcommons.json"
    path.write_text(json.dumps(doc))
    return wfcommons.Instance(path, schema_file=str(trace.SCHEMA_FILE))


# --------------------------------------------------------------------------- (a) the pure builder


def chain():
    """envelope (3 slabs) -> smooth (halo 1 iline: reaches the neighbouring slabs) -> dip (halo 2 xline: the
    chunks span every xline, so the halo is clipped at the volume's edge and reaches nothing)."""
    env = a_map("envelope", "/data/survey 1.sgy", "/runs/r/01-envelope.zarr", source_bytes=12345,
                started=1000, ended=1010)
    smo = a_map("smooth", env.output_path, "/runs/r/02-smooth.zarr", halo=(1, 0, 0), started=1010, ended=1020)
    dip = a_map("dip", smo.output_path, "/runs/r/03-dip.zarr", halo=(0, 2, 0), started=1020, ended=1030)
    keys = slabs(0, 3, 6, 9)
    obs = ([attempt(env, k, 1001 + i) for i, k in enumerate(keys)]
           + [attempt(smo, k, 1011 + i) for i, k in enumerate(keys)]
           + [attempt(dip, k, 1021 + i) for i, k in enumerate(keys)])
    return [env, smo, dip], obs, keys


def test_a_chain_with_halos_has_exactly_the_overlapped_upstream_chunks_as_parents_and_inputs(tmp_path):
    maps, obs, (k0, k1, k2) = chain()
    doc = trace.build_instance(maps, obs, MACHINES, FLOW_RUN)
    e, s = "envelope_{}", "smooth_{}"
    expected = {
        # smooth's read boxes: i0-4 (slabs 0, 1), i2-7 (all three), i5-9 (slabs 1, 2)
        (e.format(k0), s.format(k0)), (e.format(k1), s.format(k0)),
        (e.format(k0), s.format(k1)), (e.format(k1), s.format(k1)), (e.format(k2), s.format(k1)),
        (e.format(k1), s.format(k2)), (e.format(k2), s.format(k2)),
        # dip's halo lies on xline, which no chunk cuts: each reads its own slab only
        (s.format(k0), f"dip_{k0}"), (s.format(k1), f"dip_{k1}"), (s.format(k2), f"dip_{k2}"),
    }
    assert edges(doc) == expected
    spec = spec_tasks(doc)
    assert spec[s.format(k0)]["inputFiles"] == [f"01-envelope.zarr.{k0}", f"01-envelope.zarr.{k1}"]
    assert spec[f"dip_{k2}"]["inputFiles"] == [f"02-smooth.zarr.{k2}"]
    assert spec[e.format(k1)]["inputFiles"] == ["survey_1.sgy"] and spec[e.format(k1)]["outputFiles"] == [
        f"01-envelope.zarr.{k1}"]
    assert sorted(spec[e.format(k1)]["children"]) == spec[e.format(k1)]["children"] == [
        s.format(k0), s.format(k1), s.format(k2)]
    files = {f["id"]: f["sizeInBytes"] for f in doc["workflow"]["specification"]["files"]}
    assert files["survey_1.sgy"] == 12345  # the source's size on disk
    assert files[f"02-smooth.zarr.{k0}"] == 3 * 4 * 10 * 4  # the output chunk's elements x itemsize
    assert len(files) == 1 + 3 * 3
    inst = load_back(doc, tmp_path)
    assert set(inst.workflow.edges) == expected and len(inst.workflow.nodes) == 9


def test_execution_fields_are_the_observations(tmp_path):
    maps, obs, (k0, _, _) = chain()
    o = obs[3]  # smooth's first chunk
    doc = trace.build_instance(maps, obs, MACHINES, FLOW_RUN, created_at=2000.0)
    t = exec_tasks(doc)[f"smooth_{k0}"]
    read = with_halo(Chunk.from_key(k0), (1, 0, 0), SHAPE)[0]
    assert t == {
        "id": f"smooth_{k0}", "runtimeInSeconds": 1.0, "coreCount": 1, "avgCPU": 50.0, "readBytes": read.elements * 4,
        "writtenBytes": 3 * 4 * 10 * 4, "memoryInBytes": 105_000_000, "energyInKWh": kwh(5.0), "avgPowerInW": 5.0,
        "machines": ["node-a"], "executedAt": "1970-01-01T00:16:51+00:00", "category": "smooth",
        "energySource": "estimate", "outcome": "ok", "operatorKey": "smooth|float32|cpu",
        "peakAboveRestingBytes": 5_000_000, "taskRunId": o.task_run_id}
    assert exec_tasks(doc)[f"smooth_{k0}"]["readBytes"] == o.bytes_in
    assert doc["schemaVersion"] == "1.5" and doc["name"] == "pipeline/brave-otter"
    assert doc["createdAt"] == "1970-01-01T00:33:20+00:00"
    assert doc["workflow"]["execution"]["executedAt"] == "1970-01-01T00:16:40+00:00"
    assert doc["workflow"]["execution"]["makespanInSeconds"] == 100.0
    assert doc["runtimeSystem"] == {"name": "memchunk-prefect", "version": trace._version()}
    assert "author" not in doc, "no author unless one is given (WfCommons would make one up)"
    assert "estimated" in doc["description"] and "watts_per_core" in doc["description"] and RUN in doc["description"]
    # Only the hosts tasks ran on; the CPU model the Machine class drops is kept.
    assert doc["workflow"]["execution"]["machines"] == [{
        "nodeName": "node-a", "system": "linux", "architecture": "x86_64", "memoryInBytes": 8 * 2**30,
        "release": "6.1", "cpu": {"coreCount": 4, "speedInMHz": 2600, "vendor": "GenuineIntel", "model": "Xeon"}}]
    with_author = trace.build_instance(maps, obs, MACHINES, FLOW_RUN, author="A. Geo", email="a@example.org")
    assert with_author["author"] == {"name": "A. Geo", "email": "a@example.org"}
    trace.validate(with_author)


def test_a_failed_attempt_and_its_split_pieces(tmp_path):
    env = a_map("envelope", "/data/s.sgy", "/runs/r/env.zarr", started=1000, ended=1010)
    dip = a_map("dip", env.output_path, "/runs/r/dip.zarr", halo=(1, 0, 0), started=1010, ended=1040)
    top = a_map("top", dip.output_path, "/runs/r/top.zarr", started=1040, ended=1050)
    e0, e1 = slabs(0, 4, 9)
    whole = f"i0-9_x0-{SHAPE[1]}_t0-{SHAPE[2]}"
    obs = [attempt(env, e0, 1001), attempt(env, e1, 1002),
           attempt(dip, whole, 1011, outcome="memory_error", seconds=2.0, cpu=1.5),
           # the halves; the second ran on a worker that was then lost, and again (its first try an error)
           attempt(dip, e0, 1014),
           attempt(dip, e1, 1015, outcome="killed", seconds=0.0, cpu=None, joules=None, source=None, host="",
                   run_id="", started=False, baseline=None, peak=2**30),
           attempt(dip, e1, 1020),
           attempt(top, e0, 1041), attempt(top, e1, 1042)]
    doc = trace.build_instance([env, dip, top], obs, MACHINES, FLOW_RUN)
    spec, ex = spec_tasks(doc), exec_tasks(doc)
    failed, killed, retried = f"dip_{whole}", f"dip_{e1}", f"dip_{e1}_2"
    assert set(spec) == {f"envelope_{e0}", f"envelope_{e1}", failed, f"dip_{e0}", killed, retried,
                         f"top_{e0}", f"top_{e1}"}
    # Failed attempts: parents like any reader of the same box, no children, no output, nothing written.
    assert spec[failed]["parents"] == [f"envelope_{e0}", f"envelope_{e1}"]
    assert spec[failed]["children"] == [] and spec[failed]["outputFiles"] == []
    assert spec[failed]["inputFiles"] == [f"env.zarr.{e0}", f"env.zarr.{e1}"]
    assert ex[failed]["outcome"] == "memory_error" and ex[failed]["writtenBytes"] == 0
    assert ex[failed]["energyInKWh"] == kwh(15.0) and ex[failed]["runtimeInSeconds"] == 2.0
    assert spec[killed]["parents"] == [f"envelope_{e0}", f"envelope_{e1}"] and spec[killed]["children"] == []
    assert ex[killed]["outcome"] == "killed" and "machines" not in ex[killed] and "energyInKWh" not in ex[killed]
    assert "taskRunId" not in ex[killed] and ex[killed]["memoryInBytes"] == 2**30
    assert ex[killed]["executedAt"] == trace.rfc3339(1015.0), "no recorded start: its end less its seconds"
    # The pieces are the ones downstream tasks depend on; the failed attempts are nobody's parent.
    assert spec[f"top_{e0}"]["parents"] == [f"dip_{e0}"]
    assert spec[f"top_{e1}"]["parents"] == [retried]
    assert spec[f"dip_{e0}"]["outputFiles"] == [f"dip.zarr.{e0}"] and spec[retried]["outputFiles"] == [
        f"dip.zarr.{e1}"]
    inst = load_back(doc, tmp_path)
    assert len(inst.workflow.nodes) == 8 and set(inst.workflow.edges) == edges(doc)


def test_measured_energy_overlapping_on_one_device_is_shared_and_estimates_are_kept(tmp_path):
    env = a_map("envelope", "/data/s.sgy", "/runs/r/env.zarr", started=1000, ended=1020)
    k = slabs(0, 2, 4, 6, 8, 9)
    obs = [
        # rapl on node-a: [0, 10] read 100 J, [5, 10] read 50 J, equal busy cores -> 75 J and 25 J
        attempt(env, k[0], 1000, seconds=10.0, cpu=10.0, joules=100.0, source="rapl"),
        attempt(env, k[1], 1005, seconds=5.0, cpu=5.0, joules=50.0, source="rapl"),
        # the same counter on another host, overlapping in time only: its own device, kept whole
        attempt(env, k[2], 1005, seconds=5.0, cpu=5.0, joules=40.0, source="rapl", host="node-b"),
        # an estimate overlapping the rapl runs: per task already, never split
        attempt(env, k[3], 1004, seconds=4.0, cpu=3.0, joules=30.0, source="estimate"),
        # no energy at all
        attempt(env, k[4], 1001, seconds=1.0, cpu=1.0, joules=None, source=None),
        # node-c: the same 10 s, each read the device's 100 J; one kept a core busy, the other half of one:
        # the 100 J are shared 2:1
        attempt(env, "i0-9_x0-2_t0-10", 1000, seconds=10.0, cpu=10.0, joules=100.0, source="rapl", host="node-c"),
        attempt(env, "i0-9_x2-4_t0-10", 1000, seconds=10.0, cpu=5.0, joules=100.0, source="rapl", host="node-c"),
    ]
    doc = trace.build_instance([env], obs, MACHINES, FLOW_RUN)
    ex = exec_tasks(doc)
    got = {key: (ex[f"envelope_{key}"].get("energyInKWh"), ex[f"envelope_{key}"].get("energySource")) for key in k}
    assert got[k[0]] == (pytest.approx(kwh(75.0)), "rapl") and got[k[1]] == (pytest.approx(kwh(25.0)), "rapl")
    assert got[k[2]] == (kwh(40.0), "rapl") and got[k[3]] == (kwh(30.0), "estimate") and got[k[4]] == (None, None)
    assert ex["envelope_i0-9_x0-2_t0-10"]["energyInKWh"] == pytest.approx(kwh(100 * 2 / 3))
    assert ex["envelope_i0-9_x2-4_t0-10"]["energyInKWh"] == pytest.approx(kwh(100 / 3))
    assert ex[f"envelope_{k[0]}"]["avgPowerInW"] == pytest.approx(7.5)
    assert "measured" in doc["description"] and "estimated" in doc["description"]
    # node-b and node-c have no description in the store: bare machines, still declared
    assert [m["nodeName"] for m in doc["workflow"]["execution"]["machines"]] == ["node-a", "node-b", "node-c"]
    inst = load_back(doc, tmp_path)
    assert inst.workflow.tasks[f"envelope_{k[0]}"].energy == pytest.approx(kwh(75.0))
    assert sum(t.energy or 0 for t in inst.workflow.tasks.values()) == pytest.approx(kwh(75 + 25 + 40 + 30 + 100))


def test_ids_are_sanitized_and_unique_even_for_odd_names_and_one_operator_twice(tmp_path):
    first = a_map("my op+1", "/data/a dir/sur:vey#1.sgy", "/runs/x/out put.zarr", started=1000, ended=1010)
    second = a_map("my op+1", first.output_path, "/runs/y/out put.zarr", started=1010, ended=1020)
    key = slabs(0, 9)[0]
    obs = [attempt(first, key, 1001), attempt(second, key, 1011)]
    doc = trace.build_instance([first, second], obs, MACHINES, FLOW_RUN)
    spec = spec_tasks(doc)
    assert set(spec) == {f"my_op_1_{key}", f"my_op_1_{key}_2"}
    assert spec[f"my_op_1_{key}_2"]["parents"] == [f"my_op_1_{key}"], "the second map by time, not the first"
    ids = set(spec) | {f["id"] for f in doc["workflow"]["specification"]["files"]}
    assert ids == {f"my_op_1_{key}", f"my_op_1_{key}_2", "sur_vey_1.sgy", f"out_put.zarr.{key}",
                   f"y_out_put.zarr.{key}"}
    assert all(trace.ID_PATTERN.match(i) for i in ids)
    load_back(doc, tmp_path)
    # Two maps of one key at the same time (two surveys at once): the chunk's volume tells them apart.
    small = a_map("my op+1", "/data/small.sgy", "/runs/s/out.zarr", shape=(4, 4, 10), started=1000, ended=1020)
    big = a_map("my op+1", "/data/big.sgy", "/runs/b/out.zarr", started=1000, ended=1020)
    doc = trace.build_instance([small, big], [attempt(big, key, 1001)], MACHINES, FLOW_RUN)
    assert spec_tasks(doc)[f"my_op_1_{key}"]["inputFiles"] == ["big.sgy"]
    assert "matched more than one map" not in doc["description"]


def test_observations_that_carry_their_map_id_go_to_that_map_even_when_time_and_volume_cannot_tell():
    import dataclasses

    # Two maps of one key over same-shaped volumes at the same time: only the map id tells their tasks apart.
    a = dataclasses.replace(a_map("op", "/data/a.sgy", "/runs/a.zarr", started=1000, ended=1020), map_id="A")
    b = dataclasses.replace(a_map("op", "/data/b.sgy", "/runs/b.zarr", started=1000, ended=1020), map_id="B")
    key = slabs(0, 9)[0]
    obs = [dataclasses.replace(attempt(a, key, 1001), map_id="B"), dataclasses.replace(attempt(b, key, 1002),
                                                                                       map_id="A")]
    doc = trace.build_instance([a, b], obs, MACHINES, FLOW_RUN)
    inputs = sorted(t["inputFiles"][0] for t in doc["workflow"]["specification"]["tasks"])
    assert inputs == ["a.sgy", "b.sgy"]
    by_start = {t["executedAt"]: spec_tasks(doc)[t["id"]]["inputFiles"][0]
                for t in doc["workflow"]["execution"]["tasks"]}
    assert by_start == {trace.rfc3339(1001): "b.sgy", trace.rfc3339(1002): "a.sgy"}, "by map id, not by time"
    assert "matched more than one map" not in doc["description"]


def test_an_upstream_output_partly_written_by_an_earlier_run_is_read_as_a_whole(tmp_path):
    env = a_map("envelope", "/data/s.sgy", "/runs/r/env.zarr", started=1000, ended=1010)
    smo = a_map("smooth", env.output_path, "/runs/r/smooth.zarr", halo=(1, 0, 0), started=1010, ended=1020,
                source_bytes=999)
    k0, k1, k2 = slabs(0, 3, 6, 9)
    # envelope's k0 was written by an earlier run (the output was resumed): this run wrote k1 and k2 only.
    obs = [attempt(env, k1, 1001), attempt(env, k2, 1002)] + [attempt(smo, k, 1011 + i) for i, k in enumerate(slabs(
        0, 3, 6, 9))]
    doc = trace.build_instance([env, smo], obs, MACHINES, FLOW_RUN)
    spec = spec_tasks(doc)
    assert spec[f"smooth_{k0}"]["inputFiles"] == [f"env.zarr.{k1}", "env.zarr"]  # reads i0-4
    assert spec[f"smooth_{k1}"]["inputFiles"] == [f"env.zarr.{k1}", f"env.zarr.{k2}", "env.zarr"]  # i2-7
    assert spec[f"smooth_{k2}"]["inputFiles"] == [f"env.zarr.{k1}", f"env.zarr.{k2}"]  # i5-9: all from this run
    assert spec[f"smooth_{k0}"]["parents"] == [f"envelope_{k1}"]
    assert {f["id"]: f["sizeInBytes"] for f in doc["workflow"]["specification"]["files"]}["env.zarr"] == 999
    trace.validate(doc)


def test_a_source_a_later_map_overwrites_is_read_as_a_file_not_from_that_map():
    old = a_map("envelope", "/runs/r/env.zarr", "/runs/r/smooth.zarr", started=1000, ended=1010, source_bytes=77)
    new = a_map("envelope", "/data/s.sgy", "/runs/r/env.zarr", started=1010, ended=1020)
    key = slabs(0, 9)[0]
    doc = trace.build_instance([old, new], [attempt(old, key, 1001), attempt(new, key, 1011)], MACHINES, FLOW_RUN)
    assert edges(doc) == set()
    assert spec_tasks(doc)[f"envelope_{key}"]["inputFiles"] == ["env.zarr"]
    trace.validate(doc)


def test_the_vendored_schema_is_wfformat_1_5_byte_for_byte_and_ships_in_the_wheel():
    data = trace.SCHEMA_FILE.read_bytes()
    assert hashlib.sha256(data).hexdigest() == "5f644ca101a178f978f49902831ed85217e81824268a2dbbf78db469cc383bb0"
    assert "5f644ca101a178f978f49902831ed85217e81824268a2dbbf78db469cc383bb0" in (
        trace.SCHEMA_FILE.parent / "README.md").read_text()
    assert trace.schema_version_of(json.loads(data)) == "1.5"
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    globs = pyproject["tool"]["setuptools"]["package-data"]["memchunk_prefect"]
    shipped = [p.relative_to(REPO / "memchunk_prefect").as_posix() for p in trace.SCHEMA_FILE.parent.iterdir()]
    assert sorted(p for p in shipped if any(fnmatch.fnmatch(p, g) for g in globs)) == [
        "data/LICENSE-WfFormat.md", "data/README.md", "data/wfformat-1.5-schema.json"]
    assert any(r.startswith("wfcommons>=1.6,<1.7") for r in pyproject["project"]["optional-dependencies"]["trace"])


# --------------------------------------------------------------------------- (b) bad input: nothing written


@pytest.fixture
def store(tmp_path):
    maps, obs, _ = chain()
    with Store(tmp_path / "s.sqlite") as s:
        for m in maps:
            s.add_map(m)
        s.add_many(obs)
        s.put_machines(MACHINES)
    return tmp_path / "s.sqlite"


def files_in(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir())


def test_export_with_a_known_flow_run_writes_a_valid_file(store, tmp_path):
    out = tmp_path / "o" / "t.json"
    out.parent.mkdir()
    with Store(store) as s:  # an older run's map, recorded later: `latest` is by end time, not by row
        s.add_map(MapRun(**{**a_map("old", "/x.sgy", "/o.zarr").to_dict(), "flow_run_id": "older", "ended_at": 5.0}))
    assert trace.export_wfcommons("latest", store, out, flow_run=FLOW_RUN) == out
    doc = json.loads(out.read_text())
    trace.validate(doc)
    assert len(doc["workflow"]["specification"]["tasks"]) == 9 and files_in(out.parent) == ["t.json"]


def test_an_output_that_cannot_be_written_leaves_nothing_behind(store, tmp_path, monkeypatch):
    with pytest.raises(TraceExportError, match="cannot write the trace to .*missing"):
        trace.export_wfcommons(RUN, store, tmp_path / "missing" / "t.json", flow_run=FLOW_RUN)
    target = tmp_path / "out"
    target.mkdir()
    (target / "a-directory.json").mkdir()  # the temporary file is written, the rename over a directory fails
    before = files_in(target)
    with pytest.raises(TraceExportError, match="cannot write the trace"):
        trace.export_wfcommons(RUN, store, target / "a-directory.json", flow_run=FLOW_RUN)
    assert files_in(target) == before, "no temporary file left"
    (target / "t.json").write_text("the old trace")

    def disk_full(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", disk_full)
    with pytest.raises(TraceExportError, match="No space left"):
        trace.export_wfcommons(RUN, store, target / "t.json", flow_run=FLOW_RUN)
    assert files_in(target) == sorted(before + ["t.json"]) and (target / "t.json").read_text() == "the old trace"


def test_a_trace_that_fails_validation_is_not_written(store, tmp_path):
    strict = json.loads(trace.SCHEMA_FILE.read_text())
    task = strict["properties"]["workflow"]["properties"]["execution"]["properties"]["tasks"]["items"]
    task["properties"]["energySource"] = {"type": "string", "enum": ["rapl", "nvml"]}  # estimates refused
    schema = tmp_path / "strict.json"
    schema.write_text(json.dumps(strict))
    out = tmp_path / "t.json"
    out.write_text("the old trace")
    before = files_in(tmp_path)
    with pytest.raises(TraceExportError, match=r"does not validate.*energySource.*'estimate' is not one of") as info:
        trace.export_wfcommons(RUN, store, out, schema=schema, flow_run=FLOW_RUN)
    assert "nothing was written" in str(info.value)
    assert out.read_text() == "the old trace" and files_in(tmp_path) == before
    # A semantic error (a parent nobody declared) is caught too.
    maps, obs, _ = chain()
    doc = trace.build_instance(maps, obs, MACHINES, FLOW_RUN)
    doc["workflow"]["specification"]["tasks"][0]["parents"] = ["no_such_task"]
    with pytest.raises(TraceExportError, match='Parent task "no_such_task" is not declared'):
        trace.validate(doc)
    # What WfCommons only warns about (a dependency declared on one side) is refused as well.
    doc = trace.build_instance(maps, obs, MACHINES, FLOW_RUN)
    trace.validate(doc)
    doc["workflow"]["specification"]["tasks"][0]["children"].pop()
    with pytest.raises(TraceExportError, match="1 warning.*does not declare"):
        trace.validate(doc)


@pytest.mark.parametrize("schema_text, match", [
    ("not json", "is not JSON"), ('{"type": "object"}', "names no schemaVersion"), (None, "cannot read")])
def test_a_bad_schema_file_is_a_clear_error(store, tmp_path, schema_text, match):
    schema = tmp_path / "schema.json"
    if schema_text is not None:
        schema.write_text(schema_text)
    with pytest.raises(TraceExportError, match=match):
        trace.export_wfcommons(RUN, store, tmp_path / "t.json", schema=schema, flow_run=FLOW_RUN)
    assert not (tmp_path / "t.json").exists()


def test_bad_runs_and_arguments_are_trace_export_errors(store, tmp_path, monkeypatch):
    with pytest.raises(TraceExportError, match="'not-a-run' is not a flow run id"):
        trace.export_wfcommons("not-a-run", store, tmp_path / "t.json")
    maps, obs, _ = chain()
    with pytest.raises(TraceExportError, match="both a name and an email"):
        trace.build_instance(maps, obs, MACHINES, FLOW_RUN, author="A. Geo")
    with pytest.raises(TraceExportError, match="ran no task"):
        trace.build_instance(maps, [], MACHINES, FLOW_RUN)
    with pytest.raises(TraceExportError, match="no chunked map record for them"):
        trace.build_instance(maps[:1], obs, MACHINES, FLOW_RUN)
    with pytest.raises(TraceExportError, match="no chunk key"):
        trace.build_instance(maps, [*obs[:1], Observation(maps[0].operator_key, 1, (1, 1, 1), 4, 1, flow_run_id=RUN)],
                             MACHINES, FLOW_RUN)
    with pytest.raises(TraceExportError, match=r"no chunked maps recorded in store .*empty\.sqlite"):
        trace.export_wfcommons("latest", tmp_path / "empty.sqlite", tmp_path / "t.json")
    monkeypatch.setitem(sys.modules, "wfcommons.common", None)
    with pytest.raises(TraceExportError, match=r"pip install 'memchunk-prefect\[trace\]'"):
        trace.export_wfcommons(RUN, store, tmp_path / "t.json", flow_run=FLOW_RUN)
    assert not (tmp_path / "t.json").exists()


def run_cli(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_usage_errors_exit_2(capsys, store):
    code, _, err = run_cli(capsys, "export", "--format", "wfcommons", "--store", str(store))
    assert code == 2 and "needs --flow-run" in err
    code, _, err = run_cli(capsys, "export", "--format", "csv", "--flow-run", RUN, "--store", str(store))
    assert code == 2 and "--flow-run only apply to --format wfcommons" in err


@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_unknown_unfinished_and_mapless_flow_runs_name_the_problem(capsys, store, tmp_path):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL
    from prefect.states import Running

    out = tmp_path / "t.json"
    unknown = str(uuid.uuid4())
    code, _, err = run_cli(capsys, "export", "--format", "wfcommons", "--flow-run", unknown, "-o", str(out),
                           "--store", str(store))
    assert code == 1 and f"flow run {unknown} is unknown to the Prefect API at {PREFECT_API_URL.value()}" in err
    assert "PREFECT_API_URL" in err

    @flow(name="no-maps")
    def no_maps():
        return 1

    state = no_maps(return_state=True)
    run_id = str(state.state_details.flow_run_id)
    code, _, err = run_cli(capsys, "export", "--format", "wfcommons", "--flow-run", run_id, "-o", str(out),
                           "--store", str(store))
    assert code == 1 and f"no chunked maps recorded for flow run {run_id} in store {store}" in err
    assert "pass --store" in err

    with get_client(sync_client=True) as client:
        running = client.create_flow_run(no_maps, state=Running())
    code, _, err = run_cli(capsys, "export", "--format", "wfcommons", "--flow-run", str(running.id), "-o", str(out),
                           "--store", str(store))
    assert code == 1 and "is Running: unfinished, wait for it to end" in err
    assert not out.exists() and files_in(tmp_path) == sorted(p.name for p in tmp_path.iterdir())


# --------------------------------------------------------------------------- (c) one real run, end to end


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.slow
@pytest.mark.usefixtures("prefect_server")
def test_a_real_flow_exported_through_the_cli_holds_every_chunk_task_run(capsys, tmp_path, monkeypatch):
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from memchunk_prefect import MemoryAwareRunner, chunked, operators, synthetic_survey
    from memchunk_prefect.testing import start_local_cluster

    survey = tmp_path / "s.sgy"
    synthetic_survey(survey, (24, 20, 150), seed=3)
    store_path = tmp_path / "store.sqlite"
    monkeypatch.setenv("MEMCHUNK_STORE", str(store_path))
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    try:
        runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(store_path),
                                   output_dir=str(tmp_path / "out"))

        @flow(task_runner=runner, name="trace-e2e")
        def pipeline(path: str):
            env = operators.envelope.map(chunked(path))
            smooth = operators.gaussian_smooth.map(chunked(env), sigma=(2.0, 2.0, 1.0))
            return smooth.summary()

        state = pipeline(str(survey), return_state=True)
        assert state.is_completed()
    finally:
        cluster.close()
    run_id = str(state.state_details.flow_run_id)
    out = tmp_path / "trace.json"
    code, stdout, err = run_cli(capsys, "export", "--format", "wfcommons", "--flow-run", "latest", "-o", str(out))
    assert code == 0, err
    assert f"wrote {out}: WfFormat 1.5, validated" in stdout
    doc = json.loads(out.read_text())
    trace.validate(doc)
    inst = wfcommons.Instance(out, schema_file=str(trace.SCHEMA_FILE))
    ex = exec_tasks(doc)
    assert run_id in doc["description"] and doc["name"].startswith("trace-e2e/")
    assert len(inst.workflow.nodes) == len(ex) == len(doc["workflow"]["specification"]["tasks"])

    # Every chunk task run Prefect knows of in this flow run is a task of the trace, with estimated energy.
    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[uuid.UUID(run_id)])))
    chunk_runs = {str(r.id) for r in runs if r.name.startswith(("envelope", "gaussian_smooth"))}
    assert chunk_runs and chunk_runs == {t["taskRunId"] for t in ex.values()}
    with Store(store_path) as s:
        assert len(ex) == len(s.run_observations(run_id))
        smooth_halo = next(m.halo for m in s.maps(run_id) if m.operator == "gaussian_smooth")
        # Every observation names its map (what the trace assigns tasks by).
        map_ids = {m.map_id for m in s.maps(run_id)}
        assert len(map_ids) == 2 and "" not in map_ids
        assert {o.map_id for o in s.run_observations(run_id)} == map_ids
    for t in ex.values():
        assert t["energySource"] == "estimate" and t["energyInKWh"] > 0 and t["avgPowerInW"] > 0
        assert inst.workflow.tasks[t["id"]].energy == t["energyInKWh"]
    # The smoothing's halo reaches across envelope's chunks: some smoothing task has several envelope parents,
    # and every smoothing task has at least one.
    assert smooth_halo[0] > 0 or smooth_halo[1] > 0
    parents = {t["id"]: t["parents"] for t in doc["workflow"]["specification"]["tasks"]
               if t["name"] == "gaussian_smooth"}
    assert parents and all(p for p in parents.values()) and max(len(p) for p in parents.values()) > 1
    assert set(inst.workflow.edges) == edges(doc)


def test_the_documented_example_is_a_valid_trace_of_a_real_demo_run():
    path = REPO / "docs" / "examples" / "demo.wfcommons.json"
    doc = json.loads(path.read_text())
    trace.validate(doc)
    inst = wfcommons.Instance(path, schema_file=str(trace.SCHEMA_FILE))
    s = trace.summary(doc)
    docs = (REPO / "docs" / "how-to" / "traces.md").read_text()
    assert (f"WfFormat 1.5, validated; {s['tasks']} tasks ({s['failed']} failed attempts),\n{s['files']} files, "
            f"{s['edges']} dependencies, energy {s['energy_kwh'] * 3.6e6:.1f} J (estimate)") in docs
    assert ".venv/bin/memchunk export --format wfcommons --flow-run latest -o docs/examples/demo.wfcommons.json" in docs
    assert len(inst.workflow.nodes) == s["tasks"] and len(inst.workflow.edges) == s["edges"]
    ex = exec_tasks(doc).values()
    assert {t["category"] for t in ex} == {"envelope", "gaussian_smooth", "gst3d_dip"}
    assert all(t["taskRunId"] and t["energySource"] == "estimate" and t["energyInKWh"] > 0 for t in ex)


# --------------------------------------------------------------------------- simulated runs and comparisons


def _simulated(tmp_path, seed=0):
    import math

    import numpy as np

    from memchunk_prefect.core.records import Prediction
    from memchunk_prefect.sim.inputs import ClusterShape, Step
    from memchunk_prefect.sim.runs import run_strategy

    class Known:  # a learned model as the simulator reads it: 100 B per element, 1 us per element
        def predict(self, ext):
            mean = 100.0 * math.prod(ext)
            return Prediction(mean, 1.2 * mean, 10, True, tight_bytes=mean)

        def seconds_per_element(self):
            return 1e-6

        def seconds_for(self, elements):
            return None

        def joules_for(self, elements):
            return None

        def touch_seconds_per_byte(self):
            return None

        def first_call_seconds(self):
            return None

        def choose_arm(self, groups):
            from memchunk_prefect.learn.bandit import ArmLearner

            return ArmLearner("k").choose(groups)

    steps = [Step("envelope", "envelope|float32|cpu", (0, 0, 0), True),
             Step("smooth", "smooth|float32|cpu", (2, 2, 2), False)]
    cluster = ClusterShape(workers=2, memory_limit_bytes=100 * 2**20, resting_bytes=40 * 2**20,
                           per_task_overhead_seconds=0.1)
    shape = (40, 40, 100)
    result = run_strategy("memchunk", steps, shape, cluster, lambda key: Known(), np.random.default_rng(seed))
    return result, steps, shape, cluster


def test_a_simulated_run_exports_to_the_same_format_and_loads_with_wfcommons(tmp_path):
    result, steps, shape, cluster = _simulated(tmp_path)
    assert result.completed
    doc = trace.simulated_instance(result, steps, shape, cluster, started_at=1000.0)
    inst = load_back(doc, tmp_path)
    ex = exec_tasks(doc)
    assert len(ex) == len(result.ended) == len(inst.workflow.nodes)
    assert doc["workflow"]["execution"]["makespanInSeconds"] == pytest.approx(result.makespan_seconds)
    assert "SIMULATED" in doc["description"]
    # The tasks' energy is the simulation's, and every smoothing task reads the envelope chunks its halo reaches.
    assert sum(t["energyInKWh"] for t in ex.values()) == pytest.approx(kwh(result.busy_joules))
    smooth = [t for t in doc["workflow"]["specification"]["tasks"] if t["name"] == "smooth"]
    assert smooth and all(t["parents"] for t in smooth)
    hosts = {m["nodeName"] for m in doc["workflow"]["execution"]["machines"]}
    assert hosts <= {"sim-worker-0", "sim-worker-1"} and hosts


def test_comparing_a_trace_with_itself_and_with_another_run(tmp_path, capsys):
    result, steps, shape, cluster = _simulated(tmp_path)
    a = trace.simulated_instance(result, steps, shape, cluster, started_at=1000.0)
    same = trace_compare.compare(a, a)
    assert same["makespan_seconds"][2] == 0.0
    assert all(r[f][2] in (0.0, None) for r in same["operators"] for f in ("tasks", "runtime_seconds",
                                                                            "energy_joules"))
    other, *_ = _simulated(tmp_path, seed=1)
    b = trace.simulated_instance(other, steps, shape, cluster, started_at=1000.0)
    c = trace_compare.compare(a, b)
    env = next(r for r in c["operators"] if r["category"] == "envelope")
    x, y, rel = env["runtime_seconds"]
    assert rel == pytest.approx((y - x) / x) and x != y  # another seed draws other times
    pa, pb = tmp_path / "a.json", tmp_path / "b.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    code, out, err = run_cli(capsys, "compare-traces", str(pa), str(pb))
    assert code == 0, err
    assert "envelope" in out and "smooth" in out and "makespan:" in out and "energy J" in out
    code, out, err = run_cli(capsys, "compare-traces", str(pa), str(tmp_path / "missing.json"))
    assert code != 0 and "cannot read the trace" in err
