"""What the runner asks of Prefect beyond the task-runner interface: the flow run, its logger, its state, the API.

- :func:`flow_run_id`, :func:`flow_logger`: the current flow run's id and logger (usable outside one);
- :func:`flow_run_state`, :func:`fail_flow_run`: read a flow run's state, mark it Failed;
- :func:`allow_slow_first_start`, :func:`fail_fast_without_a_database`, :func:`one_api_for_workers`: Prefect's
  temporary server, given time to start, refused early where it cannot, and shared with the Dask workers.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from typing import Any

from prefect.logging import get_run_logger
from prefect.settings import PREFECT_API_URL, get_current_settings, temporary_settings

logger = logging.getLogger("memchunk_prefect.run.prefect_api")


def flow_run_state(flow_run_id: str) -> Any:
    """The flow run's state as the Prefect API has it (None when it cannot be read)."""
    if not flow_run_id:
        return None
    try:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return client.read_flow_run(uuid.UUID(flow_run_id)).state
    except Exception as exc:  # noqa: BLE001
        logger.debug("could not read flow run %s: %r", flow_run_id, exc)
        return None


def fail_flow_run(flow_run_id: str, error: BaseException) -> None:
    """Mark the flow run Failed with ``error`` (it was marked Completed when its function returned)."""
    if not flow_run_id:
        return
    try:
        from prefect.client.orchestration import get_client
        from prefect.states import Failed

        with get_client(sync_client=True) as client:
            client.set_flow_run_state(flow_run_id, Failed(message=f"a chunked map failed and nothing waited for it: "
                                                                 f"{type(error).__name__}: {error}"), force=True)
    except Exception as exc:  # noqa: BLE001 - the error is raised all the same
        logger.warning("could not mark flow run %s Failed: %r", flow_run_id, exc)


def flow_logger(fallback: logging.Logger | None = None) -> Any:
    """The current flow run's logger (its lines reach the Prefect UI); ``fallback`` (or this module's) outside one."""
    try:
        return get_run_logger()
    except Exception:  # noqa: BLE001 - outside a flow run
        return fallback or logger


def flow_run_id() -> str:
    """The current flow run's id, or "" outside one."""
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id or "")
    except Exception:  # noqa: BLE001 - outside a flow run
        return ""


#: Seconds a flow waits for Prefect's temporary server when none is configured. Its first start migrates a new
#: database: ~23 s on a busy 2-core machine, beyond Prefect's default 20 s
#: (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS``), and a flow that gives up leaves a half-started server
#: holding the database ("database is locked").
FIRST_START_TIMEOUT_SECONDS = 180


_STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"


def allow_slow_first_start() -> bool:
    """Give Prefect's temporary server :data:`FIRST_START_TIMEOUT_SECONDS` to start, unless the user chose a timeout.

    Called when a runner is made (at ``@flow(task_runner=MemoryAwareRunner())``,
    before the flow starts the server). A value the user set in the environment
    or a Prefect profile is left alone. Sets the environment variable (worker
    processes started later inherit it) and refreshes Prefect's global settings,
    which were read when Prefect was imported. Returns whether it changed anything.
    """
    if _STARTUP_TIMEOUT_ENV in os.environ or get_current_settings().api.url:
        return False  # the user's own timeout, or a configured server: no temporary server to wait for
    try:
        from prefect.context import refresh_global_settings_context
        from prefect.settings.models.server.ephemeral import ServerEphemeralSettings

        default = ServerEphemeralSettings.model_fields["startup_timeout_seconds"].default
        if get_current_settings().server.ephemeral.startup_timeout_seconds != default:
            return False  # chosen in a profile
        os.environ[_STARTUP_TIMEOUT_ENV] = str(FIRST_START_TIMEOUT_SECONDS)
        refresh_global_settings_context()
    except Exception as exc:  # noqa: BLE001 - a Prefect without these: its own default applies
        logger.debug("could not raise the temporary server's startup timeout: %r", exc)
        return False
    return True


@contextlib.contextmanager
def one_api_for_workers():
    """Give Dask workers the flow's Prefect API, instead of one temporary server per worker.

    With no ``PREFECT_API_URL`` the flow talks to a temporary local server; each
    worker process would otherwise start its own on the same SQLite file (seconds
    of start-up per worker, and "database is locked" errors). The settings context
    is pickled into every submission, so setting the URL here reaches the workers.
    """
    if get_current_settings().api.url:
        yield
        return
    try:
        from prefect.server.api.server import SubprocessASGIServer  # the server package is heavy: only when needed

        server = SubprocessASGIServer()
        server.start()
        url = server.api_url
    except Exception as exc:  # pragma: no cover - depends on the local install
        logger.warning("could not share the temporary Prefect server with workers: %r", exc)
        yield
        return
    with temporary_settings(updates={PREFECT_API_URL: url}):
        yield


def keep_final_state(future: Any, state: Any) -> None:
    """Make a Prefect future answer ``.state`` and ``.result()`` from ``state`` without its Dask future.

    A chunk's Dask future is released as soon as its result is read: a result kept on a worker is recomputed
    when that worker dies later (prefect #15442). Prefect's futures cache their final state in
    ``_final_state`` (``prefect.futures.PrefectWrappedFuture``) and offer no public way to set it: this is the
    one place the runner sets it.
    """
    future._final_state = state


def started_cluster(runner: Any) -> Any:
    """The cluster object a ``DaskTaskRunner`` started (None on a scheduler it was given by address).

    prefect-dask keeps it in ``_cluster`` with no public accessor; read here only, to count the workers it was
    asked for (:func:`memchunk_prefect.run.cluster.requested_workers`).
    """
    return getattr(runner, "_cluster", None)
