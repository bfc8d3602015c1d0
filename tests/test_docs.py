"""The documentation's code is run or checked: every fenced block of README.md and docs/**/*.md.

- ``python`` blocks are executed, page by page in a subprocess of their own (a fresh Prefect home, no server,
  analytics off, a temporary working directory), in order and in one namespace, so a later block may use what an
  earlier one defined. A block titled ``title="name.py"`` is also written to that file first, as the reader
  would save it. Blocks run with ``__name__`` other than ``"__main__"``: a script's ``if __name__ == "__main__":``
  part (a flow run) is left to the tutorial's end-to-end test. The README's two marked blocks are
  tests/test_readme.py's and are not run twice.
- ``bash`` / ``sh`` blocks, and the ``$ `` lines of ``console`` blocks, are checked command by command without
  running them: ``memchunk`` lines through the command's own argparse parser, ``prefect`` lines through Prefect's,
  ``dask`` and ``mkdocs`` lines through theirs, ``python -m X`` must name a module that imports, a script must
  exist (in the repository, or as a titled block of the same page), ``pip install`` may only name extras
  pyproject.toml declares, and any other program must be one the docs are known to use.
- ``yaml`` blocks must parse; ``text``, ``console`` and unlabelled blocks are output, not run.

The tutorial itself is run end to end, as written, on its small synthetic survey (marked cluster and slow).
"""

from __future__ import annotations

import contextlib
import doctest
import importlib.util
import io
import json
import os
import re
import shlex
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
PAGES = [REPO / "README.md", *sorted(DOCS.rglob("*.md"))]
#: A block under this comment is run as written by the test module it names (with what that test sets up first).
RUN_BY = re.compile(r"<!-- (tests/[\w/]+\.py) runs this block")

OUTPUT = {"", "text", "console"}
SHELL = {"bash", "sh"}
KNOWN = OUTPUT | SHELL | {"python", "yaml"}
# Modules of the package's optional extras: a block that needs one is skipped, naming the extra, where it is absent.
OPTIONAL = {"dask_jobqueue": "hpc", "cupy": "gpu", "cupyx": "gpu", "dask_cuda": "gpu-cluster", "wfcommons": "trace",
            "matplotlib": "plot"}
# Programs the docs show that have nothing to parse here (shell built-ins, system tools).
PLAIN = {"cd", "mkdir", "export", "source", "apt-get", "nvidia-smi", "git", "ls", "cat", "echo"}


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # of the opening fence, 1-based
    lang: str
    title: str | None
    body: str
    run_by: str | None  # the test module that runs this block as written (named in a comment just above it)

    @property
    def id(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    """The fenced code blocks of ``page``, in order (fences indented in lists included)."""
    lines = page.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})\s*([\w+-]*)(.*)$", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, rest = m.groups()
        title = re.search(r'title="([^"]+)"', rest)
        j = i + 1
        while j < len(lines) and not re.match(rf"^\s*{fence}\s*$", lines[j]):
            j += 1
        body = textwrap.dedent("\n".join(lines[i + 1:j])) + "\n"
        marked = RUN_BY.match(lines[i - 1]) if i > 0 else None
        out.append(Block(page, i + 1, lang.lower(), title.group(1) if title else None, body,
                         marked.group(1) if marked else None))
        i = j + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
PYTHON = [b for b in ALL if b.lang == "python" and b.run_by is None]
SHELL_BLOCKS = [b for b in ALL if b.lang in SHELL or (b.lang == "console" and "\n$ " in "\n" + b.body)]
YAML = [b for b in ALL if b.lang == "yaml"]


def test_every_code_block_is_run_checked_or_marked_as_output():
    unknown = [f"{b.id} ({b.lang})" for b in ALL if b.lang not in KNOWN]
    assert not unknown, f"code blocks of a kind no test runs or checks: {unknown}; use python, bash, yaml, or " \
                        f"text/console for output"
    assert PYTHON and SHELL_BLOCKS, "the docs lost their code"
    readme = [b for b in ALL if b.page.name == "README.md" and b.run_by == "tests/test_readme.py"]
    assert len(readme) == 2, "README.md marks two blocks for tests/test_readme.py"
    for b in ALL:
        if b.run_by is not None:  # the test it names exists and reads this page
            runner = REPO / b.run_by
            assert runner.exists() and b.page.name in runner.read_text(), f"{b.id}: {b.run_by} does not run it"


