"""WfCommons traces: one flow run's chunk task runs as a WfFormat instance (``memchunk export --format wfcommons``).

What: every chunk task-run attempt of one Prefect flow run (failed attempts
included) becomes a WfFormat task, with its time, CPU, memory, bytes and energy;
every chunk a task wrote becomes a file; a task's parents are the upstream
chunks its read box (the chunk plus its halo) overlaps. Why: WfFormat is what
workflow simulators and schedulers (WfCommons' WfSim/WRENCH tools, WfChef,
studies of energy-aware scheduling) read, so a real run of a seismic pipeline
can be replayed, simulated and compared there.

Two layers:

- :func:`build_instance` is pure: plain records in (the store's
  :class:`~memchunk_prefect.core.records.MapRun` and
  :class:`~memchunk_prefect.core.records.Observation` lists, the machines, a dict
  describing the flow run), a WfFormat dict out, built with WfCommons' own
  classes (``wfcommons.common.Workflow``, ``Task``, ``File``, ``Machine``);
- :func:`export_wfcommons` does the I/O: asks Prefect about the flow run (known
  and finished), reads the store, builds, validates (syntax and semantics,
  ``wfcommons.wfinstances.schema.SchemaValidator``) and only then writes the
  file, atomically (:func:`memchunk_prefect.io.files.atomic_write_text`).

The schema. ``wfcommons`` 1.6 validates against the WfFormat 1.6 schema, which
it downloads from GitHub when it runs; offline (clusters, CI) it cannot. The
package ships WfFormat's 1.5 schema, byte for byte (:data:`SCHEMA_FILE`,
LGPL-3.0, see ``memchunk_prefect/data/README.md``), validates against it and
writes the ``schemaVersion`` that schema accepts. The instance WfCommons
generates is otherwise unchanged except for extension fields the schema allows
on each execution task: ``energySource``, ``outcome``, ``operatorKey``,
``peakAboveRestingBytes`` and ``taskRunId`` (:data:`EXTENSION_FIELDS`), and the
CPU ``model`` of each machine. ``docs/how-to/traces.md`` describes every field.

Units: seconds, bytes, kWh (``energyInKWh``), watts (``avgPowerInW``), percent
(``avgCPU``: 100 = one core busy for the whole run); times are RFC 3339 in UTC.

``wfcommons`` is an optional dependency (``pip install 'memchunk-prefect[trace]'``),
imported only when a trace is built.

>>> task_id_base("gst3d_dip", "i0-64_x0-64_t0-400")
'gst3d_dip_i0-64_x0-64_t0-400'
>>> sanitize_id("survey 1/a+b.sgy")
'survey_1_a_b.sgy'
"""

from __future__ import annotations

import bisect
import json
import logging
import math
import os
import re
import uuid
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Mapping, Sequence

from memchunk_prefect.core.chunks import Chunk, with_halo
from memchunk_prefect.core.energy import (
    ESTIMATE,
    DeviceRun,
    busy_weight,
    is_measured,
    kwh,
    split_among_devices,
)
from memchunk_prefect.core.errors import MemchunkError, TraceExportError
from memchunk_prefect.core.records import MapRun, Observation

#: The WfFormat schema traces are validated against by default: WfFormat 1.5, vendored (see data/README.md).
SCHEMA_FILE = Path(__file__).resolve().parents[1] / "data" / "wfformat-1.5-schema.json"
#: Fields each execution task carries beyond WfFormat's own (the schema allows extra properties).
EXTENSION_FIELDS = ("energySource", "outcome", "operatorKey", "peakAboveRestingBytes", "taskRunId")
#: What a WfFormat task or file id may hold here (the 1.5 schema's pattern for parents, children and files).
ID_PATTERN = re.compile(r"^[0-9a-zA-Z_.-]+$")
_ID_BAD = re.compile(r"[^0-9a-zA-Z_.-]")
#: The runtime system a trace names.
RUNTIME_SYSTEM = "memchunk-prefect"
#: How many validation errors a TraceExportError quotes.
ERRORS_SHOWN = 5

# WfCommons logs what it finds (a validation error, a file of two sizes) through logging; the exporter
# reports those itself, so WfCommons' own records go nowhere.
_QUIET = logging.getLogger("memchunk_prefect.sim.trace.wfcommons")
_QUIET.addHandler(logging.NullHandler())
_QUIET.propagate = False


# --------------------------------------------------------------------------- small pure helpers


def sanitize_id(text: str) -> str:
    """``text`` with every character outside ``[0-9a-zA-Z_.-]`` replaced by ``_`` (WfFormat's id pattern)."""
    return _ID_BAD.sub("_", str(text)) or "_"


def task_id_base(operator: str, chunk_key: str) -> str:
    """A task's id before de-duplication: ``<operator>_<chunk key>``, sanitized."""
    return sanitize_id(f"{operator}_{chunk_key}")


