"""The ``memchunk`` subcommands on this machine: ``demo``, ``ui`` (Prefect's server), ``doctor``, ``outputs``.

Each runs or checks something locally: the demo pipeline on a synthetic survey
(:mod:`memchunk_prefect.cli.demo`), the Prefect server and UI, and what the runner relies on
(:mod:`memchunk_prefect.run.doctor`).
"""

from __future__ import annotations

import argparse
import json
import sys

from memchunk_prefect.cli.registry import EXIT_FAILURE, EXIT_OK, arguments, emit, register

# --------------------------------------------------------------------------- demo and ui


def _demo_arguments(p: argparse.ArgumentParser) -> None:
    from memchunk_prefect.cli.demo import add_arguments

    add_arguments(p)


@register("demo", "run the demo flow (envelope -> gaussian_smooth -> gst3d_dip) on a synthetic survey, locally")
@arguments(_demo_arguments)
def _demo(args: argparse.Namespace) -> int:
    from memchunk_prefect.cli.demo import run

    return run(args)


def _ui_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--port", type=int, default=4200, help="port of the Prefect server (default 4200)")


@register("ui", "start the Prefect server and UI on 127.0.0.1 (prefect server start); Ctrl-C or SIGTERM stops it")
@arguments(_ui_arguments)
def _ui(args: argparse.Namespace) -> int:
    from memchunk_prefect.cli.server import port_taken, serve

    url = f"http://127.0.0.1:{args.port}"
    taken = port_taken(args.port)
    if taken:
        emit(f"memchunk ui: port {args.port} is already in use ({taken}); nothing was started. If that is a Prefect "
             f"server, use it: export PREFECT_API_URL={url}/api. Else stop what holds the port, or pass --port.")
        return EXIT_FAILURE
    emit(f"Prefect UI at {url}; to send flow runs to it: export PREFECT_API_URL={url}/api")
    # `python -m prefect`: this interpreter's Prefect, wherever its console scripts were installed.
    return serve([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(args.port)])


# --------------------------------------------------------------------------- doctor


def _doctor_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="a Dask scheduler to check (default: what the runner would start locally)")
    p.add_argument("--output-dir", help="where chunked outputs go (default: $MEMCHUNK_OUTPUT_DIR, else "
                                        "./memchunk-outputs)")
    p.add_argument("--memory-reuse", action="store_true",
                   help="also time touching memory freed 2.5 s before (3 times) against memory just freed: a VM "
                        "that gives freed memory back to its host makes task times depend on what ran before (about "
                        "10 s; with --address, on one worker of each of the cluster's machines)")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("doctor", "check what the runner relies on (versions, Prefect API, store, cluster, GPU, energy counters)")
@arguments(_doctor_arguments)
def _doctor(args: argparse.Namespace) -> int:
    from memchunk_prefect.run.doctor import FAIL, run_checks

    checks = run_checks(address=args.address, store=args.store, output_dir=args.output_dir,
                        memory_reuse=args.memory_reuse)
    failed = [c for c in checks if c.status == FAIL]
    if args.json:
        emit(json.dumps({"ok": not failed, "checks": [c.to_dict() for c in checks]}, indent=1))
    else:
        emit("\n".join(c.line() for c in checks))
        emit(f"{len(failed)} problem(s) stop a run" if failed else "nothing stops a run")
    return EXIT_FAILURE if failed else EXIT_OK


# --------------------------------------------------------------------------- outputs


def _outputs_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", help="the output directory (default: $MEMCHUNK_OUTPUT_DIR, else ./memchunk-outputs)")
    p.add_argument("--remove", nargs="+", default=(), metavar="RUN",
                   help="remove these flow runs' outputs (folder names, or flow run names, as listed)")
    p.add_argument("--older-than", metavar="AGE", help="remove the outputs of runs unchanged for AGE (7d, 12h, 90min)")
    p.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    p.add_argument("--json", action="store_true", help="print JSON")


@register("outputs", "list flow runs' outputs in the output directory, with sizes; remove those you name or "
                     "older than an age")
@arguments(_outputs_arguments)
def _outputs(args: argparse.Namespace) -> int:
    from memchunk_prefect.cli.outputs import run

    return run(args)
