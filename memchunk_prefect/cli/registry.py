"""The ``memchunk`` command's subcommand registry, exit codes and output, shared by every subcommand module.

A subcommand is ``run(args) -> exit code`` registered under its name with :func:`register`, its
``add_arguments(parser)`` attached with :func:`arguments`; :data:`SUBCOMMANDS` holds them
(name -> (help, add_arguments, run)) and :mod:`memchunk_prefect.cli.app` builds the parser from it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

#: Exit codes: 0 ok, 1 a store or planning problem, 2 bad input (bad budget, unknown operator, argparse errors).
EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

AddArguments = Callable[[argparse.ArgumentParser], Any]
Run = Callable[[argparse.Namespace], int]
SUBCOMMANDS: dict[str, tuple[str, AddArguments, Run]] = {}


def register(name: str, help: str) -> Callable[[Run], Run]:  # noqa: A002 - argparse's word
    """Register a subcommand: decorate ``run(args) -> exit code`` whose ``add_arguments`` is ``run.arguments``.

    >>> @register("hello", "say hello")
    ... def _hello(args):
    ...     return 0
    >>> "hello" in SUBCOMMANDS
    True
    >>> del SUBCOMMANDS["hello"]
    """

    def decorate(run: Run) -> Run:
        SUBCOMMANDS[name] = (help, getattr(run, "arguments", lambda p: None), run)
        return run

    return decorate


def arguments(add: AddArguments) -> Callable[[Run], Run]:
    """Attach an ``add_arguments(parser)`` to a subcommand function (apply below :func:`register`)."""

    def decorate(run: Run) -> Run:
        run.arguments = add  # type: ignore[attr-defined]
        return run

    return decorate


def open_store(args: argparse.Namespace):
    """The observation store ``--store`` names (default: ``$MEMCHUNK_STORE``, else under the Prefect home)."""
    from memchunk_prefect.learn.store import Store

    return Store(args.store)


def emit(text: str, args: argparse.Namespace | None = None) -> None:
    """Write ``text`` to standard output, ending it with a newline."""
    sys.stdout.write(text if text.endswith("\n") else text + "\n")