def schema_version_of(schema: Mapping[str, Any]) -> str:
    """The ``schemaVersion`` a WfFormat schema accepts (the highest of its enum), else TraceExportError.

    >>> schema_version_of({"properties": {"schemaVersion": {"enum": ["1.4", "1.10", "1.5"]}}})
    '1.10'
    """
    enum = (schema.get("properties", {}) or {}).get("schemaVersion", {}).get("enum") or []
    versions = [str(v) for v in enum if isinstance(v, str) and v]
    if not versions:
        raise TraceExportError("the schema names no schemaVersion it accepts (properties.schemaVersion.enum): "
                               "is it a WfFormat schema (wfcommons-schema.json)?")

    def order(v: str) -> tuple:
        return tuple(int(p) if p.isdigit() else -1 for p in v.split("."))

    return max(versions, key=order)


def load_schema(path: str | os.PathLike | None = None) -> dict[str, Any]:
    """The WfFormat schema at ``path`` (default: the vendored 1.5 schema), as a dict; TraceExportError if unusable."""
    p = Path(path) if path is not None else SCHEMA_FILE
    try:
        schema = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise TraceExportError(f"cannot read the WfFormat schema {p}: {exc}") from exc
    except ValueError as exc:
        raise TraceExportError(f"the WfFormat schema {p} is not JSON: {exc}") from exc
    if not isinstance(schema, dict):
        raise TraceExportError(f"the WfFormat schema {p} is not a JSON object")
    schema_version_of(schema)
    return schema


def _epoch(value: Any) -> float | None:
    """Epoch seconds of a datetime (naive = UTC), an ISO 8601 string or a number; None stays None."""
    if value is None or value == "":
        return None
    if isinstance(value, datetime):
        return (value if value.tzinfo else value.replace(tzinfo=timezone.utc)).timestamp()
    if isinstance(value, (int, float)):
        return float(value)
    try:
        return _epoch(datetime.fromisoformat(str(value).replace("Z", "+00:00")))
    except ValueError:
        raise TraceExportError(f"{value!r} is not a time (a datetime, an ISO 8601 string or epoch seconds)") from None


def rfc3339(epoch_seconds: float) -> str:
    """Epoch seconds as an RFC 3339 date-time in UTC.

    >>> rfc3339(0.5)
    '1970-01-01T00:00:00.500000+00:00'
    """
    return datetime.fromtimestamp(float(epoch_seconds), tz=timezone.utc).isoformat()


def _finite(x: float | None) -> bool:
    return x is not None and math.isfinite(x)


def _cpu_seconds(o: Observation) -> float | None:
    """The attempt's CPU seconds when recorded (a run its worker could not report has none)."""
    return float(o.cpu_seconds) if o.cpu_seconds is not None and math.isfinite(o.cpu_seconds) else None


class _Ids:
    """Unique, sanitized ids: the first free of a key's candidates, else the first one numbered ``_2``, ``_3``..."""

    def __init__(self) -> None:
        self.used: set[str] = set()
        self.by_key: dict[Any, str] = {}

    def get(self, key: Any, candidates: Sequence[str]) -> str:
        if key in self.by_key:
            return self.by_key[key]
        names = [sanitize_id(c) for c in candidates if c]
        chosen = next((n for n in names if n not in self.used), None)
        if chosen is None:
            base = names[0] if names else "_"
            n = 2
            while f"{base}_{n}" in self.used:
                n += 1
            chosen = f"{base}_{n}"
        self.used.add(chosen)
        self.by_key[key] = chosen
        return chosen


def _path_candidates(path: str) -> list[str]:
    """Names for a path: its basename, then ``<parent>_<basename>`` (two outputs of one name in two folders)."""
    p = Path(path.rstrip("/"))
    return [p.name, f"{p.parent.name}_{p.name}" if p.parent.name else ""]


# --------------------------------------------------------------------------- the pure builder


@dataclass
class _Attempt:
    """One chunk task-run attempt, placed: its map, output chunk, read box, id, times and energy share."""

    obs: Observation
    map_index: int
    chunk: Chunk
    read: Chunk
    start: float
    task_id: str = ""
    joules: float | None = None
    parents: list["_Attempt"] = field(default_factory=list)
    inputs: list[str] = field(default_factory=list)
    output: str | None = None


def _start_of(o: Observation) -> float:
    """When an attempt started: its recorded start, else its end less its duration (epoch seconds)."""
    if _finite(o.started_at):
        return float(o.started_at)  # type: ignore[arg-type]
    return float(o.created_at) - max(0.0, float(o.seconds or 0.0))


