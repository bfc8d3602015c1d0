"""Where outputs go by default, and keep-or-clean as a user's decision (``memchunk outputs``)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from memchunk_prefect.core.chunks import Chunk
from memchunk_prefect.core.errors import OutputPathError
from memchunk_prefect.io.zarr_store import ZarrOutput
from memchunk_prefect.run.outputs import RUN_MANIFEST, default_output_dir, list_runs, output_path_for, remove_runs


def _run(base, run_id, *, finished: bool, age_seconds: float, name: str = "") -> None:
    path = output_path_for(base, run_id, 1, "envelope", {"flow": "attributes", "flow_run": name, "flow_run_id": run_id})
    out = ZarrOutput.create(path, (2, 2, 4))
    out.write(Chunk((0, 0, 0), (2, 2, 4)), np.ones((2, 2, 4), np.float32))
    out.mark_done(Chunk((0, 0, 0), (2, 2, 4)))
    if finished:
        out.finalize()
    then = time.time() - age_seconds
    for root, dirs, files in os.walk(base / run_id):
        for f in files + dirs:
            os.utime(os.path.join(root, f), (then, then))


def test_the_default_output_directory_is_in_the_working_directory_unless_named(tmp_path, monkeypatch):
    monkeypatch.delenv("MEMCHUNK_OUTPUT_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_output_dir() == tmp_path / "memchunk-outputs"
    monkeypatch.setenv("MEMCHUNK_OUTPUT_DIR", str(tmp_path / "elsewhere"))
    assert default_output_dir() == tmp_path / "elsewhere"
    assert default_output_dir(tmp_path / "mine") == tmp_path / "mine"


def test_runs_are_listed_with_sizes_and_what_is_unfinished(tmp_path):
    _run(tmp_path, "aaa", finished=True, age_seconds=10 * 86400, name="old-run")
    _run(tmp_path, "bbb", finished=False, age_seconds=60, name="busy-run")
    runs = list_runs(tmp_path)
    assert [r.name for r in runs] == ["aaa", "bbb"]
    assert runs[0].flow_run == "old-run" and runs[0].flow == "attributes" and runs[0].size_bytes > 0
    assert runs[0].unfinished == () and runs[1].unfinished == ("01-envelope.zarr",)
    assert (tmp_path / "aaa" / RUN_MANIFEST).exists()


def test_old_runs_are_removed_and_one_still_being_written_never_is(tmp_path):
    _run(tmp_path, "aaa", finished=True, age_seconds=10 * 86400)
    _run(tmp_path, "bbb", finished=False, age_seconds=60, name="busy-run")
    _run(tmp_path, "ccc", finished=False, age_seconds=3 * 86400)  # stopped days ago: not busy
    removed, kept = remove_runs(tmp_path, older_than_seconds=86400)
    assert sorted(r.name for r in removed) == ["aaa", "ccc"] and kept == []
    removed, kept = remove_runs(tmp_path, ["busy-run"])
    assert removed == [] and [r.name for r, _ in kept] == ["bbb"] and "may still be being written" in kept[0][1]
    assert (tmp_path / "bbb").exists() and not (tmp_path / "aaa").exists()


def test_a_name_that_matches_no_run_removes_nothing_and_says_so(tmp_path):
    _run(tmp_path, "aaa", finished=True, age_seconds=10)
    with pytest.raises(OutputPathError, match="no flow run's outputs named nope"):
        remove_runs(tmp_path, ["aaa", "nope"])
    assert (tmp_path / "aaa").exists()


def test_the_outputs_command_lists_and_removes_what_the_user_names(tmp_path, capsys):
    from memchunk_prefect.cli.app import main

    _run(tmp_path, "aaa", finished=True, age_seconds=10 * 86400, name="old-run")
    _run(tmp_path, "bbb", finished=False, age_seconds=60, name="busy-run")
    assert main(["outputs", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "2 flow run(s)" in out and "old-run" in out and "1 (1 unfinished)" in out
    assert main(["outputs", "--dir", str(tmp_path), "--older-than", "7d", "--dry-run"]) == 0
    assert "would remove" in capsys.readouterr().out and (tmp_path / "aaa").exists()
    assert main(["outputs", "--dir", str(tmp_path), "--older-than", "7d"]) == 0
    assert not (tmp_path / "aaa").exists()
    assert main(["outputs", "--dir", str(tmp_path), "--remove", "busy-run"]) == 1
    assert "may still be being written" in capsys.readouterr().out and (tmp_path / "bbb").exists()
