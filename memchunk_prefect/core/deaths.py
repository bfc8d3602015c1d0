"""Why a worker died: out of memory, or lost (walltime, preemption, a cancelled job, a lost node).

Dask only sees a worker vanish (``KilledWorker``). On a batch cluster the same vanishing has causes that call for
opposite answers: a job the kernel or the batch system killed for memory needs its chunk split (``retry-smaller``,
a censored observation), while a job that reached its walltime, was preempted or cancelled needs the same chunk
run again and nothing learned about memory. What the runner can read besides Dask's report
(:mod:`memchunk_prefect.run.batch` reads it) is a :class:`DeathEvidence`; :func:`death_cause` is the rule, and
:func:`worker_death` falls back to the model's guess (:func:`memchunk_prefect.core.budget.is_memory_kill`) where
nothing was read.

The rule, first match wins:

1. the worker's nanny logged a memory kill for it (``worker-restart-memory``): memory;
2. the kernel's OOM killer ran in the worker's job cgroup since it was last read (the ``oom_kill`` count of
   ``memory.oom_control`` in cgroup v1, ``memory.events`` in v2): memory;
3. the batch system ended the job ``OUT_OF_MEMORY`` (Slurm: a cgroup OOM in the step): memory;
4. the batch system ended the job ``FAILED``, killed by signal 9 (SIGKILL): memory. That is how Slurm's
   accounting poll ends a job over its ``--mem`` where there are no cgroups (``JobAcctGatherParams=OverMemoryKill``:
   Slurm 22.05 marks it ``FAILED``, exit ``0:9``), and how the kernel's OOM killer ends one; a user's or an
   administrator's ``kill -9`` reads the same, and is taken as memory too;
5. the batch system ended the job for time, preemption, cancellation or a node (:data:`LOST_STATES`): lost;
6. anything else (the job still running, no batch system, nothing readable): unknown.

Pure: plain values in, a verdict and its reason in words out.
"""

from __future__ import annotations

from dataclasses import dataclass

from memchunk_prefect.core.budget import is_memory_kill
from memchunk_prefect.core.errors import format_bytes
from memchunk_prefect.core.settings import DEFAULT_SETTINGS, PolicySettings

#: Verdicts of :func:`death_cause`.
MEMORY, LOST, UNKNOWN = "memory", "lost", "unknown"

#: Slurm job states that end a job for a reason other than its memory (``squeue``/``sacct`` state names; PBS
#: and the others are not read).
LOST_STATES = frozenset({"TIMEOUT", "DEADLINE", "CANCELLED", "PREEMPTED", "NODE_FAIL", "BOOT_FAIL", "REQUEUED",
                         "REQUEUE_FED", "REQUEUE_HOLD", "REVOKED", "SUSPENDED", "STOPPED"})

#: The Slurm job state of a job killed for memory.
OUT_OF_MEMORY = "OUT_OF_MEMORY"

#: The signal that ends a job over its memory where it is not a cgroup's OOM (Slurm's poll, the kernel): SIGKILL.
SIGKILL = 9

#: Slurm job states of a job that has not ended: a death read while its job is in one of them says nothing yet.
LIVE_STATES = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SIGNALING", "STAGE_OUT", "RESIZING"})


@dataclass(frozen=True)
class DeathEvidence:
    """What was read about one worker's death besides Dask's report; None where it was not read.

    ``nanny_memory_kill``: its nanny logged a memory kill for it; ``oom_kills``: kills by the kernel's OOM killer
    in its job's cgroup since the runner last read that cgroup (an increase, not a total); ``job_state``: its batch
    job's state (Slurm's names, e.g. ``CANCELLED``; ``CANCELLED by 0`` is read as ``CANCELLED``); ``job_id`` and
    ``source`` (``scontrol``, ``sacct``): where that state came from, for the reason; ``job_signal``: the signal
    that ended the job's batch script (the second half of Slurm's ``ExitCode=0:9``), None where none did.
    """

    nanny_memory_kill: bool | None = None
    oom_kills: int | None = None
    job_state: str | None = None
    job_id: str | None = None
    source: str = ""
    job_signal: int | None = None