def _assign_maps(maps: Sequence[MapRun], observations: Sequence[Observation]) -> tuple[list[int], int]:
    """The map each observation belongs to (index into ``maps``), and how many could belong to several.

    An observation that carries its map's id (``Observation.map_id``, recorded
    since store v5) belongs to that map. Otherwise (records of older runners) it
    names only its operator key: a key used by one map of the run settles it;
    when several maps of the run share the key (the same operator applied twice),
    the map whose volume holds the chunk and whose ``[started_at, ended_at]``
    holds the attempt's end (nearest, else) is taken.
    """
    by_id = {m.map_id: i for i, m in enumerate(maps) if m.map_id}
    if by_id and all(o.map_id in by_id for o in observations):
        return [by_id[o.map_id] for o in observations], 0
    by_key: dict[str, list[int]] = {}
    for i, m in enumerate(maps):
        by_key.setdefault(m.operator_key, []).append(i)
    missing = sorted({o.operator_key for o in observations if o.operator_key not in by_key})
    if missing:
        raise TraceExportError(
            f"the store holds task runs of this flow run for operator key(s) {', '.join(missing)} but no chunked "
            f"map record for them (maps recorded: {', '.join(sorted(by_key)) or 'none'}); the store may have "
            "failed to record a map (the flow's log says so): a trace without those task runs would be wrong, "
            "so none is written")
    out, ambiguous = [], 0
    for o in observations:
        candidates = by_key[o.operator_key]
        if len(candidates) > 1:
            chunk = _parse_chunk(o)
            fits = [i for i in candidates if all(b <= n for b, n in zip(chunk.stop, maps[i].shape))] or candidates
            end = float(o.created_at)
            dist = {i: max(0.0, maps[i].started_at - end, end - maps[i].ended_at) for i in fits}
            best = min(dist.values())
            nearest = [i for i in fits if dist[i] == best]
            ambiguous += len(nearest) > 1
            candidates = nearest
        out.append(candidates[0])
    return out, ambiguous


def _parse_chunk(o: Observation) -> Chunk:
    try:
        return Chunk.from_key(o.chunk)
    except MemchunkError:
        raise TraceExportError(f"a task run of {o.operator_key} (task run {o.task_run_id or 'unknown'}) has no "
                               f"chunk key the trace can place ({o.chunk!r}); records older than the store's "
                               "schema v5 cannot be traced") from None


def _energy_shares(observations: Sequence[Observation]) -> list[float | None]:
    """Each attempt's own energy, joules: estimates as recorded; whole-device counters shared out.

    A counter (``rapl``, ``nvml``, ``nvml+rapl``) measured its whole device over
    each run, so runs overlapping on one device counted each other's energy:
    :func:`memchunk_prefect.core.energy.split_device_energy` shares it among the
    runs measured on the same host with the same source, weighted by busy
    cores (CPU seconds over wall seconds, 1 when unknown).
    """
    out: list[float | None] = [None] * len(observations)
    measured: list[int] = []
    for i, o in enumerate(observations):
        if not _finite(o.energy_joules):
            continue
        if is_measured(o.energy_source):
            measured.append(i)
        else:
            out[i] = float(o.energy_joules)  # type: ignore[arg-type]
    runs = []
    for i in measured:
        o = observations[i]
        seconds = max(0.0, float(o.seconds or 0.0))
        start = _start_of(o)
        runs.append(DeviceRun(start, start + seconds, float(o.energy_joules),  # type: ignore[arg-type]
                              busy_weight(_cpu_seconds(o), seconds)))
    try:
        shares = split_among_devices([(observations[i].host, str(observations[i].energy_source)) for i in measured],
                                     runs)
    except MemchunkError as exc:
        raise TraceExportError(f"cannot share the measured energy of the task runs: {exc}") from exc
    for i, j in zip(measured, shares):
        out[i] = j
    return out


def _energy_description(observations: Sequence[Observation]) -> str:
    sources = {str(o.energy_source or ESTIMATE) for o in observations if _finite(o.energy_joules)}
    measured = sorted(s for s in sources if is_measured(s))
    estimated = ESTIMATE in sources
    parts = []
    if measured:
        parts.append(f"measured by whole-device counters ({', '.join(measured)}), each task's share of its "
                     "device's counter where tasks overlapped on one device (split in proportion to busy cores, "
                     "core.energy.split_device_energy: power varying within a task is averaged over it "
                     "and idle power is charged to the tasks running)")
    if estimated:
        parts.append("estimated, not measured, where no counter could be read: CPU seconds x the runner's "
                     "watts_per_core")
    if not parts:
        return "Energy: not recorded."
    return ("Energy (energyInKWh, avgPowerInW): " + "; ".join(parts)
            + ("; energySource on each task says which." if len(parts) > 1 else "."))


