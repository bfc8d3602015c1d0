"""What a long history costs a flow run's start: a model rebuilt by replaying its key's stored rows.

    python -m benchmarks.studies.replay [--rows 1000 5000 20000 50000] [--json PATH]

A model (``ModelBank``) is rebuilt at a flow run's first map of each operator
by replaying every row the store holds for its key; every nightly map adds as
many rows as it had chunks. For each ``--rows`` count this writes that many
observations of one key (sizes drawn from 10^5 to 10^7 elements, a linear
memory law with +-10% noise, seeded) into a fresh store and times the replay
(seconds, milliseconds per row; median of ``--repeat``), then says what the
runner's cap (``RunnerSettings.store_keep_per_key``: each map's end trims its key
to that many rows) bounds the replay to.

The same script runs against any commit with this public API (``Store``,
``ModelBank``), which is how a before/after is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

KEY = "envelope|float32|cpu"
BYTES_PER_ELEMENT = 100.0


def make_store(path: Path, rows: int, seed: int = 0) -> None:
    """``rows`` observations of KEY: a linear law with +-10% noise over sizes 10^5..10^7 elements."""
    from memchunk_prefect.core.records import Observation
    from memchunk_prefect.learn.store import Store

    rng = np.random.default_rng(seed)
    sizes = rng.integers(1000, 100_000, rows) * 100  # whole 100-sample traces
    noise = rng.uniform(0.9, 1.1, rows)
    with Store(path) as s:
        s.add_many([Observation(KEY, int(n), (1, int(n) // 100, 100), int(n) * 4, int(BYTES_PER_ELEMENT * n * f),
                                seconds=1e-7 * float(n), outcome="ok", method="vmhwm", chunk=f"c{i}")
                    for i, (n, f) in enumerate(zip(sizes, noise))])


def time_replay(path: Path) -> tuple[float, int]:
    """Seconds to rebuild KEY's model from the store at ``path`` (what a flow run's first map does)."""
    from memchunk_prefect.learn.bank import ModelBank
    from memchunk_prefect.learn.store import Store

    with Store(path) as s:
        t = time.perf_counter()
        model = ModelBank(s).model(KEY)
        seconds = time.perf_counter() - t
        return seconds, model.n_observations


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.studies.replay", description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, nargs="+", default=[1000, 5000, 20000, 50000],
                   help="history lengths to time (default 1000 5000 20000 50000)")
    p.add_argument("--repeat", type=int, default=3, help="replays per length; the median is reported (default 3)")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from memchunk_prefect.core.settings import RUNNER_SETTINGS

    keep = getattr(RUNNER_SETTINGS, "store_keep_per_key", None)  # None on commits before the cap
    results = []
    with tempfile.TemporaryDirectory(prefix="memchunk-replay-") as d:
        for n in args.rows:
            path = Path(d) / f"s{n}.sqlite"
            make_store(path, n)
            times = []
            for _ in range(args.repeat):
                seconds, learned = time_replay(path)
                times.append(seconds)
            med = statistics.median(times)
            results.append({"rows": n, "seconds": med, "ms_per_row": 1000 * med / n, "learned": learned})
            print(f"{n:>7} rows: replay {med:7.2f} s, {1000 * med / n:.3f} ms per row ({learned} learned)",
                  flush=True)
    if len(results) >= 2:
        x, y = np.log([r["rows"] for r in results]), np.log([r["seconds"] for r in results])
        slope = float(np.polyfit(x, y, 1)[0])
        print(f"growth: seconds ~ rows^{slope:.2f} (1.0 is linear)")
    else:
        slope = None
    if keep is None:
        print("this commit keeps every row: a replay grows with the history")
    else:
        near = min(results, key=lambda r: abs(r["rows"] - keep))
        print(f"the runner keeps {keep} rows per key: at {near['ms_per_row']:.3f} ms per row (measured at "
              f"{near['rows']} rows) a replay is bounded by ~{keep * near['ms_per_row'] / 1000:.1f} s per operator")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": results, "growth_exponent": slope, "keep_per_key": keep}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
