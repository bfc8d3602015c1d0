"""The results page: BENCHMARKS.md, written from the JSON of benchmark runs, never by hand.

    python -m benchmarks report RUN.json... [--out BENCHMARKS.md]

Each JSON is one run of a suite benchmark, as its ``--json`` writes it: ``python -m benchmarks`` (side by side),
``python -m benchmarks.heterogeneous``, ``python -m benchmarks.family``, ``python -m benchmarks.sim_validation``,
``python -m benchmarks.sim_noise``, ``python -m benchmarks.studies.segy_scan`` or
``python -m benchmarks.studies.real_size``. The page opens with
every target of every run and its verdict; then one section per run: the command that reruns it, the machine,
the date and the commit it measured, and its
tables. How each figure is measured is in each benchmark's module docstring (linked), not repeated here.

A run JSON that is none of these is refused with what was expected. Figures are printed as the JSON holds
them; nothing is typed in.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

HEADER = """# Benchmarks

Where memchunk-prefect stands against hand-tuned static chunking, from the runs listed below. This page is
written from the runs' JSON (kept in `benchmarks/results/`) by

    python -m benchmarks report {files} --out BENCHMARKS.md

Rerun a benchmark with the command in its section, then regenerate the page. What changed between versions is in
[CHANGELOG.md](CHANGELOG.md).
"""


@dataclass(frozen=True)
class Section:
    """One run's part of the page: its title, the short name its targets go by, the command that reruns it,
    its targets (label -> ``{"met": bool | None, "figure": str}``) and its lines of markdown."""

    title: str
    short: str
    command: str
    targets: dict[str, dict[str, Any]]
    lines: list[str]


def _verdict(met: Any) -> str:
    return {True: "met", False: "**missed**", None: "not measured"}.get(met, str(met))


def _machine(doc: dict[str, Any]) -> str:
    m = doc.get("machine", {})
    mem = f", {m['memory_bytes'] / 2**30:.1f} GiB" if m.get("memory_bytes") else ""
    versions = ", ".join(f"{k} {v}" for k, v in (m.get("versions") or {}).items())
    load = ""
    if m.get("loadavg_start") and m.get("loadavg_end"):
        load = f"; load average {m['loadavg_start'][0]:.2f} at the start, {m['loadavg_end'][0]:.2f} at the end"
    return (f"{m.get('date', '?')}, commit `{m.get('commit') or 'unknown'}`; {m.get('cpus', '?')} CPUs{mem}, "
            f"{m.get('platform', '?')}, Python {m.get('python', '?')}" + (f"; {versions}" if versions else "")
            + load)


def _targets_rows(targets: dict[str, dict[str, Any]]) -> list[tuple[str, str, str]]:
    return [(label, str(v.get("figure", "")), _verdict(v.get("met"))) for label, v in targets.items()]


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows]
    return out


def _strategy_rows(strategies: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for s in strategies:
        peak = "-" if s.get("peak_memory_fraction") is None else f"{s['peak_memory_fraction']:.2f}"
        rows.append([s["name"], "yes" if s["completed"] else "no", f"{s['wall_seconds']:.1f}", str(s["oom_events"]),
                     str(s["tasks"]), f"{s['lost_worker_seconds']:.1f}", peak])
    return rows


STRATEGY_HEAD = ["strategy", "completed", "wall s", "out-of-memory", "tasks", "lost worker-s", "peak / limit"]


def side_by_side(doc: dict[str, Any]) -> Section:
    cfg = doc.get("config", {})
    shape = " x ".join(map(str, cfg.get("shape", [])))
    what = (f"envelope -> gaussian_smooth -> gst3d_dip over a {shape} float32 survey on {cfg.get('n_workers')} "
            f"workers x {cfg.get('memory_limit')} x 1 thread, every strategy on one cluster from one process; rows "
            f"are medians of {cfg.get('repeats', 1)} round(s). Measured as [benchmarks/strategies.py]"
            "(benchmarks/strategies.py) says.")
    lines = _table(STRATEGY_HEAD, _strategy_rows(doc["strategies"]))
    if doc.get("overhead"):
        o = doc["overhead"]
        lines += ["", f"Overhead (MemoryAwareRunner / DaskTaskRunner on {o['chunks']} identical chunks of envelope): "
                      f"{o['overhead_ratio']:.3f}, median of {len(o['ratios'])} pairs "
                      f"({', '.join(f'{r:.3f}' for r in o['ratios'])})."]
    if doc.get("scaling"):
        lines += ["", "Scaling (memchunk-warm): " + "; ".join(
            f"{s['factor']}x {s['wall_seconds']:.1f} s, {s['seconds_per_element'] * 1e6:.3f} µs per element"
            for s in doc["scaling"]) + "."]
    if doc.get("learning_quality"):
        lines += ["", *_table(["operator", "within the bound", "MAPE after 5 runs", "bound / peak at the chunks chosen",
                               "met"],
                              [[q["operator"], f"{q['coverage'] * 100:.0f}%", f"{q['mape'] * 100:.1f}%",
                               f"{q['bound_at_chosen']:.2f}x", _verdict(q["met"])]
                               for q in doc["learning_quality"]])]
    return Section("Side by side: Dask auto-chunking, static chunks, split-on-failure and the runner", "side by side",
                   "python -m benchmarks --json side_by_side.json", doc["targets"], [what, "", *lines])


def heterogeneous(doc: dict[str, Any]) -> Section:
    steps = " -> ".join(s.get("op", "?") for s in doc.get("steps", []))
    lines = [f"{steps} on {doc.get('n_workers')} workers x {doc.get('memory_limit')}, static sweep "
             f"{doc.get('static_counts')}, rows medians of {doc.get('repeats')} rounds; measured as "
             "[benchmarks/heterogeneous.py](benchmarks/heterogeneous.py) says."]
    for s in doc["surveys"]:
        lines += ["", f"Survey {' x '.join(map(str, s['shape']))}:", "", *_table(STRATEGY_HEAD,
                                                                                 _strategy_rows(s["strategies"]))]
    return Section("A pipeline no single static chunking suits", "heterogeneous",
                   "python -m benchmarks.heterogeneous --json hetero.json", doc["targets"], lines)


def family(doc: dict[str, Any]) -> Section:
    from benchmarks.family.__main__ import TARGETS as FAMILY_TARGETS
    from benchmarks.family.__main__ import resummarize
    from benchmarks.family.__main__ import table as family_table

    doc = resummarize(doc)  # the figures from the raw runs, by this code: a failed run counts as the worst
    s = doc["summary"]
    t = s["targets"]

    def verdict(key: str) -> bool | None:
        return {"met": True, "missed": False}.get(t[key])

    def f(x: Any, unit: str = "x", failed: str = "") -> str:
        return "failed" if failed and s.get(failed) else ("-" if x is None else f"{x:.2f}{unit}")

    targets = {
        f"memchunk warm: median <= {FAMILY_TARGETS['warm_median']}x the best static": {
            "met": verdict("warm_median"), "figure": f(s["warm_median"], failed="warm_median_failed")},
        f"memchunk warm: worst <= {FAMILY_TARGETS['warm_worst']}x the best static": {
            "met": verdict("warm_worst"), "figure": f(s["warm_worst"], failed="warm_worst_failed")},
        f"memchunk cold: median <= {FAMILY_TARGETS['cold_median']}x the best static": {
            "met": verdict("cold_median"), "figure": f"{f(s['cold_median'], failed='cold_median_failed')} "
                      f"(worst {f(s['cold_worst'], failed='cold_worst_failed')})"},
        "memchunk warm: 0 kills, 0 failed runs": {
            "met": verdict("warm_kills"),
            "figure": f"kills {s['warm_kills']} warm, {s['cold_kills']} cold; failed runs "
                      f"{s.get('warm_failed_runs', 0)} warm, {s.get('cold_failed_runs', 0)} cold"},
        "runner's flow call to first task <= 1.0 s beyond a plain flow's": {
            "met": verdict("first_task_extra"),
            "figure": f"{f(s['first_task_memchunk_median'], ' s')} against {f(s['first_task_static_median'], ' s')}"},
    }
    seed, n, scale = doc.get("seed", 0), s.get("workloads"), int(doc.get("scale") or 1)
    what = (f"{n} workloads drawn from seed {seed}: user-style operators none of which ships with the project, on "
            "odd SEG-Y geometries and zarr" + (f", every survey at {scale}x its traces" if scale != 1 else "")
            + ", 2 workers of 600 MiB to 2 GiB, each strategy in a fresh process on a fresh cluster; measured as "
            "[benchmarks/family](benchmarks/family/__main__.py) says. Ratios are memchunk's wall over the "
            "workload's best static chunking (the fastest of the sweep). A wall ends a whole number of seconds "
            "after its flow run's start, plus a constant: at its end Prefect joins the flow run's heartbeat thread, "
            "which sleeps in 1 s steps (each run's `exit_seconds`, from the flow body's return, holds that wait), so "
            "two runs less than a second apart read the same or a second apart.")
    cmd = ("python -m benchmarks.family --json family.json" + (f" --seed {seed}" if seed else "")
           + (f" --scale {scale}" if scale != 1 else ""))
    if doc.get("quick"):
        cmd = "python -m benchmarks.family --quick --json family.json"
    title, short = ("A family of workloads the runner never saw", "family") if scale == 1 else (
        f"A family of workloads the runner never saw, surveys at {scale}x", f"family, {scale}x")
    return Section(title, short, cmd, targets, [what, "", *family_table(doc["results"], s).splitlines()])


def sim_validation(doc: dict[str, Any]) -> Section:
    from benchmarks.sim_validation import table as validation_table

    s, t = doc["summary"], doc["summary"]["targets"]

    def verdict(key: str) -> bool | None:
        return {"met": True, "missed": False}.get(t[key])

    def pct(x: Any) -> str:
        return "-" if x is None else f"{100 * x:.0f}%"

    targets = {
        "simulated makespan: median absolute error <= 10%": {"met": verdict("median_abs_error"),
                                                             "figure": pct(s["median_abs_error"])},
        "simulated makespan: worst absolute error <= 25%": {"met": verdict("worst_abs_error"),
                                                            "figure": pct(s["worst_abs_error"])},
        "a run that failed predicted to fail (>= 90% of simulated runs)": {
            "met": verdict("failed_predicted_failed"),
            "figure": f"{s['failed_predicted_failed']} of {s['failed_in_reality']}"},
        "a run that completed predicted to complete (>= 90%)": {
            "met": verdict("completed_predicted_completed"),
            "figure": f"{s['completed_predicted_completed']} of {s['completed_in_reality']}"},
        "1,000-worker simulation of a recorded flow run < 30 s": {
            "met": verdict("thousand_workers"),
            "figure": f"{s['thousand_workers_seconds'] or 0:.1f} s in process, "
                      f"{s['thousand_workers_end_to_end_seconds'] or 0:.1f} s end to end"},
    }
    scale = _validation_scale(doc)
    what = (f"{len(doc['workloads'])} workload(s) of the family (seed {doc.get('seed', 0)})"
            + (f", every survey at {scale}x its traces" if scale != 1 else "")
            + ", each strategy run for real beside the simulator's prediction of the same flow run, cluster and "
            "store; measured as [benchmarks/sim_validation.py](benchmarks/sim_validation.py) says.")
    cmd = ("python -m benchmarks.sim_validation --quick --json sim-validation.json" if doc.get("quick")
           else "python -m benchmarks.sim_validation" + (f" --seed {doc['seed']}" if doc.get("seed") else "")
           + (f" --scale {scale}" if scale != 1 else "")
           + (f" --repeats {doc['repeats']}" if (doc.get("repeats") or 1) > 1 else "")
           + " --json sim-validation.json")
    lines = [what]
    replayed = doc.get("replayed_from")
    if replayed:
        lines += ["", f"The real runs are those of commit `{replayed.get('commit')}`; the predictions were made again "
                      f"at the commit named above from that run's stores (`{cmd} --work DIR`, then "
                      "`python -m benchmarks.sim_validation --replay sim-validation.json --work DIR`)."]
    title, short = ("The simulator against real runs", "simulator") if scale == 1 else (
        f"The simulator against real runs, surveys at {scale}x", f"simulator, {scale}x")
    seed = doc.get("seed", 0)
    if seed:  # another family of the same archetypes: one that no change to the simulator was judged on
        title, short = f"{title}, the seed-{seed} family", f"{short}, seed {seed}"
    return Section(title, short, cmd, targets, [*lines, "", *validation_table(doc["rows"], s).splitlines()])


def _validation_scale(doc: dict[str, Any]) -> int:
    """The ``--scale`` a validation ran with: its own record, else its workloads' smallest scale (the family
    draws 1x and 4x surveys, so the smallest is the factor)."""
    if doc.get("scale"):
        return int(doc["scale"])
    return min((int(w.get("scale", 1)) for w in doc.get("workloads", [])), default=1)


def segy_scan(doc: dict[str, Any]) -> Section:
    traces = doc["traces"]
    rows = [[r["mode"], f"{r['seconds']:.2f}", f"{r['seconds'] / traces * 1e6:.2f}"] for r in doc["rows"]]
    what = (f"{traces:,} traces ({doc['bytes'] / 2**20:,.0f} MiB), each read in a fresh process: `scan` reads every "
            "trace header, `first` also keeps the geometry, `kept` reads what was kept; measured as "
            "[benchmarks/studies/segy_scan.py](benchmarks/studies/segy_scan.py) says.")
    return Section("Reading a SEG-Y file's geometry", "SEG-Y scan",
                   "python -m benchmarks.studies.segy_scan --json scan.json", {},
                   [what, "", *_table(["read", "seconds", "seconds per million traces"], rows)])


def _run_of(doc: dict[str, Any], shape: list[int], mode: str) -> dict[str, Any] | None:
    return next((r for r in doc.get("runs", []) if r["shape"] == shape and r["mode"] == mode), None)


def _read_of(doc: dict[str, Any], start: str) -> dict[str, Any] | None:
    return next((r for r in doc.get("reads", []) if r["read"].startswith(start)), None)


def real_size_targets(doc: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The issue's targets for a survey of real size, from the study's JSON (None where not measured)."""
    shape, ref = doc["shape"], doc["reference"]
    warm, ref_warm = _run_of(doc, shape, "warm"), _run_of(doc, ref, "warm")
    targets: dict[str, dict[str, Any]] = {}
    if warm is not None:
        ok = "error" not in warm
        targets["completes warm with 0 kills"] = {"met": ok and warm["kills"] == 0,
                                                  "figure": f"{warm['kills']} kills" if ok else "failed"}
    if warm is not None and ref_warm is not None and "error" not in warm and "error" not in ref_warm:
        # Judged on the chunks' span (first chunk's start to last chunk's end): the wall adds fixed costs (the
        # cluster's start, the flow's set-up) that a small survey pays per element many times over.
        ratio = warm["ns_per_element_chunks"] / ref_warm["ns_per_element_chunks"]
        wall = warm["ns_per_element"] / ref_warm["ns_per_element"]
        targets[f"time per element <= 1.2x the {' x '.join(map(str, ref))} run's (warm, chunks' span)"] = {
            "met": ratio <= 1.2, "figure": f"{ratio:.2f}x ({warm['ns_per_element_chunks']:.0f} vs "
                                          f"{ref_warm['ns_per_element_chunks']:.0f} ns; wall {wall:.2f}x)"}
    peaks = [r["flow_memory"]["peak_rss"] for r in doc.get("runs", []) if "flow_memory" in r]
    if peaks:
        targets["flow process memory < 1 GiB throughout"] = {"met": max(peaks) < 2**30,
                                                              "figure": f"peak {max(peaks) / 2**20:.0f} MiB"}
    scan = next((r for r in doc.get("scan", []) if r["mode"] == "scan"), None)
    if scan is not None:
        per_m = scan["seconds"] / scan["traces"] * 1e6
        targets["geometry scan < 10 s per million traces"] = {"met": per_m < 10, "figure": f"{per_m:.2f} s"}
    segyio = _read_of(doc, "segyio inlines")
    for start, what in (("SEG-Y, whole-trace blocks 128", "tiles of 128 x 128 traces"),
                        ("SEG-Y, whole-trace blocks of", "slabs of whole inlines")):
        ours = _read_of(doc, start)
        if ours is not None and segyio is not None:
            share = ours["mib_per_s"] / segyio["mib_per_s"]
            targets[f"whole-trace block reads ({what}) >= 50% of segyio's inline reads"] = {
                "met": share >= 0.5, "figure": f"{100 * share:.0f}% ({ours['mib_per_s']:.0f} vs "
                                               f"{segyio['mib_per_s']:.0f} MiB/s)"}
    return targets


