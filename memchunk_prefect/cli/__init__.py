"""The ``memchunk`` command: demo, doctor, models, plan, simulate, recommend, export, ui."""

from memchunk_prefect.cli.app import main

__all__ = ["main"]
