"""What the runner decided, shown where Prefect users look: artifacts on the flow run.

Per chunked map (written by the runner's :class:`ArtifactWriter`, one thread that
makes the API calls in order in a copy of the flow's run context, so a map never
waits for the Prefect server between its chunks; Dask callback threads carry no
run context and are never used):

- a **table** artifact ``memchunk-<operator>-chunks``: one row per task run of the map
  (a chunk split after running out of memory has its failed attempt and its pieces):
  chunk, extents read (halo included), elements, predicted and upper-bound MiB (the
  model's figures when the chunk was submitted), measured MiB, seconds, decision
  (``probe`` / ``continue`` / ``rechunk`` / ``retry-smaller``), outcome and worker;
- a **progress** artifact ``memchunk-<operator>-progress``: share of the output's
  elements written, updated as chunks finish.

Per flow run, a **markdown** artifact ``memchunk-summary-<flow name>``, created after
the first chunked map and updated after each: per operator the chunking chosen and
why, out-of-memory events avoided and recovered, budget use (peak / budget), model
error, time lost in retries.

Keys are lowercase letters, digits and dashes (:func:`artifact_key`), so every
artifact also shows on the Artifacts page, where a key gathers the same table
across runs.

The module has two layers: pure functions over plain data (:class:`MapRecord`,
:func:`chunk_rows`, :func:`map_summary`, :func:`summary_markdown`), testable
without Prefect; and a thin :class:`MapReporter`, a map observer
(:mod:`memchunk_prefect.run.observe`), which fills a :class:`MapRecord` from the
map's typed events and writes the artifacts through ``prefect.artifacts`` and
the client. A failing API call is logged, never raised: a report must not stop
a run.
"""

from __future__ import annotations

import contextvars
import logging
import math
import re
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate
from prefect.context import FlowRunContext

from memchunk_prefect.core.chunks import Chunk, with_halo
from memchunk_prefect.core.energy import energy_by_source, energy_text
from memchunk_prefect.core.errors import format_bytes
from memchunk_prefect.run.observe import Decision, MapEnd, MapObserver, MapStart, TaskEnded, TaskSubmitted

logger = logging.getLogger("memchunk_prefect.run.report")

MIB = 2**20

#: What each outcome of a task run is called in the table.
OUTCOME_TEXT = {"ok": "ok", "memory_error": "MemoryError", "killed": "worker killed", "lost": "worker lost",
                "deferred": "no room where it began: planned again"}
OOM_EVENTS = ("memory_error", "killed")
#: The progress artifact is updated when the share written moved by this many points, or this many seconds
#: passed since the last update (each update is an API call from the flow's thread).
PROGRESS_STEP_PERCENT = 25.0
PROGRESS_EVERY_SECONDS = 5.0


# =========================================================================== pure: keys and numbers


def artifact_key(*parts: str) -> str:
    """A key the Artifacts page accepts: lowercase letters, digits and single dashes.

    >>> artifact_key("memchunk", "gst3d_dip", "chunks")
    'memchunk-gst3d-dip-chunks'
    >>> artifact_key("memchunk-summary", "Seismic Attributes!")
    'memchunk-summary-seismic-attributes'
    """
    key = "-".join(str(p) for p in parts).lower()
    key = re.sub(r"[^a-z0-9]+", "-", key).strip("-")
    return key or "memchunk"


def mib(n: float | int | None, digits: int = 1) -> float | None:
    """Bytes -> MiB rounded for a table cell (None stays None).

    >>> mib(3 * 2**20), mib(None)
    (3.0, None)
    """
    return None if n is None else round(float(n) / MIB, digits)


def progress_percent(done_elements: int, total_elements: int) -> float:
    """Share of the output written, 0..100.

    >>> progress_percent(1, 4), progress_percent(0, 0)
    (25.0, 100.0)
    """
    if total_elements <= 0:
        return 100.0
    return round(100.0 * min(done_elements, total_elements) / total_elements, 1)


# =========================================================================== pure: one map's record


