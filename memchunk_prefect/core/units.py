"""Memory sizes as people write them: ``"2GiB"``, ``"512 MB"``, plain bytes.

One parser for the command line, the runner's ``memory_budget`` and the demo.
"""

from __future__ import annotations

import math
import re

from memchunk_prefect.core.errors import BudgetError

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
BUDGET_FORMS = ("a number of bytes (2147483648) or a number with a unit: B, KB, MB, GB, TB (powers of 1000), "
                "KiB, MiB, GiB, TiB (powers of 1024), e.g. 2GiB or 512MiB")


def parse_bytes(text: str | int | float, *, what: str | None = None) -> int:
    """``"2GiB" -> 2147483648``; ``"2GB" -> 2000000000``; plain numbers are bytes.

    Raises :class:`~memchunk_prefect.core.errors.BudgetError` quoting the value and the accepted forms, and
    ``what`` was given it (an argument's name) where given.

    >>> parse_bytes("2GiB"), parse_bytes("1.5 MiB"), parse_bytes(1000), parse_bytes(2e9)
    (2147483648, 1572864, 1000, 2000000000)
    """
    try:
        return _parse_bytes(text)
    except BudgetError as exc:
        if what is None:
            raise
        raise BudgetError(f"`{what}`: {exc}") from None


def _parse_bytes(text: str | int | float) -> int:
    if isinstance(text, float) and math.isfinite(text):
        text = int(text)
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise BudgetError(f"cannot read {text!r} as a memory size; use {BUDGET_FORMS}")
        try:
            value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
        except OverflowError:
            raise BudgetError(f"{text!r} is too large for a memory size; use {BUDGET_FORMS}") from None
    if value <= 0:
        raise BudgetError(f"a memory size must be positive, got {text!r}; use {BUDGET_FORMS}")
    return value


def parse_seconds(text: str | float | int) -> float:
    """A duration: seconds (``"3600"``), with a unit (``"90s"``, ``"45min"``, ``"6h"``, ``"7d"``) or ``"HH:MM[:SS]"``.

    >>> parse_seconds("6h"), parse_seconds("45min"), parse_seconds("06:30"), parse_seconds(90), parse_seconds("2d")
    (21600.0, 2700.0, 23400.0, 90.0, 172800.0)
    """
    from memchunk_prefect.core.errors import VolumeError

    if isinstance(text, (int, float)):
        value = float(text)
    else:
        t = str(text).strip().lower()
        try:
            if ":" in t:
                parts = [float(p) for p in t.split(":")]
                if len(parts) not in (2, 3):
                    raise ValueError(t)
                value = parts[0] * 3600 + parts[1] * 60 + (parts[2] if len(parts) == 3 else 0.0)
            else:
                for unit, scale in (("min", 60.0), ("h", 3600.0), ("d", 86400.0), ("s", 1.0)):
                    if t.endswith(unit):
                        value = float(t[: -len(unit)]) * scale
                        break
                else:
                    value = float(t)
        except ValueError:
            raise VolumeError(f"cannot read {text!r} as a duration: give seconds (3600), 90s, 45min, 6h, 7d or "
                              "HH:MM[:SS]") from None
    if not (value > 0 and math.isfinite(value)):
        raise VolumeError(f"a duration must be a positive, finite number of seconds, got {text!r}")
    return value
