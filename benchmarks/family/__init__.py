"""The workload family: user operators the project never saw, run as deployments run them (``python -m
benchmarks.family``); see :mod:`benchmarks.family.__main__`."""