@dataclass
class Attempt:
    """One task run of a chunked map, as the flow saw it."""

    chunk: str  # label, e.g. "iline 64:96"
    chunk_key: str
    extents: tuple[int, int, int]  # block read, halo included
    elements: int
    decision: str
    predicted_bytes: float | None = None  # the model's mean when submitted
    upper_bytes: float | None = None  # the model's upper bound when submitted
    submitted_at: float = 0.0
    outcome: str = ""  # "" while running; ok | memory_error | killed | lost
    measured_bytes: int | None = None
    censored: bool = False  # measured_bytes is a floor: it needed more
    seconds: float | None = None
    worker: str = ""
    joules: float | None = None  # the run's energy (measured or estimated, see energy_source)
    energy_source: str | None = None


@dataclass
class MapRecord:
    """Everything the report says about one chunked map: plain data."""

    operator: str
    operator_key: str
    shape: tuple[int, int, int]
    budget_bytes: int = 0
    budget_reason: str = ""
    slots: int = 0
    output_path: str = ""
    decisions: list[dict] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    done_elements: int = 0
    done_chunks: int = 0
    started_at: float = field(default_factory=time.time)
    ended_at: float | None = None
    error: str = ""
    #: Dask's ``chunks="auto"`` for this volume and what the model predicts for it (see :func:`naive_chunking`).
    naive: dict = field(default_factory=dict)
    #: What the learned policy's arm earned (``records.Reward.to_dict()``); empty when nothing was taught.
    reward: dict = field(default_factory=dict)
    #: Workers' pauses (Dask's pause line) during the map, and the worker-seconds they lasted.
    pauses: int = 0
    paused_seconds: float = 0.0

    @property
    def total_elements(self) -> int:
        return self.shape[0] * self.shape[1] * self.shape[2]


#: Most rows a map's table artifact holds. The Prefect server refuses to publish an event over 1.5 MB
#: (``PREFECT_SERVER_EVENTS_MAXIMUM_SIZE_BYTES``), and an artifact's creation event carries its data: a map of
#: 16,641 chunks made a 5.5 MB table, and the server logged "Refusing to publish event of size 5473722"
#: (``python -m benchmarks.many_chunks --chunks 20000 --seeded``). A row is ~330 bytes.
TABLE_ROWS = 1000


def shown_attempts(attempts: Sequence[Attempt], limit: int = TABLE_ROWS) -> list[Attempt]:
    """The task runs a table of at most ``limit`` rows shows, in submission order.

    All of them when they fit. Else, in this order until ``limit``: every run that
    did not end ``ok`` (out of memory, killed, lost, still running), the first run
    of each decision, the run with the highest measured peak, then ``ok`` runs
    evenly spaced over the map. Nothing is lost by it: every run's figures are in
    the observation store (``memchunk models``, the map's summary).

    >>> a = [Attempt(f"c{i}", f"k{i}", (1, 1, 1), 1, "rechunk", outcome="ok", measured_bytes=i) for i in range(10)]
    >>> a[7].outcome = "killed"
    >>> [x.chunk for x in shown_attempts(a, limit=4)]
    ['c0', 'c4', 'c7', 'c9']
    """
    if len(attempts) <= limit:
        return list(attempts)
    keep: dict[int, None] = {}  # indices, insertion-ordered by priority

    def add(i: int) -> None:
        if len(keep) < limit:
            keep.setdefault(i, None)

    for i, a in enumerate(attempts):
        if a.outcome != "ok":
            add(i)
    seen: set[str] = set()
    for i, a in enumerate(attempts):
        if a.decision not in seen:
            seen.add(a.decision)
            add(i)
    measured = [i for i, a in enumerate(attempts) if a.measured_bytes is not None]
    if measured:
        add(max(measured, key=lambda i: attempts[i].measured_bytes or 0))
    room = limit - len(keep)
    if room > 0:
        rest = [i for i in range(len(attempts)) if i not in keep]
        step = len(rest) / room
        for j in range(min(room, len(rest))):
            add(rest[int((j + 0.5) * step)])  # the middle of each stretch
    return [attempts[i] for i in sorted(keep)]


