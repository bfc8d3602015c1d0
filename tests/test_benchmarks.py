"""Smoke test of the side-by-side benchmark: `python -m benchmarks --quick` runs and reports every strategy.

No timing assertions: figures on a shared CI machine say nothing. It checks the
JSON's structure (the names the issue fixes) and that every strategy appears.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = [pytest.mark.cluster]

STRATEGY_FIELDS = {"name", "wall_seconds", "completed", "oom_events", "tasks", "lost_worker_seconds",
                   "peak_memory_fraction"}


@pytest.fixture(scope="module")
def api_url(prefect_server) -> str:
    """The session's Prefect server, for benchmarks run against a server that is already up (PREFECT_API_URL)."""
    from prefect.settings import get_current_settings

    url = get_current_settings().api.url
    assert url, "the session's Prefect server set no API URL"
    return str(url)


def benchmark_env(tmp_path, api_url: str | None = None):
    """The environment a benchmark subprocess runs in: a Prefect home of its own, no telemetry, and either the
    session's Prefect server (``api_url``) or none, in which case the benchmark starts its own.

    Starting a server takes ~20 s on a 2-core CI machine; every benchmark here that reports to Prefect is pointed
    at the session's, so the suite starts one instead of nine.
    """
    env = dict(os.environ)
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    return env


@pytest.mark.long
def test_quick_benchmark_reports_every_strategy(tmp_path, api_url):
    out = tmp_path / "bench.json"
    env = benchmark_env(tmp_path, api_url)
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "--quick", "--json", str(out),
                           "--plot", str(tmp_path / "bench.png"), "--workdir", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"using the Prefect API at {api_url}" in proc.stdout
    result = json.loads(out.read_text())

    names = [s["name"] for s in result["strategies"]]
    for expected in ("dask-auto", "static-best", "split-on-failure", "memchunk-cold", "memchunk-warm",
                     "heuristic-cold", "heuristic-warm"):
        assert expected in names, names
    assert any(n.startswith("static-") and n != "static-best" for n in names)
    for s in result["strategies"]:
        assert STRATEGY_FIELDS <= set(s), s
        assert isinstance(s["completed"], bool)
        assert s["oom_events"] >= 0 and s["tasks"] >= 0 and s["lost_worker_seconds"] >= 0
    assert "overhead_ratio" in result and result["overhead_ratio"] is not None
    assert [s["factor"] for s in result["scaling"]][0] == 1
    assert all({"factor", "elements", "wall_seconds", "seconds_per_element"} <= set(s) for s in result["scaling"])
    assert {"cpus", "memory_bytes"} <= set(result["machine"])
    # Without a GPU (CI) the GPU section says so and why, and the run goes on on the CPU; with one, every
    # operator has a CPU row and a GPU row.
    from memchunk_prefect.run.pinning import usable_gpus

    devices, found = usable_gpus(env)
    if not devices:
        assert result["gpu"] == {"skipped": found} and f"GPU section skipped: {found}" in proc.stdout
    else:
        assert sorted({r["device"] for r in result["gpu"]["rows"]}) == ["cpu", "cuda"], result["gpu"]
    # The memory-aware runner finishes the work the benchmark is sized to break in one piece.
    by = {s["name"]: s for s in result["strategies"]}
    assert by["memchunk-cold"]["completed"] and by["memchunk-warm"]["completed"]
    assert by["heuristic-cold"]["completed"] and by["heuristic-warm"]["completed"]
    assert "dask-auto" in proc.stdout and "memchunk-warm" in proc.stdout
    # Every map under the learned policy names the arm it played; the ablation plays the heuristic's only.
    arms = {op: v["arms"] for op, v in by["memchunk-warm"]["extra"]["operators"].items()}
    assert all(a and set(a) <= {"bold", "mid", "safe", "finer", "coarser"} for a in arms.values()), arms
    assert all(v["arms"] == ["safe"] for v in by["heuristic-warm"]["extra"]["operators"].values())
    # What was learned, from the runs themselves: every operator of the pipeline scored on its own history.
    quality = {q["operator"]: q for q in result["learning_quality"]}
    assert set(quality) == {"envelope", "gaussian_smooth", "gst3d_dip"}, quality
    for q in quality.values():
        assert q["scored"] > 0 and 0 <= q["coverage"] <= 1 and q["mape"] >= 0 and q["bound_at_chosen"] > 0, q
        assert isinstance(q["met"], bool)
    assert "MAPE after 5" in proc.stdout

    # The simulator against these runs, from the benchmark's own store (no timing assertions either).
    sim_json = tmp_path / "sim.json"
    env = benchmark_env(tmp_path, api_url)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.simulated", "--from", str(out), "--workdir",
                           str(tmp_path / "work"), "--runs", "3", "--json", str(sim_json)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["strategy"]: r for r in json.loads(sim_json.read_text())["rows"]}
    assert {"dask-auto", "split-on-failure", "memchunk-warm"} <= set(rows), rows
    assert any(name.startswith("static-") for name in rows)
    assert rows["memchunk-warm"]["predicted_p50"] > 0 and rows["memchunk-warm"]["predicted_completed"] == "3/3"
    assert "| memchunk-warm |" in proc.stdout


@pytest.mark.long
def test_quick_heterogeneous_benchmark_reports_every_survey_and_the_ablation(tmp_path, api_url):
    out = tmp_path / "hetero.json"
    env = benchmark_env(tmp_path, api_url)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.heterogeneous", "--quick", "--json", str(out),
                           "--workdir", str(tmp_path / "work")],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"using the Prefect API at {api_url}" in proc.stdout
    result = json.loads(out.read_text())
    assert [s["name"] for s in result["steps"]] == ["envelope", "trace_correlation", "gaussian_smooth", "gst3d_dip"]
    for survey in result["surveys"]:
        by = {s["name"]: s for s in survey["strategies"]}
        for name in ("memchunk-cold", "memchunk-warm", "heuristic-cold", "heuristic-warm"):
            assert by[name]["completed"], (name, by[name]["notes"])
        assert "static-best" in by
        assert {q["operator"] for q in survey["learning_quality"]} == {
            "envelope", "trace_correlation", "gaussian_smooth", "gst3d_dip"}
        # Every step's wall, on both sides, and the per-operator best of the sweep built from them.
        assert len(by["memchunk-warm"]["extra"]["step_seconds"]) == 4
        assert all(len(r["extra"]["step_seconds"]) == 4 for r in survey["strategies"]
                   if r["name"].startswith("static-") and r["name"] != "static-best" and r["completed"])
        reach = survey["per_operator_best"]
        assert [s["step"] for s in reach["steps"]] == [s["name"] for s in result["steps"]]
        assert 0 < reach["seconds"] <= by["static-best"]["wall_seconds"]  # one round: single runs' step walls
    assert "per-operator best of the sweep" in proc.stdout
    assert any("0.85x static-best" in label for label in result["targets"])
    assert any(label.startswith("learning quality") for label in result["targets"])


@pytest.mark.long
def test_quick_nights_benchmark_runs_both_policies_night_after_night_on_their_own_stores(tmp_path, api_url):
    out = tmp_path / "nights.json"
    # One warm night after the cold one: the suite's form (the study's --quick runs two).
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.nights", "--quick", "--nights", "1",
                           "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    (survey,) = result["surveys"]
    assert [r["night"] for r in survey["nights"]] == [0, 1]
    for r in survey["nights"]:
        assert r["learned"]["completed"] and r["heuristic"]["completed"], r
        # The ablation plays the heuristic's arm only (none on a map that probed the whole survey).
        assert all(v["arms"] in ([], ["safe"]) for v in r["heuristic"]["extra"]["operators"].values()), r
    cold = survey["nights"][0]["learned"]["extra"]["operators"]
    assert all("probe" in v["decisions"] for v in cold.values()), cold
    # Every operator's bandit was taught by the warm night (a cold start's remainder teaches nothing).
    assert len(survey["arms"]) == 4 and all(sum(a["pulls"] for a in arms) >= 1 for arms in survey["arms"].values()), \
        survey["arms"]
    assert survey["summary"]["warm_nights"] == 1 and "every warm night" in proc.stdout


def test_the_nights_summary_compares_settled_nights_and_counts_exploration_in_the_totals():
    from benchmarks.studies.nights import summarize

    def run(wall, why):
        return {"completed": True, "wall_seconds": wall, "oom_events": 0,
                "extra": {"operators": {"op": {"arms": ["x"], "arm_why": [why], "chunks": 2, "decisions": []}}}}

    rows = []
    for night, (learned, heuristic, why) in enumerate([(9.0, 5.0, "burn-in"), (6.0, 5.0, "burn-in"),
                                                        (4.0, 5.0, "best"), (4.5, 5.0, "best"), (6.0, 5.0, "explore")]):
        from benchmarks.studies.nights import exploring

        row = {"night": night, "learned": run(learned, why), "heuristic": run(heuristic, "")}
        row["learning"] = exploring(row["learned"])
        rows.append(row)
    rows[3]["heuristic"]["extra"]["operators"]["op"]["chunks"] = 4  # night 3: the heuristic planned otherwise
    s = summarize(rows)
    assert s["settled_nights"] == [2, 3] and s["warm_nights"] == 4
    assert s["settled_median_ratio"] == pytest.approx(statistics_median([0.8, 0.9]))
    assert s["warm_total_ratio"] == pytest.approx(round(20.5 / 20.0, 3)), "exploration is paid for in the totals"
    assert s["settled_same_plans"] == [2], "night 2 ran the heuristic's plan: its ratio is the host's"
    from benchmarks.studies.nights import verdict

    assert "the same plans as the heuristic on 1 of them ([2])" in verdict(s)