def build_instance(maps: Sequence[MapRun], observations: Sequence[Observation],
                   machines: Mapping[str, Mapping[str, Any]], flow_run: Mapping[str, Any], *,
                   schema_version: str | None = None, author: str | None = None, email: str | None = None,
                   created_at: float | None = None) -> dict[str, Any]:
    """The WfFormat instance (a JSON-able dict) of one flow run's chunk task runs; pure, no I/O but WfCommons.

    - ``maps``: the run's chunked maps (``Store.maps(flow_run_id)``), in the order they ended;
    - ``observations``: every chunk task-run attempt of the run (``Store.run_observations``);
    - ``machines``: ``{host: description}`` (``Store.machines()``); hosts no task ran on are left out;
    - ``flow_run``: ``id``, ``name`` (the flow run's), ``flow_name``, ``start_time``, ``end_time``
      (datetimes, ISO strings or epoch seconds), optionally ``state``;
    - ``schema_version``: the ``schemaVersion`` to write (default: the vendored schema's, "1.5");
    - ``author`` / ``email``: both or neither (WfFormat requires both in an author);
    - ``created_at``: the instance's creation time, epoch seconds (default now).

    One task per attempt: id ``<operator>_<chunk key>`` (``_2``, ``_3``... for later attempts of the
    same chunk, e.g. a chunk resubmitted after its worker was lost), name and category the operator.
    Not validated here: :func:`validate` does that.
    """
    wfc = _wfcommons()
    _check_instance_inputs(maps, observations, flow_run, author, email)
    if schema_version is None:
        schema_version = schema_version_of(load_schema())
    span = (_epoch(flow_run.get("start_time")), _epoch(flow_run.get("end_time")))
    attempts, ambiguous = _place_attempts(maps, observations)
    files = _Files(wfc)
    ok_by_map = files.outputs(maps, attempts)
    _link_upstream(maps, attempts, ok_by_map, files)
    machine_objs = _machines_of(wfc, machines, attempts)
    wf = _workflow(wfc, maps, attempts, flow_run, span, _instance_description(maps, attempts, flow_run, ambiguous),
                   author=author, email=email, created_at=created_at)
    wf.schema_version = schema_version
    wf.machines = machine_objs  # declared in host order (else in the order tasks first use them)
    wf.runtime_system_url = None  # WfCommons would name its own documentation
    if author is None:
        wf.author_name = None  # WfCommons would make one up (the login name, its support address)
    by_id = _add_tasks(wfc, wf, maps, attempts, files.files, machine_objs)
    wf.generate_json()
    doc: dict[str, Any] = wf.workflow_json
    _finish_instance(doc, by_id, machines)
    return doc


def _check_instance_inputs(maps: Sequence[MapRun], observations: Sequence[Observation], flow_run: Mapping[str, Any],
                           author: str | None, email: str | None) -> None:
    """TraceExportError unless there is something to trace and the author is whole (a name and an email, or neither)."""
    if not maps:
        raise TraceExportError(f"flow run {flow_run.get('id', '?')} has no chunked maps to trace")
    if not observations:
        raise TraceExportError(
            f"no chunk task runs recorded for flow run {flow_run.get('id', '?')}: its {len(maps)} chunked map(s) "
            "ran no task (their outputs were complete already?); WfFormat needs at least one task")
    if (author is None) != (email is None) or author == "" or email == "":
        raise TraceExportError("an author needs both a name and an email (WfFormat requires both): give --author "
                               "and --email together, or neither")


def _place_attempts(maps: Sequence[MapRun], observations: Sequence[Observation]) -> tuple[list[_Attempt], int]:
    """Every attempt placed: its map, chunk, read box (chunk plus halo, clipped to the volume), energy share
    (joules) and task id, in map order then start time; and how many matched several maps (see :func:`_assign_maps`)."""
    owners, ambiguous = _assign_maps(maps, observations)
    attempts: list[_Attempt] = []
    for o, mi in zip(observations, owners):
        chunk = _parse_chunk(o)
        m = maps[mi]
        try:
            read, _ = with_halo(chunk, m.halo, m.shape)
        except MemchunkError as exc:
            raise TraceExportError(f"the chunk {o.chunk} of {m.operator} does not fit its map's volume "
                                   f"{m.shape}: {exc}") from exc
        attempts.append(_Attempt(o, mi, chunk, read, _start_of(o)))
    attempts.sort(key=lambda a: (a.map_index, a.start, a.obs.created_at))
    shares = _energy_shares([a.obs for a in attempts])
    for a, j in zip(attempts, shares):
        a.joules = j
    task_ids = _Ids()
    for a in attempts:
        base = task_id_base(maps[a.map_index].operator, a.chunk.key())
        a.task_id = task_ids.get(id(a), [base])
    return attempts, ambiguous


class _Files:
    """The instance's files, by id (WfCommons ``File`` objects, sizes in bytes), and the ids given so far."""

    def __init__(self, wfc: Any) -> None:
        self.wfc = wfc
        self.files: dict[str, Any] = {}
        self.ids = _Ids()
        self.output_names = _Ids()  # prefixes of chunk file ids

    def file_of(self, fid: str, size: int) -> Any:
        """The file ``fid``, declared with ``size`` bytes the first time it is named."""
        if fid not in self.files:
            self.files[fid] = self.wfc.File(fid, int(max(0, size)), logger=_QUIET)
        return self.files[fid]

    def source(self, m: MapRun) -> str:
        """The id of ``m``'s source file (its recorded size, else the volume's bytes)."""
        fid = self.ids.get(("path", m.source), _path_candidates(m.source))
        volume_bytes = m.shape[0] * m.shape[1] * m.shape[2] * int(m.itemsize)
        self.file_of(fid, m.source_bytes if m.source_bytes is not None else volume_bytes)
        return fid

    def outputs(self, maps: Sequence[MapRun], attempts: Sequence[_Attempt]) -> dict[int, list[_Attempt]]:
        """Declare every ok attempt's output region (``<output>.<chunk key>``) as its output file; the ok
        attempts by map index."""
        ok_by_map: dict[int, list[_Attempt]] = {}
        for a in attempts:
            m = maps[a.map_index]
            if a.obs.outcome == "ok":
                base = self.output_names.get(m.output_path or ("operator", m.operator, a.map_index),
                                             _path_candidates(m.output_path) if m.output_path else [m.operator])
                fid = self.ids.get(("chunk", a.map_index, a.chunk.key()), [f"{base}.{a.chunk.key()}"])
                self.file_of(fid, a.chunk.elements * int(m.itemsize))
                a.output = fid
                ok_by_map.setdefault(a.map_index, []).append(a)
        return ok_by_map


