"""MDIO v1 in and out: an MDIO post-stack survey as a source, and a result written as an MDIO v1 dataset.

MDIO v1 (TGS's open format for seismic on Zarr; package ``multidimio``, imported as ``mdio``) keeps a 3D
post-stack survey as a zarr v3 group: the samples in one variable (``amplitude``, named by the group's
``attributes.defaultVariableName``) with dims ``inline``, ``crossline`` and ``time`` (ms) or ``depth``;
``cdp_x``/``cdp_y`` over (inline, crossline); ``trace_mask`` (the live traces) and, after a SEG-Y import, the
trace ``headers``. ``mdio.open_mdio`` opens it as an ``xarray.Dataset``.

Reading needs zarr only: :class:`MdioSource` is a :class:`~memchunk_prefect.io.zarr_store.ZarrSource` over
the variable, so workers read their boxes straight from the store and the source pickles as a path and a
name. Writing (:func:`create_mdio_output`) builds the dataset from mdio's own post-stack template, so mdio's
tools read it as one of theirs; it needs the ``mdio`` extra (``pip install 'memchunk-prefect[mdio]'``) in
the flow's process only. The chunks are then written region by region, with completion markers, exactly as
a zarr output (:class:`~memchunk_prefect.io.zarr_store.ZarrOutput`).

An MDIO output always uses MDIO's names (``inline``, ``crossline``, ``time`` or ``depth``, ``amplitude``):
that is the format. A zarr output keeps its input's names.

>>> is_mdio_attrs({"apiVersion": "1.1.3", "attributes": {"defaultVariableName": "amplitude"}})
True
>>> is_mdio_attrs({"memchunk_store": 1})
False
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import zarr

from memchunk_prefect.core.chunks import AXES, Chunk, Shape, check_shape, grid
from memchunk_prefect.core.errors import MdioError, MdioNotFoundError
from memchunk_prefect.io.source import dims_convention
from memchunk_prefect.io.zarr_store import (
    ZarrOutput,
    ZarrSource,
    _root_attrs,
    clear_output_path,
    init_bookkeeping,
    memchunk_attrs,
    output_coords,
    output_storage_chunks,
)

#: The data variable of an MDIO post-stack dataset (mdio's templates name it so).
MDIO_VARIABLE = "amplitude"

#: MDIO's lateral dimension names; the vertical one is ``time`` or ``depth`` (the template's domain).
MDIO_LATERAL = ("inline", "crossline")

#: Variables of an MDIO input carried into an MDIO output unchanged: the live-trace mask, the trace headers
#: and the SEG-Y file headers (what ``mdio.mdio_to_segy`` needs to write the result back as SEG-Y).
CARRIED_VARIABLES = ("trace_mask", "headers", "segy_file_header")

INSTALL_HINT = "pip install 'memchunk-prefect[mdio]' (multidimio 1.1, Python >= 3.11)"


def is_mdio_attrs(attrs: Mapping[str, Any]) -> bool:
    """Whether a zarr group's root attributes are an MDIO v1 dataset's (``apiVersion`` and ``attributes``)."""
    return isinstance(attrs.get("apiVersion"), str) and isinstance(attrs.get("attributes"), dict)


def is_mdio_store(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an MDIO v1 dataset on disk (reads its root ``zarr.json`` only)."""
    return os.path.isdir(path) and is_mdio_attrs(_root_attrs(os.fspath(path)))


def _variables(path: str) -> dict[str, tuple[int, ...]]:
    """The store's arrays and their shapes."""
    return {n: tuple(a.shape) for n, a in zarr.open_group(path, mode="r").arrays()}


def _dimension_names(path: str, name: str) -> tuple[str, ...]:
    arr = zarr.open_array(path, path=name, mode="r")
    return tuple(str(d) for d in (getattr(arr.metadata, "dimension_names", None) or ()))