def chunk_rows(record: MapRecord, limit: int = TABLE_ROWS) -> list[dict[str, Any]]:
    """The table artifact's rows: one per task run shown (:func:`shown_attempts`), in submission order.

    A censored figure (the run died of memory: it needed *more* than this) is
    written as ``"over 950.0"`` (not ``"> 950.0"``: the UI renders text cells as
    markdown, where ``>`` starts a quote).
    """
    rows = []
    for a in shown_attempts(record.attempts, limit):
        measured: Any = mib(a.measured_bytes)
        if a.censored and measured is not None:
            measured = f"over {measured}"
        rows.append({
            "chunk": a.chunk,
            "extents": " x ".join(str(e) for e in a.extents),
            "elements": a.elements,
            "predicted MiB": mib(a.predicted_bytes),
            "upper-bound MiB": mib(a.upper_bytes),
            "measured MiB": measured,
            "seconds": None if a.seconds is None else round(a.seconds, 2),
            "energy J": None if a.joules is None else round(a.joules, 1),
            "energy source": a.energy_source,
            "decision": a.decision,
            "outcome": OUTCOME_TEXT.get(a.outcome, a.outcome or "running"),
            "worker": a.worker,
        })
    return rows


def model_error(attempts: Iterable[Attempt]) -> dict[str, Any]:
    """How well the model predicted the finished chunks it had a prediction for.

    ``median_abs_pct``: median of |measured - predicted| / measured, in percent;
    ``within_upper``: share of measured peaks at or below the upper bound; ``n``.

    >>> a = [Attempt("c", "k", (1, 1, 1), 1, "rechunk", 90, 120, outcome="ok", measured_bytes=100),
    ...      Attempt("d", "k", (1, 1, 1), 1, "rechunk", 110, 105, outcome="ok", measured_bytes=110)]
    >>> model_error(a)
    {'n': 2, 'median_abs_pct': 5.0, 'within_upper': 0.5}
    """
    errs, within = [], []
    for a in attempts:
        if a.outcome != "ok" or not a.measured_bytes or a.predicted_bytes is None:
            continue
        errs.append(abs(a.measured_bytes - a.predicted_bytes) / a.measured_bytes * 100.0)
        if a.upper_bytes is not None:
            within.append(1.0 if a.measured_bytes <= a.upper_bytes else 0.0)
    errs.sort()
    med = None
    if errs:
        mid = len(errs) // 2
        med = errs[mid] if len(errs) % 2 else (errs[mid - 1] + errs[mid]) / 2
    return {"n": len(errs), "median_abs_pct": None if med is None else round(med, 1),
            "within_upper": None if not within else round(sum(within) / len(within), 3)}


def map_summary(record: MapRecord) -> dict[str, Any]:
    """One map in numbers: what the flow summary shows per operator."""
    ok = [a for a in record.attempts if a.outcome == "ok"]
    ooms = [a for a in record.attempts if a.outcome in OOM_EVENTS]
    lost = [a for a in record.attempts if a.outcome in OOM_EVENTS + ("lost",)]
    peak = max((a.measured_bytes or 0 for a in ok), default=None)
    plans = [d for d in record.decisions if d.get("chunk_shape")]
    final = plans[-1] if plans else {}
    naive = record.naive or {}
    return {
        "operator": record.operator,
        "operator_key": record.operator_key,
        "decisions": [d.get("decision") for d in record.decisions],
        "chunking": (f"{record.done_chunks} chunks, largest {' x '.join(map(str, final['chunk_shape']))}"
                     if final else f"{record.done_chunks} chunks"),
        "tasks": len(record.attempts),
        "oom_avoided": int(naive.get("over_budget", 0) or 0),
        "oom_recovered": len(ooms),
        "peak_bytes": peak,
        "budget_bytes": record.budget_bytes,
        "budget_use": None if not peak or not record.budget_bytes else round(peak / record.budget_bytes, 3),
        "model_error": model_error(record.attempts),
        "retry_seconds": round(sum(a.seconds or 0.0 for a in lost), 2),
        "pauses": record.pauses,
        "paused_seconds": round(record.paused_seconds, 2),
        # Every task run's energy, failed attempts included (they used it too), joules per source.
        "energy": energy_by_source((a.joules, a.energy_source) for a in record.attempts),
        "seconds": None if record.ended_at is None else round(record.ended_at - record.started_at, 2),
        "error": record.error,
        "output": record.output_path,
    }


def pct(x: float | None) -> str:
    return "n/a" if x is None else f"{100 * x:.0f}%"


