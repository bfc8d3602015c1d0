"""convert: a volume written unchanged to another store, as a chunked step of a flow.

``operators.convert.map(chunked("survey.sgy", output="survey.zarr"))`` (or an ``.mdio`` output, an MDIO v1
dataset) reads the source on the workers block by block and writes it with the runner's guarantees: a rerun
resumes a conversion that stopped, the store is marked complete only once every block is written, and the
source's coordinates go with it. Later maps read the store, not the file.

Converting first does not make later reads faster on a local disk: whole-trace blocks of a SEG-Y file read
faster than the same blocks of a compressed zarr store there (``benchmarks/studies/real_size.py`` measures both,
and the conversion, on one file). It is for where the survey goes next: object storage, MDIO's tools.
"""

from __future__ import annotations

import numpy as np
from prefect.cache_policies import NO_CACHE

from memchunk_prefect.operators._common import check_block
from memchunk_prefect.operators.spec import operator


@operator(halo=(0, 0, 0), whole_traces=True, cache_policy=NO_CACHE)
def convert(block):
    """The block unchanged, as float32 (the samples the source's reader gives, IBM floats already converted)."""
    return np.asarray(check_block(block, "convert"), dtype=np.float32)
