"""Quiet terminal output for the ``memchunk`` command: flow-level lines and the runner's decisions, no chatter.

A flow run on a local Dask cluster prints, by default, Dask's INFO log (scheduler
start, nanny and worker registration, connections closing: ~35 lines) and one
Prefect line per task run. :func:`quiet` turns both off *in the terminal* with
Dask's and Prefect's own logging configuration, no filtering of text:

- Dask: the ``distributed`` loggers at WARNING (the worker memory manager's at
  ERROR: its pause and unmanaged-memory warnings), in this process and in the
  worker processes it starts (``DASK_LOGGING``, Dask's ``logging`` setting,
  which a worker reads when it imports ``distributed``);
- Prefect: task-run lines keep going to the Prefect API (the UI shows them as
  before) and reach the terminal only at WARNING and above: a logging
  configuration derived from Prefect's own (``PREFECT_LOGGING_SETTINGS_PATH``),
  read by this process and by every worker process it starts.

The ``memchunk`` command calls it unless ``--verbose``; a library user's flow
keeps Dask's and Prefect's defaults unless it calls :func:`quiet` itself (before
the flow starts its cluster).
"""

from __future__ import annotations

import atexit
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

logger = logging.getLogger("memchunk_prefect.run.logs")

DASK_ENV = "DASK_LOGGING"
#: Dask loggers quiet mode raises. ``distributed.worker.memory`` warns on every pause and of "unmanaged memory"
#: when a worker holds no Dask data to spill — the normal state of a worker running one chunk at a time here.
QUIET_DASK_LEVELS = {"distributed": "warning", "distributed.worker.memory": "error"}
PREFECT_ENV = "PREFECT_LOGGING_SETTINGS_PATH"
#: The handler quiet mode gives Prefect's task-run logger: its console handler's settings, WARNING and above.
TASK_RUN_CONSOLE = "memchunk_task_run_console"


def quiet_logging_config(prefect_config: dict[str, Any]) -> dict[str, Any]:
    """Prefect's logging configuration with task-run lines kept off the console below WARNING.

    ``prefect.task_runs`` stops propagating to the root logger's console handler
    and gets its own copy of that handler at WARNING; its API handler (the UI's
    logs) is kept.

    >>> cfg = {"handlers": {"console": {"level": 0, "class": "X"}, "api": {}},
    ...        "loggers": {"prefect.task_runs": {"level": "NOTSET", "handlers": ["api"]}}}
    >>> q = quiet_logging_config(cfg)
    >>> q["loggers"]["prefect.task_runs"]
    {'level': 'NOTSET', 'handlers': ['api', 'memchunk_task_run_console'], 'propagate': False}
    >>> q["handlers"][TASK_RUN_CONSOLE]
    {'level': 'WARNING', 'class': 'X'}
    """
    config = {**prefect_config, "handlers": dict(prefect_config.get("handlers", {})),
              "loggers": dict(prefect_config.get("loggers", {}))}
    console = config["handlers"].get("console")
    task_runs = dict(config["loggers"].get("prefect.task_runs", {"level": "NOTSET", "handlers": []}))
    handlers = list(task_runs.get("handlers", []))
    if console is not None:
        config["handlers"][TASK_RUN_CONSOLE] = {**console, "level": "WARNING"}
        handlers.append(TASK_RUN_CONSOLE)
    task_runs.update(handlers=handlers, propagate=False)
    config["loggers"]["prefect.task_runs"] = task_runs
    return config


def _write_quiet_prefect_config() -> Path | None:
    """Write :func:`quiet_logging_config` of Prefect's default logging file to a temporary file (removed at exit)."""
    import yaml
    from prefect.logging.configuration import DEFAULT_LOGGING_SETTINGS_PATH

    # Loaded as YAML with Prefect's ${SETTING} placeholders left as text: Prefect fills them in when it reads
    # the file we write, as it does its own.
    config = yaml.safe_load(DEFAULT_LOGGING_SETTINGS_PATH.read_text())
    fd, name = tempfile.mkstemp(prefix="memchunk-logging-", suffix=".yml")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(quiet_logging_config(config), fh, sort_keys=False)
    atexit.register(lambda: Path(name).unlink(missing_ok=True))
    return Path(name)


