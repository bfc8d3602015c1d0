"""What the runner asks of Prefect beyond the task-runner interface: the flow run, its logger, its state, the API.

- :func:`flow_run_id`, :func:`flow_logger`: the current flow run's id and logger (usable outside one);
- :func:`flow_run_state`, :func:`fail_flow_run`: read a flow run's state, mark it Failed;
- :func:`temporary_server_defaults`, :func:`one_api_for_workers`: Prefect's temporary server, given time to
  start and no telemetry to send, and shared with the Dask workers;
- :func:`keep_final_state`, :func:`started_cluster`: the two reaches into Prefect's and prefect-dask's own
  attributes, each with why.
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

#: What the runner sets for Prefect's temporary server, where the user chose nothing: (environment variable,
#: the setting's path in Prefect's settings, value). Analytics off: the server's telemetry service posts a
#: heartbeat to prefect.io every 10 minutes (every flow run on a machine without internet logs "Failed to send
#: telemetry"), and on a fresh Prefect home its first heartbeat reads then writes a session row in one SQLite
#: transaction while the server's other services are writing: SQLite refuses that upgrade at once ("database is
#: locked", a 130-line traceback in the flow's output; prefect/server/services/telemetry.py,
#: ``_fetch_or_set_telemetry_session``). A temporary server exists for one flow run; nothing is lost.
TEMPORARY_SERVER_DEFAULTS = (
    ("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", ("server", "ephemeral", "startup_timeout_seconds"),
     str(FIRST_START_TIMEOUT_SECONDS)),
    ("PREFECT_SERVER_ANALYTICS_ENABLED", ("server", "analytics_enabled"), "false"),
)


def temporary_server_defaults() -> list[str]:
    """Set :data:`TEMPORARY_SERVER_DEFAULTS` for Prefect's temporary server, unless the user chose a value.

    Called when a runner is made (at ``@flow(task_runner=MemoryAwareRunner())``, before the flow starts the
    server). Nothing where ``PREFECT_API_URL`` names a server (no temporary server starts). A value the user set
    in the environment or a Prefect profile is left alone. Sets the environment variables (the server's process
    and the workers started later inherit them) and refreshes Prefect's global settings, which were read when
    Prefect was imported. Returns the variables it set.
    """
    if get_current_settings().api.url:
        return []
    changed = []
    for env, path, value in TEMPORARY_SERVER_DEFAULTS:
        if env in os.environ or _chosen_in_profile(path):
            continue
        os.environ[env] = value
        changed.append(env)
    if changed:
        try:
            from prefect.context import refresh_global_settings_context

            refresh_global_settings_context()
        except Exception as exc:  # noqa: BLE001 - a Prefect without it: the environment still reaches the server
            logger.debug("could not refresh Prefect's settings: %r", exc)
    return changed


def _chosen_in_profile(path: tuple[str, ...]) -> bool:
    """Whether the setting at ``path`` differs from Prefect's own default (a profile or .env chose it)."""
    try:
        from prefect.settings import Settings

        default: Any = Settings.model_construct()
        current: Any = get_current_settings()
        for name in path:
            default, current = _field_default(default, name), getattr(current, name)
        return current != default
    except Exception:  # noqa: BLE001 - settings moved: take it as the user's
        return True


def _field_default(model: Any, name: str) -> Any:
    field = type(model).model_fields[name]
    return field.default_factory() if field.default_factory is not None else field.default


def startup_timeout_seconds() -> float:
    """The seconds a flow here would wait for Prefect's temporary server: the user's choice, else the runner's."""
    env, path, value = TEMPORARY_SERVER_DEFAULTS[0]
    if env in os.environ or _chosen_in_profile(path):
        return float(get_current_settings().server.ephemeral.startup_timeout_seconds)
    return float(value)


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
