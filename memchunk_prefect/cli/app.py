"""The ``memchunk`` command: inspect what was learned, plan without running, forget, export.

::

    memchunk models [--json] [--store PATH]
    memchunk plan --operator NAME --shape IL XL T --budget 2GiB [--halo N | --halo A B C]
                  [--slots N] [--whole-traces | --cut-traces] [--json]
    memchunk forget KEY
    memchunk export [--format csv|json] [--output FILE]
    memchunk export --format wfcommons --flow-run ID|latest [-o FILE] [--schema FILE]
    memchunk compare-traces TRACE_A TRACE_B [--json]
    memchunk demo [--dir DIR] [--shape IL XL T] [--workers N] [--memory-limit 1.5GiB]
    memchunk ui [--port 4200]
    memchunk doctor [--address tcp://HOST:8786] [--json]
    memchunk simulate --shape IL XL T --workers N --memory-limit 8GiB [--steps OP|KEY ...] [--runs 20]
                      [--deadline S] [--trace FILE]
    memchunk simulate --flow-run ID|latest [--shape IL XL T] [--workers N] [--memory-limit 8GiB] [--cold]
    memchunk recommend --shape IL XL T --deadline 6h [--memory 4GiB 8GiB ...] [--max-workers 256]
                       [--objective time|energy]
    memchunk recommend --flow-run ID|latest --deadline 6h [--shape IL XL T] [--memory 4GiB 8GiB ...]

Watch runs in the Prefect UI: ``memchunk ui`` (or ``prefect server start``), then
open http://127.0.0.1:4200; flows started with ``PREFECT_API_URL`` pointing at it
show up live.

Every subcommand takes ``--store PATH`` (default: ``$MEMCHUNK_STORE``, else
under the Prefect home; see :mod:`memchunk_prefect.learn.store`). Exit codes: 0 ok,
1 a store or planning problem, 2 bad input (bad budget, unknown or ambiguous
operator, argparse errors).

Subcommands live in :data:`SUBCOMMANDS` (name -> (help, add_arguments, run)); add one
with :func:`register`. They are defined by group: on the store
(:mod:`~memchunk_prefect.cli.store_commands`), simulated from it
(:mod:`~memchunk_prefect.cli.sim_commands`), and on this machine
(:mod:`~memchunk_prefect.cli.local_commands`); the registry is
:mod:`memchunk_prefect.cli.registry`. This module builds the parser and runs it.

>>> parse_bytes("2GiB"), parse_bytes("512 MiB"), parse_bytes("2GB"), parse_bytes("1000")
(2147483648, 536870912, 2000000000, 1000)
"""

from __future__ import annotations

import argparse
import sys
import warnings
from typing import Sequence

# The subcommand modules register their subcommands when imported (store_commands with match_operator below).
import memchunk_prefect.cli.local_commands  # noqa: F401
import memchunk_prefect.cli.sim_commands  # noqa: F401
from memchunk_prefect.cli.registry import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    SUBCOMMANDS,
    AddArguments,
    Run,
    arguments,
    register,
)
from memchunk_prefect.cli.store_commands import match_operator
from memchunk_prefect.core.errors import (
    BudgetError,
    BudgetTooSmallError,
    MemchunkError,
    SimulationInputError,
    UnknownOperatorError,
    VolumeError,
)
from memchunk_prefect.core.units import parse_bytes

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_USAGE",
    "LISTED",
    "SUBCOMMANDS",
    "AddArguments",
    "Run",
    "arguments",
    "build_parser",
    "main",
    "match_operator",
    "parse_bytes",
    "register",
]

#: The order ``memchunk --help`` lists the built-in subcommands in; others follow in the order registered.
LISTED = ("models", "forget", "compact", "export", "plan", "demo", "ui", "simulate", "compare-traces", "recommend",
          "doctor", "outputs")


def _listed(name: str) -> int:
    """Where subcommand ``name`` comes in ``memchunk --help``: its place in :data:`LISTED`, else after them."""
    return LISTED.index(name) if name in LISTED else len(LISTED)


# --------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    """The ``memchunk`` parser: one subparser per registered subcommand, each with ``--store``."""
    parser = argparse.ArgumentParser(
        prog="memchunk", description="Learned memory and chunking for Prefect flows.",
        epilog="Watch runs in the Prefect UI: `memchunk ui` (or `prefect server start`), then open "
               "http://127.0.0.1:4200 and set PREFECT_API_URL=http://127.0.0.1:4200/api for flows to report there.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (help_text, add, _run) in sorted(SUBCOMMANDS.items(), key=lambda item: _listed(item[0])):
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.add_argument("--store", default=None,
                       help="the observation store (default: $MEMCHUNK_STORE, else <PREFECT_HOME>/memchunk/)")
        add(p)
        p.set_defaults(_run=_run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code (0 ok, 1 failure, 2 bad input)."""
    # Prefect warns at import when it cannot create its home; the commands that need it say so with the fix
    # (memchunk_prefect.run.doctor), once.
    warnings.filterwarnings("ignore", message="Failed to create the Prefect home directory", category=UserWarning)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse: --help (0) or a usage error (2)
        return int(exc.code or 0)
    if not getattr(args, "_run", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return args._run(args)
    except BudgetTooSmallError as exc:
        sys.stderr.write(f"memchunk {args.command}: {exc}\n")
        return EXIT_FAILURE
    except (BudgetError, UnknownOperatorError, VolumeError, SimulationInputError) as exc:
        sys.stderr.write(f"memchunk {args.command}: {exc}\n")
        return EXIT_USAGE
    except MemchunkError as exc:
        sys.stderr.write(f"memchunk {args.command}: {exc}\n")
        return EXIT_FAILURE


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
