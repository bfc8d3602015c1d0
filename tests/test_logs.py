"""Quiet mode for the `memchunk` command: Dask's and Prefect's own logging configuration, in a fresh process."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest

CHILD = r"""
import ast, json, logging, os
from memchunk_prefect.run.logs import quiet
quiet()
import yaml
config = yaml.safe_load(open(os.environ["PREFECT_LOGGING_SETTINGS_PATH"]))
task_runs = logging.getLogger("prefect.task_runs")
print(json.dumps({
    "dask_env": ast.literal_eval(os.environ["DASK_LOGGING"]),
    "distributed_level": logging.getLogger("distributed").getEffectiveLevel(),
    "memory_level": logging.getLogger("distributed.worker.memory").getEffectiveLevel(),
    "task_runs_config": config["loggers"]["prefect.task_runs"],
    "task_runs_propagate": task_runs.propagate,
    "task_runs_handlers": sorted(type(h).__name__ + ":" + logging.getLevelName(h.level) for h in task_runs.handlers),
    "flow_runs_propagate": logging.getLogger("prefect.flow_runs").propagate,
}))
"""


def test_quiet_turns_dask_info_and_task_run_lines_off_the_terminal_and_keeps_them_for_the_ui():
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DASK_LOGGING", "PREFECT_LOGGING"))}
    proc = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    # Worker processes inherit DASK_LOGGING (distributed lays it over its own defaults when it is imported).
    assert got["dask_env"] == {"distributed": "warning", "distributed.worker.memory": "error"}
    assert (got["distributed_level"], got["memory_level"]) == (30, 40)
    # Task-run lines: still to the API (the UI), to the console only from WARNING; flow-level lines unchanged.
    assert got["task_runs_config"]["propagate"] is False
    assert got["task_runs_propagate"] is False
    assert got["task_runs_handlers"] == ["APILogHandler:NOTSET", "PrefectConsoleHandler:WARNING"]
    assert got["flow_runs_propagate"] is True


def test_a_typed_error_is_logged_in_one_line_and_other_errors_keep_their_traceback():
    import logging
    import sys

    from memchunk_prefect.core.errors import SegyFileNotFoundError
    from memchunk_prefect.run.logs import TypedErrorsInOneLine

    f = TypedErrorsInOneLine()

    def record(exc: BaseException) -> logging.LogRecord:
        try:
            raise exc
        except BaseException:
            return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "failed: %r", (exc,),
                                     sys.exc_info())

    typed = record(SegyFileNotFoundError("/x.sgy", "no such file"))
    assert f.filter(typed) and typed.exc_info is None and "no such file" in typed.getMessage()
    other = record(ValueError("a bug"))
    assert f.filter(other) and other.exc_info is not None


TEMPORARY_SERVER = r"""
import json, os
from memchunk_prefect.run import prefect_api
changed = prefect_api.temporary_server_defaults()
print(json.dumps({"changed": changed, "analytics": os.environ.get("PREFECT_SERVER_ANALYTICS_ENABLED"),
                  "timeout": prefect_api.startup_timeout_seconds(),
                  "runners_timeout": prefect_api.FIRST_START_TIMEOUT_SECONDS}))
"""


@pytest.mark.parametrize("chose_analytics", [True, False])
def test_the_temporary_server_gets_the_runners_defaults_unless_the_user_chose(tmp_path, chose_analytics):
    """A user's first flow, with no Prefect API configured (a fresh process, no ``PREFECT_*`` variables but the
    user's own, a new ``PREFECT_HOME``): the runner sets the temporary server's defaults the user left alone, the
    startup timeout and, unless the user chose it, analytics off. In a subprocess: this process's Prefect
    settings name the suite's own server."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    if chose_analytics:
        env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "true"  # the user's own choice
    out = subprocess.run([sys.executable, "-c", TEMPORARY_SERVER], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    timeout = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
    assert got["changed"] == ([timeout] if chose_analytics else [timeout, "PREFECT_SERVER_ANALYTICS_ENABLED"])
    assert got["analytics"] == ("true" if chose_analytics else "false")
    assert got["timeout"] == got["runners_timeout"]


def test_a_workers_close_cutting_its_own_heartbeat_short_is_not_logged_as_an_error():
    """The race at the end of every flow run, made certain: a real scheduler holds a real worker's heartbeat
    unanswered while the worker closes. Its close aborts the heartbeat's connection and Dask logs the failure at
    ERROR; the filter keeps that one record off, and the same failure from a running worker on."""
    import asyncio

    from distributed import Scheduler, Worker

    from memchunk_prefect.run.logs import HEARTBEAT_FAILED, HeartbeatAtClose

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.messages.append(record.getMessage())

    async def close_while_the_heartbeat_waits() -> None:
        async with Scheduler(dashboard_address=":0", port=0) as scheduler:
            answer = asyncio.Event()

            async def held(**kwargs):  # the scheduler answers only when told to
                await answer.wait()
                return {"status": "OK", "time": 0.0, "heartbeat-interval": 0.5}

            scheduler.handlers["heartbeat_worker"] = held
            worker = await Worker(scheduler.address, nthreads=1, dashboard_address=":0")
            beat = asyncio.create_task(worker.heartbeat())
            await asyncio.sleep(0.3)  # the heartbeat is on the wire, waiting
            await worker.close()
            await beat
            answer.set()

    target = logging.getLogger("distributed.worker")
    kept = Kept()
    saved = list(target.filters)
    target.addHandler(kept)
    try:
        for f in saved:
            target.removeFilter(f)
        asyncio.run(close_while_the_heartbeat_waits())
        unfiltered = [m for m in kept.messages if m.startswith(HEARTBEAT_FAILED)]
        kept.messages.clear()
        target.addFilter(HeartbeatAtClose())
        asyncio.run(close_while_the_heartbeat_waits())
        filtered = [m for m in kept.messages if m.startswith(HEARTBEAT_FAILED)]
        # A running worker's failed heartbeat (no worker of this process is closing) is still an error.
        from distributed.comm.core import CommClosedError

        try:
            raise CommClosedError("in <TCP (closed) ConnectionPool.heartbeat_worker>: Stream is closed")
        except CommClosedError:
            running = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 0, HEARTBEAT_FAILED + ".",
                                        None, sys.exc_info())
        assert HeartbeatAtClose().filter(running)
    finally:
        target.removeHandler(kept)
        target.filters[:] = saved
    assert unfiltered, "without the filter the race logs its error (else this test shows nothing)"
    assert filtered == []
