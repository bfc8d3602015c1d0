"""What touching memory again costs after the machine has left it free for a while: seconds per GiB by idle gap.

    python -m benchmarks.studies.idle_memory [--mib 512] [--gaps 0 1 2 4 8] [--rounds 2] [--json PATH]

In a fresh worker-like process (:mod:`benchmarks.studies.children`), ``--mib`` of memory is touched and freed
(:func:`memchunk_prefect.run.doctor.touch_memory`);
then, for each gap in ``--gaps`` (seconds), the process sleeps that long and touches and frees the same amount
again, timing the touch: wall seconds and the kernel's CPU seconds (``getrusage``). ``--rounds`` runs the gaps
that many times in that process. The first touch of all is reported apart.

Why it matters: the time model charges the kernel's work of faulting memory in to a run that takes its worker
above the most it has held (``TimeModel.first_touch``), because on a machine that keeps the pages a process gave
back, memory touched again is cheap. A virtual machine that reports freed pages to its host (virtio-balloon's
free page reporting, Linux ``page_reporting``) gives them up a few seconds after they are freed, and the next
touch of that memory pays the host again. There, whether a run pays for its memory depends on how long ago any
process on the machine last freed that much, not on its worker's high-water mark: a run below the mark can pay
as much as a first touch, and the kernel seconds per byte the model learns from the runs that grew their worker
come out near zero once the other runs' kernel time is set against them. The simulator then predicts those runs
short. Compare the seconds per GiB at gap 0 (memory freed an instant ago) with the longest gap: a machine that
keeps freed memory shows the same cost at both.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from benchmarks.studies.children import run_child
from memchunk_prefect.run.doctor import touch_memory

GIB = 2**30


def child(mib: int, gaps: list[float], rounds: int) -> dict:
    nbytes = int(mib) * 2**20
    wall, kernel = touch_memory(nbytes)
    first = {"wall_seconds": round(wall, 4), "system_seconds": round(kernel, 4)}
    touches = []
    for r in range(rounds):
        for gap in gaps:
            time.sleep(gap)
            wall, kernel = touch_memory(nbytes)
            touches.append({"round": r, "gap_seconds": gap, "wall_seconds": round(wall, 4),
                            "system_seconds": round(kernel, 4)})
    return {"mib": int(mib), "first": first, "touches": touches}


def summarise(doc: dict) -> list[dict]:
    """Per gap: the median wall and kernel seconds per GiB over the rounds."""
    gib = doc["mib"] * 2**20 / GIB
    out = []
    for gap in sorted({t["gap_seconds"] for t in doc["touches"]}):
        at = [t for t in doc["touches"] if t["gap_seconds"] == gap]
        out.append({"gap_seconds": gap, "touches": len(at),
                    "wall_seconds_per_gib": statistics.median(t["wall_seconds"] for t in at) / gib,
                    "system_seconds_per_gib": statistics.median(t["system_seconds"] for t in at) / gib})
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.idle_memory",
                                description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=512, help="memory touched each time, MiB (default 512)")
    p.add_argument("--gaps", type=float, nargs="+", default=[0.0, 1.0, 2.0, 4.0, 8.0],
                   help="seconds the process sleeps before each touch (default 0 1 2 4 8)")
    p.add_argument("--rounds", type=int, default=2, help="times each gap is measured (default 2)")
    p.add_argument("--json", metavar="PATH")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.mib < 1 or args.rounds < 1 or any(g < 0 for g in args.gaps):
        p.error(f"--mib and --rounds must be at least 1 and every gap 0 or more, got --mib {args.mib}, "
                f"--rounds {args.rounds}, --gaps {' '.join(map(str, args.gaps))}")
    if args.child:
        print(json.dumps(child(args.mib, args.gaps, args.rounds)))
        return 0
    doc = run_child("benchmarks.studies.idle_memory", ["--child", "--mib", str(args.mib), "--rounds",
                                                       str(args.rounds), "--gaps", *map(str, args.gaps)])
    rows = summarise(doc)
    gib = args.mib / 1024
    print(f"{args.mib} MiB touched in a fresh process: the first time {doc['first']['wall_seconds'] / gib:.2f} s "
          f"per GiB ({doc['first']['system_seconds'] / gib:.2f} s of it the kernel's)")
    print(f"{'idle s':>6s} {'touches':>7s} {'wall s/GiB':>10s} {'kernel s/GiB':>12s}")
    for r in rows:
        print(f"{r['gap_seconds']:>6.1f} {r['touches']:>7d} {r['wall_seconds_per_gib']:>10.2f} "
              f"{r['system_seconds_per_gib']:>12.2f}")
    lo, hi = rows[0], rows[-1]
    ratio = hi["wall_seconds_per_gib"] / lo["wall_seconds_per_gib"]
    print(f"memory left free {hi['gap_seconds']:g} s costs {ratio:.1f}x what it costs {lo['gap_seconds']:g} s after "
          f"it was freed")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**doc, "summary": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
