"""Seismic attribute flows: one survey, or every survey in a directory (nightly reprocessing).

``seismic_attributes(segy_path, attributes, output)`` computes each requested
attribute from the seismic itself (not chained: see ``flows.pipeline`` for
chains) with the memory-aware runner choosing the chunking, writes each to a
zarr store under ``output`` and, with ``export_segy=True``, to a SEG-Y file with
the input's geometry and headers. Attributes are plain data, so the flow can be
deployed with parameters::

    ["envelope", {"name": "gaussian_smooth", "sigma": [2, 2, 2], "output": "smooth-2"}, {"name": "gst3d_dip"}]

``"output"`` names the attribute's files (default: the operator's name); it is
a path relative to ``output`` and may not leave it
(:class:`~memchunk_prefect.core.errors.OutputPathError`).

When every output is finalized (every element written) and exported, a small
manifest ``memchunk-manifest.json`` is written atomically beside them, naming
the input's content fingerprint and the parameters. It is deleted before a run
starts writing, so a half-written output is never marked done.

``reprocess_survey(directory, attributes)`` runs ``seismic_attributes`` as a
subflow for every SEG-Y file in ``directory`` (outputs under
``<output>/<file stem>/``), skipping files whose content and parameters are
unchanged since their last successful processing. Content identity is the
file's SHA-256; the size and modification time (ns) recorded with it are a
shortcut: when both match, the file is taken as unchanged without re-reading it
(``always_hash=True`` re-hashes every file every run). A file whose size or
mtime changed is hashed: same hash -> skipped (the manifest's times are
refreshed), different -> reprocessed.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from prefect import flow, get_run_logger

from memchunk_prefect import MemoryAwareRunner, chunked
from memchunk_prefect.core.errors import OutputPathError, RunnerConfigError
from memchunk_prefect.io.files import atomic_write_json

MANIFEST = "memchunk-manifest.json"
MANIFEST_VERSION = 1
SEGY_SUFFIXES = (".sgy", ".segy")
#: What the nightly deployment computes unless told otherwise.
DEFAULT_ATTRIBUTES: list[Any] = ["envelope", {"name": "gaussian_smooth", "sigma": [2.0, 2.0, 2.0]}, "gst3d_dip"]

AttributeSpec = Union[str, dict[str, Any]]


# =========================================================================== parameters


@dataclass(frozen=True)
class Attribute:
    """One requested attribute: the operator, its parameters, and the name of its outputs."""

    name: str
    params: dict[str, Any] = field(default_factory=dict)
    output: str = ""

    def canonical(self) -> dict[str, Any]:
        return {"name": self.name, "output": self.output,
                "params": {k: (list(v) if isinstance(v, tuple) else v) for k, v in sorted(self.params.items())}}


def normalize_attributes(attributes: list[AttributeSpec] | None) -> list[Attribute]:
    """Check every requested attribute before anything runs.

    Unknown operators, unknown parameters and two attributes writing the same
    output are :class:`~memchunk_prefect.core.errors.RunnerConfigError`; an ``output``
    name that would leave the output directory is an ``OutputPathError``.
    """
    from memchunk_prefect.operators.registry import resolve_step

    specs = list(attributes) if attributes else list(DEFAULT_ATTRIBUTES)
    out: list[Attribute] = []
    seen: set[str] = set()
    for spec in specs:
        op, params = resolve_step(spec, reserved=("name", "output"))
        name = op.name
        spec = {"name": spec} if isinstance(spec, str) else spec
        label = str(spec.get("output") or name)
        safe_relative(label)
        if label in seen:
            raise RunnerConfigError(f"two attributes write the output {label!r}: give one of them another "
                                    "\"output\" name")
        seen.add(label)
        out.append(Attribute(name=name, params=params, output=label))
    return out


def safe_relative(name: str) -> str:
    """``name`` as a relative path that stays inside its directory, else OutputPathError.

    >>> safe_relative("smooth/sigma-2")
    'smooth/sigma-2'
    >>> safe_relative("../etc")
    Traceback (most recent call last):
    ...
    memchunk_prefect.core.errors.OutputPathError: output name '../etc' must be a relative path inside the output directory (no '..', not absolute)
    """
    p = Path(name)
    if not name or p.is_absolute() or any(part in ("..", "") for part in p.parts) or name.startswith("~") \
            or "\x00" in name or p.parts in ((".",), ()):
        raise OutputPathError(f"output name {name!r} must be a relative path inside the output directory "
                              "(no '..', not absolute)")
    return name


def output_path(root: str | os.PathLike, name: str, suffix: str = "") -> Path:
    """``root/name+suffix``, checked to stay inside ``root`` after resolving links (OutputPathError if not)."""
    safe_relative(name)
    base = Path(root).expanduser().resolve()
    target = (base / f"{name}{suffix}").resolve()
    if target == base or not target.is_relative_to(base):
        raise OutputPathError(f"output {name!r} resolves to {target}, outside the output directory {base}")
    return target


def parameters_hash(attributes: list[Attribute], **options: Any) -> str:
    """SHA-256 of the canonical JSON of what decides the outputs (attributes, options, library version)."""
    import memchunk_prefect

    doc = {"attributes": [a.canonical() for a in attributes], "options": options,
           "memchunk_prefect": memchunk_prefect.__version__}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()


# =========================================================================== content fingerprints and manifests


def sha256_file(path: str | os.PathLike, block: int = 4 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while chunk := fh.read(block):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(path: str | os.PathLike) -> dict[str, Any]:
    """Size, mtime (ns) and SHA-256 of a file's content."""
    st = os.stat(path)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256_file(path)}


