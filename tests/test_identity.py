"""Who owns an output path: create, resume, restart or refuse, one table row per case (pure, no files)."""

from __future__ import annotations

import pytest

from memchunk_prefect.core.errors import OutputPathError
from memchunk_prefect.io.identity import FoundOutput, OutputIdentity, open_output, output_action

SHAPE = (4, 4, 8)
WANT = OutputIdentity("envelope|float32|cpu", {"kind": "segy", "path": "/s.sgy", "size": 10, "mtime_ns": 1},
                      code="c1", params="p1", halo=(0, 0, 0))


def found(**changes):
    ident = {**WANT.to_json(), **changes.pop("identity", {})}
    return FoundOutput(**{"memchunk": True, "shape": SHAPE, "operator_key": WANT.operator_key, "identity": ident,
                          **changes})


@pytest.mark.parametrize("what, there, replace_any, action, says", [
    ("nothing there", None, False, "create", ""),
    ("the same computation", found(), False, "resume", ""),
    ("other task code", found(identity={"code": "c2"}), False, "restart", "other task code"),
    ("other parameters and halo", found(identity={"params": "p2", "halo": [1, 1, 1]}), False, "restart",
     "other parameters and another halo"),
    ("a changed input", found(identity={"input": {"kind": "segy", "path": "/s.sgy", "size": 11}}), False,
     "restart", "another input"),
    ("another operator", found(operator_key="gst3d_dip|float32|cpu"), False, "refuse", "choose another output path"),
    ("another shape", found(shape=(4, 4, 9)), False, "refuse", "with shape (4, 4, 9)"),
    ("another operator, path owned", found(operator_key="gst3d_dip|float32|cpu"), True, "restart", "it held"),
    ("not memchunk's", FoundOutput(memchunk=False), False, "refuse", "not a store written by memchunk"),
    ("not memchunk's, path owned", FoundOutput(memchunk=False), True, "refuse", "refusing to replace it"),
])
def test_output_action(what, there, replace_any, action, says):
    act = output_action("/o.zarr", there, WANT, SHAPE, replace_any=replace_any)
    assert act.action == action, what
    assert says in act.reason


def test_an_input_that_cannot_be_identified_is_always_recomputed():
    want = OutputIdentity(WANT.operator_key, None, "c1", "p1", (0, 0, 0))
    there = FoundOutput(memchunk=True, shape=SHAPE, operator_key=WANT.operator_key, identity=want.to_json())
    act = output_action("/o.zarr", there, want, SHAPE)
    assert act.action == "restart" and "cannot be identified" in act.reason


def test_open_output_creates_resumes_and_refuses_real_stores(tmp_path):
    path = str(tmp_path / "o.zarr")
    out, done, act = open_output(path, WANT, SHAPE, {}, operator="envelope")
    assert act.action == "create" and done == []
    out, done, act = open_output(path, WANT, SHAPE, {}, operator="envelope")
    assert act.action == "resume"
    other = OutputIdentity("gst3d_dip|float32|cpu", WANT.input, "c1", "p1", (0, 0, 0))
    with pytest.raises(OutputPathError, match="already holds output of 'envelope"):
        open_output(path, other, SHAPE, {}, operator="gst3d_dip")
    _, _, act = open_output(path, other, SHAPE, {}, operator="gst3d_dip", replace_any=True)
    assert act.action == "restart"
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    with pytest.raises(OutputPathError, match="not a store written by memchunk"):
        open_output(str(tmp_path / "mine"), WANT, SHAPE, {}, operator="envelope", replace_any=True)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
