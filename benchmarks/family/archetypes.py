"""Operators as users write them, none of them the project's own: the archetypes the workload family draws from.

Each is a plain block function made an operator with :func:`memchunk_prefect.operators.operator`, as a user
would. What varies is how memory and compute grow with the block:

| archetype | memory (bytes, block of T traces x S samples, E = T x S elements) | compute |
|---|---|---|
| ``fam_linear`` | ``k`` x 4E (``k - 1`` scratch copies) | ``passes`` box filters: linear |
| ``fam_table`` | a fixed ``table_mib`` table + ``k`` x 4E | linear |
| ``fam_gram`` | 4E + 4T^2 (a traces x traces Gram matrix) | T^2 x S: quadratic in traces |
| ``fam_autocorr`` | 4E + 4 x 64 x S^2 (64 traces' sample x sample products at once) | T x S^2 |
| ``fam_first_use`` | ``lib_mib`` held by the worker from its first call on, + ``k`` x 4E | linear |

Every operator takes ``h``, its halo on both line axes (and on samples for ``fam_autocorr``, which may cut
traces), and returns a float32 block of the input's shape. ``FAMILY_MARKS`` (an environment variable naming a
directory, inherited by worker processes) makes each call leave its start time there, so a benchmark can
read when the first task of a run started.
"""

from __future__ import annotations

import os
import time

import numpy as np

from memchunk_prefect.operators import operator

MIB = 2**20
#: Held by ``fam_first_use`` from a worker's first call: what a library's first use leaves loaded.
_LIBRARY: dict[str, np.ndarray] = {}


def _mark() -> None:
    where = os.environ.get("FAMILY_MARKS")
    if where:
        with open(os.path.join(where, f"{os.getpid()}-{time.time_ns()}"), "w"):
            pass


def _touch(nbytes: int) -> np.ndarray:
    """``nbytes`` of scratch, really written (the kernel only charges memory that is touched)."""
    a = np.empty(max(1, nbytes // 4), dtype=np.float32)
    a.fill(1.0)
    return a


def _box(block: np.ndarray, h: int, passes: int) -> np.ndarray:
    """``passes`` box filters of half-width ``h`` along both line axes: work linear in the block."""
    from scipy.ndimage import uniform_filter

    out = block
    size = (2 * h + 1, 2 * h + 1, 1)
    for _ in range(max(1, passes)):
        out = uniform_filter(out, size=size, mode="nearest")
    return out.astype(np.float32, copy=False)


def _line_halo(p: dict) -> tuple[int, int, int]:
    return (int(p["h"]), int(p["h"]), 0)


@operator(halo=_line_halo, memory_params=("k",))
def fam_linear(block, k: float = 4.0, h: int = 1, passes: int = 2):
    """Memory ``k`` x the block; ``passes`` box filters."""
    _mark()
    scratch = [_touch(block.nbytes) for _ in range(max(0, int(round(k)) - 1))]
    out = _box(np.asarray(block, dtype=np.float32), h, passes)
    del scratch
    return out


@operator(halo=_line_halo, memory_params=("table_mib", "k"))
def fam_table(block, table_mib: int = 128, k: float = 2.0, h: int = 1, passes: int = 1):
    """A ``table_mib`` lookup table built for every call, and ``k`` x the block."""
    _mark()
    table = _touch(int(table_mib) * MIB)
    scratch = [_touch(block.nbytes) for _ in range(max(0, int(round(k)) - 1))]
    out = _box(np.asarray(block, dtype=np.float32), h, passes) + np.float32(table[0] * 0.0)
    del scratch, table
    return out


@operator(halo=_line_halo)
def fam_gram(block, h: int = 0):
    """Each trace scaled by its mean correlation with every trace of the block: a traces x traces matrix."""
    _mark()
    b = np.asarray(block, dtype=np.float32)
    x = b.reshape(-1, b.shape[-1])
    g = x @ x.T  # T x T: memory and work quadratic in the traces of the block
    weight = g.mean(axis=1) / (np.abs(g).max() + 1e-12)
    del g
    return (x * weight[:, None]).reshape(b.shape).astype(np.float32, copy=False)


@operator(halo=lambda p: (int(p["h"]), int(p["h"]), int(p["h"])), whole_traces=False)
def fam_autocorr(block, h: int = 0):
    """Each trace's sample x sample products, 64 traces at a time: memory quadratic in the samples of a block."""
    _mark()
    b = np.asarray(block, dtype=np.float32)
    x = b.reshape(-1, b.shape[-1])
    out = np.empty_like(x)
    for a in range(0, len(x), 64):
        part = x[a:a + 64]
        outer = part[:, :, None] * part[:, None, :]  # 64 x S x S
        out[a:a + 64] = outer.mean(axis=2)
        del outer
    return out.reshape(b.shape)


@operator(halo=_line_halo, memory_params=("lib_mib", "k"))
def fam_first_use(block, lib_mib: int = 150, k: float = 3.0, h: int = 1):
    """A library loaded at a worker's first call (``lib_mib``, kept), then ``k`` x the block per call."""
    _mark()
    if "lib" not in _LIBRARY:
        _LIBRARY["lib"] = _touch(int(lib_mib) * MIB)
    scratch = [_touch(block.nbytes) for _ in range(max(0, int(round(k)) - 1))]
    out = _box(np.asarray(block, dtype=np.float32), h, 1)
    del scratch
    return out


ARCHETYPES = {op.name: op for op in (fam_linear, fam_table, fam_gram, fam_autocorr, fam_first_use)}