def read_manifest(out_dir: str | os.PathLike) -> dict | None:
    p = Path(out_dir) / MANIFEST
    try:
        doc = json.loads(p.read_text())
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) and doc.get("version") == MANIFEST_VERSION else None


def outputs_complete(out_dir: str | os.PathLike, outputs: dict[str, dict]) -> tuple[bool, str]:
    """Every zarr output finalized and complete, every SEG-Y export present."""
    import zarr

    from memchunk_prefect.io.zarr_store import ZarrOutput

    for label, files in outputs.items():
        z = Path(out_dir) / files["zarr"]
        try:
            store = ZarrOutput.open(z)
            if not (store.is_complete() and zarr.open_group(str(z), mode="r").attrs.get("complete")):
                return False, f"{label}: {z} is not complete"
        except Exception as exc:
            return False, f"{label}: {z} cannot be opened ({type(exc).__name__})"
        if files.get("segy") and not (Path(out_dir) / files["segy"]).is_file():
            return False, f"{label}: SEG-Y export {files['segy']} is missing"
    return True, "outputs complete"


def up_to_date(segy_path: str | os.PathLike, out_dir: str | os.PathLike, params_hash: str, *,
               always_hash: bool = False) -> tuple[bool, str]:
    """Whether ``segy_path`` was processed successfully with these parameters and has not changed since.

    Returns (skip?, why). When the file was only touched (same SHA-256, new
    mtime) the manifest's size and mtime are refreshed so the next run needs no hash.
    """
    m = read_manifest(out_dir)
    if m is None:
        return False, "never processed successfully"
    if m.get("params_hash") != params_hash:
        return False, "parameters changed"
    ok, why = outputs_complete(out_dir, m.get("outputs", {}))
    if not ok:
        return False, why
    fp = m.get("fingerprint", {})
    st = os.stat(segy_path)
    same_stat = fp.get("size") == st.st_size and fp.get("mtime_ns") == st.st_mtime_ns
    if same_stat and not always_hash:
        return True, "unchanged (same size and mtime)"
    if fp.get("size") != st.st_size:
        return False, "content changed (size)"
    digest = sha256_file(segy_path)
    if digest != fp.get("sha256"):
        return False, "content changed (SHA-256)"
    if not same_stat:
        m["fingerprint"] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        atomic_write_json(Path(out_dir) / MANIFEST, m)
        return True, "unchanged (same SHA-256; only touched)"
    return True, "unchanged (same SHA-256)"