def job_state_name(state: str | None) -> str | None:
    """A job state as Slurm prints it, reduced to its name: ``"CANCELLED by 0"`` -> ``"CANCELLED"``; blank: None.

    >>> job_state_name("CANCELLED by 0"), job_state_name(" out_of_memory "), job_state_name("")
    ('CANCELLED', 'OUT_OF_MEMORY', None)
    """
    if state is None:
        return None
    words = str(state).strip().upper().split()
    return words[0].rstrip("+") if words else None


def death_cause(evidence: DeathEvidence) -> tuple[str, str]:
    """The cause of a worker's death by the rule in the module docstring: (:data:`MEMORY`, :data:`LOST` or
    :data:`UNKNOWN`, the reason in words).

    >>> death_cause(DeathEvidence(oom_kills=1))
    ('memory', "the kernel's OOM killer ran 1 time(s) in the worker's job cgroup")
    >>> death_cause(DeathEvidence(oom_kills=0, job_state="CANCELLED by 0", job_id="7", source="scontrol"))
    ('lost', 'its batch job 7 ended CANCELLED (scontrol), not for memory')
    >>> death_cause(DeathEvidence(job_state="RUNNING", job_id="7", source="scontrol"))[0]
    'unknown'
    """
    job = f"its batch job {evidence.job_id}" if evidence.job_id else "its batch job"
    where = f" ({evidence.source})" if evidence.source else ""
    state = job_state_name(evidence.job_state)
    if evidence.nanny_memory_kill:
        return MEMORY, "its nanny killed it at its memory line (worker-restart-memory)"
    if evidence.oom_kills is not None and evidence.oom_kills > 0:
        return MEMORY, f"the kernel's OOM killer ran {evidence.oom_kills} time(s) in the worker's job cgroup"
    if state == OUT_OF_MEMORY:
        return MEMORY, f"{job} ended {OUT_OF_MEMORY}{where}"
    if state == "FAILED" and evidence.job_signal == SIGKILL:
        return MEMORY, (f"{job} ended FAILED, killed by signal 9{where}: over its --mem (Slurm's accounting poll) or "
                        "the kernel's OOM killer")
    if state in LOST_STATES:
        return LOST, f"{job} ended {state}{where}, not for memory"
    read = [f"{job} is {state}{where}"] if state else []
    if evidence.oom_kills == 0:
        read.append("no OOM kill in its job cgroup")
    return UNKNOWN, ("nothing read says why: " + ", ".join(read)) if read else "nothing was read about it"


def worker_death(evidence: DeathEvidence | None, upper_bytes: float | None, kill_headroom_bytes: int, attempt: int,
                 settings: PolicySettings = DEFAULT_SETTINGS) -> tuple[bool, str]:
    """Whether a chunk's worker died of memory, and why it is taken so: :func:`death_cause` where the evidence
    says, else the model's guess (:func:`memchunk_prefect.core.budget.is_memory_kill`: no ready bound, a bound
    above ``settings.memory_kill_fraction`` of the kill headroom, or the chunk's second death).

    >>> worker_death(DeathEvidence(job_state="TIMEOUT", job_id="9"), None, 1000, 0)
    (False, 'its batch job 9 ended TIMEOUT, not for memory')
    >>> worker_death(None, None, 1000, 0)
    (True, 'nothing was read about it; treated as out of memory: the model has no ready bound for the chunk')
    >>> worker_death(DeathEvidence(oom_kills=0, job_state="RUNNING"), 100.0, 1000, 0)[0]
    False
    """
    cause, reason = death_cause(evidence) if evidence is not None else (UNKNOWN, "nothing was read about it")
    if cause != UNKNOWN:
        return cause == MEMORY, reason
    memory = is_memory_kill(upper_bytes, kill_headroom_bytes, attempt, settings)
    if not memory:
        return False, (f"{reason}; treated as lost: the model bounds the chunk at {format_bytes(upper_bytes)}, within "
                       f"{settings.memory_kill_fraction:g} of the {format_bytes(kill_headroom_bytes)} it had")
    why = ("the model has no ready bound for the chunk" if upper_bytes is None
           else "the chunk died before" if attempt > 0
           else f"the model's bound for the chunk is over {settings.memory_kill_fraction:g} of what it had")
    return True, f"{reason}; treated as out of memory: {why}"
