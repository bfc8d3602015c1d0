"""The package's shape, checked from its source: no import cycles, modules and functions of a readable size,
and an install that puts only the library on ``sys.path``. The layers themselves are import-linter contracts in
pyproject.toml (``lint-imports``, run by .ci/run)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "memchunk_prefect"
MAX_MODULE_LINES = 900
#: The runner is glue between Prefect, Dask and the map executor: what grows in it belongs in a layer below.
MAX_RUNNER_LINES = 500
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    out = {}
    for f in PACKAGE.rglob("*.py"):
        parts = list(f.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    """The package modules ``module`` imports, anywhere in it (function-level imports count: they run too)."""
    tree = ast.parse(path.read_text())
    is_pkg = path.name == "__init__.py"
    out = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = module.split(".") if is_pkg else module.split(".")[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([node.module] if node.module else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            while name and name not in known:  # the deepest package module the name is in
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_package_has_no_import_cycles():
    modules = _modules()
    known = set(modules)
    # A package's __init__ importing its own submodules (a facade) is not a cycle of the code.
    graph = {m: {n for n in _imports(m, p, known) if not (p.name == "__init__.py" and n.startswith(m + "."))}
             for m, p in modules.items()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


@pytest.mark.parametrize("module", sorted(_modules()))
def test_modules_and_functions_stay_readable(module):
    path = _modules()[module]
    text = path.read_text()
    assert text.count("\n") <= MAX_MODULE_LINES, f"{module} has {text.count(chr(10))} lines: split it by concept"
    if module == "memchunk_prefect.run.runner":
        assert text.count("\n") <= MAX_RUNNER_LINES, f"the runner has {text.count(chr(10))} lines: move logic down a layer"
    long = [f"{n.name} ({n.end_lineno - n.lineno + 1} lines)" for n in ast.walk(ast.parse(text))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]
    assert not long, f"{module}: break into named steps: {', '.join(long)}"


def test_an_install_puts_only_the_library_on_the_path():
    """tasks/, flows/, deployments/ and benchmarks/ are the Prefect project and the suite beside the library; an
    install that made them top-level packages would shadow a user's own ``tasks.py`` or ``flows/``."""
    from setuptools import find_packages

    tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    find = config["tool"]["setuptools"]["packages"]["find"]
    packages = find_packages(str(REPO), include=find["include"], exclude=find.get("exclude", ()))
    assert packages and all(p == "memchunk_prefect" or p.startswith("memchunk_prefect.") for p in packages), packages
    assert {"memchunk_prefect.core", "memchunk_prefect.run", "memchunk_prefect.operators"} <= set(packages)


def test_what_a_worker_imports_to_run_a_chunk_leaves_xarray_and_pandas_out():
    """~40 MiB of every worker's memory: a worker reads SEG-Y or zarr blocks and writes zarr regions without them."""
    code = ("import sys; import memchunk_prefect.run.worker, memchunk_prefect.run.runner, memchunk_prefect.io.volume, "
            "memchunk_prefect.io.segy_source, memchunk_prefect.io.zarr_store, memchunk_prefect.io.mdio; "
            "print(sorted(m for m in ('xarray', 'pandas') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