# =========================================================================== flows


def _source_for(segy_path: str, iline: int, xline: int):
    from memchunk_prefect.io.segy_source import SegySource

    return SegySource(segy_path, iline, xline)


@flow(name="seismic-attributes", task_runner=MemoryAwareRunner(), log_prints=True)
def seismic_attributes(segy_path: str, attributes: list[AttributeSpec] | None = None,
                       output: str = "memchunk-output", export_segy: bool = False,
                       iline: int = 189, xline: int = 193) -> dict[str, Any]:
    """Compute ``attributes`` from ``segy_path``; write them under ``output`` as zarr (and SEG-Y).

    ``attributes``: operator names or ``{"name": ..., **parameters, "output": "file-name"}``
    (default: envelope, gaussian_smooth sigma 2, gst3d_dip). ``iline``/``xline``: trace
    header bytes of the inline and crossline numbers. Returns, per attribute, its
    outputs and what the runner decided (``summary``).
    """
    from memchunk_prefect import operators
    from memchunk_prefect.io.export import to_segy

    log = get_run_logger()
    attrs = normalize_attributes(attributes)
    root = Path(output).expanduser().resolve()
    paths = {a.output: (output_path(root, a.output, ".zarr"),
                        output_path(root, a.output, ".sgy") if export_segy else None) for a in attrs}
    phash = parameters_hash(attrs, export_segy=export_segy, iline=iline, xline=xline)
    src_path = os.path.abspath(segy_path)
    fp = fingerprint(src_path)  # before reading: a file changed during the run is reprocessed next time
    source = _source_for(src_path, iline, xline)
    root.mkdir(parents=True, exist_ok=True)
    (root / MANIFEST).unlink(missing_ok=True)  # from here on, nothing here is "done" until the new manifest
    results: dict[str, Any] = {}
    t0 = time.time()
    # Every attribute's map is submitted before any is waited for: they read the same survey and share the
    # cluster (a chunked .map returns at once); each is then collected, exported, and logged in order.
    maps = []
    for a in attrs:
        op = operators.OPERATORS[a.name]
        zpath, spath = paths[a.output]
        zpath.parent.mkdir(parents=True, exist_ok=True)
        # The attribute's file is this flow's: a memchunk output of other parameters there is replaced
        # (resumed when it is this same computation; anything memchunk did not write is refused).
        maps.append((a, zpath, spath, op.map(chunked(source, output=zpath, replace_any=True), **a.params)))
    for a, zpath, spath, res in maps:
        summary = res.summary()  # raises the map's error: no manifest is written after a failed attribute
        if spath is not None:
            to_segy(res.output_path, spath, src_path, iline=iline, xline=xline)
        log.info("%s -> %s%s: %s", a.output, zpath, f" and {spath}" if spath else "",
                 ", ".join(summary["decisions"]))
        results[a.output] = {"operator": a.name, "params": a.canonical()["params"], "zarr": str(zpath),
                             "segy": str(spath) if spath else None, "summary": summary}
    manifest = {
        "version": MANIFEST_VERSION, "source": src_path, "fingerprint": fp, "params_hash": phash,
        "attributes": [a.canonical() for a in attrs], "export_segy": export_segy,
        "outputs": {k: {"zarr": os.path.relpath(v["zarr"], root),
                        "segy": os.path.relpath(v["segy"], root) if v["segy"] else None} for k, v in results.items()},
        "completed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "seconds": round(time.time() - t0, 2),
        "flow_run_id": _flow_run_id(),
    }
    atomic_write_json(root / MANIFEST, manifest)  # only now: every store finalized, every export written
    return {"segy_path": src_path, "output": str(root), "attributes": results}