def test_replaying_a_kept_nights_store_lists_every_reward_beside_the_plans_the_model_offered(tmp_path):
    from benchmarks.studies.nights import replay_rewards
    from memchunk_prefect.learn.store import Store
    from tests.fixtures import store_from_json

    store = store_from_json("nights-store.json", tmp_path / "nights.sqlite")
    rows = replay_rewards(str(store))
    with Store(store) as s:
        stored = [(k, r.arm, r.n_chunks) for k in s.keys() for r in s.rewards(k)]
    assert [(r["key"], r["arm"], r["chunks"]) for r in rows] == stored and len(rows) == 40
    planned = [r for r in rows if "safe" in r]
    assert planned and all(r["safe"][0] >= 1 and r["safe"][1] > 0 for r in planned)
    finer = [r["finer"] for r in planned if r.get("finer")]
    assert finer and all(n > s for (n, _), s in zip(finer, (r["safe"][0] for r in planned if r.get("finer"))))


def statistics_median(xs):
    import statistics

    return round(statistics.median(xs), 3)


@pytest.mark.long
def test_quick_energy_benchmark_reports_both_objectives_with_their_energy_sources(tmp_path, api_url):
    out = tmp_path / "energy.json"
    env = benchmark_env(tmp_path, api_url)
    proc = subprocess.run([sys.executable, "-m", "benchmarks.energy", "--quick", "--pairs", "1", "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    runs = result["runs"]
    # The planner's estimates per operator and slab count, from the store the runs left.
    assert {e["operator"] for e in result["estimates"]} == {"envelope", "gaussian_smooth", "gst3d_dip"}
    assert all(e["joules"] > 0 and e["seconds"] > 0 for e in result["estimates"])
    assert sorted(r["objective"] for r in runs) == ["energy", "time"]
    for r in runs:
        assert r["completed"] and r["oom_events"] == 0, r
        # No counter is readable on CI machines: every figure is an estimate, and says so.
        assert r["energy_sources"] == ["estimate"] or "rapl" in r["energy_sources"] or "nvml" in r["energy_sources"]
        assert r["busy_joules"] > 0 and r["total_joules"] >= r["busy_joules"]
    assert "objective  wall s  busy J" in proc.stdout


def _seeded_demo_store(path: Path) -> Path:
    """A store that knows the demo pipeline's operators (seeded figures: a smoke test checks structure, not values)."""
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.operators.registry import DEFAULT_STEPS
    from memchunk_prefect.sim.inputs import Step
    from memchunk_prefect.testing import seed_store

    with Store(path) as store:
        for step, bpe in zip(DEFAULT_STEPS, (40.0, 12.0, 240.0)):
            seed_store(store, Step.of(step).key, bpe, sizes=(20_000, 50_000, 100_000, 200_000, 400_000, 800_000))
    return path


def test_quick_simulator_scale_benchmark_times_every_row_and_says_whether_it_meets_the_target(tmp_path):
    store, out = _seeded_demo_store(tmp_path / "s.sqlite"), tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sim_scale", "--quick", "--repeat", "1", "--store",
                           str(store), "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]  # 1: the 30 s target missed
    result = json.loads(out.read_text())
    assert [r["kind"] for r in result["rows"]] == ["target"] + ["workers"] * 3 + ["survey"] * 3
    assert all(r["tasks"] > 0 and r["seconds"] > 0 for r in result["rows"])
    assert result["rows"][0]["workers"] == 1000 and result["rows"][0]["shape"] == [2000, 2000, 1500]
    assert result["end_to_end"]["seconds"] > 0 and result["allocation"]["runs"] == 3
    assert ("meets the 30 s target" in proc.stdout) == (proc.returncode == 0)


def test_quick_allocation_benchmark_sets_the_model_beside_the_simulated_runs(tmp_path):
    store, out = _seeded_demo_store(tmp_path / "s.sqlite"), tmp_path / "alloc.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.allocation", "--quick", "--store", str(store), "--json",
                           str(out)], cwd=REPO, env=benchmark_env(tmp_path), capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["runs"] == 8 and result["rows"]
    for r in result["rows"]:
        assert 0 <= r["p_model"] <= 1 and 0 <= r["p_simulated"] <= 1 and r["target"] > 0
    assert "model - simulated: mean |gap|" in proc.stdout


def test_replay_benchmark_times_each_history_length(tmp_path):
    out = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.replay", "--rows", "50", "200", "--repeat", "1",
                           "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["rows"] for r in result["rows"]] == [50, 200]
    assert all(r["learned"] == r["rows"] and r["seconds"] > 0 for r in result["rows"])
    assert result["keep_per_key"] > 0 and "a replay is bounded by" in proc.stdout


def test_write_memory_benchmark_measures_each_read_and_write_concurrency_on_every_slab_shape(tmp_path):
    out = tmp_path / "write.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.write_memory", "--repeat", "1", "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [(r["read_concurrency"], r["concurrency"]) for r in result] == [(10, 10), (10, 1), (2, 1), (1, 1)]
    for r in result:
        # The reads-only rows: each of the 8 slabs of 16 ilines read 5 times, each read's peak measured.
        assert len(r["reads"]["peaks_mib"]) == 40 and r["reads"]["seconds"] > 0
        assert set(r["slabs"]) == {"72+56 ilines", "9+36 ilines"}
        for s in r["slabs"].values():
            # One peak per chunk (two chunks per repeat), each above the chunk's own float32 input.
            assert len(s["peaks_mib"]) == 2 and all(p > 9 * 128 * 400 * 4 / 2**20 for p in s["peaks_mib"])
            assert s["seconds"] > 0
    assert "reads, writes at once" in proc.stdout and "reads alone" in proc.stdout


def test_task_memory_measures_each_chunks_whole_task_beside_its_operator_alone(tmp_path):
    out = tmp_path / "task.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.task_memory", "--operator", "envelope", "--survey", "64",
                           "48", "200", "--chunk", "0", "32", "0", "48", "--chunk", "32", "64", "16", "48", "--repeat",
                           "1", "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert [r["chunk"] for r in result["rows"]] == ["i0-32_x0-48_t0-200", "i32-64_x16-48_t0-200"]
    for r in result["rows"]:
        assert r["read"] == r["written"], "envelope has no halo: the block read is the region written"
        assert len(r["task_peaks_mib"]) == 1 and len(r["operator_peaks_mib"]) == 1
        # The task holds the block it read on top of what the operator alone holds.
        assert r["task_peaks_mib"][0] >= r["operator_peaks_mib"][0]
    assert "task adds" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.studies.task_memory", "--survey", "32", "24", "100", "--chunk",
                          "0", "40", "0", "24"], cwd=REPO, env=benchmark_env(tmp_path), capture_output=True, text=True,
                         timeout=60)
    assert bad.returncode == 2 and "not inside the survey's 32 ilines x 24 xlines" in bad.stderr


def test_peak_time_study_finds_a_gram_peaking_late_and_an_autocorrelation_early(tmp_path):
    """The simulator takes every operator's memory to peak half way through its run; the study measures when each
    reaches it. A BLAS Gram matrix fills its output over its run, autocorrelation holds one product at a time."""
    out = tmp_path / "peak.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.peak_time", "--operators", "fam_gram",
                           "fam_autocorr", "--repeats", "1", "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {r["operator"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"fam_gram", "fam_autocorr"}
    for r in rows.values():
        assert r["seconds"] > 0 and r["peak_mib"] > 0 and r["samples"] > 10, r
        assert 0 <= r["at_50"] <= r["at_90"] <= 1, r
    assert rows["fam_gram"]["at_90"] > rows["fam_autocorr"]["at_90"], rows
    assert "where no rise is learned, the simulator takes 0.45" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.studies.peak_time", "--repeats", "0"], cwd=REPO,
                         env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--repeats must be at least 1, got 0" in bad.stderr


def test_measure_overhead_study_times_the_monitor_and_what_timing_the_rise_costs(tmp_path):
    from benchmarks.studies import measure_overhead

    figures = measure_overhead.main(["--runs", "20", "--rise-seconds", "0.5", "--json", str(tmp_path / "o.json")])
    assert figures["psutil_ms"] > 0 and 0 <= figures["rise_cpu_share"] < 0.2, figures
    assert json.loads((tmp_path / "o.json").read_text()) == figures


def test_first_touch_benchmark_times_each_call_in_each_fresh_process(tmp_path):
    out = tmp_path / "touch.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.first_touch", "--calls", "2", "--processes", "1",
                           "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (calls,) = json.loads(out.read_text())
    assert len(calls) == 2
    for c in calls:
        assert c["wall_seconds"] > 0 and c["user_seconds"] >= 0 and c["system_seconds"] >= 0 and c["minor_faults"] > 0
    # The Gram matrix is ~545 MiB: the first call faults it in (~4,300 faults here; 2 MiB huge pages would need
    # ~270, so the floor is set below that).
    assert calls[0]["minor_faults"] > 100
    assert "first call" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.studies.first_touch", "--calls", "1"], cwd=REPO,
                         env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--calls must be at least 2" in bad.stderr


def test_idle_memory_study_times_each_touch_by_the_gap_before_it_in_a_fresh_process(tmp_path):
    out = tmp_path / "idle.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.idle_memory", "--mib", "16", "--gaps", "0", "0.3",
                           "--rounds", "2", "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["mib"] == 16 and doc["first"]["wall_seconds"] > 0
    assert [(t["round"], t["gap_seconds"]) for t in doc["touches"]] == [(0, 0.0), (0, 0.3), (1, 0.0), (1, 0.3)]
    assert all(t["wall_seconds"] > 0 and t["system_seconds"] >= 0 for t in doc["touches"])
    assert [(r["gap_seconds"], r["touches"]) for r in doc["summary"]] == [(0.0, 2), (0.3, 2)]
    assert "memory left free 0.3 s costs" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.studies.idle_memory", "--gaps", "-1"], cwd=REPO,
                         env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "every gap 0 or more" in bad.stderr and "--gaps -1.0" in bad.stderr


def test_idle_memory_summary_is_the_median_per_gib_at_each_gap():
    from benchmarks.studies.idle_memory import summarise

    doc = {"mib": 512, "touches": [{"gap_seconds": 2.0, "wall_seconds": 5.0, "system_seconds": 4.8},
                                   {"gap_seconds": 0.0, "wall_seconds": 0.07, "system_seconds": 0.05},
                                   {"gap_seconds": 2.0, "wall_seconds": 6.0, "system_seconds": 5.5},
                                   {"gap_seconds": 2.0, "wall_seconds": 1.0, "system_seconds": 0.9}]}
    rows = summarise(doc)
    assert [(r["gap_seconds"], r["touches"]) for r in rows] == [(0.0, 1), (2.0, 3)]
    assert rows[0]["wall_seconds_per_gib"] == pytest.approx(0.14)
    assert rows[1]["wall_seconds_per_gib"] == pytest.approx(10.0) and rows[1]["system_seconds_per_gib"] == pytest.approx(9.6)