def _link_upstream(maps: Sequence[MapRun], attempts: Sequence[_Attempt], ok_by_map: Mapping[int, list[_Attempt]],
                   files: _Files) -> None:
    """Each attempt's input files and parents: the upstream map's output chunks its read box overlaps, else
    (and for what no upstream chunk covers) its source file.

    The upstream map of a map is the one that wrote its source, the last to end before it (maps are in the
    order they ended; one that ended later cannot have fed this one).
    """
    for mi, m in enumerate(maps):
        mine = [a for a in attempts if a.map_index == mi]
        if not m.source:
            continue  # an array in memory: nothing read from a file
        ui = next((ui for ui in range(mi - 1, -1, -1) if maps[ui].output_path == m.source), None)
        if ui is None:  # a file no map of the run wrote first (a SEG-Y survey, an output of an earlier run)
            fid = files.source(m)
            for a in mine:
                a.inputs.append(fid)
            continue
        producers = sorted(ok_by_map.get(ui, []), key=lambda p: p.chunk.start[0])
        starts = [p.chunk.start[0] for p in producers]
        longest = max((p.chunk.shape[0] for p in producers), default=0)
        for a in mine:
            lo = bisect.bisect_left(starts, a.read.start[0] - longest + 1)
            hi = bisect.bisect_left(starts, a.read.stop[0])
            if _link_producers(a, producers[lo:hi]) < a.read.elements:
                # Part of the read box was written by an earlier flow run (a resumed output): the store itself.
                a.inputs.append(files.source(m))


def _link_producers(a: _Attempt, producers: Sequence[_Attempt]) -> int:
    """Make each producer whose output chunk overlaps ``a``'s read box a parent, its output an input; returns
    the elements of the read box they cover (each output counted once)."""
    covered, seen = 0, set()
    for p in producers:
        box = p.chunk.intersect(a.read)
        if box is None:
            continue
        a.parents.append(p)
        if p.output not in seen:
            seen.add(p.output)
            a.inputs.append(p.output)  # type: ignore[arg-type]
            covered += box.elements
    return covered


def _machines_of(wfc: Any, machines: Mapping[str, Mapping[str, Any]], attempts: Sequence[_Attempt]) -> dict[str, Any]:
    """WfCommons ``Machine`` objects of the hosts tasks ran on, in host order, described as the store has them."""
    machine_objs: dict[str, Any] = {}
    for host in sorted({a.obs.host for a in attempts if a.obs.host}):
        info = dict(machines.get(host, {}) or {})
        try:
            system = wfc.MachineSystem(str(info.get("system", "")).lower()) if info.get("system") else None
        except ValueError:
            system = None
        machine_objs[host] = wfc.Machine(name=host, cpu=dict(info.get("cpu") or {}), system=system,
                                         architecture=info.get("architecture") or None,
                                         memory=info.get("memoryInBytes") or None,
                                         release=info.get("release") or None, logger=_QUIET)
    return machine_objs


def _instance_description(maps: Sequence[MapRun], attempts: Sequence[_Attempt], flow_run: Mapping[str, Any],
                          ambiguous: int) -> str:
    """The instance's description: what the tasks, files, parents, memory and energy figures are."""
    flow_id = str(flow_run.get("id", ""))
    flow_name, run_name = str(flow_run.get("flow_name") or "flow"), str(flow_run.get("name") or flow_id)
    operators = ", ".join(dict.fromkeys(m.operator for m in maps))
    state = f", {flow_run['state']}" if flow_run.get("state") else ""
    return (
        f"Chunk task runs of Prefect flow run {flow_id} (flow {flow_name}, run {run_name}{state}), chunked by "
        f"memchunk-prefect: one task per chunk task-run attempt of its {len(maps)} chunked map(s) ({operators}), "
        "failed attempts included (outcome on each task; they have no children and no output files). Files are the "
        "chunks' output regions (<output>.<chunk key>) and the source files no map of the run wrote; a task's "
        "parents are the upstream tasks whose output chunks its read box (chunk plus halo) overlaps. memoryInBytes "
        "is the worker process's resident set peak (its resting level at the start plus the task's peak above it, "
        "peakAboveRestingBytes). " + _energy_description([a.obs for a in attempts])
        + (f" {ambiguous} task run(s) matched more than one map of the same operator key and were given to the "
           "first." if ambiguous else ""))


