"""Per-run overhead of the monitor: milliseconds added to a task run by ``track()``.

    python -m benchmarks.studies.measure_overhead [--runs 2000] [--json PATH]

Times ``with monitor.track(): pass`` (a no-op body) against a bare no-op loop, for the
exact path (VmHWM, where /proc/self/clear_refs is writable) and the sampling path
(psutil on a thread, 5 ms interval), GPU and energy probing as configured by default
(NVML absent here means its cost is one cached lookup). Target: exact < 1 ms per run.

Also: what timing a run's memory rise (:mod:`memchunk_prefect.run.rise`, on by default) costs in CPU over a run
of ``--rise-seconds`` that sleeps, the process's CPU time with it less without it, as a share of one core.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from memchunk_prefect.run import monitor as mon
from memchunk_prefect.run.probes import clear_refs_writable


def per_run_ms(monitor: mon.Monitor, runs: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean milliseconds one ``track()`` of a no-op adds."""
    for _ in range(min(runs, 50)):  # warm up: first-use probe / NVML / RAPL decisions
        with monitor.track():
            pass
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(runs):
            with monitor.track():
                pass
        tracked = time.perf_counter() - t0
        t0 = time.perf_counter()
        for _ in range(runs):
            pass
        bare = time.perf_counter() - t0
        samples.append((tracked - bare) / runs * 1e3)
    return statistics.median(samples)


def rise_cpu_share(seconds: float) -> float:
    """The process CPU time, as a share of one core, that timing the memory rise adds over a run of ``seconds``."""
    spent = {}
    for rise in (False, True):
        monitor = mon.Monitor(gpu=False, energy=False, rise=rise)
        t0 = time.process_time()
        with monitor.track():
            time.sleep(seconds)
        spent[rise] = time.process_time() - t0
    return max(0.0, spent[True] - spent[False]) / seconds


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=2000, help="track() calls per timing (default 2000)")
    parser.add_argument("--rise-seconds", type=float, default=2.0,
                        help="length of the run the memory rise's CPU is timed over (default 2 s)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)

    figures: dict[str, float] = {}
    if clear_refs_writable():
        figures["vmhwm_ms"] = per_run_ms(mon.Monitor(method="vmhwm"), args.runs)
        figures["vmhwm_tracemalloc_ms"] = per_run_ms(mon.Monitor(method="vmhwm", tracemalloc=True), args.runs // 4)
    else:
        print("exact path unavailable: /proc/self/clear_refs is not writable in this process")
    # Each sampling run starts and joins a thread; fewer runs keep this quick.
    figures["psutil_ms"] = per_run_ms(mon.Monitor(method="psutil"), max(1, args.runs // 4))

    for name, ms in figures.items():
        print(f"{name.removesuffix('_ms'):>18s}: {ms:7.3f} ms per run")
    figures["rise_cpu_share"] = rise_cpu_share(args.rise_seconds)
    print(f"timing the memory rise: {figures['rise_cpu_share']:.1%} of one core over a {args.rise_seconds:g} s run")
    if "vmhwm_ms" in figures:
        verdict = "OK" if figures["vmhwm_ms"] < 1.0 else "OVER TARGET"
        print(f"exact path target < 1 ms per run: {verdict}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return figures


if __name__ == "__main__":
    main()
