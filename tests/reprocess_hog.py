"""reprocess_survey with slow chunks, in its own process: for the interruption tests (tests/test_interruptions.py).

``python tests/reprocess_hog.py run DIRECTORY OUTPUT STORE [SECONDS]``: run ``reprocess_survey``
once (envelope, then the ``memory_hog`` test operator holding each chunk for
SECONDS, default 0.5 s, so a test can interrupt it mid-map) on a local cluster of two 1 GiB
single-thread workers, with a 48 MiB budget per task; prints the rows as JSON.
The served flow takes the hold time and the budget as parameters.

``python tests/reprocess_hog.py serve``: serve the ``reprocess-hog`` flow (the
same run, as a deployment) so a test can cancel it from Prefect.

Not a test module (pytest collects ``test_*.py`` only). ``memory_hog`` is a test
helper, so it is added to the operator registry here, in this process only.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from prefect import flow

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

CLUSTER = {"n_workers": 2, "threads_per_worker": 1, "processes": True, "memory_limit": "1GiB",
           "dashboard_address": "127.0.0.1:0"}


def attributes(seconds: float) -> list:
    return ["envelope", {"name": "memory_hog", "multiple": 40, "seconds": seconds}]


def reprocess(directory: str, output: str, store: str, seconds: float = 0.5, budget: str = "48MiB") -> list[dict]:
    from flows.seismic import reprocess_survey
    from memchunk_prefect import MemoryAwareRunner, operators
    from memchunk_prefect.testing import memory_hog

    operators.OPERATORS.setdefault("memory_hog", memory_hog)
    runner = MemoryAwareRunner(cluster_kwargs=dict(CLUSTER), memory_budget=budget, store=store)
    return reprocess_survey.with_options(task_runner=runner)(directory, attributes(seconds), output)


@flow(name="reprocess-hog")
def reprocess_hog(directory: str, output: str, store: str, seconds: float = 0.5, budget: str = "48MiB") -> list[dict]:
    """The same run as a flow of its own, so it can be served and cancelled from Prefect."""
    return reprocess(directory, output, store, seconds, budget)


if __name__ == "__main__":
    import signal

    # Ctrl-C raises KeyboardInterrupt even when this process was started from a background job (which
    # inherits SIGINT ignored), as it does for a user at a terminal.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if sys.argv[1] == "run":
        print(json.dumps(reprocess(*sys.argv[2:5], *map(float, sys.argv[5:6]))))
    elif sys.argv[1] == "serve":
        reprocess_hog.serve(name="hog")
    else:
        raise SystemExit(f"usage: {sys.argv[0]} run DIRECTORY OUTPUT STORE [SECONDS] | serve")