def quiet() -> None:
    """Dask's INFO chatter and Prefect's per-task-run lines off in the terminal (see the module docstring).

    A setting the user made (``DASK_LOGGING__DISTRIBUTED``,
    ``PREFECT_LOGGING_SETTINGS_PATH``) is kept. Call it before the flow starts its
    cluster, so that the worker processes inherit it.
    """
    _quiet_dask()
    try:
        if PREFECT_ENV in os.environ:
            return
        path = _write_quiet_prefect_config()
        os.environ[PREFECT_ENV] = str(path)
        from prefect.context import refresh_global_settings_context
        from prefect.logging.configuration import setup_logging

        refresh_global_settings_context()
        setup_logging(incremental=False)
    except Exception as exc:  # noqa: BLE001 - louder output, never a failed run
        logger.debug("could not quiet Prefect's task-run lines: %r", exc)
    finally:
        # After Prefect's (re)configuration: this process's scheduler and nannies log through "distributed".
        for name, level in QUIET_DASK_LEVELS.items():
            logging.getLogger(name).setLevel(level.upper())


def _quiet_dask() -> None:
    """Dask's ``logging`` setting with :data:`QUIET_DASK_LEVELS`, in this process's environment
    (``DASK_LOGGING``), so worker processes started later read it when they import ``distributed``
    (distributed lays these levels over its own defaults: tornado, bokeh and the rest stay as they were).

    Left alone when the user set Dask's logging in the environment.
    """
    if any(k == DASK_ENV or k.startswith(DASK_ENV + "__") for k in os.environ):
        return
    import dask

    levels = {**(dask.config.get("logging", default={}) or {}), **QUIET_DASK_LEVELS}
    os.environ[DASK_ENV] = repr(levels)  # Dask reads environment values with ast.literal_eval
    dask.config.set({"logging": levels})


class TypedErrorsInOneLine(logging.Filter):
    """Log a memchunk error (:class:`~memchunk_prefect.core.errors.MemchunkError`) as its one line, not with its
    traceback.

    Prefect's flow engine logs a flow's exception with its traceback before re-raising it, so a typed error
    whose message already says what was wrong and what to do reached the terminal twice in full (91 lines for
    a missing file). The record keeps the exception's type and message; the traceback is still raised to the
    caller, once. Other exceptions are left as they are: their traceback is what says where they came from.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        from memchunk_prefect.core.errors import MemchunkError

        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, MemchunkError):
            record.exc_info, record.exc_text = None, None
        return True


_ONE_LINE = TypedErrorsInOneLine()


def typed_errors_in_one_line(logger_name: str = "prefect.flow_runs") -> None:
    """Install :class:`TypedErrorsInOneLine` on Prefect's flow-run logger, where the flow engine's records are
    made (once; idempotent)."""
    target = logging.getLogger(logger_name)
    if _ONE_LINE not in target.filters:
        target.addFilter(_ONE_LINE)


#: The message Dask's worker logs, with a traceback, when its heartbeat to the scheduler raises ``OSError``.
HEARTBEAT_FAILED = "Failed to communicate with scheduler during heartbeat"


class HeartbeatAtClose(logging.Filter):
    """Drop the error a Dask worker logs when its own close cuts its heartbeat short; every other record passes.

    ``Worker.close`` marks the worker closing, then closes its connection pool (``self.rpc.close()``), and with
    it the connection a heartbeat to the scheduler may be waiting on at that moment. That heartbeat raises
    ``CommClosedError`` and the worker logs "Failed to communicate with scheduler during heartbeat." at ERROR,
    with a 40-line traceback, at the end of a flow run that succeeded (dask/distributed#5371 shows the same
    race). Nothing is lost: the worker is closing on purpose, and its batched stream, not the heartbeat, is what
    tells it the scheduler is gone (dask/distributed#6492). Only a ``CommClosedError`` (the closed connection)
    is dropped, and only while a worker of this process is closing (the state ``Worker.close`` holds until its
    connections are closed). In a process of several workers (a threaded cluster) that also hides another
    worker's failed heartbeat during that close; a worker process holds one worker.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if not str(record.msg).startswith(HEARTBEAT_FAILED):
            return True
        try:
            from distributed.comm.core import CommClosedError
            from distributed.core import Status
            from distributed.worker import Worker

            if not (record.exc_info and isinstance(record.exc_info[1], CommClosedError)):
                return True  # not a connection closed under it: a scheduler that does not answer
            return not any(w.status == Status.closing for w in list(getattr(Worker, "_instances", ())))
        except Exception:  # noqa: BLE001 - a filter that fails would break the heartbeat it reports on
            return True


_AT_CLOSE = HeartbeatAtClose()


def heartbeat_at_close_quiet() -> None:
    """Install :class:`HeartbeatAtClose` on ``distributed.worker``, the logger of Dask's worker (once;
    idempotent). Installed in the flow's process (threaded workers) and in every worker process that imports
    :mod:`memchunk_prefect.run.worker`, as a forked worker's server does before it forks it."""
    target = logging.getLogger("distributed.worker")
    if _AT_CLOSE not in target.filters:
        target.addFilter(_AT_CLOSE)