def _flow_run_id() -> str:
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    return str(ctx.flow_run.id) if ctx and ctx.flow_run else ""


def survey_files(directory: str | os.PathLike) -> list[Path]:
    """The SEG-Y files directly in ``directory`` (``.sgy``/``.segy``, any case), sorted by name."""
    d = Path(directory)
    if not d.is_dir():
        raise FileNotFoundError(f"survey directory {d} does not exist or is not a directory")
    return sorted(p for p in d.iterdir() if p.is_file() and p.suffix.lower() in SEGY_SUFFIXES)


def _shared_runner() -> MemoryAwareRunner:
    """A runner for subflows on this flow's own Dask cluster (one cluster for every file, not one per file)."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    parent = ctx.task_runner if ctx else None
    if not isinstance(parent, MemoryAwareRunner):
        return MemoryAwareRunner()
    return MemoryAwareRunner(address=parent.client.scheduler.address, memory_budget=parent.memory_budget,
                             target_fraction=parent.target_fraction, store=parent.store,
                             output_dir=parent.output_dir, policy=parent.policy)


@flow(name="reprocess-survey", task_runner=MemoryAwareRunner(), log_prints=True)
def reprocess_survey(directory: str, attributes: list[AttributeSpec] | None = None, output: str | None = None,
                     export_segy: bool = False, always_hash: bool = False, iline: int = 189,
                     xline: int = 193) -> list[dict[str, Any]]:
    """Compute ``attributes`` for every SEG-Y file in ``directory`` whose content or parameters changed.

    Outputs go to ``<output>/<file stem>/`` (default ``output``:
    ``<directory>/memchunk-attributes``). Each file runs as a ``seismic-attributes``
    subflow on this flow's Dask cluster; a file that fails does not stop the
    others, but fails this run at the end (and is retried next run: it has no manifest).
    """
    from prefect.artifacts import create_table_artifact

    from memchunk_prefect.run.report import artifact_key

    log = get_run_logger()
    attrs = normalize_attributes(attributes)  # fail before touching anything
    phash = parameters_hash(attrs, export_segy=export_segy, iline=iline, xline=xline)
    root = Path(output).expanduser() if output else Path(directory) / "memchunk-attributes"
    files = survey_files(directory)
    specs = [{"name": c["name"], **c["params"], "output": c["output"]} for c in (a.canonical() for a in attrs)]
    rows: list[dict[str, Any]] = []
    sub = None
    for f in files:
        out_dir = output_path(root, f.stem)
        skip, why = up_to_date(f, out_dir, phash, always_hash=always_hash)
        row = {"file": f.name, "status": "skipped" if skip else "processed", "why": why, "output": str(out_dir),
               "seconds": 0.0, "flow_run": ""}
        if not skip:
            if sub is None:
                sub = seismic_attributes.with_options(task_runner=_shared_runner())
            t = time.time()
            state = sub(str(f), specs, str(out_dir), export_segy, iline, xline, return_state=True)
            row["seconds"] = round(time.time() - t, 2)
            row["flow_run"] = str(state.state_details.flow_run_id or "")
            if not state.is_completed():
                row["status"] = "failed"
                row["why"] = f"{why}; {state.name}: {state.message or ''}".strip()
        log.info("%s: %s (%s)", f.name, row["status"], row["why"])
        rows.append(row)
    if rows:
        create_table_artifact(rows, key=artifact_key("memchunk-reprocess", Path(directory).name or "survey"),
                              description=f"reprocess-survey of `{directory}`: "
                                          f"{sum(r['status'] == 'processed' for r in rows)} processed, "
                                          f"{sum(r['status'] == 'skipped' for r in rows)} skipped, "
                                          f"{sum(r['status'] == 'failed' for r in rows)} failed")
    failed = [r["file"] for r in rows if r["status"] == "failed"]
    if failed:
        raise RuntimeError(f"{len(failed)} of {len(rows)} surveys failed: {', '.join(failed)}")
    return rows