def test_task_start_benchmark_times_both_modes_and_the_kept_mode_reuses_settings_and_clients(tmp_path, api_url):
    out = tmp_path / "start.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.task_start", "--tasks", "4", "--rounds", "1", "--json",
                           str(out)], cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    by_mode = {r["mode"]: r for r in result["runs"]}
    assert set(by_mode) == {"prefect", "kept"}
    for r in by_mode.values():
        assert len(r["seconds"]) == 4 and all(s > 0 for s in r["seconds"]) and r["plain_median"] > 0
    assert by_mode["prefect"]["worker_hydration"]["reused"] == 0  # not installed: Prefect's own hydration
    assert by_mode["kept"]["worker_hydration"]["reused"] >= 3  # every task run after the first found its settings
    assert by_mode["prefect"]["worker_clients"]["opened"] == 0  # not installed: Prefect's own clients
    # Installed before the first task run: it opens the worker thread's client, the other three are given it.
    assert by_mode["kept"]["worker_clients"] == {"opened": 1, "reused": 3, "open": 1}
    assert "median over rounds" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.studies.task_start", "--tasks", "2"], cwd=REPO,
                         env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--tasks must be at least 3" in bad.stderr


def test_chunk_body_benchmark_runs_both_sides_on_the_same_chunk_and_both_write_it(tmp_path):
    out = tmp_path / "body.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.chunk_body", "--pairs", "1", "--operator", "envelope",
                           "--shape", "16", "12", "50", "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert set(result["runs"]) == {"static", "memchunk"}
    for side, (run,) in result["runs"].items():
        # the operator's call is part of the body, which is measured around it
        assert 0 < run["operator_seconds"] <= run["wall_seconds"], (side, run)
        assert run["max_rss_kib"] > 0 and run["written_nan"] == 0  # the whole chunk written
    assert result["runs"]["static"][0]["written_sum"] == pytest.approx(result["runs"]["memchunk"][0]["written_sum"])
    assert result["runs"]["static"][0]["written_sum"] != 0
    assert set(result["summary"]) == {"wall_seconds", "cpu_seconds", "operator_seconds"}
    assert "median of the pairs' differences" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "benchmarks.studies.chunk_body", "--operator", "nope"], cwd=REPO,
                         env=benchmark_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--operator 'nope' is not one of" in bad.stderr


@pytest.mark.long
def test_consecutive_nights_report_the_store_what_the_process_holds_and_whether_plans_settled(tmp_path, api_url):
    out = tmp_path / "nights.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.consecutive", "--runs", "2", "--keep", "4", "--quick",
                           "--json", str(out)], cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert len(result["runs"]) == 2 and result["keep_per_key"] == 4 and result["quick"] is True
    for r in result["runs"]:
        night = r["night"]
        assert night["fds"] > 0 and night["threads"] > 0 and night["store_bytes"] > 0
        assert set(night["recent_mape"]) == {"envelope", "gaussian_smooth", "gst3d_dip"}
    # The cap holds at each map's end: per key the newest 4 rows and the newest of up to 4 other (size, outcome)
    # pairs, 8 at most (3 keys), whatever each night added; and it deleted rows.
    made = sum(r["tasks"] for r in result["runs"])
    assert all(n <= 3 * 8 for n in result["verdict"]["observations"]), result["verdict"]
    assert result["verdict"]["observations"][-1] < made, (made, result["verdict"])
    assert "decisions:" in proc.stdout and "held by this process" in proc.stdout


def test_many_chunks_benchmark_reports_every_task_run_final_and_the_memory_and_latency_figures(tmp_path, api_url):
    out = tmp_path / "many.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.many_chunks", "--chunks", "24", "--seeded", "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["completed"] and result["chunks"] >= 12, result
    assert set(result["task_runs"]) == {"COMPLETED"} and sum(result["task_runs"].values()) == result["tasks"]
    assert result["flow_process_peak_bytes"] > 0 and result["scheduler_peak_bytes"] > 0
    assert result["server_health_seconds"]["samples"] >= 1


def test_compare_runs_reads_each_kept_run_and_sets_its_ratios_against_that_runs_fastest_static():
    """The rows in BENCHMARKS.md come from the kept JSONs; each ratio is over that run's own fastest static-N."""
    from benchmarks import compare_runs

    paths = sorted((REPO / "tests" / "data").glob("side_by_side-*.json"))
    assert len(paths) >= 2
    for path in paths:
        result = json.loads(path.read_text())
        walls = {s["name"]: s["wall_seconds"] for s in result["strategies"]}
        best = min(s["wall_seconds"] for s in result["strategies"]
                   if s["name"].startswith("static-") and s["name"] != "static-best" and s["completed"])
        line = compare_runs.row(result)
        assert f"({walls['memchunk-warm'] / best:.2f}x)" in line and f"({walls['memchunk-cold'] / best:.2f}x)" in line
        assert f"{result['overhead_ratio']:.3f}" in line
    failed = json.loads(paths[0].read_text())
    for s in failed["strategies"]:
        s["completed"] = False
    with pytest.raises(ValueError, match="no static-N completed"):
        compare_runs.row(failed)


def test_store_quality_replays_every_store_given_and_names_a_missing_one(tmp_path):
    """Per operator over several stores: runs scored add up, and a linear operator is predicted closely."""
    from benchmarks.studies import store_quality
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    paths = []
    for s in range(2):
        path = tmp_path / f"s{s}.sqlite"
        with Store(str(path)) as store:
            for k in range(12):
                n = 10_000 * (1 + (k * 7 + s) % 9)
                store.add(Observation("envelope|float32|cpu", n, (1, 1, n), 4 * n, 2**20 + 30 * n, seconds=0.1))
        paths.append(str(path))
    rows = store_quality.quality(paths, after=5)
    one = store_quality.quality(paths[:1], after=5)
    assert set(rows) == {"envelope"} and rows["envelope"]["stores"] == 2
    assert rows["envelope"]["scored"] == 2 * one["envelope"]["scored"] > 0
    assert rows["envelope"]["coverage"] == 1.0 and rows["envelope"]["mape"] < 0.02
    with pytest.raises(FileNotFoundError, match="no observation store"):
        store_quality.quality([str(tmp_path / "missing.sqlite")])
    # --tight: only runs of blocks larger than any measured before them (sizes here cycle up to 90,000 elements).
    tight = store_quality.tight_beyond(paths)["envelope"]
    assert 0 < tight["runs"] < 24 and tight["under"] == 0 and 1.0 <= tight["median"] < 1.25
    assert store_quality.main([*paths, "--tight", "--json", str(tmp_path / "t.json")]) == 0
    assert json.loads((tmp_path / "t.json").read_text())["envelope"]["runs"] == tight["runs"]
    # The command line passes the model's options through: the figures BENCHMARKS.md quotes for other settings.
    json_path = tmp_path / "q.json"
    assert store_quality.main([*paths, "--noise-floor-mib", "16", "--json", str(json_path)]) == 0
    assert json.loads(json_path.read_text())["envelope"]["scored"] == rows["envelope"]["scored"]


def test_gap_counts_the_runs_a_curve_taken_across_a_gap_predicted_beside_the_line(tmp_path, capsys):
    """An operator quadratic in its traces with a fixed cost, measured at probes and then 18x larger blocks: the
    curve is taken across the gap on leave-one-out alone, and --gap scores it beside the line, within the sizes
    measured and on the next, larger block (where the line under-reads a quadratic)."""
    from benchmarks.studies import store_quality
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    key = "trace_pairs|float32|cpu"

    def peak(e: int) -> int:
        return int(5 * 2**20 + 8 * e + 2e-5 * e**2)

    path = str(tmp_path / "s.sqlite")
    with Store(path) as store:
        for ext in [(10, 10, 100), (12, 12, 100), (14, 14, 100), (60, 60, 100), (66, 66, 100), (60, 60, 100),
                    (90, 90, 100)]:
            for _ in range(2):
                e = ext[0] * ext[1] * ext[2]
                store.add(Observation(key, e, ext, 4 * e, peak(e)))
    gap = store_quality.gap_curves([path])["trace_pairs"]
    assert gap["within"] >= 2 and gap["beyond"] == 2, gap  # the first 66 x 66 block, and the first 90 x 90
    assert gap["mape_curve"] < 0.02 < gap["mape_line"], gap
    assert all(abs(c - 1) < 0.05 for c in gap["curve_over_peak"]) and max(gap["line_over_peak"]) < 0.95, gap
    assert store_quality.main([path, "--gap"]) == 0
    assert "trace_pairs" in capsys.readouterr().out


def test_the_examples_of_the_learning_quality_figures_hold():
    """benchmarks/ is outside the doctest paths: the examples of replay_quality and repeatability run here."""
    import doctest

    from benchmarks import quality

    result = doctest.testmod(quality)
    assert result.attempted >= 2 and result.failed == 0