def summary_markdown(flow_name: str, records: Sequence[MapRecord], *, title: str | None = None) -> str:
    """The flow run's markdown summary over its chunked maps."""
    lines = [f"# {title or 'memchunk: ' + flow_name}", ""]
    if not records:
        return "\n".join(lines + ["No chunked maps ran."])
    sums = [map_summary(r) for r in records]
    budget = max((s["budget_bytes"] or 0 for s in sums), default=0)
    peak = max((s["peak_bytes"] or 0 for s in sums), default=0)
    failed = [s for s in sums if s["error"]]
    lines += [
        f"{len(records)} chunked map{'s' if len(records) != 1 else ''}, "
        f"{sum(s['tasks'] for s in sums)} task runs. Budget per task {format_bytes(budget)}; "
        f"highest measured peak {format_bytes(peak or None)} ({pct(peak / budget if budget and peak else None)} "
        f"of the budget). Out-of-memory events: {sum(s['oom_avoided'] for s in sums)} avoided, "
        f"{sum(s['oom_recovered'] for s in sums)} recovered. Time lost in retries: "
        f"{sum(s['retry_seconds'] for s in sums):.1f} s. Energy: "
        + energy_text(energy_by_source((j, src) for s in sums for src, j in s["energy"].items()))
        + "."
        + (f" **{len(failed)} map(s) failed.**" if failed else ""),
        "",
        "| operator | chunking | decisions | tasks | OOM avoided / recovered | peak / budget | "
        "model error: median, within bound | retry time | energy |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in sums:
        me = s["model_error"]
        err = "n/a" if me["median_abs_pct"] is None else f"{me['median_abs_pct']:.0f}% of {me['n']}"
        decisions = " → ".join(dict.fromkeys(d for d in s["decisions"] if d))
        lines.append(
            f"| {s['operator']} | {s['chunking']} | {decisions or 'n/a'} | {s['tasks']} | {s['oom_avoided']} / "
            f"{s['oom_recovered']} | {format_bytes(s['peak_bytes'])} / {format_bytes(s['budget_bytes'])} "
            f"({pct(s['budget_use'])}) | {err}, {pct(me['within_upper'])} | {s['retry_seconds']:.1f} s | "
            f"{energy_text(s['energy'])} |")
    lines.append("")
    for r, s in zip(records, sums):
        lines += [f"## {r.operator}", "", f"`{r.operator_key}` → `{r.output_path}`", ""]
        if r.budget_reason:
            lines.append(f"- **budget**: {r.budget_reason}")
        for d in r.decisions:
            reason = str(d.get("reason", "")).replace("\n", " ")
            lines.append(f"- **{d.get('decision')}**: {reason}")
        n = r.naive or {}
        if n.get("over_budget"):
            lines.append(
                f"- **out-of-memory avoided**: Dask's `chunks=\"auto\"` would cut this volume into {n['n_chunks']} "
                f"chunk(s) of up to {' x '.join(map(str, n['chunk_shape']))}; the model predicts "
                f"{format_bytes(n['predicted_bytes'])} for the largest, over the {format_bytes(r.budget_bytes)} "
                f"budget ({n['over_budget']} chunk(s) would not fit)")
        if s["oom_recovered"]:
            lines.append(f"- **out-of-memory recovered**: {s['oom_recovered']} task run(s) ran out of memory and "
                         f"were split and resubmitted; {s['retry_seconds']:.1f} s of task time lost")
        if s["pauses"]:
            lines.append(f"- **workers paused**: {s['pauses']} time(s), {s['paused_seconds']:.1f} worker-seconds "
                         "above Dask's pause line (`distributed.worker.memory.pause`): no new task started there")
        if r.reward:
            w = r.reward
            paused = (f", {w.get('paused_seconds', 0.0):.1f} worker-seconds paused" if w.get("pauses") else "")
            lines.append(f"- **learned policy**: arm {w['arm']} earned {w['reward']:.2f} (slot efficiency "
                         f"{w['efficiency']:.2f} over {w['wall_seconds']:.1f} s on {w['slots']} slot(s), "
                         f"{w['out_of_memory']} out of memory{paused})")
        if s["error"]:
            lines.append(f"- **failed**: {s['error']}")
        lines.append("")
    return "\n".join(lines)


def naive_chunking(shape: Sequence[int], halo: Sequence[int], budget_bytes: int,
                   predict: Callable[[tuple[int, int, int]], Any]) -> dict[str, Any]:
    """Dask's ``chunks="auto"`` for a float32 volume, and how many of its chunks the model says would not fit.

    ``predict(extents)`` returns an object with ``mean_bytes`` and ``ready``; an
    unready model gives an empty dict (nothing claimed).
    """
    from dask.array.core import normalize_chunks  # dask.array takes ~0.9 s to import; only this report needs it

    chunks = normalize_chunks("auto", tuple(shape), dtype="float32")
    starts = [[sum(c[:i]) for i in range(len(c))] for c in chunks]
    boxes = [Chunk((a, b, c), (a + x, b + y, c + z))
             for a, x in zip(starts[0], chunks[0]) for b, y in zip(starts[1], chunks[1])
             for c, z in zip(starts[2], chunks[2])]
    cache: dict[tuple, float | None] = {}
    over = 0
    largest: tuple[tuple[int, int, int], int, float] | None = None
    for box in boxes:
        read, _ = with_halo(box, tuple(halo), tuple(shape))
        ext = read.shape
        if ext not in cache:
            p = predict(ext)
            cache[ext] = float(p.mean_bytes) if getattr(p, "ready", True) else None
        predicted = cache[ext]
        if predicted is None:
            return {}
        if predicted > budget_bytes:
            over += 1
        if largest is None or read.elements > largest[1]:
            largest = (box.shape, read.elements, predicted)
    if largest is None:  # pragma: no cover - normalize_chunks gives at least one chunk
        return {}
    return {"n_chunks": len(boxes), "chunk_shape": list(largest[0]), "predicted_bytes": largest[2],
            "over_budget": over}


# =========================================================================== thin: the runner's reporter

#: Flow run id -> its maps' records and summary artifact id (the newest 64 flow runs of this process).
_FLOW_RUNS: "OrderedDict[str, dict]" = OrderedDict()


def _flow_context() -> tuple[str | None, str]:
    try:
        ctx = FlowRunContext.get()
        if ctx and ctx.flow_run:
            return str(ctx.flow_run.id), ctx.flow.name if ctx.flow else ctx.flow_run.name
    except Exception:  # pragma: no cover
        pass
    return None, "flow"


class ArtifactWriter:
    """The reports' Prefect API calls, made in order on one thread of their own, off the flow's thread.

    Each artifact call is a round trip to the Prefect server (10-15 ms each on a
    local server here, up to 0.8 s while thousands of task runs load it): made
    from the flow's thread, a map waited for them between its chunks and before
    the next map could start. Each call runs in a copy of the caller's context
    (the flow run's, so the artifact is attached to it), in the order submitted.
    :meth:`close` waits for what is left (the runner does at the end of its flow
    run) and stops the thread. A call that raises is logged, never raised.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._jobs: list[tuple[contextvars.Context, Callable, tuple]] = []
        self._busy = False
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, fn: Callable, *args: Any) -> None:
        """Run ``fn(*args)`` on the writer's thread, after everything submitted before it."""
        ctx = contextvars.copy_context()
        with self._cond:
            if self._closed:
                raise RuntimeError("the artifact writer is closed")
            self._jobs.append((ctx, fn, args))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="memchunk-artifacts", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closed:
                    self._cond.wait()
                if not self._jobs:
                    return
                ctx, fn, args = self._jobs.pop(0)
                self._busy = True
            try:
                ctx.run(fn, *args)
            except Exception as exc:  # noqa: BLE001 - a report never stops a run
                logger.warning("memchunk report: an artifact call failed (%r); the run goes on", exc)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    @property
    def pending(self) -> int:
        """Calls submitted and not finished."""
        with self._cond:
            return len(self._jobs) + int(self._busy)

    def wait(self, timeout: float | None = None) -> bool:
        """Wait until every call submitted so far has finished; False if ``timeout`` seconds passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while self._jobs or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self, timeout: float | None = None) -> bool:
        """Wait for what is left (at most ``timeout`` seconds), then stop the thread; False if calls were left."""
        done = self.wait(timeout)
        with self._cond:
            self._closed = True
            self._jobs.clear()
            self._cond.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=1.0)
        return done


class MapReporter(MapObserver):
    """The map observer that keeps a map's artifacts current: fills a :class:`MapRecord` and writes it.

    Told from the flow's thread (see :mod:`memchunk_prefect.run.observe`): the progress
    artifact is created at the first submission and updated as chunks end; the
    table and the flow run's summary are written when the map ends. With a
    ``writer`` (the runner's) those API calls are made on the writer's thread and
    the flow goes on at once; without one, here and now.
    """

    def __init__(self, writer: ArtifactWriter | None = None) -> None:
        self.writer = writer
        self.record: MapRecord | None = None
        self.flow_run_id, self.flow_name = _flow_context()
        self.key = "memchunk"
        self._predict: Callable[[Any], Any] | None = None
        self._halo: tuple[int, int, int] = (0, 0, 0)
        self._open: dict[int, Attempt] = {}
        self._progress_id: Any = None
        self._progress_asked = False  # the progress artifact's creation was asked for (made now or by the writer)
        self._api_ok = True
        self._last_progress = -1.0
        self._last_progress_at = 0.0

    # ---- the observer calls

    def on_map_start(self, event: MapStart) -> None:
        self.record = MapRecord(operator=event.operator, operator_key=event.operator_key, shape=event.shape,
                                budget_bytes=int(event.budget_bytes), budget_reason=event.budget_reason,
                                slots=int(event.slots),
                                output_path=event.output_path, started_at=event.at or time.time())
        self.key = artifact_key("memchunk", event.operator)
        self._predict = event.predict
        self._halo = tuple(event.halo)  # type: ignore[assignment]

    def on_decision(self, event: Decision) -> None:
        if self.record is not None:
            self.record.decisions.append(event.to_dict())

    def on_submit(self, event: TaskSubmitted) -> None:
        r = self.record
        if r is None:
            return
        if not self._progress_asked and self._api_ok:
            self._progress_asked = True
            self._call(self._create_progress)
        a = Attempt(chunk=event.label, chunk_key=event.chunk.key(), extents=tuple(event.read_extents),  # type: ignore[arg-type]
                    elements=math.prod(event.read_extents), decision=event.decision,
                    predicted_bytes=event.predicted_bytes, upper_bytes=event.upper_bytes,
                    submitted_at=event.at or time.time())
        r.attempts.append(a)
        self._open[event.id] = a

    def on_chunk_end(self, event: TaskEnded) -> None:
        r = self.record
        if r is None:
            return
        a = self._open.pop(event.id, None)
        if a is not None:
            o = event.observation
            a.outcome = event.outcome
            a.measured_bytes = o.peak_bytes if o is not None else None
            a.censored = bool(o.censored) if o is not None else a.outcome in OOM_EVENTS
            if a.outcome == "ok" or (o is not None and o.seconds):
                a.seconds = o.seconds if o is not None else None
            else:  # the worker died: the flow only knows the wall time since submission
                a.seconds = (event.at or time.time()) - a.submitted_at
            a.worker = (o.worker if o is not None else "").removeprefix("tcp://")
            if o is not None and o.energy_joules is not None:
                a.joules, a.energy_source = float(o.energy_joules), o.energy_source
        r.done_chunks, r.done_elements = event.done_chunks, event.done_elements
        pct = progress_percent(r.done_elements, r.total_elements)
        # One API call per chunk cost ~30 ms of the flow's time each: update when the share moved by
        # PROGRESS_STEP_PERCENT or PROGRESS_EVERY_SECONDS passed (the end of the map always updates it).
        now = event.at or time.time()
        moved = pct - self._last_progress >= PROGRESS_STEP_PERCENT
        if self._progress_asked and pct != self._last_progress and (
                moved or now - self._last_progress_at >= PROGRESS_EVERY_SECONDS):
            self._last_progress, self._last_progress_at = pct, now
            self._call(self._update_progress, pct)

    def on_map_end(self, event: MapEnd) -> None:
        r = self.record
        if r is None:  # the map failed before it started (no budget, no output): nothing to report
            return
        r.ended_at = event.at or time.time()
        r.done_chunks, r.done_elements = event.done_chunks, event.done_elements
        if event.error is not None:
            r.error = f"{type(event.error).__name__}: {event.error}"
        if event.reward is not None:
            r.reward = event.reward.to_dict()
        r.pauses, r.paused_seconds = event.pauses, event.paused_seconds
        if r.budget_bytes and self._predict is not None:
            self._call(self._naive, r)
        if self._progress_asked and event.error is None:
            self._call(self._update_progress, 100.0)
        if r.attempts:
            self._call(self._create_table)
        self._call(self._publish_summary)

    def _naive(self, r: MapRecord) -> None:
        """What Dask's automatic chunking would have done here, for the summary (model predictions: cheap,
        but a plan's worth of them, so on the writer's thread too)."""
        predict = self._predict
        if predict is None:  # pragma: no cover - asked for only with a predictor
            return
        try:
            r.naive = naive_chunking(r.shape, self._halo, r.budget_bytes, predict)
        except Exception as exc:  # noqa: BLE001  # pragma: no cover - a figure for the report only
            logger.debug("no naive-chunking estimate: %r", exc)

    # ---- Prefect

    def _call(self, fn: Callable, *args: Any) -> None:
        if not self._api_ok:
            return
        if self.writer is not None:
            self.writer.submit(self._guarded, fn, *args)
        else:
            self._guarded(fn, *args)

    def _guarded(self, fn: Callable, *args: Any) -> None:
        if not self._api_ok:  # an earlier call failed: the API is not answering, stop asking
            return
        try:
            fn(*args)
        except Exception as exc:
            self._api_ok = False
            logger.warning("memchunk report: could not write artifacts for %s (%r); the run goes on",
                           self.record.operator if self.record else "a map", exc)

    def _progress_description(self) -> str:
        r = self.record
        assert r is not None
        return (f"{r.operator}: {r.done_chunks} chunks written, {progress_percent(r.done_elements, r.total_elements)}% "
                f"of {' x '.join(map(str, r.shape))} → `{r.output_path}`")

    # ``_sync=True``: Prefect's artifact functions dispatch on whether an event loop is running; the flow's
    # thread may run one (an async flow), and these calls must complete before the map goes on.
    def _create_progress(self) -> None:
        self._progress_id = create_progress_artifact(  # type: ignore[call-arg]
            0.0, key=artifact_key(self.key, "progress"), description=self._progress_description(), _sync=True)

    def _update_progress(self, pct: float) -> None:
        if self._progress_id is None:
            return
        update_progress_artifact(self._progress_id, pct, description=self._progress_description(),  # type: ignore[call-arg]
                                 _sync=True)

    def _create_table(self) -> None:
        r = self.record
        assert r is not None
        s = map_summary(r)
        rows = chunk_rows(r)
        shown = "" if len(rows) == len(r.attempts) else (
            f" ({len(rows)} of {len(r.attempts)} task runs shown: every one not ok, the first of each decision, "
            "the highest peak, and ok runs evenly spaced; all are in the observation store)")
        create_table_artifact(
            rows, key=artifact_key(self.key, "chunks"),
            description=(f"**{r.operator}** (`{r.operator_key}`){shown}: {s['chunking']}, "
                         f"{s['tasks']} task runs, decisions {' → '.join(dict.fromkeys(s['decisions']))}; "
                         f"peak {format_bytes(s['peak_bytes'])} of a {format_bytes(s['budget_bytes'])} budget; "
                         f"{s['oom_recovered']} out-of-memory events recovered"),
            _sync=True)  # type: ignore[call-arg]

    def _publish_summary(self) -> None:
        assert self.record is not None
        publish_summary(self.flow_run_id, self.flow_name, self.record)


def publish_summary(flow_run_id: str | None, flow_name: str, record: MapRecord) -> Any:
    """Add ``record`` to its flow run's summary, and create or update the markdown artifact."""
    run_key = flow_run_id or "no-flow-run"
    entry = _FLOW_RUNS.setdefault(run_key, {"records": [], "artifact_id": None})
    _FLOW_RUNS.move_to_end(run_key)
    while len(_FLOW_RUNS) > 64:
        _FLOW_RUNS.popitem(last=False)
    entry["records"].append(record)
    md = summary_markdown(flow_name, entry["records"])
    description = f"memchunk: how {flow_name} was chunked, and why"
    with get_client(sync_client=True) as client:
        if entry["artifact_id"] is None:
            art = client.create_artifact(ArtifactCreate(
                type="markdown", key=artifact_key("memchunk-summary", flow_name), description=description,
                data=md, flow_run_id=uuid.UUID(flow_run_id) if flow_run_id else None))
            entry["artifact_id"] = art.id
        else:
            client.update_artifact(entry["artifact_id"], ArtifactUpdate(data=md, description=description))
    return entry["artifact_id"]


def flow_records(flow_run_id: str) -> list[MapRecord]:
    """The records of a flow run's chunked maps seen by this process (for flows that want them)."""
    return list(_FLOW_RUNS.get(str(flow_run_id), {}).get("records", []))
