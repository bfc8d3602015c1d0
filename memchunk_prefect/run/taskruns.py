"""Prefect task-run state repair: no task run of a chunked map is left RUNNING.

Prefect only learns a task run's end from the worker that ran it. Three ways
that goes wrong on a Dask cluster, and what is done here:

- the worker was killed (the nanny, for memory): the run stays RUNNING forever
  (prefect #12968, #21638). The runner marks it Crashed with a message
  (:func:`set_final_state`).
- the map stopped early (Ctrl-C, a cancellation, a lost scheduler): runs of
  chunks in flight are marked Cancelled or Crashed. A task a worker started just
  before the cancellation reached it creates its run a moment later, so runs not
  found yet are looked for again for a while (:func:`mark_runs`).
- the worker was killed just after a task returned: the final state, sent in
  the background, can die with it although the flow holds the Completed state
  (:func:`settle_completed`).

Every call is best effort: a Prefect API that cannot be reached is logged, never
raised (repairing the UI must not stop a run).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterable, Sequence

from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterId
from prefect.exceptions import ObjectNotFound
from prefect.states import Cancelled, Completed, Crashed, State

from memchunk_prefect.core.settings import RUNNER_SETTINGS, RunnerSettings

logger = logging.getLogger("memchunk_prefect.run.taskruns")

#: What :func:`set_final_state` found: it set the state, the run already had a final one, the run does not
#: exist (yet), or the API call failed.
SET, FINAL, MISSING, ERROR = "set", "final", "missing", "error"


def set_final_state(task_run_id: Any, name: str, message: str) -> str:
    """Force a task run into a final state (``"Crashed"`` or ``"Cancelled"``) unless it has one.

    Returns :data:`SET`, :data:`FINAL` (left alone), :data:`MISSING` (not created:
    its worker never started it) or :data:`ERROR`.
    """
    try:
        state: State = {"Crashed": Crashed, "Cancelled": Cancelled}[name](message=message)
        with get_client(sync_client=True) as client:
            try:
                current = client.read_task_run(task_run_id).state
            except ObjectNotFound:  # the worker never started it (yet): nothing to mark
                return MISSING
            if current is not None and current.is_final():
                return FINAL
            client.set_task_run_state(task_run_id, state, force=True)
            return SET
    except Exception as exc:  # noqa: BLE001 - best effort, see the module docstring
        logger.info("could not mark task run %s %s: %r", task_run_id, name, exc)
        return ERROR


def mark_runs(marks: Sequence[tuple[Any, str, str]], *, look_again_seconds: float = 0.0,
              poll_seconds: float = RUNNER_SETTINGS.settle_poll_seconds,
              set_state: Callable[[Any, str, str], str] = set_final_state,
              clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> list[Any]:
    """Mark each ``(task_run_id, state name, message)``; runs not created yet are looked for again.

    Returns the ids still missing after ``look_again_seconds`` (their worker never
    started them). ``set_state``, ``clock`` and ``sleep`` are seams for tests.

    >>> seen = {"a": 0}
    >>> def fake(rid, name, msg):
    ...     seen[rid] += 1
    ...     return "missing" if seen[rid] < 2 else "set"   # created on the second look
    >>> mark_runs([("a", "Cancelled", "why")], look_again_seconds=1.0, set_state=fake, sleep=lambda s: None), seen
    ([], {'a': 2})
    """
    pending = list(marks)
    deadline = clock() + look_again_seconds
    while pending:
        pending = [m for m in pending if set_state(*m) == MISSING]
        if not pending or clock() > deadline:
            break
        sleep(poll_seconds)
    return [m[0] for m in pending]


def settle_completed(task_run_ids: Iterable[Any], settings: RunnerSettings = RUNNER_SETTINGS) -> int:
    """Give the Prefect API the Completed state of runs the flow holds as Completed but the API does not.

    One bulk read per ``settings.task_run_page`` runs. Returns how many runs were set.
    """
    held = list(task_run_ids)
    fixed = 0
    page = max(1, settings.task_run_page)
    try:
        with get_client(sync_client=True) as client:
            for i in range(0, len(held), page):
                ids = held[i:i + page]
                runs = client.read_task_runs(task_run_filter=TaskRunFilter(id=TaskRunFilterId(any_=ids)),
                                             limit=len(ids))
                for r in runs:
                    if r.state is None or not r.state.is_final():
                        client.set_task_run_state(r.id, Completed(
                            message="completed; its worker died before reporting it"), force=True)
                        fixed += 1
    except Exception as exc:  # noqa: BLE001 - best effort
        logger.info("could not settle task runs: %r", exc)
    return fixed
