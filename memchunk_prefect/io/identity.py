"""Whose output is this? The one owner of the resume / restart / refuse decision for a map's output path.

A chunked map writes a zarr store at its output path. When something is
already there, what to do depends on what it was computed from, recorded in the
store when it was created as an :class:`OutputIdentity`: the operator key (with
its memory parameters), the input's identity (path, size, mtime; see
:meth:`memchunk_prefect.io.source.Source.identity`), a digest of the task's code, a
digest of every other parameter, and the halo.

:func:`output_action` decides, as a pure function over what is found:

- nothing there: ``create``;
- a memchunk store of this operator and shape, computed from the same input,
  code, parameters and halo: ``resume`` (completed chunks are kept; only what
  they do not cover is computed, nothing when it is complete);
- a memchunk store of this operator and shape computed from anything else, or
  from an input that cannot be identified (an array in memory), or written in
  the other format (zarr where MDIO is asked, or MDIO where zarr is): ``restart``
  (replaced, never mixed);
- a memchunk store of another operator or shape: ``refuse``, unless the caller
  owns the path (``replace_any=True``, as the ``seismic-attributes`` flow does
  for its own attribute files), then ``restart``;
- anything else (not a store memchunk wrote): ``refuse``, always.

:func:`open_output` is the I/O around it, used by the runner for every chunked map.

>>> want = OutputIdentity("envelope|float32|cpu", {"kind": "segy", "path": "/s.sgy"}, "c1", "p1", (0, 0, 0))
>>> output_action("/o.zarr", None, want, (4, 4, 8)).action
'create'
>>> found = FoundOutput(memchunk=True, shape=(4, 4, 8), operator_key=want.operator_key, identity=want.to_json())
>>> output_action("/o.zarr", found, want, (4, 4, 8)).action
'resume'
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import zarr

from memchunk_prefect.core.chunks import AXES, Chunk, Shape
from memchunk_prefect.core.errors import OutputPathError
from memchunk_prefect.core.settings import DTYPE
from memchunk_prefect.io.mdio import create_mdio_output
from memchunk_prefect.io.zarr_store import ZarrOutput, output_layout

CREATE, RESUME, RESTART, REFUSE = "create", "resume", "restart", "refuse"

#: The output formats: a zarr store in the input's dims (the default), or an MDIO v1 dataset.
ZARR, MDIO = "zarr", "mdio"
OUTPUT_FORMATS = (ZARR, MDIO)


@dataclass(frozen=True)
class OutputIdentity:
    """What an output was computed from. ``input`` is None when the input cannot be identified cheaply."""

    operator_key: str
    input: dict | None
    code: str  # SHA-256 of the task's source (see code_digest)
    params: str  # SHA-256 of the map's other arguments (see params_digest)
    halo: Sequence[int]

    def to_json(self) -> dict:
        """The identity as the store keeps it (a JSON round trip, so it compares equal to what is read back)."""
        doc = {"operator_key": self.operator_key, "input": self.input, "code": self.code, "params": self.params,
               "halo": [int(h) for h in self.halo]}
        return json.loads(json.dumps(doc))


@dataclass(frozen=True)
class FoundOutput:
    """What is at an output path: a memchunk store (with its shape, operator key and identity) or something else."""

    memchunk: bool
    shape: Shape | None = None
    operator_key: str | None = None
    identity: dict | None = None
    layout: str = ZARR


@dataclass(frozen=True)
class OutputAction:
    """``action`` (create, resume, restart, refuse) and ``reason`` in words (for the log and the error)."""

    action: str
    reason: str = ""


_WHAT_DIFFERS = {"input": "another input (or the input changed since)", "code": "other task code",
                 "params": "other parameters", "halo": "another halo"}


def output_action(path: str, found: FoundOutput | None, want: OutputIdentity, shape: Shape, *,
                  replace_any: bool = False, output_format: str = ZARR) -> OutputAction:
    """Create, resume, restart or refuse the output at ``path`` (pure; see the module docstring)."""
    if found is None:
        return OutputAction(CREATE)
    if not found.memchunk:
        return OutputAction(REFUSE, f"{path}: exists and is not a store written by memchunk; refusing to replace it. "
                                    "Choose another output path, or move that one away")
    shape = tuple(int(s) for s in shape)  # type: ignore[assignment]
    if found.shape != shape or found.operator_key != want.operator_key:
        held = f"output of {found.operator_key!r} with shape {found.shape}"
        if replace_any:
            return OutputAction(RESTART, f"it held {held}")
        return OutputAction(REFUSE, f"{path}: already holds {held}, not {want.operator_key!r} with shape {shape}; "
                                    "choose another output path")
    identity = want.to_json()
    if found.layout != output_format:
        return OutputAction(RESTART, f"it was written as {found.layout}, and {output_format} is asked for")
    if identity["input"] is None:
        return OutputAction(RESTART, "its input (an array in memory, or a zarr store not written by memchunk) "
                                     "cannot be identified without reading it all")
    if found.identity == identity:
        return OutputAction(RESUME)
    old = found.identity or {}
    differs = " and ".join(v for k, v in _WHAT_DIFFERS.items() if old.get(k) != identity[k])
    return OutputAction(RESTART, "it was computed from " + (differs or "something else"))


def inspect_output(path: str | os.PathLike) -> FoundOutput | None:
    """Read what is at ``path``: None for nothing, else what kind of store (reads only its metadata)."""
    p = Path(path)
    if not p.exists():
        return None
    try:
        existing = ZarrOutput.open(p)
        attrs = dict(zarr.open_group(str(p), mode="r").attrs)
    except Exception:  # noqa: BLE001 - anything unreadable is "not ours"
        return FoundOutput(memchunk=False)
    if not attrs.get("memchunk_store"):
        return FoundOutput(memchunk=False)
    key, identity = attrs.get("operator_key"), attrs.get("memchunk_identity")
    return FoundOutput(memchunk=True, shape=existing.shape, operator_key=key if isinstance(key, str) else None,
                       identity=dict(identity) if isinstance(identity, dict) else None, layout=output_layout(p))


def open_output(path: str, want: OutputIdentity, shape: Shape, coords: Mapping[str, Any], *, operator: str,
                replace_any: bool = False, output_format: str = ZARR, dims: Sequence[str] = AXES,
                carry_from: str | None = None) -> tuple[Any, list[Chunk], OutputAction]:
    """Create, resume or replace the store at ``path`` for a map computing ``want``; refuse with OutputPathError.

    ``output_format``: ``zarr`` (a :class:`~memchunk_prefect.io.zarr_store.ZarrOutput` store in the input's
    ``dims``) or ``mdio`` (an MDIO v1 dataset, :func:`~memchunk_prefect.io.mdio.create_mdio_output`, carrying
    ``carry_from``'s trace headers where that is an MDIO input). Returns the
    :class:`~memchunk_prefect.io.zarr_store.ZarrOutput` (either format is written through it), the chunks it
    already holds (on resume), and the action taken.
    """
    attrs = {"operator": operator, "operator_key": want.operator_key, "memchunk_identity": want.to_json()}

    def decide() -> OutputAction:
        return output_action(path, inspect_output(path), want, shape, replace_any=replace_any,
                             output_format=output_format)

    act = decide()
    if act.action == REFUSE:
        raise OutputPathError(act.reason)
    if act.action == RESUME:
        out = ZarrOutput.open(path)
        return out, out.completed_chunks(), act
    try:
        if output_format == MDIO:
            out = create_mdio_output(path, shape, coords, dims=dims, attrs=attrs, overwrite=act.action == RESTART,
                                     carry_from=carry_from)
        else:
            out = ZarrOutput.create(path, shape, coords, dtype=DTYPE, attrs=attrs, overwrite=act.action == RESTART,
                                    dims=dims)
    except OutputPathError:
        # Created by someone else between the look and the create: decide again on what is there now.
        act = decide()
        if act.action != RESUME:
            raise
        out = ZarrOutput.open(path)
        return out, out.completed_chunks(), act
    return out, [], act


# --------------------------------------------------------------------------- digests


def _plain(v: Any, array: Callable[[np.ndarray], Any], scalars: bool = False) -> Any:
    """``v`` as JSON-able values: containers element by element, arrays as ``array`` says, numpy scalars as
    numbers where ``scalars`` (else by repr, as digests of existing outputs were taken), others by repr."""
    if isinstance(v, np.ndarray):
        return array(v)
    if isinstance(v, (list, tuple)):
        return [_plain(x, array, scalars) for x in v]
    if isinstance(v, dict):
        return {str(k): _plain(x, array, scalars) for k, x in v.items()}
    if scalars and isinstance(v, np.generic):
        return v.item()
    return v if isinstance(v, (str, int, float, bool, type(None))) else repr(v)


def params_digest(params: Mapping[str, Any]) -> str:
    """SHA-256 of a map's other arguments (JSON where possible, else their repr; arrays by content)."""

    def by_content(a: np.ndarray) -> dict[str, Any]:
        return {"ndarray": hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest(), "dtype": str(a.dtype),
                "shape": list(a.shape)}

    return hashlib.sha256(json.dumps(_plain(dict(params), by_content), sort_keys=True).encode()).hexdigest()


#: The longest parameter record kept with a map (characters): a long list or repr is cut there.
PARAMS_RECORD_CHARS = 4000


def params_record(params: Mapping[str, Any]) -> str:
    """A map's other arguments as the store keeps them, to show and to re-simulate the map: JSON, sorted, arrays
    by shape and dtype (not content), anything else by its repr; at most :data:`PARAMS_RECORD_CHARS` characters.

    >>> params_record({"sigma": (1, 2), "w": np.zeros((3, 4), "float32"), "name": "x"})
    '{"name": "x", "sigma": [1, 2], "w": {"dtype": "float32", "ndarray": [3, 4]}}'
    """
    text = json.dumps(_plain(dict(params), lambda a: {"ndarray": list(a.shape), "dtype": str(a.dtype)}, True),
                      sort_keys=True)
    return text[:PARAMS_RECORD_CHARS]


def code_digest(fn: Any) -> str:
    """SHA-256 of a task function's source (its bytecode when the source is not available)."""
    try:
        text = inspect.getsource(fn).encode()
    except (OSError, TypeError):
        code = getattr(fn, "__code__", None)
        text = code.co_code + repr(code.co_consts).encode() if code is not None else repr(fn).encode()
    return hashlib.sha256(text).hexdigest()