def test_explain_takes_each_runs_bound_apart_as_the_model_read_it_before_the_run(tmp_path, capsys):
    """Per run once the model is ready: the block, its peak and what the bound was made of; the blended bound
    is never under the chosen form's own, and the command prints one line per run."""
    from benchmarks.studies import store_quality
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    key = "envelope|float32|cpu"
    rows = [Observation(key, n, (1, 1, n), 4 * n, 2**20 + 30 * n) for n in
            (10_000, 20_000, 40_000, 40_000, 80_000, 160_000, 160_000)]
    from memchunk_prefect.learn.operator import OperatorModel

    cold = OperatorModel(key).explain((1, 1, 100))
    assert not cold["ready"] and cold["form_upper_bytes"] is None and cold["times_largest"] is None
    got = store_quality.explain_runs(rows, key)
    assert [r["elements"] for r in got] == [40_000, 80_000, 160_000, 160_000]  # ready after 3 runs at 2 sizes
    assert [round(r["times_largest"], 2) for r in got] == [1.0, 2.0, 2.0, 1.0]
    for r in got:
        assert r["ready"] and r["form_upper_bytes"] <= r["upper_bytes"] and 0.0 <= r["curved_weight"] <= 1.0
        assert abs(r["mean_bytes"] / r["peak_bytes"] - 1) < 0.02
    path = str(tmp_path / "s.sqlite")
    with Store(path) as store:
        for o in rows:
            store.add(o)
    assert store_quality.main([path, "--explain", "envelope"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(key) and len(lines) == 2 + len(got)


def test_a_bound_under_the_peak_at_the_chunks_chosen_misses_the_learning_goal(tmp_path):
    """The bound at the chunks a run chose must hold their peak (>= 1x) and be at most 1.25x it: the 17:12
    heterogeneous run's envelope read 0.90x on 256 x 128 x 200 and was reported as met."""
    from benchmarks.strategies import learning_quality
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    key = "envelope|float32|cpu"
    path = str(tmp_path / "s.sqlite")
    with Store(path) as store:
        for k in range(12):
            n = 10_000 * (1 + (k * 7) % 9)
            store.add(Observation(key, n, (1, 1, n), 4 * n, 2**20 + 30 * n, seconds=0.1))

    def met(bound_over_peak: float) -> bool:
        chosen = {"extra": {"operators": {"envelope": {"operator_key": key, "bound_over_peak": bound_over_peak}}}}
        (q,) = learning_quality(path, chosen)
        assert q["coverage"] == 1.0 and q["mape"] < 0.02 and q["bound_at_chosen"] == bound_over_peak
        return q["met"]

    assert met(1.10) and met(1.0) and met(1.25)
    assert not met(0.90) and not met(1.30)


def test_first_run_excess_compares_a_worker_s_first_run_with_its_later_runs_of_the_same_size():
    """Only sizes where both kinds ran count; a worker is new once per key, and an unknown worker never is."""
    from benchmarks.studies.store_quality import first_run_excess
    from memchunk_prefect.core.records import Observation

    def run(worker: str, n: int, extra_mib: float = 0.0) -> Observation:
        return Observation("envelope|float32|cpu", n, (1, 1, n), 4 * n, int(20 * n + extra_mib * 2**20),
                           worker=worker)

    rows = [run("a", 100_000, 4.0), run("b", 200_000, 6.0), run("a", 100_000), run("b", 100_000),
            run("c", 300_000, 5.0), run("", 300_000, 9.0), run("a", 200_000)]
    # 100,000: first a (+4), later a and b; 200,000: first b (+6), later a; 300,000: only c's first run.
    assert first_run_excess(rows) == pytest.approx([4.0, 6.0], abs=1e-5)
    assert first_run_excess([]) == []


def test_map_overhead_profiles_the_maps_submissions_and_the_runners_steps(tmp_path, api_url):
    """Smoke test of ``python -m benchmarks.studies.map_overhead``: the steps it reports are the map's own."""
    out = tmp_path / "mo.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.map_overhead", "--runs", "1", "--chunks", "2",
                           "--shape", "8", "8", "40", "--top", "3", "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = json.loads(out.read_text())["steps"]
    assert steps["executor.py:*(submit)"]["calls_per_map"] == 2
    assert steps["executor.py:*(_run)"]["seconds_per_map"] >= steps["executor.py:*(submit)"]["seconds_per_map"] > 0
    assert "the runner's steps" in proc.stdout


def test_overlap_benchmark_times_both_ways_and_compares_their_outputs(tmp_path, api_url):
    """Smoke test of ``python -m benchmarks.overlap`` on its straggler chain (three chained maps, a worker
    throttled by SIGSTOP / SIGCONT): both ways timed, outputs compared, each chunk's seconds reported."""
    out = tmp_path / "ov.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.overlap", "--rows",
                           "chain-straggler", "--repeats", "1", "--hold", "0.5", "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["row"] for r in rows] == ["chain-straggler"]
    for row in rows:
        assert row["outputs_equal"] is True
        assert row["blocking_seconds"] > 0 and row["overlapped_seconds"] > 0
        assert [r["chunks"] for r in row["runs"]["blocking"]] == [r["chunks"] for r in row["runs"]["overlapped"]]
        for run in row["runs"]["blocking"] + row["runs"]["overlapped"]:
            assert [len(m) for m in run["chunk_seconds"]] == run["chunks"]
            assert min(run["chunks"]) > 1, f"a map ran as one chunk, nothing to pipeline: {run['chunks']}"


def test_rounds_repeat_every_strategy_in_turn_and_report_each_ones_median_run():
    """The static sweep and the memchunk rows run round by round; a row is its median run, with every wall kept
    and out-of-memory events summed; statics that failed or were far behind the fastest are not run again."""
    from benchmarks import strategies as st

    class Bench:
        def __init__(self):
            self.order = []

        def measure(self, name, fn):
            self.order.append(name)
            out = fn()
            return st.StrategyResult(name=name, wall_seconds=out["seconds"], completed=out["completed"],
                                     oom_events=out.get("oom", 0), tasks=1, lost_worker_seconds=0.0,
                                     peak_memory_fraction=0.5)

    walls = {"static-2": iter([10.0, 12.0, 8.0]), "static-8": iter([16.0])}

    def static(name, completed=True):
        return lambda: {"seconds": next(walls[name]) if completed else 3.0, "completed": completed}

    cold = iter([(6.0, 0), (11.0, 1), (12.0, 0)])  # faster than any static in the first round: not the yardstick

    def memchunk(r):
        seconds, oom = next(cold)
        return {"seconds": seconds, "completed": True, "oom": oom, "round": r}

    bench = Bench()
    rows = st.in_rounds(bench, [("static-1", static("static-1", completed=False)), ("static-2", static("static-2")),
                                ("static-8", static("static-8"))], [("memchunk-cold", memchunk)], repeats=3)
    assert bench.order == ["static-1 #1", "static-2 #1", "static-8 #1", "memchunk-cold #1",
                           "static-2 #2", "memchunk-cold #2", "static-2 #3", "memchunk-cold #3"]
    by = {r.name: r for r in rows}
    assert [r.name for r in rows] == ["static-1", "static-2", "static-8", "memchunk-cold"]
    assert not by["static-1"].completed
    assert by["static-2"].wall_seconds == 10.0 and by["static-2"].extra["walls"] == [10.0, 12.0, 8.0]
    assert by["static-8"].wall_seconds == 16.0, "16 s is over 1.5x the fastest static's first run (10 s): run once"
    assert by["memchunk-cold"].wall_seconds == 11.0 and by["memchunk-cold"].oom_events == 1
    assert "median of 3: 6.0, 11.0, 12.0 s" in by["memchunk-cold"].notes


def test_learned_against_heuristic_says_when_both_ran_the_same_plans_in_every_round():
    """Rows of several rounds keep each round's plan (chunks per operator); the learned-policy check then says
    whether the two rows ran the same plans throughout (their walls differ by the host) and never claims it for
    rounds whose plans were not kept."""
    from benchmarks import strategies as st
    from benchmarks.__main__ import evaluate

    def run(name, seconds, chunks):
        ops = {op: {"chunks": n} for op, n in chunks.items()}
        return st.StrategyResult(name=name, wall_seconds=seconds, completed=True, oom_events=0, tasks=1,
                                 lost_worker_seconds=0.0, peak_memory_fraction=None, extra={"operators": ops})

    plan = {"envelope": 2, "gst3d_dip": 2}
    learned = st.median_of("memchunk-warm", [run("memchunk-warm", w, plan) for w in (9.8, 13.7, 14.3)])
    heuristic = st.median_of("heuristic-warm", [run("heuristic-warm", w, plan) for w in (10.8, 11.8, 9.8)])
    assert learned.extra["plans_runs"] == [plan] * 3
    rows = [dataclasses.asdict(r) for r in (learned, heuristic)]
    figure = evaluate(rows, {}, [], 2)["policy_warm"]
    assert not figure["met"] and "the same plans in every round of both" in figure["figure"], figure
    other = st.median_of("heuristic-warm", [run("heuristic-warm", w, {**plan, "envelope": n})
                                            for w, n in ((10.8, 2), (11.8, 4), (9.8, 2))])
    assert not st.same_plans(rows[0], dataclasses.asdict(other))
    unkept = dict(rows[1], extra={k: v for k, v in rows[1]["extra"].items() if k != "plans_runs"})
    assert not st.same_plans(rows[0], unkept)  # three rounds, one plan kept: unknown, not the same


def test_the_per_operator_best_takes_each_steps_least_median_wall_failed_statics_included():
    """A static that failed at its second step still ran its first, and that wall counts for the first step; each
    row's step walls are the per-step medians of its rounds (a round that stopped early counts where it ran)."""
    from benchmarks import strategies as st

    def run(name, walls, completed=True):
        return st.StrategyResult(name=name, wall_seconds=sum(walls), completed=completed, oom_events=0, tasks=1,
                                 lost_worker_seconds=0.0, peak_memory_fraction=None,
                                 extra={"step_seconds": walls})

    two = st.median_of("static-2", [run("static-2", [2.0, 9.0]), run("static-2", [3.0, 7.0]),
                                    run("static-2", [1.0, 8.0])])
    assert two.extra["step_seconds"] == [2.0, 8.0] and len(two.extra["step_seconds_runs"]) == 3
    one = run("static-1", [1.5], completed=False)
    four = st.median_of("static-4", [run("static-4", [2.5, 6.0]), run("static-4", [2.5, 9.0])])
    assert four.extra["step_seconds"] == [2.5, 7.5]
    reach = st.per_operator_best([one, two, four], ["envelope", "gst3d_dip"])
    assert reach == {"seconds": 9.0, "steps": [
        {"step": "envelope", "of": "static-1", "seconds": 1.5, "not_reached": []},
        {"step": "gst3d_dip", "of": "static-4", "seconds": 7.5, "not_reached": ["static-1"]}]}
    # Older rows without step walls: nothing to derive.
    assert st.per_operator_best([run("static-2", [])], ["envelope"]) is None


def test_cold_start_reads_each_operators_map_from_the_store(tmp_path):
    """benchmarks/cold_start.py: a map's seconds run from its first chunk's start to its last chunk's end; chunks
    and traces read (halo included) are summed; failed runs are not the map's work."""
    from benchmarks.studies import cold_start
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    store = Store(str(tmp_path / "s.sqlite"))
    key = "gst3d_dip[sigma_gradient=1;sigma_tensor=2]|float32|cpu"
    for start, seconds, extents, outcome in [(100.0, 0.5, (13, 34, 400), "ok"), (100.1, 0.6, (13, 46, 400), "ok"),
                                             (100.8, 7.0, (128, 76, 400), "ok"),
                                             (100.8, 2.0, (128, 76, 400), "memory_error")]:
        store.add(Observation(key, extents[0] * extents[1] * extents[2], extents, 4, 10, seconds=seconds,
                              outcome=outcome, censored=outcome != "ok", started_at=start))
    store.add(Observation("envelope|float32|cpu", 10, (1, 1, 10), 4, 10, seconds=0.2, started_at=99.0))
    store.close()
    ops = cold_start.per_operator(str(tmp_path / "s.sqlite"))
    assert ops["gst3d_dip"] == {"map_seconds": 7.8, "starts_at": 1.0, "chunks": 3,
                                "traces_read": 13 * 34 + 13 * 46 + 128 * 76,
                                "idle_slot_seconds": pytest.approx(2 * 7.8 - (0.5 + 0.6 + 7.0))}
    assert ops["envelope"]["starts_at"] == 0.0 and ops["envelope"]["chunks"] == 1


def test_time_forms_replays_each_flow_run_and_the_support_test_can_be_turned_off(tmp_path, capsys):
    """benchmarks.studies.time_forms: the form after each flow run, cold (first in its store) and later; with
    ``--time-gap-ratio inf`` every curve counts as supported, as before the support test. The rows are one
    benchmark round's gst3d_dip cold map (tests/test_model.py) and a warm run of 2 chunks after it."""
    from benchmarks.studies import time_forms
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    key = "gst3d_dip[sigma_gradient=1;sigma_tensor=2]|float32|cpu"
    cold = [(176_800, (13, 34, 400), 0.531, 0.048, 0, 31_469_568),
            (239_200, (13, 46, 400), 0.584, 0.068, 9_203_712, 42_278_912),
            (343_200, (13, 66, 400), 0.596, 0.067, 27_455_488, 58_875_904),
            (280_800, (13, 54, 400), 0.684, 0.131, 7_454_720, 48_132_096),
            (3_891_200, (128, 76, 400), 9.548, 1.985, 621_813_760, 669_335_552),
            (3_891_200, (128, 76, 400), 10.387, 2.140, 611_237_888, 669_450_240)]
    warm = [(3_891_200, (128, 76, 400), 7.3, 0.6, 0, 669_000_000)] * 2
    path = str(tmp_path / "s.sqlite")
    with Store(path) as store:
        for run, rows in (("cold", cold), ("warm", warm)):
            for e, ext, secs, sys_secs, grew, peak in rows:
                store.add(Observation(key, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew,
                                      flow_run_id=run))
    now = time_forms.forms([path])["gst3d_dip"]
    before = time_forms.forms([path], time_gap_ratio=math.inf)["gst3d_dip"]
    assert (now["cold"], now["later"]) == (before["cold"], before["later"]) == (1, 1)
    assert now["cold_curved"] == 0 and before["cold_curved"] == 1
    assert now["ratios"][0] < 1.0, "the probes cost more per element than the large chunks"
    assert now["cold_partial"] == now["later_partial"] == 0 and now["weights"] == []  # falling rates: no curve counts
    assert time_forms.main([path, "--time-gap-ratio", "inf"]) == 0
    assert "gst3d_dip" in capsys.readouterr().out
    # --fits: each form's leave-one-out error and predictions beside the medians measured and the planned line.
    assert time_forms.main([path, "--fits"]) == 0
    out = capsys.readouterr().out
    assert "176,800" in out and "3,891,200" in out and "line planned" in out
    assert [w for w in ("linear", "superlinear", "quadratic") if f"  {w} " in out] == ["linear", "superlinear",
                                                                                    "quadratic"]
    with pytest.raises(SystemExit):
        time_forms.main([str(tmp_path / "missing.sqlite")])


def test_time_forms_plans_sum_what_each_warm_map_cost_by_its_chunk_count(tmp_path, capsys):
    """--plans: per chunk count of the maps after a store's first flow run, the task seconds summed, the kernel
    seconds of first touches (runs that grew their worker past the threshold) and the MiB they grew. The warm
    rows are trace_correlation's 4- and 8-chunk maps on 192 x 192 x 100 (benchmarks.heterogeneous at cacbee3)."""
    from benchmarks.studies import time_forms
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    key = "trace_correlation|float32|cpu"
    mib = 2**20
    # (elements, seconds, kernel seconds, bytes grown, peak)
    flows = {"cold": [(232_800, 0.1, 0.01, 0, 47 * mib)] * 2,  # the first flow run of the store: not a warm plan
             "warm4": [(940_900, 1.96, 0.93, 664 * mib, 695 * mib), (940_900, 2.03, 0.98, 664 * mib, 694 * mib),
                       (940_900, 0.81, 0.14, 0, 686 * mib), (940_900, 0.99, 0.16, mib, 686 * mib)],
             "warm8": [(475_300, 0.33, 0.12, 152 * mib, 182 * mib)] * 2 + [(485_000, 0.25, 0.04, 0, 185 * mib)] * 6}
    path = str(tmp_path / "s.sqlite")
    with Store(path) as store:
        for run, rows in flows.items():
            for e, secs, sys_secs, grew, peak in rows:
                store.add(Observation(key, e, (e // 9700, 97, 100), 4 * e, peak, seconds=secs,
                                      sys_seconds=sys_secs, grew_bytes=grew, flow_run_id=run))
    costs = time_forms.plan_costs([path])["trace_correlation"]
    assert sorted(costs) == [4, 8] and costs[4]["maps"] == costs[8]["maps"] == 1
    assert costs[4]["task_seconds"] == pytest.approx(1.96 + 2.03 + 0.81 + 0.99)
    assert costs[4]["first_touch_seconds"] == pytest.approx(0.93 + 0.98)  # 1 MiB grown is no first touch
    assert costs[4]["grew_mib"] == pytest.approx(2 * 664)
    assert costs[8]["task_seconds"] == pytest.approx(2 * 0.33 + 6 * 0.25)
    assert costs[8]["first_touch_seconds"] == pytest.approx(0.24) and costs[8]["grew_mib"] == pytest.approx(304)
    assert time_forms.main([path, "--plans"]) == 0
    assert "first-touch kernel s" in capsys.readouterr().out


def test_time_forms_counts_the_runs_that_named_the_line_while_a_curve_counted(tmp_path, capsys):
    """A cold trace_correlation map whose noisy probes left the line named (tests/test_model.py's
    ``test_a_noisy_probe_leaves_the_curve_counting...``, the same rows): counted as partial, with its weight."""
    from benchmarks.studies import time_forms
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    key = "trace_correlation|float32|cpu"
    rows = [(232_800, (24, 97, 100), 0.111, 0.033, 32_886_784, 48_857_088),
            (232_800, (24, 97, 100), 0.139, 0.056, 16_748_544, 48_447_488),
            (834_200, (86, 97, 100), 1.063, 0.604, 525_651_968, 571_514_880),
            (834_200, (86, 97, 100), 0.489, 0.087, 655_360, 566_804_480),
            (834_200, (86, 97, 100), 1.045, 0.596, 526_225_408, 571_895_808),
            (834_200, (86, 97, 100), 0.586, 0.101, 1_036_288, 567_435_264)]
    path = str(tmp_path / "s.sqlite")
    with Store(path) as store:
        for e, ext, secs, sys_secs, grew, peak in rows:
            store.add(Observation(key, e, ext, 4 * e, peak, seconds=secs, sys_seconds=sys_secs, grew_bytes=grew,
                                  flow_run_id="cold"))
    row = time_forms.forms([path])["trace_correlation"]
    assert (row["cold"], row["cold_curved"], row["cold_partial"]) == (1, 0, 1)
    assert len(row["weights"]) == 1 and 0.3 < row["weights"][0] < 0.5
    assert time_forms.main([path]) == 0
    assert f"({row['weights'][0]:.2f}-{row['weights'][0]:.2f})" in capsys.readouterr().out


def test_quick_gpu_benchmark_runs_every_strategy_on_the_fake_device_and_checks_against_the_cpu(tmp_path, api_url):
    """``python -m benchmarks.gpu --quick`` where there is no GPU: the fake device of 32 MiB (numpy, memory by
    tracemalloc), on which gst3d_dip does not fit in one piece. Every strategy reports, static-1 runs out of the
    device's memory, memchunk plans around it cold and warm, and its output equals the CPU path."""
    env = benchmark_env(tmp_path, api_url)
    env.pop("MEMCHUNK_FAKE_GPU_BYTES", None)
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--quick", "--workdir", str(tmp_path / "w"),
                           "--json", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "--quick without a GPU: the fake device of 32 MiB" in proc.stdout
    result = json.loads(out.read_text())
    rows = {r["name"]: r for r in result["strategies"]}
    assert set(rows) == {"dask-auto", "static-1", "static-6", "static-best", "memchunk-cold", "memchunk-warm"}
    assert STRATEGY_FIELDS <= set(rows["memchunk-warm"])
    assert not rows["static-1"]["completed"] and rows["static-1"]["oom_events"] == 1, "one piece does not fit"
    for name in ("memchunk-cold", "memchunk-warm"):
        assert rows[name]["completed"] and rows[name]["extra"]["operator_key"].endswith("|cuda")
        assert rows[name]["extra"]["gpu_peak_bytes"] <= rows[name]["extra"]["gpu_budget_bytes"]
    t = result["targets"]
    assert t["one_piece"]["met"] and t["warm_oom"]["met"] and t["exact"]["met"], t
    assert "targets:" in proc.stdout and "memchunk-warm" in proc.stdout


def test_gpu_memory_benchmark_measures_known_allocations_exactly_on_the_fake_device(tmp_path):
    """``python -m benchmarks.studies.gpu_memory --quick`` on the fake device: its figure for each allocation of known size
    is the size (NVML columns empty: no GPU); each operator is measured twice."""
    env = benchmark_env(tmp_path)
    env["MEMCHUNK_FAKE_GPU_BYTES"] = str(4 << 30)
    out = tmp_path / "m.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.gpu_memory", "--quick", "--json", str(out)], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    known = [r for r in rows if "truth_bytes" in r]
    assert len(known) == 4 and all(abs(r["pool_error"]) < 0.01 and r["nvml_end_bytes"] is None for r in known)
    assert sorted(r["call"] for r in rows if r.get("operator") == "gst3d_dip") == ["first", "second"]


@pytest.mark.long
def test_quick_family_runs_every_strategy_in_its_own_process_and_scores_the_runner_against_the_best_static(
        tmp_path, api_url):
    out = tmp_path / "family.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.family", "--quick", "--json", str(out), "--work",
                           str(tmp_path / "work")], cwd=REPO, env=benchmark_env(tmp_path, api_url),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    [w] = doc["results"]
    assert [r["strategy"] for r in w["sweep"]] == ["static-2", "static-4"]
    assert w["cold"]["strategy"] == "memchunk" and w["cold"]["completed"], w["cold"]
    [pair] = w["pairs"]
    assert set(pair) == {"static", "memchunk"} and pair["memchunk"]["completed"], pair
    assert w["best_static"] in {"static-2", "static-4"} and w["cold_ratio"] > 0 and w["warm_ratio"] > 0
    # Each child is its own process: every run reports when its flow started its first task.
    assert all(x is not None and x > 0 for x in w["first_task_seconds"]["static"] + w["first_task_seconds"]["memchunk_warm"])
    assert set(doc["summary"]["targets"]) == {"warm_median", "warm_worst", "cold_median", "warm_kills", "first_task_extra"}
    assert "| workload |" in proc.stdout and w["workload"]["name"] in proc.stdout
    page = subprocess.run([sys.executable, "-m", "benchmarks", "report", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    assert "## A family of workloads the runner never saw" in page.stdout and "| family | memchunk warm: 0 kills, 0 failed runs |" in page.stdout


def test_quick_sim_validation_sets_every_real_run_beside_the_simulators_prediction_of_it(tmp_path, api_url):
    from memchunk_prefect.learn.store import Store

    out = tmp_path / "validation.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sim_validation", "--quick", "--json", str(out), "--work",
                           str(tmp_path / "work")], cwd=REPO, env=benchmark_env(tmp_path, api_url),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [r["kind"] for r in doc["rows"]] == ["memchunk cold", "static-2", "split", "memchunk warm"]
    for r in doc["rows"]:
        assert {"makespan_seconds", "completed", "wall_seconds"} <= set(r["real"]), r
        assert {"makespan_p50", "failed_fraction", "kills_mean", "chunks"} <= set(r["predicted"]), r
        assert isinstance(r["outcome_predicted"], bool)
    # The memchunk runs are read back from the store by their flow run; every strategy reports chunks per step.
    assert all(len(r["real"]["chunks"]) == 2 for r in doc["rows"] if r["real"]["completed"])
    assert set(doc["summary"]["targets"]) == {"median_abs_error", "worst_abs_error", "failed_predicted_failed",
                                              "completed_predicted_completed", "thousand_workers"}
    assert doc["restart"]["first_task_seconds"] > doc["restart"]["rejoin_seconds"] > 0
    assert doc["thousand_workers"]["workers"] == 1000 and doc["thousand_workers"]["end_to_end_seconds"] > 0
    assert "| workload | run |" in proc.stdout and "restart of a killed worker: the simulator's default" in proc.stdout
    # The workload's store read as a user's is by `memchunk simulate --track-record`: its cold and warm flow runs.
    track = doc["summary"]["track_record"]
    assert (track["stores"], track["runs"], track["cold"]) == (1, 2, 1) and track["factor"] >= 1.0, track
    assert track["median_abs_error_warm"] is not None and track["median_abs_error_cold"] is not None
    assert f"a deadline at the p90 held for {track['under_p90']}, one at the p90 times" in proc.stdout
    # The warm run's chunks, on a fresh cluster: how many were their worker's first call of the operator.
    calls = doc["summary"]["warm_first_calls"]
    assert 0 < calls["first_calls"] <= calls["chunks"] and 0 <= calls["beyond_cold"] <= calls["chunks"], calls
    assert f"the warm runs' chunks (each run on a fresh cluster): {calls['first_calls']} of" in proc.stdout
    page = subprocess.run([sys.executable, "-m", "benchmarks", "report", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    assert "## The simulator against real runs" in page.stdout
    # The runner timed its tasks' memory rise, and the workload's store kept it.
    rises = [o.rise_90 for o in Store(tmp_path / "work" / f"{doc['workloads'][0]['name']}.sqlite").observations()]
    assert any(r is not None for r in rises), rises
    # Replayed (new predictions from the stores' copies), and a replay replayed, as if no rise had been timed: the
    # real runs and their provenance (the commit and time they ran at) stand, and the stores keep their rises.
    once, twice = tmp_path / "once.json", tmp_path / "twice.json"
    for source, dest, extra in ((out, once, []), (once, twice, ["--without-rise"])):
        again = subprocess.run([sys.executable, "-m", "benchmarks.sim_validation", "--replay", str(source), "--work",
                                str(tmp_path / "work"), "--json", str(dest), *extra], cwd=REPO, capture_output=True,
                               text=True, timeout=300)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    first, second = json.loads(once.read_text()), json.loads(twice.read_text())
    assert first["replayed_from"] == second["replayed_from"] == {
        "path": str(out), "commit": doc["machine"]["commit"], "started": doc["started"]}
    assert [r["real"] for r in second["rows"]] == [r["real"] for r in doc["rows"]]
    assert [o.rise_90 for o in Store(tmp_path / "work" / f"{doc['workloads'][0]['name']}.sqlite").observations()] \
        == rises


def test_segy_scan_study_times_the_scan_the_first_kept_read_and_a_later_one_in_fresh_processes(tmp_path):
    out = tmp_path / "scan.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.segy_scan", "--ilines", "60", "--xlines", "40",
                           "--samples", "10", "--work", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["traces"] == 60 * 40 and [r["mode"] for r in doc["rows"]] == ["scan", "first", "kept"]
    assert all(r["traces"] == 2400 and r["shape"] == [60, 40] and r["seconds"] > 0 for r in doc["rows"])
    assert len(list((tmp_path / "work" / "cache").glob("*.npz"))) == 1  # the first read kept the geometry


def test_real_size_study_scaled_down_runs_the_pipeline_and_reports_its_targets(tmp_path, api_url):
    """The real-size study's form for the suite: a small survey, no reference, one cold run, the session's Prefect
    server (the full study runs cold then warm, beside a reference survey, on a server of its own)."""
    out = tmp_path / "real.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.studies.real_size", "--shape", "40", "24", "100",
                           "--no-reference", "--modes", "cold", "--settle", "0", "--skip", "scan", "--work", str(tmp_path / "work"), "--json", str(out)],
                          cwd=REPO, env=benchmark_env(tmp_path, api_url), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert [(r["shape"], r["mode"]) for r in doc["runs"]] == [([40, 24, 100], "cold")]
    for r in doc["runs"]:
        assert "error" not in r, r.get("error")
        assert [m["operator"] for m in r["maps"]] == ["envelope", "gaussian_smooth", "gst3d_dip"]
        assert r["kills"] == 0 and 0 < r["chunk_span"] < r["wall"] and r["server"] is None
        assert 0 < r["flow_memory"]["first_rss"] <= r["flow_memory"]["peak_rss"]
    reads = {r["read"]: r for r in doc["reads"]}
    segy, zarr_ = reads["SEG-Y, whole-trace blocks 128 x 128"], reads["zarr, whole-trace blocks 128 x 128"]
    assert segy["bytes"] == zarr_["bytes"] == 40 * 24 * 100 * 4  # every sample read, once, from each
    assert reads["SEG-Y, blocks 128 x 128 cut in 4 along time"]["bytes"] == segy["bytes"]
    assert "scan" not in doc  # the segy_scan study's test covers the scan
    page = subprocess.run([sys.executable, "-m", "benchmarks", "report", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert page.returncode == 0, page.stderr
    assert "| real size | flow process memory < 1 GiB throughout |" in page.stdout
    assert "| real size | whole-trace block reads (tiles of 128 x 128 traces) >= 50% of segyio's inline reads |" \
        in page.stdout
    assert "| real size | whole-trace block reads (slabs of whole inlines) >= 50% of segyio's inline reads |" \
        in page.stdout
    assert "| 40 x 24 x 100 | cold |" in page.stdout and "| SEG-Y to zarr (read and write) |" in page.stdout


def test_the_results_page_lists_every_target_of_every_run_and_reruns_each_from_its_command(tmp_path):
    run = REPO / "tests" / "data" / "side_by_side-2026-11-24T1619.json"
    page = tmp_path / "BENCHMARKS.md"
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "report", str(run), "--out", str(page)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    text = page.read_text()
    doc = json.loads(run.read_text())
    for label, v in doc["targets"].items():
        verdict = {True: "met", False: "**missed**", None: "not measured"}[v["met"]]
        assert f"| side by side | {label} | {v['figure']} | {verdict} |" in text
    assert "Rerun: `python -m benchmarks --json side_by_side.json`" in text and doc["machine"]["date"] in text
    assert "| memchunk-warm | yes | 8.3 | 0 | 6 | 0.0 | 0.86 |" in text  # the run's own row, as the JSON holds it

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": []}))
    proc = subprocess.run([sys.executable, "-m", "benchmarks", "report", str(bad)], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "not the JSON of a suite benchmark" in proc.stderr and "['rows']" in proc.stderr


def test_a_family_workload_whose_runner_runs_failed_counts_as_the_worst_ratio_not_as_left_out():
    from benchmarks.family.__main__ import resummarize

    def run(wall, ok=True, failed=""):
        return {"wall_seconds": wall, "completed": ok, "failed": failed, "kills": 0, "strategy": "static-2"}

    def workload(memchunk_ok):
        return {"sweep": [run(4.0), run(6.0)], "cold": run(5.0),
                "pairs": [{"static": run(4.0), "memchunk": run(4.4) if memchunk_ok else
                           run(9.0, False, "exit 1: ChunkOutOfMemoryError: ...")} for _ in range(3)]}

    doc = resummarize({"results": [workload(True), workload(True), workload(False)]})
    s = doc["summary"]
    assert s["warm_median"] == pytest.approx(1.1) and s["warm_worst"] is None and s["warm_worst_failed"]
    assert s["warm_failed_runs"] == 3 and s["warm_kills"] == 3
    assert s["targets"]["warm_worst"] == "missed" and s["targets"]["warm_kills"] == "missed"
    assert doc["results"][2]["warm_ratios"] == [None, None, None] and doc["results"][2]["warm_median_failed"]


def test_the_plain_tasks_of_the_family_share_one_copy_of_a_library_loaded_at_first_use(tmp_path):
    """The static and split strategies' task is pickled by value (a closure): it must reach the operators through
    their module on the worker, or each task carries its own copy of the module's globals and fam_first_use loads
    its library in every task (100 MiB a task: the workers of static-8 and static-32 were killed or paused)."""
    import cloudpickle
    import numpy as np

    from benchmarks.family import archetypes
    from benchmarks.family.child import _slab_task
    from memchunk_prefect.core.chunks import Chunk
    from memchunk_prefect.io.zarr_store import ZarrOutput

    shape = (4, 3, 5)
    coords = {"iline": np.arange(4), "xline": np.arange(3), "twt": np.arange(5, dtype=float)}
    src = ZarrOutput.create(str(tmp_path / "in.zarr"), shape, coords)
    src.write(Chunk.whole(shape), np.ones(shape, dtype=np.float32))
    src.finalize()
    out = ZarrOutput.create(str(tmp_path / "out.zarr"), shape, coords)
    archetypes._LIBRARY.clear()
    for i in range(2):  # each task unpickled afresh, as a worker receives it
        fn = cloudpickle.loads(cloudpickle.dumps(_slab_task().fn))
        fn(src.to_source(), out.path, Chunk((2 * i, 0, 0), (2 * i + 2, 3, 5)), (0, 0, 0), "fam_first_use",
           {"lib_mib": 1, "k": 2.0, "h": 0})
    assert "lib" in archetypes._LIBRARY  # the module's own library, the one every later task finds


def test_a_comparison_of_checkouts_scores_each_against_the_best_static_and_the_static_run_of_its_round():
    from benchmarks.family.compare import summarize, table

    def run(wall, ok=True):
        return {"wall_seconds": wall, "completed": ok}

    res = {"workload": {"name": "w0"}, "sweep": {"2": run(4.0), "4": run(5.0)},
           "cold": {"before": [run(6.0), run(5.0)], "after": [run(4.8), run(4.4)]},
           "static": [run(4.0), run(5.0)],
           "warm": {"before": [run(4.4), run(5.5)], "after": [run(3.6), run(9.0, ok=False)]}}
    s = summarize([res], ["before", "after"])
    (row,) = s["rows"]
    assert row["before"]["cold"] == pytest.approx(5.5 / 4.0) and row["after"]["cold"] == pytest.approx(4.6 / 4.0)
    assert row["before"]["warm_pairs"] == pytest.approx([1.1, 1.1]) and row["after"]["warm_pairs"][1] == math.inf
    assert s["family"]["after"]["warm"]["worst"] == math.inf, "a failed warm run can never improve the figures"
    assert "failed" in table(s, ["before", "after"])


def test_sim_validation_spread_compares_repeated_runs_of_a_flow_with_each_other_and_the_prediction_with_their_median():
    from benchmarks.sim_validation import real_spread

    def row(workload: str, strategy: str, span: float | None, predicted: float, repeat: int | None) -> dict:
        return {"workload": workload, "strategy": strategy, "repeat": repeat, "predicted": {"makespan_p50": predicted},
                "real": {"completed": span is not None, "makespan_seconds": span}}

    rows = [row("w0", "static-2", 10.0, 11.0, 0), row("w0", "static-2", 12.5, 11.0, 1),
            row("w1", "split", 4.0, 3.0, 0), row("w1", "split", 4.0, 3.0, 1), row("w1", "split", 5.0, 3.0, 2),
            row("w1", "static-8", 2.0, 2.0, 0),  # run once: nothing to compare it with
            row("w2", "static-2", None, 1.0, 0), row("w2", "static-2", 1.0, 1.0, 1),  # the failed run does not count
            row("w0", "memchunk", 3.0, 3.0, None), row("w0", "memchunk", 9.0, 3.0, None)]  # a cold and a warm run
    s = real_spread(rows)
    assert s is not None and (s["flows"], s["runs"]) == (2, 5)
    # w0: 2.5/10 and 2.5/12.5; w1: 0 twice, 1/4 twice, 1/5 twice.
    assert s["worst_apart"] == pytest.approx(0.25) and s["median_apart"] == pytest.approx(0.2)
    # w0's median run 11.25 against 11.0; w1's 4.0 against 3.0.
    assert s["worst_error_to_median"] == pytest.approx(0.25)
    assert s["median_error_to_median"] == pytest.approx((0.25 / 11.25 + 0.25) / 2)
    assert real_spread(rows[5:]) is None


def test_sim_validation_p90_coverage_counts_the_completed_runs_that_ended_by_their_predicted_p90():
    from benchmarks.sim_validation import p90_coverage

    def row(span: float | None, p50: float, p90: float) -> dict:
        error = None if span is None else (p50 - span) / span
        return {"error": error, "predicted": {"makespan_p50": p50, "makespan_p90": p90},
                "real": {"completed": span is not None, "makespan_seconds": span}}

    rows = [row(10.0, 9.0, 9.9),  # ran past its p90
            row(10.0, 8.0, 10.0),  # ended on it: counts as held
            row(4.0, 5.0, 8.0),
            row(None, 5.0, 6.0),  # failed: no makespan to hold
            {"error": None, "predicted": None, "real": {"completed": True, "makespan_seconds": 3.0}},
            {"error": 0.1, "predicted": {"makespan_p50": 1.1}, "real": {"completed": True, "makespan_seconds": 1.0}}]
    c = p90_coverage(rows)
    assert c is not None and (c["runs"], c["under_p90"]) == (3, 2)  # the row without a p90 is left out
    assert c["p90_above_p50_median"] == pytest.approx(0.25)  # 0.1, 0.25 and 0.6: the median, not the mean
    assert c["signed_median_error"] == pytest.approx(-0.1)  # -0.1, -0.2 and +0.25: the p50 short, below 0
    assert p90_coverage(rows[3:]) is None


def test_sim_validation_splits_its_errors_by_how_far_each_runs_blocks_lay_beyond_what_the_store_had_timed(tmp_path):
    from benchmarks.family.archetypes import ARCHETYPES
    from benchmarks.family.workloads import Workload
    from benchmarks.sim_validation import _after_cold, _before_warm, _extent_line, error_by_extent
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store
    from memchunk_prefect.operators.spec import operator_key

    w = Workload(name="w0-fam_gram-fam_table", steps=[{"op": "fam_gram", "h": 0}, {"op": "fam_table", "table_mib": 64}],
                 shape=(10, 10, 100), scale=1, source="segy", memory_limit_mib=600, threads=1, seed=1)
    gram = operator_key(ARCHETYPES["fam_gram"], {"h": 0})
    table_key = operator_key(ARCHETYPES["fam_table"], {"table_mib": 64})
    assert table_key != operator_key(ARCHETYPES["fam_table"], {})  # the step's own key, its table size in it

    def store(path: Path, timed: dict[str, int], first_call: dict[str, int] | None = None) -> None:
        with Store(path) as s:
            for key, e in timed.items():
                s.add(Observation(key, e, (1, 1, e), 4 * e, 8 * e, seconds=0.1))
            for key, e in (first_call or {}).items():  # a first call's size is not what a later call timed
                s.add(Observation(key, e, (1, 1, e), 4 * e, 8 * e, seconds=0.5, first_call=True))

    # The survey is 10,000 elements. After the cold run: gram timed at 2,500 and table at 5,000 by later calls.
    store(_after_cold(tmp_path, w), {gram: 2500, table_key: 5000}, first_call={gram: 10_000})
    # Before the second warm run, a warm run had timed gram at 5,000 too.
    store(_before_warm(tmp_path, w, 0), {gram: 2500, table_key: 5000})
    store(_before_warm(tmp_path, w, 1), {gram: 5000, table_key: 5000})

    def row(kind: str, chunks: list[int], error: float | None) -> dict:
        return {"workload": w.name, "kind": kind, "error": error, "real": {"chunks": chunks}}

    rows = [row("memchunk cold", [8, 8], 0.9),  # its own probes timed it: left out
            row("static-2", [2, 2], -0.6),  # 5,000 / 2,500 = 2x for gram: beyond
            row("static-8", [8, 8], 0.1),  # 1,250: within for both
            row("split", [1, 1], None),  # failed: no error
            row("memchunk warm", [4, 2], 0.05),  # gram 2,500 / 2,500, table 5,000 / 5,000: within
            row("memchunk warm", [2, 2], -0.3),  # gram 5,000 against the 5,000 the first warm run timed: within
            row("static-4", [4, 1], 0.2),  # gram within, but table 10,000 / 5,000: beyond
            {**row("static-2", [2, 2], 0.9), "workload": "w9-not-in-this-run"}]
    e = error_by_extent(rows, [w], tmp_path)
    assert e is not None and e["ratio"] == pytest.approx(1.5)
    assert e["within"] == {"rows": 3, "median": pytest.approx(0.1), "p90": pytest.approx(0.1), "worst": pytest.approx(0.3)}
    assert e["beyond"] == {"rows": 2, "median": pytest.approx(0.4), "p90": pytest.approx(0.2), "worst": pytest.approx(0.6)}
    assert (e["largest_errors"], e["largest_errors_beyond"]) == (5, 2)
    (line,) = _extent_line(e)
    assert ("within 1.5x median 10%, p90 10%, worst 30% (3 rows); beyond it median 40%, p90 20%, worst 60% (2 rows); "
            "2 of the 5 largest errors lay beyond") in line
    # A step's operator never timed after a first call counts as beyond.
    (tmp_path / "never").mkdir()
    store(_after_cold(tmp_path / "never", w), {table_key: 5000}, first_call={gram: 10_000})
    never = error_by_extent([row("static-8", [8, 8], 0.1)], [w], tmp_path / "never")
    assert never is not None and never["beyond"]["rows"] == 1 and never["within"]["rows"] == 0
    assert "within 1.5x no row" in _extent_line(never)[0]
    assert error_by_extent(rows[:1], [w], tmp_path) is None and _extent_line(None) == []


#: Lines of a real child's log around a static flow's kill (distributed's own words, trimmed), and one a
#: healthy run writes too.
_KILL_LOG = """\
16:04:27.100 | INFO    | distributed.scheduler - Receive client connection: Client-3b6f
16:04:29.259 | WARNING | distributed.worker.memory - Worker is at 81% memory usage. Pausing worker.  Process memory: 0.95 GiB -- Worker memory limit: 1.17 GiB
16:04:31.160 | WARNING | distributed.nanny.memory - Worker tcp://127.0.0.1:34701 (pid=2780) exceeded 95% memory budget. Restarting...
16:04:31.212 | INFO    | distributed.scheduler - Remove worker addr: tcp://127.0.0.1:34701 name: 0
16:04:31.213 | ERROR   | distributed.scheduler - Task slab-44cd marked as failed because 1 workers died while trying to run it
16:04:31.215 | INFO    | distributed.nanny - Worker process 2780 was killed by signal 15
16:04:31.219 | WARNING | distributed.nanny - Restarting worker (status=Status.running)
"""


def test_a_failed_child_keeps_its_clusters_warnings_and_errors_in_order_and_the_last_ones_when_there_are_many():
    from benchmarks.family.__main__ import cluster_log

    kept = cluster_log(_KILL_LOG)
    assert [ln[:12] for ln in kept] == ["16:04:29.259", "16:04:31.160", "16:04:31.213", "16:04:31.215",
                                         "16:04:31.219"], kept  # the INFO lines but the process killed left out
    assert cluster_log(_KILL_LOG, lines=2, deaths=0) == kept[-2:]
    assert cluster_log(_KILL_LOG, lines=0, deaths=0) == []
    # The deaths are kept wherever they are: the nanny's restart, the failed task, the process killed.
    assert cluster_log(_KILL_LOG, lines=1, deaths=2) == [kept[1], kept[2], kept[4]]
    long_line = "00:00:00.000 | WARNING | x - " + "y" * 1000
    assert cluster_log(long_line) == [long_line[:300]]
    # Dask's own log format counts too; a run that logs many errors after its death keeps the death.
    assert cluster_log("2026-01-01 00:00:00,000 - distributed.nanny - WARNING - Restarting worker\n") == [
        "2026-01-01 00:00:00,000 - distributed.nanny - WARNING - Restarting worker"]
    noisy = _KILL_LOG + "".join(f"16:05:{i:02d}.000 | WARNING | prefect - retrying\n" for i in range(30))
    kept = cluster_log(noisy, lines=3)
    assert [ln[:12] for ln in kept] == ["16:04:31.160", "16:04:31.213", "16:04:31.215", "16:05:27.000",
                                         "16:05:28.000", "16:05:29.000"], kept
    # A run that timed out hands over its log as bytes.
    assert cluster_log(_KILL_LOG.encode()) == cluster_log(_KILL_LOG) and cluster_log(None) == []


def test_a_child_that_did_not_complete_returns_its_cluster_log_and_one_that_completed_does_not(monkeypatch):
    from benchmarks.family import __main__ as fam

    def fake_run(result: dict):
        def run(*args, **kwargs):
            return subprocess.CompletedProcess(args, 0, stdout="FAMILY-RESULT " + json.dumps(result) + "\n",
                                               stderr=_KILL_LOG)
        return run

    monkeypatch.setattr(fam.subprocess, "run", fake_run({"completed": False, "failed": "slab: KilledWorker"}))
    failed = fam.run_child({}, {}, 10.0)
    assert failed["cluster_log"] == fam.cluster_log(_KILL_LOG) and failed["failed"] == "slab: KilledWorker"
    monkeypatch.setattr(fam.subprocess, "run", fake_run({"completed": True, "wall_seconds": 1.0}))
    assert "cluster_log" not in fam.run_child({}, {}, 10.0)

    def timed_out(*args, **kwargs):  # as subprocess.run raises it: what the child wrote so far, in bytes
        raise subprocess.TimeoutExpired(args, 10.0, output=b"", stderr=_KILL_LOG.encode())

    monkeypatch.setattr(fam.subprocess, "run", timed_out)
    late = fam.run_child({}, {}, 10.0)
    assert late["failed"] == "timed out after 10 s" and late["cluster_log"] == fam.cluster_log(_KILL_LOG)


def test_sim_validation_names_each_failure_it_did_not_predict_with_the_death_its_cluster_logged():
    from benchmarks.family.__main__ import cluster_log
    from benchmarks.sim_validation import _missed_failure_lines

    def row(kind: str, completed: bool, failed_fraction: float, log: list[str] | None) -> dict:
        real: dict = {"completed": completed, "failed": "" if completed else "fam_linear: KilledWorker"}
        if log is not None:
            real["cluster_log"] = log
        return {"workload": "w3", "kind": kind, "real": real, "predicted": {"failed_fraction": failed_fraction},
                "outcome_predicted": (failed_fraction >= 0.9) != completed}

    rows = [row("static-32", False, 0.0, cluster_log(_KILL_LOG)),  # not predicted: named, with its death
            row("static-2", False, 1.0, cluster_log(_KILL_LOG)),  # predicted: not named
            row("static-8", True, 0.0, None),  # completed as predicted
            row("split", False, 0.5, None),  # not predicted, from a run that kept no log
            row("static-16", False, 0.0, [])]  # not predicted, its cluster quiet
    lines = _missed_failure_lines(rows)
    assert len(lines) == 3, lines
    assert "w3 static-32 failed (fam_linear: KilledWorker), 0% of its simulated runs did" in lines[0]
    assert lines[0].endswith("Worker tcp://127.0.0.1:34701 (pid=2780) exceeded 95% memory budget. Restarting...")
    assert "w3 split" in lines[1] and "50% of its simulated runs" in lines[1] and lines[1].endswith("its log was not kept")
    assert lines[2].endswith("its cluster logged no warning or error")


def _validation_doc(errors: dict[tuple[str, str], list[float]]) -> dict:
    """A validation run's JSON with a row per (workload, kind) and real run: real 10 s, predicted 10 x (1 + e)."""
    rows = []
    for (workload, kind), errs in errors.items():
        for e in errs:
            rows.append({"workload": workload, "kind": kind, "strategy": "memchunk" if kind.startswith("memchunk")
                         else kind, "error": e, "predicted": {"makespan_p50": 10.0 * (1 + e)},
                         "real": {"completed": True, "makespan_seconds": 10.0}})
    rows.append({"workload": "w9", "kind": "static-2", "strategy": "static-2", "error": None, "predicted": None,
                 "real": {"completed": False}})  # a failed run: no error to compare
    return {"benchmark": "sim_validation", "rows": rows}


def test_sim_noise_tells_an_error_that_repeats_in_two_validation_runs_from_one_that_changes():
    from benchmarks.sim_noise import noise

    biased = {("w0", "static-8"): [0.3, 0.3], ("w1", "memchunk warm"): [-0.2], ("w1", "split"): [0.0, 0.0]}
    same = noise([_validation_doc(biased), _validation_doc(biased)], draws=50)
    # The same errors in both runs: no noise, so a simulator without bias would be exact; the biases are listed.
    assert same["noise_sigma"] == 0.0 and same["floor"]["worst_abs_error"] == 0.0
    assert [(r["workload"], r["run"], round(r["error"], 6)) for r in same["repeated"]] == [
        ("w0", "static-8", 0.3), ("w1", "memchunk warm", -0.2)]
    assert (same["flows"], same["pairs"], same["rows"]) == (3, 4 + 1 + 4, 5)
    # Errors that flip between the runs are noise, not bias: nothing repeats, and the floor is far from 0.
    flipped = {k: [-e for e in v] for k, v in biased.items()}
    apart = noise([_validation_doc(biased), _validation_doc(flipped)], draws=200)
    assert apart["repeated"] == [] and apart["noise_sigma"] > 0.2
    assert 0.05 < apart["floor"]["median_abs_error"] < apart["floor"]["worst_abs_error"]
    with pytest.raises(ValueError, match="two validation runs"):
        noise([_validation_doc(biased)])


def test_sim_noise_command_writes_its_figures(tmp_path):
    a, b, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "noise.json"
    a.write_text(json.dumps(_validation_doc({("w0", "static-2"): [0.1, 0.2]})))
    b.write_text(json.dumps(_validation_doc({("w0", "static-2"): [0.0]})))
    proc = subprocess.run([sys.executable, "-m", "benchmarks.sim_noise", str(a), str(b), "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert "a simulator with no bias" in proc.stdout
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "sim_noise" and doc["pairs"] == 2 and len(doc["sources"]) == 2
    bad = subprocess.run([sys.executable, "-m", "benchmarks.sim_noise", str(a)], capture_output=True, text=True,
                         cwd=REPO)
    assert bad.returncode == 2 and "two validation runs" in bad.stderr
