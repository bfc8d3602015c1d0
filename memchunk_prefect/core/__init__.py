"""The decision core: pure functions and plain data, no I/O.

Chunk arithmetic, records, settings, units, errors, the planner, the learned policy (a bandit over the
planner's plans) and the map state machine (events in, instructions out). Nothing here imports Prefect,
Dask, zarr, SQLite or anything else in the package: every other layer may import it.
"""
