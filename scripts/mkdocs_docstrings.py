"""A Griffe extension for the documentation site (mkdocs.yml loads it): the package's docstrings as Markdown.

The docstrings are free-form prose written for ``help()`` and Sphinx: doctest examples (``>>>``), literal
blocks introduced by ``::`` and roles such as ``:func:`~memchunk_prefect.run.chunked.chunked```. Read as
Markdown, a ``>>>`` line is a nested block quote and a role is plain text with stray colons. Before
mkdocstrings renders a docstring, this extension turns doctest examples and ``::`` blocks into fenced code
and roles into code spans; the docstrings themselves stay as they are in the source.

>>> to_markdown("Use :func:`~pkg.mod.f` here::\\n\\n    f(1)\\n\\n>>> f(2)\\n3").splitlines()
['Use `f` here:', '', '```python', 'f(1)', '```', '', '```pycon', '>>> f(2)', '3', '```']
"""

from __future__ import annotations

import re
import textwrap
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:mod|func|class|meth|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _role(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    return f"`{target.rsplit('.', 1)[-1] if short else target}`"


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _doctest(lines: list[str], i: int, out: list[str]) -> int:
    """Fence the doctest example starting at ``lines[i]`` (up to the next blank line); the index after it."""
    start = i
    while i < len(lines) and lines[i].strip():
        i += 1
    out.extend(["```pycon", *textwrap.dedent("\n".join(lines[start:i])).splitlines(), "```"])
    return i


def _literal(lines: list[str], i: int, base: int, out: list[str]) -> int:
    """Fence the literal block that follows a ``::`` paragraph (blank lines, then lines indented more than
    ``base``); the index after it."""
    j = i
    while j < len(lines) and not lines[j].strip():
        j += 1
    end = j
    while end < len(lines) and (not lines[end].strip() or _indent(lines[end]) > base):
        end += 1
    while end > j and not lines[end - 1].strip():
        end -= 1
    if end == j:
        return i
    out.extend(["", "```python", *textwrap.dedent("\n".join(lines[j:end])).splitlines(), "```"])
    return end


def to_markdown(text: str) -> str:
    """A docstring's text with doctest examples and ``::`` literal blocks fenced and Sphinx roles as code spans."""
    lines = text.splitlines()
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith(">>>"):
            if out and out[-1].strip():
                out.append("")
            i = _doctest(lines, i, out)
            continue
        line = _ROLE.sub(_role, line)
        if line.rstrip().endswith("::"):
            stripped = line.rstrip()[:-2].rstrip()
            out.append(stripped + ":" if stripped else "")
            i = _literal(lines, i + 1, _indent(line), out)
            continue
        out.append(line)
        i += 1
    return "\n".join(out)


class MarkdownDocstrings(griffe.Extension):
    """Rewrite every docstring Griffe loads with :func:`to_markdown`."""

    def on_instance(self, *, obj: Any, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = to_markdown(obj.docstring.value)