def _real_size_run_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for r in doc.get("runs", []):
        shape = " x ".join(map(str, r["shape"]))
        if "error" in r:
            rows.append([shape, r["mode"], "failed", "", "", "", "", "", ""])
            continue
        fm, sv = r["flow_memory"], r["server"]
        chunks = ", ".join(f"{m['operator']} {m['chunks']}" for m in r["maps"])
        rows.append([shape, r["mode"], f"{r['wall']:.1f}", f"{r['ns_per_element']:.0f}",
                     f"{r['chunk_span']:.1f}" if r.get("chunk_span") is not None else "n/a", chunks,
                     str(r["kills"]), f"{fm['first_rss'] / 2**20:.0f} / {fm['peak_rss'] / 2**20:.0f}",
                     "not measured" if sv is None else f"{sv['cpu_seconds']:.1f} / {sv['peak_rss'] / 2**20:.0f}"])
    return rows


def real_size(doc: dict[str, Any]) -> Section:
    shape, sv = doc["shape"], doc["survey"]
    what = (f"A {' x '.join(map(str, shape))} survey ({sv['traces']:,} traces, {sv['bytes'] / 2**30:.2f} GiB of "
            f"SEG-Y) through envelope -> gaussian_smooth -> gst3d_dip on {doc['workers']} workers x "
            f"{doc['memory_limit']}, each run a fresh process and a fresh cluster, cold (an empty store) then warm; "
            "the reference survey the same way. Reads and the scan each in a fresh process, the page cache dropped "
            "before each read; measured as [benchmarks/studies/real_size.py](benchmarks/studies/real_size.py) "
            "says.")
    lines = [what]
    by = doc.get("measured_by") or {}
    if len(set(by.values())) > 1:
        lines += ["", "Its parts were measured at different commits: "
                  + ", ".join(f"{part} at `{commit}`" for part, commit in by.items()) + "."]
    if doc.get("runs"):
        lines += ["", *_table(["survey", "run", "wall s", "ns per element", "chunks' span s", "chunks", "kills",
                               "flow process MiB (start / peak)", "Prefect server (CPU s / peak MiB)"],
                              _real_size_run_rows(doc))]
    if doc.get("reads"):
        lines += ["", *_table(["read of the whole survey", "MiB/s", "seconds"],
                              [[r["read"], "n/a" if r["read"].startswith("segyio open") else f"{r['mib_per_s']:.0f}",
                                f"{r['seconds']:.1f}"] for r in doc["reads"]])]
    if doc.get("scan"):
        lines += ["", *_table(["geometry", "seconds", "seconds per million traces"],
                              [[r["mode"], f"{r['seconds']:.2f}", f"{r['seconds'] / r['traces'] * 1e6:.2f}"]
                               for r in doc["scan"]])]
    cmd = "python -m benchmarks.studies.real_size --json real-size.json"
    if shape != [1024, 1024, 500]:
        cmd = f"python -m benchmarks.studies.real_size --shape {' '.join(map(str, shape))} --json real-size.json"
    return Section("A survey of real size, end to end", "real size", cmd, real_size_targets(doc), lines)


