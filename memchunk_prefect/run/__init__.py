"""Real runs on Prefect and Dask: the task runner, the executor that carries out the core's instructions,
the worker side of a chunk, the cluster view, measurement, task-run repair and what observers see.
"""