# =========================================================================== python blocks

DRIVER = r"""
import json, os, runpy, sys, traceback
blocks, results_path = json.load(open(sys.argv[1])), sys.argv[2]
sys.path.insert(0, os.getcwd())
namespace, results = {}, {}
for b in blocks:
    path = b["title"] or f"_block_{b['line']}.py"
    with open(path, "w") as fh:
        fh.write(b["body"])
    try:
        namespace.update(runpy.run_path(path, init_globals=namespace, run_name="docs_block"))
        results[b["id"]] = {"status": "ok"}
    except ModuleNotFoundError as exc:
        results[b["id"]] = {"status": "missing", "module": (exc.name or "").split(".")[0],
                            "error": traceback.format_exc()}
    except BaseException:
        results[b["id"]] = {"status": "failed", "error": traceback.format_exc()}
    with open(results_path, "w") as fh:
        json.dump(results, fh)
"""


def fresh_env(home: Path) -> dict[str, str]:
    """This environment without Prefect's or memchunk's settings, with a fresh Prefect home and no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MEMCHUNK_"))}
    env.update(PREFECT_HOME=str(home / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false", DO_NOT_TRACK="1",
               MEMCHUNK_CACHE_DIR=str(home / "cache"))
    return env


@pytest.fixture(scope="session")
def page_results(tmp_path_factory):
    """Run a page's python blocks once (in one subprocess) and give each block's result."""
    done: dict[Path, dict] = {}

    def run(page: Path) -> dict:
        if page not in done:
            work = tmp_path_factory.mktemp(re.sub(r"\W", "-", str(page.relative_to(REPO))))
            spec = [{"id": b.id, "line": b.line, "title": b.title, "body": b.body}
                    for b in PYTHON if b.page == page]
            (work / "blocks.json").write_text(json.dumps(spec))
            (work / "driver.py").write_text(DRIVER)
            proc = subprocess.run([sys.executable, "driver.py", "blocks.json", "results.json"], cwd=work,
                                  env=fresh_env(work), capture_output=True, text=True, timeout=600)
            results = json.loads((work / "results.json").read_text()) if (work / "results.json").exists() else {}
            done[page] = {"results": results, "log": (proc.stdout + proc.stderr)[-4000:]}
        return done[page]

    return run


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.id)
def test_python_block_runs(block, page_results):
    run = page_results(block.page)
    result = run["results"].get(block.id)
    assert result is not None, f"{block.id} did not run (an earlier block of the page stopped the process?):\n" \
                               f"{run['log']}"
    if result["status"] == "missing" and result["module"] in OPTIONAL:
        pytest.skip(f"needs the {OPTIONAL[result['module']]} extra ({result['module']} is not installed)")
    assert result["status"] == "ok", f"{block.id} failed:\n{result['error']}"


# =========================================================================== shell commands

CONTROL = {"&&", "||", ";", "|", "&"}


def commands(text: str) -> list[list[str]]:
    """The commands of a shell snippet (continuations joined, comments and ``$(...)`` dropped), split at ``&&``,
    ``;``, ``|``; each without leading ``VAR=value`` assignments."""
    text = re.sub(r"\\\n", " ", text)
    text = re.sub(r"\$\([^)]*\)", "SUBSTITUTED", text)
    out = []
    for line in text.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split, lexer.commenters = True, "#"
        argv: list[str] = []
        for tok in [*lexer, ";"]:
            if tok in CONTROL:
                while argv and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", argv[0]):
                    argv.pop(0)
                if argv:
                    out.append(argv)
                argv = []
            else:
                argv.append(tok)
    return out


def shell_commands(block: Block) -> list[list[str]]:
    if block.lang == "console":
        return [c for line in block.body.splitlines() if line.startswith("$ ") for c in commands(line[2:])]
    return commands(block.body)


def program(argv0: str) -> str:
    """``.venv/bin/memchunk`` -> ``memchunk``; ``python3`` -> ``python``; a repository script (``.ci/run``) as is."""
    name = Path(argv0).name if "/bin/" in f"/{argv0}" else argv0
    return "python" if name in ("python", "python3") else name


def _parse_memchunk(args: list[str]) -> str | None:
    from memchunk_prefect.cli.app import build_parser

    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        try:
            build_parser().parse_args(args)
        except SystemExit as exc:
            if exc.code:
                return err.getvalue().strip().splitlines()[-1]
    return None


def _parse_prefect(args: list[str]) -> str | None:
    try:
        from prefect.cli._app import _app
    except ImportError:  # another Prefect CLI: ask it for the command's help instead
        cmd = [a for a in args if not a.startswith("-")][:2]
        proc = subprocess.run([sys.executable, "-m", "prefect", *cmd, "--help"], capture_output=True, text=True)
        return None if proc.returncode == 0 else proc.stderr[-500:]
    try:
        _app.parse_args(args, exit_on_error=False, print_error=False)
    except Exception as exc:  # noqa: BLE001 - cyclopts' errors: unknown command or option, missing argument
        return f"{type(exc).__name__}: {exc}"
    return None


def _parse_click(command, name: str, args: list[str]) -> str | None:
    import click

    try:
        command.make_context(name, list(args), resilient_parsing=False)
    except click.exceptions.Exit:
        return None
    except click.ClickException as exc:
        return exc.format_message()
    return None


def _parse_dask(args: list[str]) -> str | None:
    from distributed.cli import dask_scheduler, dask_worker

    commands = {"scheduler": dask_scheduler.main, "worker": dask_worker.main}
    if not args or args[0] not in commands:
        return f"`dask {' '.join(args[:1])}` is not a command the docs are checked against (dask scheduler, worker)"
    return _parse_click(commands[args[0]], f"dask {args[0]}", args[1:])


def _parse_mkdocs(args: list[str]) -> str | None:
    from mkdocs.__main__ import cli

    sub = cli.commands.get(args[0]) if args else None
    if sub is None:
        return f"mkdocs has no command {args[:1]}"
    return _parse_click(sub, f"mkdocs {args[0]}", args[1:])


def _extras() -> set[str]:
    from importlib.metadata import metadata

    return set(metadata("memchunk-prefect").get_all("Provides-Extra") or ())


def _markers() -> set[str]:
    block = re.search(r"^markers = \[(.*?)^\]", (REPO / "pyproject.toml").read_text(), flags=re.S | re.M)
    return set(re.findall(r'^\s*"([\w-]+):', block.group(1), flags=re.M)) if block else set()


def _check_pip(args: list[str]) -> str | None:
    if not args or args[0] != "install":
        return f"pip {args[:1]}: only pip install is expected in the docs"
    for arg in args[1:]:
        m = re.match(r"^(\.|memchunk-prefect)(\[([\w,-]+)\])?$", arg)
        if m and m.group(3):
            unknown = set(m.group(3).split(",")) - _extras()
            if unknown:
                return f"pip install {arg}: pyproject.toml declares no extra {sorted(unknown)}"
    return None


def _check_pytest(args: list[str]) -> str | None:
    markers = _markers()
    for i, arg in enumerate(args):
        if arg == "-m" and i + 1 < len(args):
            words = set(re.findall(r"[\w-]+", args[i + 1])) - {"and", "or", "not"}
            if words - markers:
                return f"pytest -m {args[i + 1]!r}: no marker {sorted(words - markers)} in pyproject.toml"
        elif arg.startswith("tests/") and not (REPO / arg.split("::")[0]).exists():
            return f"pytest: {arg} does not exist"
    return None


def _check_python(args: list[str], titles: set[str]) -> str | None:
    if not args:
        return None
    if args[0] == "-c":
        compile(args[1], "<python -c>", "exec")
        return None
    if args[0] == "-m":
        module, rest = args[1], args[2:]
        if module == "pip":
            return _check_pip(rest)
        if module == "pytest":
            return _check_pytest(rest)
        return None if importlib.util.find_spec(module) is not None else f"python -m {module}: no such module"
    script = args[0]
    return None if script in titles or (REPO / script).is_file() else f"python {script}: no such script"


def check_command(argv: list[str], titles: set[str]) -> str | None:
    """Why ``argv`` is not a command that exists as written (None: it is)."""
    prog, args = program(argv[0]), argv[1:]
    if prog == "memchunk":
        return _parse_memchunk(args)
    if prog == "python":
        return _check_python(args, titles)
    if prog == "pip":
        return _check_pip(args)
    if prog == "prefect":
        return _parse_prefect(args)
    if prog == "dask":
        return _parse_dask(args)
    if prog == "mkdocs":
        return _parse_mkdocs(args)
    if prog == "bash":
        return None if args and (REPO / args[0]).is_file() else f"bash {args[:1]}: no such script"
    if (REPO / argv[0]).is_file() or (Path(sys.executable).parent / prog).is_file() or prog in PLAIN:
        return None  # a script of the repository, an executable the test extras install, or a plain tool
    return f"{argv[0]}: not a command these docs are known to use (add it to PLAIN in tests/test_docs.py?)"


@pytest.mark.parametrize("block", SHELL_BLOCKS, ids=lambda b: b.id)
def test_shell_block_names_commands_and_options_that_exist(block):
    titles = {b.title for b in blocks(block.page) if b.title}
    found = shell_commands(block)
    assert found, f"{block.id}: a shell block without a command"
    problems = [f"{' '.join(argv)}\n    -> {why}" for argv in found if (why := check_command(argv, titles))]
    assert not problems, f"{block.id}:\n" + "\n".join(problems)


def test_the_command_checks_catch_what_does_not_exist():
    titles: set[str] = set()
    assert check_command(["memchunk", "simulate", "--no-such-option"], titles)
    assert check_command(["memchunk", "no-such-command"], titles)
    assert check_command(["python", "-m", "benchmarks.no_such_benchmark"], titles)
    assert check_command(["prefect", "worker", "start", "--no-such-option"], titles)
    assert check_command(["pip", "install", "memchunk-prefect[no-such-extra]"], titles)
    assert check_command(["python", "no_such_script.py"], titles)
    assert check_command(["frobnicate"], titles)
    assert check_command([".venv/bin/memchunk", "models", "--json"], titles) is None
    assert check_command([".venv/bin/memchunk", "models", "--no-such-option"], titles)
    assert check_command([".venv/bin/python", "-m", "pytest", "-m", "not no_such_marker"], titles)
    assert commands("A=1 memchunk demo && memchunk models  # the store\nexport X=$(mktemp -d)") == \
        [["memchunk", "demo"], ["memchunk", "models"], ["export", "X=SUBSTITUTED"]]


@pytest.mark.parametrize("block", YAML, ids=lambda b: b.id)
def test_yaml_block_parses(block):
    import yaml

    assert yaml.safe_load(block.body) is not None


# =========================================================================== generated and listed pages


def _cli_reference_module():
    spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_command_line_reference_is_the_parser():
    """docs/reference/cli.md lists every subcommand and option `memchunk <sub> --help` shows, and no other."""
    from memchunk_prefect.cli.app import build_parser

    page = (DOCS / "reference" / "cli.md").read_text()
    assert page == _cli_reference_module().reference(), \
        "docs/reference/cli.md differs from the parser: run .venv/bin/python scripts/cli_reference.py"
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    for name, p in sub.choices.items():
        assert f"## memchunk {name}\n" in page
        for action in p._actions:
            for option in action.option_strings:
                assert f"`{option}`" in page or option in ("-h", "--help", "--store"), (name, option)


def test_the_settings_page_gives_every_field_with_its_default():
    import dataclasses

    from memchunk_prefect.core.settings import PolicySettings, RunnerSettings

    page = (DOCS / "reference" / "settings.md").read_text()
    for cls in (PolicySettings, RunnerSettings):
        for f in dataclasses.fields(cls):
            assert f"| `{f.name}` | `{f.default!r}` |" in page, f"settings.md: {cls.__name__}.{f.name} = {f.default!r}"
    used = {v for path in (REPO / "memchunk_prefect").rglob("*.py") for v in
            re.findall(r"MEMCHUNK_[A-Z_]+", path.read_text())} | {"MEMCHUNK_SEGY_TEST_DATA"}
    missing = sorted(v for v in used if f"`{v}`" not in page)
    assert not missing, f"settings.md does not list the environment variables {missing}"


def test_the_readme_links_resolve():
    text = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if not link.startswith("http") and not (REPO / link).exists()]
    assert links and not missing, f"README.md links to {missing}"


def test_docstrings_render_as_markdown_on_the_site():
    spec = importlib.util.spec_from_file_location("mkdocs_docstrings", REPO / "scripts" / "mkdocs_docstrings.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert doctest.testmod(module).failed == 0


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path):
    """What .ci/run runs: any warning (a broken link or anchor, a page left out of the nav, a docstring mkdocstrings
    cannot render) fails the build."""
    mkdocs = Path(sys.executable).parent / "mkdocs"
    proc = subprocess.run([str(mkdocs), "build", "--strict", "--site-dir", str(tmp_path / "site")], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


# =========================================================================== the tutorial, end to end


def _tutorial_steps() -> list[list[str]]:
    """The tutorial's commands that run something here: its scripts, and every memchunk command but the UI's."""
    steps = []
    for b in blocks(DOCS / "tutorial.md"):
        if b.lang not in SHELL:
            continue
        for argv in commands(b.body):
            prog = program(argv[0])
            if (prog == "python" and argv[1:2] and argv[1].endswith(".py")) or (
                    prog == "memchunk" and argv[1:2] != ["ui"]):
                steps.append(argv)
    return steps


def _decisions(text: str) -> set[str]:
    return set(re.findall(r"memchunk \w+: (probe|continue|rechunk|retry-smaller|resume|restart) —", text))


@pytest.mark.cluster
@pytest.mark.slow
def test_the_tutorial_runs_end_to_end_as_written(tmp_path):
    page = blocks(DOCS / "tutorial.md")
    for b in page:
        if b.title:
            (tmp_path / b.title).write_text(b.body)
    steps = _tutorial_steps()
    assert [" ".join(s) for s in steps] == [
        "python make_survey.py", "python attributes.py survey.sgy", "memchunk outputs", "python look.py",
        "python attributes.py survey.sgy", "memchunk models"]
    outputs = []
    for argv in steps:
        exe = [sys.executable] if program(argv[0]) == "python" else [sys.executable, "-m", "memchunk_prefect"]
        proc = subprocess.run([*exe, *argv[1:]], cwd=tmp_path, env=fresh_env(tmp_path), capture_output=True,
                              text=True, timeout=300)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, f"{' '.join(argv)} failed:\n{out[-4000:]}"
        outputs.append(out)
    survey, cold, listed, look, warm, models = outputs
    assert "(iline: 96, xline: 96, twt: 300)" in survey
    # The first run probes (nothing is known yet) and then plans; the second plans from what the first learned.
    assert "probe" in _decisions(cold) and "memchunk gst3d_dip:" in cold, cold[-4000:]
    assert "probe" not in _decisions(warm) and "memchunk gst3d_dip:" in warm, warm[-4000:]
    assert "dip: {'iline': 96, 'xline': 96, 'twt': 300}" in warm
    assert "attributes" in listed and "1 flow run(s)" in listed
    assert "02-gst3d_dip.zarr" in look and (tmp_path / "dip.sgy").is_file()
    assert "gst3d_dip[sigma_gradient=1;sigma_tensor=2]|float32|cpu" in models
    # The page's output blocks show decisions of the kinds these runs took.
    shown = [b.body for b in page if b.lang == "text" and "memchunk envelope:" in b.body]
    assert len(shown) == 2
    assert _decisions(shown[0]) <= _decisions(cold), (_decisions(shown[0]), _decisions(cold))
    assert _decisions(shown[1]) <= _decisions(warm), (_decisions(shown[1]), _decisions(warm))
    assert "Timed out while attempting to connect" not in cold + warm and "telemetry" not in (cold + warm).lower()