def sim_noise(doc: dict[str, Any]) -> Section:
    from benchmarks.sim_noise import lines as noise_lines

    runs = ", ".join(f"`{Path(s['path']).name}` (real runs at `{s.get('real_runs_commit')}`, predicted at "
                     f"`{s.get('commit')}`)" for s in doc["sources"])
    what = ("Validation runs of one family, each with its own cold runs, stores and real runs, tell an error "
            "the simulator makes on a flow every time (a bias) from one that changes from run to run (the models "
            "learned from a few noisy runs, and the real run's own spread); measured as "
            "[benchmarks/sim_noise.py](benchmarks/sim_noise.py) says. The runs: " + runs + ".")
    files = " ".join(s["path"] for s in doc["sources"])
    return Section("How much of the simulator's error repeats", "simulator noise",
                   f"python -m benchmarks.sim_noise {files} --json sim-noise.json", {},
                   [what, "", *(f"- {line}" for line in noise_lines(doc))])


def kind_of(doc: dict[str, Any]) -> Callable[[dict[str, Any]], Section]:
    """The section writer for one run JSON; ValueError naming what was expected when it is none of them."""
    if doc.get("benchmark") == "family":
        return family
    if doc.get("benchmark") == "sim_validation":
        return sim_validation
    if doc.get("benchmark") == "real_size":
        return real_size
    if doc.get("benchmark") == "sim_noise":
        return sim_noise
    if "surveys" in doc and "targets" in doc:
        return heterogeneous
    if "strategies" in doc and "targets" in doc:
        return side_by_side
    if "traces" in doc and "rows" in doc:
        return segy_scan
    raise ValueError("not the JSON of a suite benchmark: expected the --json of python -m benchmarks, "
                     "benchmarks.heterogeneous, benchmarks.family, benchmarks.sim_validation, benchmarks.sim_noise, "
                     "benchmarks.studies.segy_scan or benchmarks.studies.real_size; "
                     f"its top-level keys are {sorted(doc)[:12]}")