class MdioSource(ZarrSource):
    """One variable of an MDIO v1 post-stack dataset (``amplitude`` unless ``variable`` names another).

    Its dims are the store's own (``inline``, ``crossline``, ``time``/``depth``), and outputs keep them; its
    coordinates (the dimension coordinates and ``cdp_x``/``cdp_y``) are read from the store. Its storage chunks
    are the map's incoming chunking (:meth:`chunking`): the runner keeps them where they fit the operator.
    Bad input raises :class:`~memchunk_prefect.core.errors.MdioError` saying what was found and what to do.
    """

    kind = "mdio"

    def __init__(self, path: str | os.PathLike, variable: str | None = None, *, name: str | None = None):
        p = os.path.abspath(os.fspath(path))
        if not os.path.exists(p):
            raise MdioNotFoundError(f"{p}: no such MDIO store. Expected the directory of an MDIO v1 dataset (as "
                                    f"`mdio.segy_to_mdio` writes it); check the path and the working directory "
                                    f"({os.getcwd()}).")
        attrs = _root_attrs(p)
        if not is_mdio_attrs(attrs):
            found = "a zarr group" if attrs or os.path.exists(os.path.join(p, "zarr.json")) else "no zarr.json"
            raise MdioError(f"{p}: not an MDIO v1 dataset (found {found}, without MDIO's apiVersion and attributes "
                            "in its root zarr.json). Import the survey with mdio (`mdio.segy_to_mdio`), or pass a "
                            "plain zarr store as ZarrSource(path).")
        default = attrs["attributes"].get("defaultVariableName") or MDIO_VARIABLE
        variable = variable or name or str(default)
        shapes = _variables(p)
        volumes = sorted(n for n, s in shapes.items() if len(s) == 3)
        if variable not in shapes:
            raise MdioError(f"{p}: the MDIO dataset has no variable {variable!r}; its 3D variables are "
                            f"{volumes or 'none'}. Pass MdioSource(path, variable=...) with one of them.")
        dims = _dimension_names(p, variable)
        if len(shapes[variable]) != 3 or dims_convention(dims) != dims or dims[:2] != MDIO_LATERAL:
            raise MdioError(f"{p}: variable {variable!r} has dims {dims} and shape {shapes[variable]}; expected a "
                            "post-stack volume with dims (inline, crossline, time) or (inline, crossline, depth), "
                            f"in that order. Its 3D variables are {volumes or 'none'}; pre-stack data must be "
                            "stacked (or one offset selected) first.")
        super().__init__(p, variable)

    @property
    def variable(self) -> str:
        """The MDIO variable read (``amplitude`` for mdio's post-stack templates)."""
        return str(self.name)

    def chunking(self) -> tuple[Chunk, ...]:
        """The variable's storage chunks, cut to the volume (``mdio segy import`` writes 128 x 128 x 128 bricks)."""
        chunks = zarr.open_array(self.path, path=self.variable, mode="r").chunks
        return tuple(grid(self.shape, [min(int(c), n) for c, n in zip(chunks, self.shape)]))

    def identity(self, complete: bool = True) -> dict | None:
        """An output of memchunk: its ``write_id`` (see :meth:`ZarrSource.identity`). Any other MDIO dataset: its
        path and variable, mdio's ``createdOn`` and the variable's ``statsV1`` (rewritten by every mdio import),
        and the modification times (ns) of the dataset's and the variable's metadata.

        Values changed in place by a tool that rewrites neither (a region write into the existing arrays) are
        not seen: such a store is a new input only once its metadata changes.
        """
        attrs = _root_attrs(self.path)
        if attrs.get("memchunk_store"):
            return super().identity(complete)
        meta = [Path(self.path) / "zarr.json", Path(self.path) / self.variable / "zarr.json"]
        var_attrs = dict(zarr.open_array(self.path, path=self.variable, mode="r").attrs)
        return {**self.memchunk_source(), "createdOn": str(attrs.get("createdOn", "")),
                "apiVersion": str(attrs.get("apiVersion", "")), "stats": str(var_attrs.get("statsV1", "")),
                "metadata_mtime_ns": [m.stat().st_mtime_ns for m in meta]}


# --------------------------------------------------------------------------- MDIO out


def _mdio_writer() -> tuple[Any, Any, Any]:
    """mdio's post-stack template class, its dataset-to-xarray builder and ``to_mdio``; MdioError without mdio."""
    try:
        from mdio import to_mdio
        from mdio.builder.templates.seismic_3d_poststack import Seismic3DPostStackTemplate
        from mdio.builder.xarray_builder import to_xarray_dataset
    except ImportError as exc:
        raise MdioError(f"writing an MDIO output needs mdio, which does not import here ({type(exc).__name__}: "
                        f"{exc}); {INSTALL_HINT}. Or write zarr (the default output).") from exc
    return Seismic3DPostStackTemplate, to_xarray_dataset, to_mdio


def mdio_dims(dims: Sequence[str]) -> tuple[str, str, str]:
    """The MDIO names of a volume whose (inline, crossline, vertical) axes are named ``dims``: ``depth`` stays
    depth, any other vertical axis (``twt``, ``time``, ``samples``) is MDIO's ``time``.

    >>> mdio_dims(("iline", "xline", "twt"))
    ('inline', 'crossline', 'time')
    """
    return (*MDIO_LATERAL, "depth" if dims[2] == "depth" else "time")


