"""Simulated runs of the same decision core: what-if, recommend, allocations, and WfCommons traces.

Never imports :mod:`memchunk_prefect.run`: a simulation needs no Prefect server or Dask cluster.
"""