def render(docs: list[tuple[str, dict[str, Any]]]) -> str:
    """The page for these ``(file name, run JSON)`` pairs."""
    sections = [(name, kind_of(doc)(doc), doc) for name, doc in docs]
    out = [HEADER.format(files=" ".join(name for name, _ in docs)), "## Every target", ""]
    rows = [[sec.short, label, figure, verdict] for _, sec, _ in sections
            for label, figure, verdict in _targets_rows(sec.targets)]
    out += _table(["benchmark", "target", "figure", "verdict"], rows) if rows else ["No run here sets a target."]
    for name, sec, doc in sections:
        out += ["", f"## {sec.title}", "", f"Rerun: `{sec.command}`. This run: {_machine(doc)}. From `{name}`.", "",
                *sec.lines]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks report", description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="+", metavar="RUN.json", help="the --json of benchmark runs")
    p.add_argument("--out", metavar="PATH", help="write the page here (default: standard output)")
    args = p.parse_args(argv)
    docs = []
    for path in args.runs:
        try:
            docs.append((path, json.loads(Path(path).read_text())))
        except (OSError, json.JSONDecodeError) as exc:
            p.error(f"cannot read the run {path}: {exc}")
    try:
        page = render(docs)
    except ValueError as exc:
        p.error(str(exc))
    if args.out:
        Path(args.out).write_text(page)
        print(f"wrote {args.out} from {len(docs)} run(s)")
    else:
        print(page, end="")
    return 0
