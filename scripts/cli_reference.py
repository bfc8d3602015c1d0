"""Write docs/reference/cli.md from the ``memchunk`` command's own parser, so the page lists every subcommand and
option the command has, with its help, and nothing it does not have.

    .venv/bin/python scripts/cli_reference.py            # rewrites docs/reference/cli.md
    .venv/bin/python scripts/cli_reference.py --check    # exit 1 if the page differs from the parser

tests/test_docs.py fails when the page and the parser disagree.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "reference" / "cli.md"

INTRO = """\
# Command line

The `memchunk` command is installed with the package. This page is generated from the command's own parser
(`python scripts/cli_reference.py`): every subcommand and option below exists, with the help the command prints.

Every subcommand takes `--store PATH`: the observation store (default `$MEMCHUNK_STORE`, else
`<PREFECT_HOME>/memchunk/observations.sqlite`). Sizes take a number of bytes or a number with a unit (`2GiB`,
`512MiB`, `2GB`: `KiB`, `MiB`, `GiB`, `TiB` are powers of 1024, `KB`, `MB`, `GB`, `TB` powers of 1000); durations
take seconds or `45min`, `6h`, `HH:MM[:SS]`.

Exit codes: 0 done; 1 a store or planning problem (including a budget too small for one chunk); 2 bad input (a bad
size, an unknown or ambiguous operator, a simulation it cannot run, an argument the parser refuses).

| command | what it does |
|---|---|
"""

GUIDES = {
    "models": ("the store", "how-to/store.md#look-at-it"), "forget": ("the store", "how-to/store.md#change-it"),
    "compact": ("the store", "how-to/store.md#change-it"), "export": ("WfCommons traces", "how-to/traces.md"),
    "plan": ("the store", "how-to/store.md#look-at-it"), "demo": ("install", "index.md#install"),
    "ui": ("the tutorial", "tutorial.md#7-watch-it-in-the-prefect-ui"),
    "simulate": ("simulate and recommend", "how-to/simulate.md"),
    "compare-traces": ("WfCommons traces", "how-to/traces.md#a-real-run-and-its-simulation-trace-against-trace"),
    "recommend": ("simulate and recommend", "how-to/simulate.md#recommend-a-cluster"),
    "doctor": ("doctor", "how-to/store.md#doctor"), "outputs": ("outputs", "how-to/store.md#outputs"),
}


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _option(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(f"`{o}`" for o in action.option_strings)
    if action.nargs == 0:
        return names
    metavar = action.metavar if action.metavar is not None else action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    many = " ..." if action.nargs in ("+", "*") else ""
    return f"{names} `{metavar}{many}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.choices:
        return f"`{action.default}` of {', '.join(f'`{c}`' for c in action.choices)}"
    if action.default in (None, False, argparse.SUPPRESS) or action.nargs == 0:
        return ""
    if isinstance(action.default, (list, tuple)):
        return " ".join(f"`{v}`" for v in action.default)
    return f"`{action.default}`"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _usage(name: str, parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = lambda prog: argparse.HelpFormatter(prog, width=110)
    return parser.format_usage().strip().removeprefix("usage: ")


def reference() -> str:
    """The page's Markdown, from the parser."""
    from memchunk_prefect.cli import app

    subs = _subcommands(app.build_parser())
    out = [INTRO]
    for name, p in subs.items():
        out.append(f"| [`memchunk {name}`](#memchunk-{name}) | {_cell(p.description)} |\n")
    for name, p in subs.items():
        what = " ".join(str(p.description).split())
        out.append(f"\n## memchunk {name}\n\n{what[:1].upper()}{what[1:]}.")
        if name in GUIDES:
            title, page = GUIDES[name]
            out.append(f" See [{title}](../{page}).")
        out.append(f"\n\n```text\n{_usage(name, p)}\n```\n\n")
        rows = [a for a in p._actions if not isinstance(a, argparse._HelpAction) and a.dest != "store"]
        if rows:
            out.append("| argument | default | what it does |\n|---|---|---|\n")
            for a in rows:
                out.append(f"| {_option(a)} | {_default(a)} | {_cell(a.help or '')} |\n")
        else:
            out.append("No arguments beyond `--store`.\n")
    return "".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="exit 1 if the page differs from the parser")
    args = p.parse_args(argv)
    text = reference()
    if args.check:
        same = PAGE.exists() and PAGE.read_text() == text
        if not same:
            sys.stderr.write(f"{PAGE.relative_to(REPO)} differs from the parser: run python scripts/cli_reference.py\n")
        return 0 if same else 1
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
