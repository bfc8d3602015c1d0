"""flows/seismic.py: attributes of one survey, reprocessing a directory, and what counts as done."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

from flows.seismic import (
    MANIFEST,
    normalize_attributes,
    output_path,
    parameters_hash,
    reprocess_survey,
    seismic_attributes,
    up_to_date,
)
from memchunk_prefect import MemoryAwareRunner, open_segy, operators, synthetic_survey
from memchunk_prefect.core.errors import OutputPathError, RunnerConfigError
from memchunk_prefect.io.zarr_store import open_result
from memchunk_prefect.testing import start_local_cluster

# --------------------------------------------------------------------------- parameters, no cluster


def test_attributes_are_checked_before_anything_runs():
    attrs = normalize_attributes(["envelope", {"name": "gaussian_smooth", "sigma": [1, 1, 2], "output": "s/one"}])
    assert [(a.name, a.output) for a in attrs] == [("envelope", "envelope"), ("gaussian_smooth", "s/one")]
    assert attrs[1].params == {"sigma": (1, 1, 2)}
    with pytest.raises(RunnerConfigError, match="unknown operator"):
        normalize_attributes(["no_such_attribute"])
    with pytest.raises(RunnerConfigError, match="no parameter 'sigm'"):
        normalize_attributes([{"name": "gaussian_smooth", "sigm": 2}])
    with pytest.raises(RunnerConfigError, match="two attributes"):
        normalize_attributes(["envelope", {"name": "cosine_phase", "output": "envelope"}])
    assert [a.name for a in normalize_attributes(None)] == ["envelope", "gaussian_smooth", "gst3d_dip"]


@pytest.mark.parametrize("name", ["../escape", "/etc/passwd", "a/../../b", "~root/x", "."])
def test_output_names_cannot_leave_the_output_directory(tmp_path, name):
    with pytest.raises(OutputPathError):
        normalize_attributes([{"name": "envelope", "output": name}])
    with pytest.raises(OutputPathError):
        output_path(tmp_path, name, ".zarr")
    with pytest.raises(OutputPathError):
        output_path(tmp_path, "", "")


def test_a_symlink_out_of_the_output_directory_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / "out" / "link")
    assert output_path(tmp_path / "out", "sub/env", ".zarr") == (tmp_path / "out" / "sub" / "env.zarr").resolve()
    with pytest.raises(OutputPathError, match="outside the output directory"):
        output_path(tmp_path / "out", "link/env", ".zarr")


def test_parameters_hash_changes_with_any_parameter():
    a = normalize_attributes(["envelope"])
    b = normalize_attributes([{"name": "gaussian_smooth", "sigma": 2}])
    base = parameters_hash(a, export_segy=False)
    assert base == parameters_hash(normalize_attributes([{"name": "envelope"}]), export_segy=False)
    assert len({base, parameters_hash(a, export_segy=True), parameters_hash(b, export_segy=False)}) == 3


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def cluster():
    c = start_local_cluster(n_workers=2, memory_limit="1GiB")
    yield c
    c.close()


@pytest.fixture()
def runner(cluster, tmp_path):
    return MemoryAwareRunner(address=cluster.scheduler_address, store=str(tmp_path / "store.sqlite"))


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_seismic_attributes_writes_every_attribute_to_zarr_and_segy_then_a_manifest(runner, tmp_path):
    import segyio

    survey = tmp_path / "s.sgy"
    synthetic_survey(survey, (10, 9, 80), seed=1)
    out = tmp_path / "out"
    flow = seismic_attributes.with_options(task_runner=runner)
    res = flow(str(survey), ["envelope", {"name": "gaussian_smooth", "sigma": [1, 1, 1], "output": "smooth/s1"}],
               str(out), export_segy=True)
    seismic = open_segy(survey).values
    env = open_result(out / "envelope.zarr").values
    np.testing.assert_allclose(env, operators.envelope.fn(seismic), rtol=1e-5, atol=1e-6)
    assert open_result(out / "smooth" / "s1.zarr").shape == seismic.shape
    with segyio.open(out / "envelope.sgy", ignore_geometry=True) as f:
        exported = np.stack([f.trace[i] for i in range(f.tracecount)]).reshape(seismic.shape)
    np.testing.assert_allclose(exported, env, rtol=1e-6)
    m = json.loads((out / MANIFEST).read_text())
    assert m["outputs"] == {"envelope": {"zarr": "envelope.zarr", "segy": "envelope.sgy"},
                            "smooth/s1": {"zarr": "smooth/s1.zarr", "segy": "smooth/s1.sgy"}}
    assert m["fingerprint"]["size"] == survey.stat().st_size and len(m["fingerprint"]["sha256"]) == 64
    assert res["attributes"]["envelope"]["summary"]["decisions"]
    phash = parameters_hash(normalize_attributes(["envelope", {"name": "gaussian_smooth", "sigma": [1, 1, 1],
                                                               "output": "smooth/s1"}]),
                            export_segy=True, iline=189, xline=193)
    assert up_to_date(survey, out, phash) == (True, "unchanged (same size and mtime)")


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_a_run_that_fails_half_way_leaves_nothing_marked_done(runner, tmp_path):
    survey = tmp_path / "s.sgy"
    synthetic_survey(survey, (8, 6, 60), seed=2)
    out = tmp_path / "out"
    flow = seismic_attributes.with_options(task_runner=runner)
    flow(str(survey), ["envelope"], str(out))
    assert (out / MANIFEST).exists()
    # The same output again, with a second attribute that fails on the workers (a bad parameter): the first
    # attribute is rewritten, the second fails; the old manifest must be gone, not left claiming success.
    state = flow(str(survey), ["envelope", {"name": "instantaneous_frequency", "sample_interval_ms": 0}], str(out),
                 return_state=True)
    assert state.is_failed()
    assert not (out / MANIFEST).exists()
    phash = parameters_hash(normalize_attributes(["envelope"]), export_segy=False, iline=189, xline=193)
    assert up_to_date(survey, out, phash) == (False, "never processed successfully")


@pytest.mark.cluster
@pytest.mark.server
@pytest.mark.usefixtures("prefect_server")
def test_reprocess_survey_skips_unchanged_files_and_redoes_changed_ones(runner, tmp_path):
    surveys = tmp_path / "surveys"
    surveys.mkdir()
    synthetic_survey(surveys / "a.sgy", (6, 5, 60), seed=1)
    synthetic_survey(surveys / "b.segy", (5, 6, 50), seed=2)
    (surveys / "notes.txt").write_text("not a survey")
    out = tmp_path / "attrs"
    flow = reprocess_survey.with_options(task_runner=runner)

    def run(**kw):
        rows = flow(str(surveys), kw.pop("attributes", ["envelope"]), str(out), **kw)
        return {r["file"]: (r["status"], r["why"]) for r in rows}

    first = run()
    assert {k: v[0] for k, v in first.items()} == {"a.sgy": "processed", "b.segy": "processed"}
    assert run() == {"a.sgy": ("skipped", "unchanged (same size and mtime)"),
                     "b.segy": ("skipped", "unchanged (same size and mtime)")}

    # Touched, not changed: hashed, skipped.
    st = (surveys / "a.sgy").stat()
    os.utime(surveys / "a.sgy", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert run()["a.sgy"] == ("skipped", "unchanged (same SHA-256; only touched)")
    # Changed content of the same size (a new survey written over it): reprocessed.
    shutil.copy(surveys / "a.sgy", tmp_path / "a-old.sgy")
    synthetic_survey(surveys / "a.sgy", (6, 5, 60), seed=9)
    assert (surveys / "a.sgy").stat().st_size == (tmp_path / "a-old.sgy").stat().st_size
    after = run()
    assert after["a.sgy"] == ("processed", "content changed (SHA-256)")
    assert after["b.segy"][0] == "skipped"
    np.testing.assert_allclose(open_result(out / "a" / "envelope.zarr").values,
                               operators.envelope.fn(open_segy(surveys / "a.sgy").values), rtol=1e-5, atol=1e-6)
    # New parameters: everything again. A half-written output (store not complete): redone.
    changed = run(attributes=["cosine_phase"])
    assert {v for v in changed.values()} == {("processed", "parameters changed")}
    marker_dir = out / "b" / "cosine_phase.zarr" / ".memchunk" / "done"
    shutil.rmtree(next(p for p in marker_dir.iterdir() if p.name != "zarr.json"))
    assert run(attributes=["cosine_phase"]) == {"a.sgy": ("skipped", "unchanged (same size and mtime)"),
                                                "b.segy": ("processed", "cosine_phase: "
                                                           f"{out / 'b' / 'cosine_phase.zarr'} is not complete")}