def _coordinate_values(values: Any, dtype: np.dtype) -> np.ndarray:
    """``values`` in the template's dtype (int32 dimension coordinates) where they are whole numbers, else
    float64: a 0.5 ms sample interval is kept, not truncated."""
    v = np.asarray(values)
    if np.issubdtype(dtype, np.integer) and not (np.all(np.isfinite(v)) and np.array_equal(v, np.round(v))):
        return v.astype(np.float64)
    return v.astype(dtype)


def _mdio_dataset(shape: Shape, c: Mapping[str, Any], dims: tuple[str, str, str], zarr_chunks: Shape) -> Any:
    """The empty MDIO post-stack dataset (an ``xarray.Dataset``; the samples lazy, never materialised) with the
    input's coordinates and every trace live."""
    template_cls, to_xarray_dataset, _ = _mdio_writer()
    template = template_cls(dims[2])
    template.full_chunk_shape = zarr_chunks
    ds = to_xarray_dataset(template.build_dataset(name=template.name, sizes=shape))
    # Each variable replaced by a copy holding the values (some are lazy): its attributes and encoding are mdio's.
    ds = ds.assign_coords({dim: ds[dim].copy(data=_coordinate_values(c[role], ds[dim].dtype))
                           for role, dim in zip(AXES, dims)})
    cdp = {k: ds[k].copy(data=np.asarray(c[k], dtype=np.float64)) for k in ("cdp_x", "cdp_y")
           if k in c and np.shape(c[k]) == shape[:2]}
    ds = ds.assign_coords(cdp)
    ds["trace_mask"] = ds["trace_mask"].copy(data=np.ones(shape[:2], dtype=bool))
    return ds


def create_mdio_output(path: str | os.PathLike, shape: Sequence[int], coords: Mapping[str, Any] | None = None, *,
                       dims: Sequence[str] = AXES, attrs: Mapping[str, Any] | None = None,
                       zarr_chunks: Sequence[int] | None = None, overwrite: bool = False,
                       carry_from: str | os.PathLike | None = None) -> ZarrOutput:
    """Create an empty MDIO v1 post-stack dataset at ``path`` for a float32 volume of ``shape``, to be filled by
    region as a :class:`~memchunk_prefect.io.zarr_store.ZarrOutput` (completion markers, locks, finalize).

    ``coords``: the input's (see :meth:`Source.coords`); ``dims``: the input's names, which decide the domain
    (``depth`` stays depth, else ``time``). ``zarr_chunks``: storage chunks (default: whole traces, about
    2 MiB). ``carry_from``: an MDIO input whose ``trace_mask``, trace ``headers`` and SEG-Y file headers are
    copied as they are (else every trace is live and there are no headers). ``attrs`` (JSON-able) and the
    memchunk bookkeeping go in the root attributes beside MDIO's own. An existing path raises
    :class:`~memchunk_prefect.core.errors.OutputPathError` unless ``overwrite=True``.
    """
    _, _, to_mdio = _mdio_writer()
    shape = check_shape(shape)
    p = clear_output_path(path, overwrite)
    c = output_coords(shape, coords)
    zc = output_storage_chunks(shape, zarr_chunks, "float32")
    names = mdio_dims(dims)
    ds = _mdio_dataset(shape, c, names, zc)
    to_mdio(ds, p, mode="w", compute=False)  # the metadata of every variable; no samples
    eager = [k for k in (*names, "cdp_x", "cdp_y", "trace_mask") if k in ds.variables]
    to_mdio(ds[eager], p, mode="r+", compute=True)
    if carry_from is not None:
        _carry_variables(Path(carry_from), p, shape)
    g = zarr.open_group(str(p), mode="r+")
    g.attrs.update(memchunk_attrs(shape, zc, names, c, attrs, data_name=MDIO_VARIABLE, layout="mdio"))
    g[MDIO_VARIABLE].attrs.update({"sample_interval_ms": float(c["sample_interval_ms"]), **dict(attrs or {})})
    os.chmod(p, 0o700)  # results are the user's: a user-only root hides everything inside it
    init_bookkeeping(p)
    return ZarrOutput(p, name=MDIO_VARIABLE)


def _carry_variables(source: Path, p: Path, shape: Shape) -> None:
    """Copy the input's :data:`CARRIED_VARIABLES` (those it has, over the same inline x crossline grid) into the
    new dataset, array directories as they are: no decoding, no memory beyond the copy's buffer."""
    have = _variables(str(source))
    for name in CARRIED_VARIABLES:
        if name in have and (have[name] == () or have[name] == tuple(shape[:2])):
            if (p / name).exists():
                shutil.rmtree(p / name)
            shutil.copytree(source / name, p / name)