def _workflow(wfc: Any, maps: Sequence[MapRun], attempts: Sequence[_Attempt], flow_run: Mapping[str, Any],
              span: tuple[float | None, float | None], description: str, *, author: str | None, email: str | None,
              created_at: float | None) -> Any:
    """The WfCommons ``Workflow``: named ``<flow>/<run>``, executed from the flow run's start (else the first
    attempt's or map's) for a makespan to its end (else the last attempt's or map's), seconds."""
    run_start, run_end = span
    first = min(a.start for a in attempts)
    last = max(max(a.start + float(a.obs.seconds or 0.0), float(a.obs.created_at)) for a in attempts)
    start = run_start if run_start is not None else min(first, min(m.started_at for m in maps))
    end = run_end if run_end is not None else max(last, max(m.ended_at for m in maps))
    flow_id = str(flow_run.get("id", ""))
    flow_name, run_name = str(flow_run.get("flow_name") or "flow"), str(flow_run.get("name") or flow_id)
    return wfc.Workflow(name=f"{flow_name}/{run_name}", description=description, runtime_system_name=RUNTIME_SYSTEM,
                        runtime_system_version=_version(), executed_at=rfc3339(start),
                        makespan=max(0.0, end - start), author_name=author, author_email=email,
                        created_at=rfc3339(created_at if created_at is not None else datetime.now(timezone.utc)
                                           .timestamp()), logger=_QUIET)


def _add_tasks(wfc: Any, wf: Any, maps: Sequence[MapRun], attempts: Sequence[_Attempt], files: Mapping[str, Any],
               machine_objs: Mapping[str, Any]) -> dict[str, _Attempt]:
    """One WfCommons ``Task`` per attempt (seconds, bytes, kWh, watts, percent of one core), then the
    dependencies on its parents; returns the attempts by task id."""
    by_id: dict[str, _Attempt] = {}
    for a in attempts:
        o, m = a.obs, maps[a.map_index]
        seconds = max(0.0, float(o.seconds or 0.0))
        memory = o.peak_bytes + int(o.baseline_bytes) if o.baseline_bytes is not None else o.peak_bytes
        task = wfc.Task(
            name=m.operator, task_id=a.task_id, runtime=seconds, category=m.operator, cores=1,
            input_files=[files[f] for f in a.inputs], output_files=[files[a.output]] if a.output else [],
            machines=[machine_objs[o.host]] if o.host else None,
            avg_cpu=100.0 * cpu / seconds if (cpu := _cpu_seconds(o)) is not None and seconds > 0 else None,
            bytes_read=int(o.bytes_in), bytes_written=a.chunk.elements * int(m.itemsize) if o.outcome == "ok" else 0,
            memory=int(memory),
            energy=kwh(a.joules) if a.joules is not None else None,
            avg_power=a.joules / seconds if a.joules is not None and seconds > 0 else None,
            executed_at=rfc3339(a.start), logger=_QUIET)
        wf.add_task(task)
        by_id[a.task_id] = a
    for a in attempts:
        for parent in dict.fromkeys(p.task_id for p in a.parents):
            wf.add_dependency(parent, a.task_id)
    return by_id


def _finish_instance(doc: dict[str, Any], by_id: Mapping[str, _Attempt],
                     machines: Mapping[str, Mapping[str, Any]]) -> None:
    """WfCommons' JSON made final, in place: edges in a stable order, the extension fields
    (:data:`EXTENSION_FIELDS`) on each execution task, the CPU model the ``Machine`` class drops."""
    for t in doc["workflow"]["specification"]["tasks"]:
        t["parents"] = sorted(t.get("parents", []))
        t["children"] = sorted(t.get("children", []))
    for t in doc["workflow"].get("execution", {}).get("tasks", []):
        o = by_id[t["id"]].obs
        if o.energy_source and _finite(o.energy_joules):
            t["energySource"] = str(o.energy_source)
        t["outcome"] = o.outcome
        t["operatorKey"] = o.operator_key
        t["peakAboveRestingBytes"] = int(o.peak_bytes)
        if o.task_run_id:
            t["taskRunId"] = str(o.task_run_id)
    for mdoc in doc["workflow"].get("execution", {}).get("machines", []):
        model = ((machines.get(mdoc.get("nodeName", ""), {}) or {}).get("cpu") or {}).get("model")
        if model:
            mdoc.setdefault("cpu", {})["model"] = str(model)


def _version() -> str:
    from memchunk_prefect import __version__

    return str(__version__)


# --------------------------------------------------------------------------- WfCommons, validation


