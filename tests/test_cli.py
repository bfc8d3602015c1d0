"""The `memchunk` command, run in-process through main([...]) and once as the installed script."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys

import pytest

from memchunk_prefect.cli.app import SUBCOMMANDS, main, match_operator, parse_bytes, register
from memchunk_prefect.core.errors import BudgetError, UnknownOperatorError
from memchunk_prefect.core.records import Observation, Reward
from memchunk_prefect.learn.store import Store

ENV = "envelope|float32|cpu"
GST = "gst3d_dip[sigma_gradient=1;sigma_tensor=2]|float32|cpu"
GST_OTHER = "gst3d_dip[sigma_gradient=1;sigma_tensor=3]|float32|cpu"


@pytest.fixture
def store_path(tmp_path, monkeypatch):
    path = tmp_path / "obs.sqlite"
    monkeypatch.setenv("MEMCHUNK_STORE", str(path))
    rng = random.Random(0)
    with Store(path) as s:
        for i in range(12):
            il = rng.choice([8, 16, 32, 64])
            e = il * 64 * 400
            peak = int((70 * 2**20 + 28 * e) * (1 + rng.gauss(0, 0.02)))
            # The first run took a fresh worker from nothing to its peak: its time is set aside (a first touch).
            # It also loaded a library the worker kept (a first use: 150 MiB, paid once per worker).
            left = 150 * 2**20 if i == 0 else 0
            s.add(Observation(ENV, e, (il, 64, 400), 4 * e, peak + left, seconds=1e-6 * e, energy_joules=2e-7 * e,
                              energy_source="estimate", grew_bytes=peak + left if i == 0 else 0,
                              retained_bytes=left, rise_50=0.3 + 0.02 * i, rise_90=0.8))
        s.add(Observation(GST, 1000, (10, 10, 10), 4000, 10**6))
        s.add_reward(Reward(ENV, "bold", ("bold", "mid"), 0.72, 0.72, 10**6, 3.0, 2, n_chunks=4))
        s.add_reward(Reward(ENV, "safe", ("safe",), -0.5, 0.5, 10**6, 4.0, 2, out_of_memory=1, n_chunks=6))
    return path


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("text, expected", [
    ("2GiB", 2 * 2**30), ("512MiB", 512 * 2**20), ("512 MiB", 512 * 2**20), ("2GB", 2 * 10**9),
    ("1.5GiB", 3 * 2**29), ("4096", 4096), ("64kib", 65536), (123, 123),
])
def test_parse_bytes(text, expected):
    assert parse_bytes(text) == expected


@pytest.mark.parametrize("text", ["2GX", "", "GiB", "-1GiB", "0", "two gigs"])
def test_parse_bytes_rejects_with_the_value_and_the_accepted_forms(text):
    with pytest.raises(BudgetError) as info:
        parse_bytes(text)
    assert repr(text) in str(info.value) and "GiB" in str(info.value)


def test_models_table_and_json(capsys, store_path):
    code, out, _ = run(capsys, "models")
    assert code == 0 and ENV in out and "bytes/element" in out and "coverage" in out
    assert "bold 0.72x1 mid 0.72x1 safe -0.50x1!1" in out, "the learned policy's arms, as taught from the store"
    assert "energy/element" in out and "0.20 uJ est" in out, "joules per element, labelled as an estimate"
    assert "linear 11 +1 first" in out, "the time model: its form, the runs it learned from, the first touch set aside"
    assert "+150.0 MiB once" in out, "what a first use left held in its worker, apart from the fixed overhead"
    assert "peak at" in out and "0.41/0.80" in out, "when its runs reached half and 90% of their peak: medians"
    code, out, _ = run(capsys, "models", "--json")
    data = json.loads(out)
    by_key = {m["key"]: m for m in data["models"]}
    env = by_key[ENV]
    assert env["n_observations"] == 12 and env["ready"]
    assert (env["time_runs"], env["first_touch_runs"]) == (11, 1) and env["seconds_per_element"] == pytest.approx(1e-6)
    assert 0 < env["fixed_overhead_bytes"] < 100 * 2**20 and env["bytes_per_element"] > 0
    assert env["first_use_bytes"] == 150 * 2**20
    assert env["rise"] == [pytest.approx(0.41), 0.8] and by_key[GST]["rise"] is None
    assert env["recent_mape"] is not None and env["coverage"] is not None
    assert by_key[GST]["ready"] is False
    assert env["joules_per_element"] == pytest.approx(2e-7) and env["energy_source"] == "estimate"
    assert by_key[GST]["joules_per_element"] is None  # no energy recorded for it
    assert data["store"] == str(store_path)
    assert [(a["arm"], a["pulls"]) for a in env["policy"]] == [("bold", 1), ("mid", 1), ("safe", 1), ("finer", 0),
                                                                ("coarser", 0)]
    assert by_key[GST]["policy"][0] == {"arm": "bold", "pulls": 0, "mean_reward": None, "out_of_memory": 0}


def test_models_time_cell_shows_a_curve_that_counts_in_part_beside_the_line():
    from memchunk_prefect.cli.format import time_cell

    row = {"time_form": "linear", "time_runs": 6, "first_touch_runs": 0, "time_rate_ratio": 1.22,
           "time_curve": "superlinear", "time_curve_weight": 0.41}
    assert time_cell(row) == "linear 6 1.2x superlinear 41%"
    assert time_cell({**row, "time_form": "superlinear", "time_curve_weight": 1.0}) == "superlinear 6 1.2x"
    assert time_cell({**row, "time_curve": None, "time_curve_weight": 0.0}) == "linear 6 1.2x"
    grew = {**row, "time_curve": None, "time_curve_weight": 0.0, "first_touch_runs": 2, "touch_seconds_per_gib": 1.47}
    assert time_cell(grew) == "linear 6 +2 first 1.5 s/GiB 1.2x"
    assert time_cell({**grew, "first_call_seconds": 0.214}) == "linear 6 +2 first 1.5 s/GiB 1.2x +0.21 s first call"
    assert time_cell({**row, "time_spread": 0.364}) == "linear 6 1.2x superlinear 41% ~0.36"  # how far runs strayed


def test_models_on_an_empty_store_says_so(capsys, tmp_path):
    code, out, _ = run(capsys, "models", "--store", str(tmp_path / "empty.sqlite"))
    assert code == 0 and "no observations yet" in out


def test_plan_json_has_the_promised_fields(capsys, store_path):
    code, out, _ = run(capsys, "plan", "--operator", "envelope", "--shape", "200", "300", "400",
                       "--budget", "2GiB", "--slots", "2", "--json")
    assert code == 0
    p = json.loads(out)
    assert len(p["chunk_shape"]) == 3 and all(isinstance(v, int) for v in p["chunk_shape"])
    assert p["n_chunks"] >= 2 and p["too_little_history"] is False and p["probe"] is False
    assert p["upper_bound_bytes"] <= 2 * 2**30
    assert p["predicted_peak_bytes"] <= p["upper_bound_bytes"]
    assert p["operator_key"] == ENV and p["whole_traces"] is True
    assert p["chunk_shape"][2] == 400  # envelope needs whole traces


def test_plan_counts_growing_fresh_workers_at_what_the_stores_runs_paid_and_not_on_workers_that_held_it(
        capsys, tmp_path, monkeypatch):
    """envelope-like rows (70 MiB + 28 B per element, 1 us per element); the runs that grew a fresh worker paid
    5 s of kernel time per GiB grown (a slow machine's figure, to make it count). On fresh workers a plan of
    2 chunks (one each) grows each worker ~400 MiB: 2 s, where 4 or more grow less and add 0.15 s per wave."""
    path = tmp_path / "touch.sqlite"
    monkeypatch.setenv("MEMCHUNK_STORE", str(path))
    rng = random.Random(1)
    with Store(path) as s:
        for i in range(12):
            il = rng.choice([8, 16, 32, 64])
            e = il * 64 * 400
            peak = 70 * 2**20 + 28 * e
            grew = peak if i % 4 == 0 else 0
            s.add(Observation(ENV, e, (il, 64, 400), 4 * e, peak, seconds=1e-6 * e, grew_bytes=grew,
                              sys_seconds=5.0 * grew / 2**30))
    argv = ("plan", "--operator", "envelope", "--shape", "200", "300", "400", "--budget", "2GiB", "--slots", "2")
    code, out, _ = run(capsys, *argv, "--json")
    fresh = json.loads(out)
    code2, out2, _ = run(capsys, *argv, "--held", "8GiB", "--json")
    held = json.loads(out2)
    assert code == code2 == 0
    assert fresh["touch_seconds_per_byte"] * 2**30 == pytest.approx(5.0)
    assert fresh["held_bytes"] == 0 and held["held_bytes"] == 8 * 2**30
    assert held["n_chunks"] == 2 and fresh["n_chunks"] > 2, fresh["reason"]
    assert "above the most they have held" in fresh["reason"]
    code, _, err = run(capsys, *argv, "--held", "lots")
    assert code == 2 and "'lots'" in err


def test_plan_with_too_little_history_says_it_would_probe(capsys, store_path):
    code, out, _ = run(capsys, "plan", "--operator", "gst3d_dip", "--shape", "100", "100", "200",
                       "--budget", "1GiB", "--json")
    p = json.loads(out)
    assert code == 0 and p["too_little_history"] is True and p["probe"] is True
    assert p["operator_key"] == GST and "too little history" in p["history"]
    code, out, _ = run(capsys, "plan", "--operator", "gst3d_dip", "--shape", "100", "100", "200", "--budget", "1GiB")
    assert "too little history" in out


def test_plan_for_an_operator_never_seen_probes(capsys, store_path):
    code, out, _ = run(capsys, "plan", "--operator", "semblance", "--shape", "50", "50", "100",
                       "--budget", "512MiB", "--halo", "1", "2", "3", "--json")
    p = json.loads(out)
    assert code == 0 and p["too_little_history"] and p["halo"] == [1, 2, 3]


def test_plan_with_an_ambiguous_name_lists_the_keys(capsys, store_path):
    with Store(store_path) as s:
        s.add(Observation(GST_OTHER, 1000, (10, 10, 10), 4000, 10**6))
    code, _, err = run(capsys, "plan", "--operator", "gst3d_dip", "--shape", "10", "10", "10", "--budget", "1GiB")
    assert code == 2 and GST in err and GST_OTHER in err and "exact key" in err


@pytest.mark.parametrize("argv, message", [
    (["--budget", "2GX"], "'2GX'"),
    (["--budget", "2GiB", "--halo", "1", "2"], "one int"),
    (["--budget", "2GiB", "--slots", "0"], "at least 1"),
])
def test_plan_bad_input_exits_2_with_the_value(capsys, store_path, argv, message):
    code, _, err = run(capsys, "plan", "--operator", "envelope", "--shape", "10", "10", "10", *argv)
    assert code == 2 and message in err


def test_plan_budget_too_small_exits_1(capsys, store_path):
    code, _, err = run(capsys, "plan", "--operator", "envelope", "--shape", "10", "10", "400", "--budget", "1KiB")
    assert code == 1 and "budget" in err


def test_forget_and_unknown_key(capsys, store_path):
    code, out, _ = run(capsys, "forget", GST)
    assert code == 0 and "forgot 1 observation" in out
    code, _, err = run(capsys, "forget", GST)
    assert code == 2 and GST in err and ENV in err


def test_compact_keeps_the_newest_observations_of_each_key(capsys, store_path):
    code, out, _ = run(capsys, "compact", "--keep", "5")
    assert code == 0 and "deleted 7 observations, 0 policy rewards and 0 map records; 6 observations kept" in out
    with Store(store_path) as s:
        assert s.count(ENV) == 5 and s.count(GST) == 1
    code, _, err = run(capsys, "compact", "--keep", "0")
    assert code == 1 and "keep must be a whole number of rows of at least 1, got 0" in err
    code, _, err = run(capsys, "compact", "--key", "nope")
    assert code == 2 and "'nope'" in err and GST in err


@pytest.mark.parametrize("fmt", ["csv", "json"])
def test_export_to_stdout_and_file(capsys, store_path, tmp_path, fmt):
    code, out, _ = run(capsys, "export", "--format", fmt)
    assert code == 0
    rows = json.loads(out) if fmt == "json" else out.strip().splitlines()[1:]
    assert len(rows) == 13
    target = tmp_path / f"out.{fmt}"
    assert run(capsys, "export", "--format", fmt, "--output", str(target))[0] == 0
    assert target.read_text() == out


def test_usage_errors_exit_2(capsys):
    assert main([]) == 2
    assert main(["nonsense"]) == 2
    assert main(["plan"]) == 2


def test_a_registered_subcommand_appears(capsys):
    @register("hello", "say hello")
    def _hello(args):
        print("hello")
        return 0

    try:
        assert run(capsys, "hello")[:2] == (0, "hello\n")
    finally:
        del SUBCOMMANDS["hello"]


def test_match_operator():
    keys = [ENV, GST, GST_OTHER]
    assert match_operator(ENV, keys) == ENV
    assert match_operator("envelope", keys) == ENV
    assert match_operator("env", keys) == ENV
    assert match_operator("semblance", keys) is None
    with pytest.raises(UnknownOperatorError):
        match_operator("gst3d_dip", keys)


def test_installed_console_script(store_path):
    script = shutil.which("memchunk", path=os.path.dirname(sys.executable)) or shutil.which("memchunk")
    assert script, "the memchunk console script is not beside this Python or on PATH; pip install -e ."
    proc = subprocess.run([str(script), "models", "--json"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MEMCHUNK_STORE": str(store_path)})
    assert proc.returncode == 0, proc.stderr
    assert ENV in {m["key"] for m in json.loads(proc.stdout)["models"]}
    proc = subprocess.run([str(script), "plan", "--operator", "envelope", "--shape", "1", "1", "1",
                           "--budget", "lots"], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MEMCHUNK_STORE": str(store_path)})
    assert proc.returncode == 2 and "'lots'" in proc.stderr
