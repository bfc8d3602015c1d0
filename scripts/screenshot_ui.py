"""Retake the README's screenshots of a real run's artifacts in the Prefect UI.

    .venv/bin/python scripts/screenshot_ui.py            # writes docs/img/ui-*.png

What it does: starts a local Prefect server (own PREFECT_HOME in a temporary
directory, analytics off), runs ``seismic_attributes`` (envelope and gst3d_dip)
on a synthetic survey with a LocalCluster of two single-thread workers whose
small memory limit makes the structure tensor rechunk, then opens the run's
pages in headless Chromium (Debian's ``chromium`` package:
``apt-get install chromium``) and saves:

- ``docs/img/ui-flow-run.png``: the flow run (timeline with chunk-named task runs and artifacts, logs);
- ``docs/img/ui-artifacts.png``: the Artifacts page (one entry per key, latest first);
- ``docs/img/ui-chunk-table.png``: the gst3d_dip chunk table;
- ``docs/img/ui-summary.png``: the run's markdown summary.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--hide-scrollbars", "--disable-dev-shm-usage"]


def chromium() -> str:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    raise SystemExit("no chromium found: apt-get update && apt-get install -y chromium")


def screenshot(url: str, out: Path, size: tuple[int, int], wait_ms: int, profile: str | os.PathLike) -> None:
    """Load ``url`` twice in the same profile and keep the second picture.

    The first load fills the browser cache with the UI's lazily loaded modules
    (the markdown renderer used for text cells among them); a cold load can
    draw a table's numbers before its text cells.
    """
    for _ in range(2):
        out.unlink(missing_ok=True)
        cmd = [chromium(), *CHROMIUM_FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
               f"--virtual-time-budget={wait_ms}", f"--screenshot={out}", url]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    if not out.exists():
        raise SystemExit(f"chromium wrote no screenshot for {url}:\n{r.stderr[-3000:]}")
    print(f"wrote {out.relative_to(REPO) if out.is_relative_to(REPO) else out}  ({url})")


def run_flow(work: Path, api_url: str) -> str:
    """Run seismic_attributes against the server at ``api_url``; return the flow run id."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from flows.seismic import seismic_attributes
    from memchunk_prefect import MemoryAwareRunner, synthetic_survey
    from memchunk_prefect.testing import start_local_cluster

    survey = work / "survey.sgy"
    synthetic_survey(survey, (96, 96, 300), seed=0)  # gst3d_dip in one piece: ~600 MiB
    cluster = start_local_cluster(n_workers=2, memory_limit="1GiB")
    ids: dict[str, str] = {}

    def remember(flow, flow_run, state):
        ids["id"] = str(flow_run.id)

    try:
        runner = MemoryAwareRunner(address=cluster.scheduler_address, store=str(work / "store.sqlite"))
        with temporary_settings(updates={PREFECT_API_URL: api_url}):
            flow = seismic_attributes.with_options(task_runner=runner, on_completion=[remember],
                                                   on_failure=[remember])
            flow(str(survey), ["envelope", "gst3d_dip"], str(work / "attributes"))
    finally:
        cluster.close()
    return ids["id"]


def artifact_ids(api_url: str, flow_run_id: str) -> dict[str, str]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings(updates={PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
        arts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: str(a.id) for a in arts if a.key}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=str(REPO / "docs" / "img"), help="where the PNGs go (default docs/img)")
    p.add_argument("--wait-ms", type=int, default=20000, help="virtual time the UI gets to load (default 20000)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory (server home, outputs)")
    args = p.parse_args(argv)

    from deployments.local_server import local_server

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="memchunk-screenshot-"))
    os.environ["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    try:
        with local_server(work / "prefect-home") as srv:
            run_id = run_flow(work, srv.api_url)
            keys = artifact_ids(srv.api_url, run_id)
            print(f"flow run {run_id}: artifacts {sorted(keys)}")
            profile = work / "chromium-profile"
            shots = [(f"{srv.ui_url}/runs/flow-run/{run_id}", "ui-flow-run.png", (1400, 1100)),
                     (f"{srv.ui_url}/artifacts", "ui-artifacts.png", (1400, 800))]
            if "memchunk-gst3d-dip-chunks" in keys:
                shots.append((f"{srv.ui_url}/artifacts/artifact/{keys['memchunk-gst3d-dip-chunks']}",
                              "ui-chunk-table.png", (1800, 800)))
            summary = next((v for k, v in keys.items() if k.startswith("memchunk-summary-")), None)
            if summary:
                shots.append((f"{srv.ui_url}/artifacts/artifact/{summary}", "ui-summary.png", (1500, 1300)))
            for url, name, size in shots:
                screenshot(url, out / name, size, args.wait_ms, profile)
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