def _wfcommons() -> Any:
    """WfCommons' classes, imported on first use; TraceExportError naming the extra when it is missing.

    Importing ``wfcommons`` runs ``warnings.filterwarnings('ignore')`` (in ``wfcommons.utils``), which would
    silence every warning of the process after it: the import runs inside ``catch_warnings``, which undoes it.
    """
    try:
        with warnings.catch_warnings():
            from wfcommons.common import File, Machine, Task, Workflow
            from wfcommons.common.machine import MachineSystem
            from wfcommons.wfinstances.schema import SchemaValidator
    except ImportError as exc:
        raise TraceExportError(f"WfCommons traces need the wfcommons package (>= 1.6, < 1.7), which is not "
                               f"installed ({exc}): pip install 'memchunk-prefect[trace]' (wfcommons 1.6 needs "
                               "Python >= 3.11)") from exc
    return SimpleNamespace(File=File, Machine=Machine, Task=Task, Workflow=Workflow, MachineSystem=MachineSystem,
                           SchemaValidator=SchemaValidator)


def validate(doc: Mapping[str, Any], schema: str | os.PathLike | None = None) -> None:
    """Validate a WfFormat instance against ``schema`` (default: the vendored 1.5 schema): WfCommons'
    syntax check (JSON Schema) and semantic check (ids declared once, parents and children known and
    agreeing, files declared, no cycle, metrics consistent). Raises TraceExportError quoting the first
    errors; warnings (a format the schema names, a dependency declared on one side only) count as errors
    too: a trace written here is meant to load cleanly anywhere."""
    wfc = _wfcommons()
    path = Path(schema) if schema is not None else SCHEMA_FILE
    load_schema(path)  # a readable WfFormat schema, or a clear error
    with warnings.catch_warnings():
        # The 1.5 schema's "$schema" (http://json-schema.org/schema#) names no draft: jsonschema uses the latest.
        warnings.simplefilter("ignore", DeprecationWarning)
        validator = wfc.SchemaValidator(path, logger=_QUIET)
        try:
            validator.validate_instance(dict(doc))
        except RuntimeError as exc:
            problems = list(validator.errors) or [str(exc)]
            raise TraceExportError(f"the trace does not validate against {path} ({exc}); nothing was written. "
                                   f"{len(problems)} error(s), first: " + "; ".join(problems[:ERRORS_SHOWN])) from None
        except (KeyError, TypeError, AttributeError) as exc:  # a document the semantic checks cannot walk
            raise TraceExportError(f"the trace does not validate against {path}: {type(exc).__name__}: {exc}; "
                                   "nothing was written") from None
    if validator.warnings:
        raise TraceExportError(f"the trace validates against {path} with {len(validator.warnings)} warning(s); "
                               "nothing was written. First: " + "; ".join(validator.warnings[:ERRORS_SHOWN]))


# --------------------------------------------------------------------------- Prefect, store, file


def _api_description() -> str:
    """Which Prefect API a client here talks to, in words."""
    try:
        from prefect.settings import get_current_settings

        settings = get_current_settings()
        if settings.api.url:
            return f"the Prefect API at {settings.api.url} (PREFECT_API_URL)"
        url: Any = settings.server.database.connection_url
        db = url.get_secret_value() if hasattr(url, "get_secret_value") else url
        return (f"Prefect's temporary local server on its database {db} (no PREFECT_API_URL; "
                f"PREFECT_HOME={settings.home})")
    except Exception:  # noqa: BLE001 - a description only
        return "the Prefect API your settings point at"


def read_flow_run(flow_run_id: str) -> dict[str, Any]:
    """What Prefect knows of a finished flow run: ``id``, ``name``, ``flow_name``, ``state``, ``start_time``,
    ``end_time`` (datetimes). TraceExportError when the id is not a UUID, the API does not know it or cannot be
    reached, or the run has not ended (Running, Pending, Scheduled, Paused: wait for it)."""
    try:
        run_uuid = uuid.UUID(str(flow_run_id))
    except ValueError:
        raise TraceExportError(f"{flow_run_id!r} is not a flow run id (a UUID, as the Prefect UI and "
                               "`prefect flow-run ls` show it) nor `latest`") from None
    # No telemetry from a temporary server started just to read one run (there may be no network for it).
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    api = _api_description()
    try:
        with get_client(sync_client=True) as client:
            run = client.read_flow_run(run_uuid)
            flow = client.read_flow(run.flow_id)
    except ObjectNotFound:
        raise TraceExportError(
            f"flow run {run_uuid} is unknown to {api}: point PREFECT_API_URL (or PREFECT_HOME, for runs that used a "
            "temporary server) at the server the flow ran with, or check the id (`prefect flow-run ls`)") from None
    except Exception as exc:  # noqa: BLE001 - unreachable, refused, timed out: say which API and why
        raise TraceExportError(f"could not read flow run {run_uuid} from {api}: {type(exc).__name__}: {exc}; start "
                               "that server or fix PREFECT_API_URL") from exc
    state = run.state
    if state is None or not state.is_final():
        name = state.name if state is not None else "without a state"
        raise TraceExportError(f"flow run {run_uuid} ({run.name}) is {name}: unfinished, wait for it to end, then "
                               "export it")
    return {"id": str(run.id), "name": run.name, "flow_name": flow.name, "state": state.name,
            "start_time": run.start_time, "end_time": run.end_time}


