"""What the batch system and the kernel say about a worker that died: the evidence for
:func:`memchunk_prefect.core.deaths.death_cause`.

Read in the flow's process when a map's chunk comes back ``KilledWorker``:

- the nanny's memory kill, from the scheduler's log (:func:`memchunk_prefect.run.cluster.read_memory_kills`);
- the kernel's OOM kills in the worker's job cgroup since the runner last read them, asked of the worker's nanny
  (:func:`memchunk_prefect.run.job_memory.run_on_nanny`): a nanny restarts a worker the kernel killed, so the job
  lives on and the batch system says nothing until it ends;
- the job's state as the batch system gives it (Slurm: ``sacct`` where accounting is kept, else ``scontrol show
  job``, which knows a job for ``MinJobAge`` seconds after it ended), and the signal that ended it (Slurm's poll
  kills a job over its ``--mem`` with SIGKILL where there are no cgroups). A job whose nanny is gone too has ended or
  is ending: its state is waited for up to ``job_state_wait_seconds`` (Slurm sets ``OUT_OF_MEMORY`` when the
  step's end is reported, a moment after its processes died).

Commands run with a timeout and a failure reads as "not known" (None): a death is then judged by the model's
guess, as it was before any of this was read. Only Slurm's commands are read: PBS, LSF and SGE jobs give their
job id (:data:`memchunk_prefect.run.job_memory.JOB_ID_VARIABLES`) but no state here.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time
from typing import Any, Callable

from memchunk_prefect.core.deaths import LIVE_STATES, DeathEvidence, job_state_name

logger = logging.getLogger("memchunk_prefect.run.batch")

#: Seconds one batch command may take before it is given up (a busy controller answers in well under one).
COMMAND_TIMEOUT_SECONDS = 10.0

#: Seconds to wait for the final state of a job whose nanny is gone as well (its end is being reported).
JOB_STATE_WAIT_SECONDS = 10.0

#: Seconds to wait for a live nanny's memory-kill event to reach the scheduler's log (it is sent as the nanny
#: kills its worker, on another connection than the one whose closing tells the scheduler of the death).
NANNY_EVENT_WAIT_SECONDS = 2.0


def _run(cmd: list[str], timeout: float) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.info("%s did not answer: %r", " ".join(cmd), exc)
        return None
    return proc.stdout if proc.returncode == 0 else None


def slurm_job_state(job_id: str, timeout: float = COMMAND_TIMEOUT_SECONDS) -> tuple[str | None, str, int | None]:
    """A Slurm job's state (``RUNNING``, ``CANCELLED``, ``OUT_OF_MEMORY``, ...), the command that gave it, and the
    signal that ended its batch script (``ExitCode=0:9`` -> 9; None where none did); ``(None, "", None)`` where
    neither ``sacct`` nor ``scontrol`` knows the job (no Slurm here, accounting off and the job forgotten, a
    controller that does not answer)."""
    out = _run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "State,ExitCode"], timeout)
    if out and out.strip():
        state, _, code = out.splitlines()[0].partition("|")
        if job_state_name(state):
            return job_state_name(state), "sacct", exit_signal(code)
    out = _run(["scontrol", "show", "job", "-o", str(job_id)], timeout)
    fields = dict(w.split("=", 1) for w in (out or "").split() if "=" in w)
    if fields.get("JobState"):
        return job_state_name(fields["JobState"]), "scontrol", exit_signal(fields.get("ExitCode", ""))
    return None, "", None


def exit_signal(code: str) -> int | None:
    """The signal of a Slurm exit code ``EXIT:SIGNAL`` (``"0:9"`` -> 9); None for none or an unreadable code.

    >>> exit_signal("0:9"), exit_signal("1:0"), exit_signal("")
    (9, None, None)
    """
    _, _, sig = str(code).strip().partition(":")
    return int(sig) if sig.isdigit() and int(sig) > 0 else None


def death_evidence(worker: str, kills: Callable[[], list[str] | None], at_nanny: Callable[[], dict[str, Any]] | None,
                   job: dict[str, Any] | None, oom_seen: int | None, *, job_id: str | None = None,
                   batch: str | None = None, wait_seconds: float = JOB_STATE_WAIT_SECONDS,
                   job_state: Callable[[str], tuple[str | None, str, int | None]] = slurm_job_state,
                   ) -> tuple[DeathEvidence, int | None]:
    """What can be read about the death of the worker at ``worker``, and the OOM count its nanny reads now.

    ``kills``: reads the workers the nannies logged as killed for memory (None: the log could not be read; a
    nanny that answers and whose cgroup saw no OOM kill is given up to :data:`NANNY_EVENT_WAIT_SECONDS` for its
    event to reach the scheduler, which it may after Dask reported the death);
    ``at_nanny``: reads :func:`memchunk_prefect.run.job_memory.job_memory` in the dead worker's nanny, which lives
    in the same job and cgroup (raises where the nanny does not answer; None: no nanny known); ``job``: what
    that reading gave on the worker earlier (None: a worker that joined mid-map); ``oom_seen``: the OOM count
    last read for that nanny (the increase since is the evidence; 0 where never read: a count there then is this
    death's); ``job_id`` / ``batch``: the job as the cluster object knows it, where neither reading gives it.
    ``job_state`` is the batch system's reader.
    """
    now: dict[str, Any] = {}
    if at_nanny is not None:
        try:
            now = at_nanny()
        except Exception as exc:  # noqa: BLE001 - the job is gone with its nanny: the batch system may say why
            logger.info("the nanny of the dead worker %s does not answer: %r", worker, exc)
    oom_now = now.get("oom_kills")
    base = oom_seen if oom_seen is not None else (job or {}).get("oom_kills", 0)
    rose = None if oom_now is None or base is None else max(0, int(oom_now) - int(base))
    known = {**(job or {}), **{k: v for k, v in now.items() if v is not None}}
    job_id = known.get("job_id") or job_id
    batch = known.get("batch") or batch
    killed = kills()
    deadline = time.monotonic() + (NANNY_EVENT_WAIT_SECONDS if now and not rose else 0.0)
    while killed is not None and worker not in killed and time.monotonic() < deadline:
        time.sleep(0.2)
        killed = kills()
    state, source, signal = (None, "", None)
    if job_id and batch == "slurm" and not (killed and worker in killed):
        state, source, signal = job_state(str(job_id))
        deadline = time.monotonic() + (0.0 if now or rose else wait_seconds)
        while state in LIVE_STATES and time.monotonic() < deadline:
            time.sleep(0.5)
            state, source, signal = job_state(str(job_id))
    evidence = DeathEvidence(nanny_memory_kill=None if killed is None else worker in killed, oom_kills=rose,
                             job_state=state, job_id=str(job_id) if job_id else None, source=source,
                             job_signal=signal)
    logger.info("death of %s: %s", worker, evidence)
    return evidence, None if oom_now is None else int(oom_now)
