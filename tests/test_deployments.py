"""prefect.yaml and deployments/: valid without a server, and deployable to a real one end to end."""

from __future__ import annotations

import json
import subprocess
import time
from datetime import datetime
from pathlib import Path

import pytest
import yaml

from deployments.local_server import PREFECT, local_server
from deployments.serve import build_deployments, load_flow

REPO = Path(__file__).resolve().parents[1]
CONFIG = yaml.safe_load((REPO / "prefect.yaml").read_text())


def test_prefect_yaml_is_valid_without_a_server():
    from prefect.cli.deploy._models import PrefectYamlModel
    from prefect.client.schemas.schedules import CronSchedule

    from flows.seismic import normalize_attributes

    model = PrefectYamlModel.model_validate(CONFIG)  # the schema `prefect deploy` reads the file with
    assert {d.name for d in model.deployments} >= {"nightly-reprocess", "on-demand"}
    for d in CONFIG["deployments"]:
        assert set(d) <= {"name", "description", "entrypoint", "tags", "parameters", "schedules", "work_pool",
                          "concurrency_limit", "version", "paused", "enforce_parameter_schema"}, d["name"]
        flow = load_flow(d["entrypoint"])  # the entrypoint imports and names a flow
        flow.validate_parameters(d.get("parameters") or {})  # types and required parameters, as Prefect checks them
        normalize_attributes(d["parameters"].get("attributes"))  # operators and their parameters exist
        assert d["work_pool"]["name"] == "memchunk-process"
        for s in d.get("schedules") or []:
            sched = CronSchedule(cron=s["cron"], timezone=s["timezone"])  # the cron parses, the zone is IANA
            assert sched.timezone == s["timezone"]
    nightly = next(d for d in CONFIG["deployments"] if d["name"] == "nightly-reprocess")
    assert nightly["entrypoint"] == "flows/seismic.py:reprocess_survey"
    (s,) = nightly["schedules"]
    from zoneinfo import ZoneInfo

    from cronsim import CronSim

    start = datetime(2026, 1, 1, 12, tzinfo=ZoneInfo(s["timezone"]))
    fire = next(CronSim(s["cron"], start))
    assert (fire.day, fire.hour, fire.minute) == (2, 2, 0), "nightly at 02:00 local time"


def test_bad_parameters_fail_validation():
    from prefect.exceptions import ParameterTypeError, SignatureMismatchError

    flow = load_flow("flows/seismic.py:reprocess_survey")
    with pytest.raises((ParameterTypeError, SignatureMismatchError)):
        flow.validate_parameters({"directory": "/x", "no_such_parameter": 1})
    with pytest.raises(ParameterTypeError):
        flow.validate_parameters({"directory": "/x", "export_segy": "sometimes"})


def test_serve_offers_the_same_deployments_as_prefect_yaml():
    served = {d.name: d for d in build_deployments()}
    assert set(served) == {d["name"] for d in CONFIG["deployments"]}
    for d in CONFIG["deployments"]:
        s = served[d["name"]]
        assert s.entrypoint.endswith(d["entrypoint"])
        assert s.parameters == d["parameters"]
        assert [(x.schedule.cron, x.schedule.timezone) for x in s.schedules or []] == \
            [(x["cron"], x["timezone"]) for x in d.get("schedules") or []]
        assert s.work_pool_name is None, "served deployments need no work pool"


@pytest.mark.slow
@pytest.mark.server
def test_deploy_to_a_process_pool_and_run_the_nightly_deployment_once(tmp_path):
    from memchunk_prefect import synthetic_survey

    surveys = tmp_path / "surveys"
    surveys.mkdir()
    synthetic_survey(surveys / "small.sgy", (6, 5, 60), seed=4)
    out = tmp_path / "attributes"
    with local_server(tmp_path / "home", services=False) as srv:  # a run triggered now needs no scheduler
        def prefect(*args: str, timeout: float = 120) -> str:
            r = subprocess.run([PREFECT, *args], env=srv.env, cwd=REPO, capture_output=True, text=True,
                               timeout=timeout)
            assert r.returncode == 0, f"prefect {' '.join(args)}:\n{r.stdout}\n{r.stderr}"
            return r.stdout

        prefect("work-pool", "create", "memchunk-process", "--type", "process")
        prefect("--no-prompt", "deploy", "--name", "nightly-reprocess")
        worker_log = open(tmp_path / "worker.log", "wb")
        worker = subprocess.Popen([PREFECT, "worker", "start", "--pool", "memchunk-process", "--type", "process"],
                                  env=srv.env, cwd=tmp_path, stdout=worker_log, stderr=subprocess.STDOUT,
                                  start_new_session=True)
        try:
            params = {"directory": str(surveys), "output": str(out), "attributes": ["envelope"]}
            text = prefect("deployment", "run", "reprocess-survey/nightly-reprocess", "--params", json.dumps(params))
            run_id = next(w for line in text.splitlines() if "UUID" in line for w in line.split()
                          if len(w) == 36 and w.count("-") == 4)
            state = wait_for_run(srv, run_id, timeout=150)
        finally:
            from deployments.local_server import stop

            stop(worker)
            worker_log.close()
        log = (tmp_path / "worker.log").read_text(errors="replace")
        assert state == "COMPLETED", f"flow run ended {state}\n--- worker log ---\n{log[-6000:]}"
        deployment = json.loads(prefect("deployment", "inspect", "reprocess-survey/nightly-reprocess",
                                        "--output", "json"))
    manifest = json.loads((out / "small" / "memchunk-manifest.json").read_text())
    assert manifest["attributes"][0]["name"] == "envelope"
    assert (out / "small" / "envelope.zarr").is_dir()
    sched = deployment["schedules"][0]["schedule"]
    assert (sched["cron"], sched["timezone"]) == ("0 2 * * *", "America/Sao_Paulo")
    assert deployment["work_pool_name"] == "memchunk-process"


def wait_for_run(srv, run_id: str, timeout: float) -> str:
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    deadline = time.monotonic() + timeout
    state = "UNKNOWN"
    with temporary_settings(updates={PREFECT_API_URL: srv.api_url}):
        with get_client(sync_client=True) as client:
            while time.monotonic() < deadline:
                run = client.read_flow_run(run_id)
                state = run.state.type.value if run.state else "UNKNOWN"
                if state in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                    return state
                time.sleep(1)
    return f"{state} after {timeout:.0f} s"