def latest_flow_run_id(store: Any) -> str:
    """The flow run of the most recently ended chunked map in ``store``; TraceExportError when it holds none."""
    maps = [m for m in store.maps() if m.flow_run_id]
    if not maps:
        raise TraceExportError(f"no chunked maps recorded in store {store.path}: run a flow with MemoryAwareRunner "
                               f"(memchunk-prefect >= {_version()} records them), or pass --store")
    return max(maps, key=lambda m: m.ended_at).flow_run_id


def default_output(flow_run_id: str) -> Path:
    """Where a trace goes when no output is given: ``./<flow run id>.wfcommons.json``."""
    return Path(f"{sanitize_id(flow_run_id)}.wfcommons.json")


def export_wfcommons(flow_run_id: str, store: Any, output: str | os.PathLike | None = None,
                     schema: str | os.PathLike | None = None, *, author: str | None = None,
                     email: str | None = None, flow_run: Mapping[str, Any] | None = None) -> Path:
    """Write the validated WfFormat trace of one finished flow run; returns the path written.

    - ``flow_run_id``: a flow run UUID, or ``"latest"`` (the flow run of the store's most recently ended map);
    - ``store``: a :class:`~memchunk_prefect.learn.store.Store` or a store path;
    - ``output``: the file to write (default :func:`default_output`); replaced atomically, only after the
      trace validated, so a failure at any step leaves no file and no temporary file;
    - ``schema``: a WfFormat schema file (default the vendored 1.5 schema); its ``schemaVersion`` is written;
    - ``flow_run``: what Prefect knows of the run (as :func:`read_flow_run` returns it), when the caller
      already has it; else Prefect is asked.
    """
    from memchunk_prefect.learn.store import Store

    own = not isinstance(store, Store)
    st = Store(store) if own else store
    try:
        version = schema_version_of(load_schema(schema))
        _wfcommons()  # fail before asking Prefect when the extra is missing
        run_id = latest_flow_run_id(st) if str(flow_run_id) == "latest" else str(flow_run_id)
        info = dict(flow_run) if flow_run is not None else read_flow_run(run_id)
        maps = st.maps(run_id)
        if not maps:
            raise TraceExportError(
                f"no chunked maps recorded for flow run {run_id} in store {st.path}: only chunked maps "
                f"(chunked(...) with MemoryAwareRunner) are traced, and runs before memchunk-prefect {_version()} "
                "kept none, or the store differs: pass --store (or set MEMCHUNK_STORE) to the store the run used")
        doc = build_instance(maps, st.run_observations(run_id), st.machines(), info, schema_version=version,
                             author=author, email=email)
    finally:
        if own:
            st.close()
    return write_instance(doc, Path(output) if output is not None else default_output(run_id), schema)


def write_instance(doc: Mapping[str, Any], output: str | os.PathLike,
                   schema: str | os.PathLike | None = None) -> Path:
    """Validate ``doc`` (:func:`validate`), then write it to ``output`` atomically; returns the path.

    Nothing is written when it does not validate or cannot be written (no temporary file is left)."""
    from memchunk_prefect.io.files import atomic_write_text

    validate(doc, schema)
    target = Path(output)
    try:
        atomic_write_text(target, json.dumps(doc, indent=1) + "\n")
    except OSError as exc:
        raise TraceExportError(f"cannot write the trace to {target}: {exc}; nothing was written") from exc
    return target


def simulated_instance(result: Any, steps: Sequence[Any], shape: Sequence[int], cluster: Any, *,
                       started_at: float | None = None) -> dict[str, Any]:
    """The WfFormat instance of one simulated run (:func:`memchunk_prefect.sim.runs.trace_records`), built
    as a real run's is, so the two compare task by task (:func:`memchunk_prefect.sim.trace_compare.compare`)."""
    import time as _time

    from memchunk_prefect.sim.runs import trace_records

    t0 = _time.time() if started_at is None else float(started_at)
    ni, nx, nt = (int(v) for v in shape)
    maps, observations, machines, flow_run = trace_records(result, steps, (ni, nx, nt), cluster, started_at=t0)
    doc = build_instance(maps, observations, machines, flow_run, created_at=t0)
    doc["description"] = ("A SIMULATED run (memchunk simulate), not a measured one: each task's memory, time and "
                          "energy were drawn from the models learned by memchunk-prefect. " + doc["description"])
    return doc


def summary(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Counts for a line of output: tasks, files, edges, failed attempts, energy (kWh) and its sources."""
    spec = doc["workflow"]["specification"]
    tasks: list[Mapping[str, Any]] = list(doc["workflow"].get("execution", {}).get("tasks", []))
    return {"tasks": len(spec["tasks"]), "files": len(spec.get("files", [])),
            "edges": sum(len(t.get("parents", [])) for t in spec["tasks"]),
            "failed": sum(t.get("outcome", "ok") != "ok" for t in tasks),
            "energy_kwh": sum(float(t.get("energyInKWh", 0.0)) for t in tasks),
            "energy_sources": sorted({str(t["energySource"]) for t in tasks if t.get("energySource")}),
            "schema_version": doc.get("schemaVersion")}
