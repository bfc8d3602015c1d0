"""Plain-text tables for the terminal: columns as wide as their widest cell, and the cells of ``memchunk models``.
"""

from __future__ import annotations

from typing import Any

from memchunk_prefect.core.errors import (
    format_bytes,
)

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2



def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def policy_cell(arms: list[dict[str, Any]]) -> str:
    """The learned policy's arms that were played: ``arm reward x plans`` (``!n``: n out-of-memory events)."""
    played = [a for a in arms if a["pulls"]]
    if not played:
        return "-"
    return " ".join(f"{a['arm']} {a['mean_reward']:.2f}x{a['pulls']}" + (f"!{a['out_of_memory']}"
                                                                          if a["out_of_memory"] else "")
                    for a in played)


def table(header: list[str], body: list[list[str]], indent: str = "") -> str:
    """Left-aligned columns as wide as their widest cell, two spaces apart."""
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(header)]
    return "\n".join(indent + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in [header, *body])


def models_table(rows: list[dict[str, Any]]) -> str:
    header = ["operator key", "obs", "censored", "form", "bytes/element", "fixed overhead", "peak at", "recent error",
              "coverage", "ready", "time", "energy/element", "policy"]
    body = [[r["key"], str(r["n_observations"]), str(r["n_censored"]), r["form"],
             "-" if r["bytes_per_element"] is None else f"{r['bytes_per_element']:.1f}",
             fixed_cell(r), rise_cell(r),
             pct(r["recent_mape"]), pct(r["coverage"]), "yes" if r["ready"] else "no", time_cell(r),
             energy_cell(r), policy_cell(r.get("policy", []))] for r in rows]
    return table(header, body)


def fixed_cell(r: dict[str, Any]) -> str:
    """The fixed overhead per chunk, and the most a first use left held in a worker, paid once per worker
    process (``2.0 MiB +150.0 MiB once``)."""
    cell = format_bytes(r["fixed_overhead_bytes"]) if r["fixed_overhead_bytes"] is not None else "-"
    return cell + (f" +{format_bytes(r['first_use_bytes'])} once" if r.get("first_use_bytes") else "")


def rise_cell(r: dict[str, Any]) -> str:
    """When in their runs its blocks reached half and 90% of their memory peak, as shares of the run (``0.36/0.80``;
    ``-`` before enough runs timed it): what a block that does not fit gets through before its worker dies."""
    rise = r.get("rise")
    return "-" if rise is None else f"{rise[0]:.2f}/{rise[1]:.2f}"


def time_cell(r: dict[str, Any]) -> str:
    """The time model: its form and the runs it learned from, those set aside for a first touch of memory, and
    the kernel seconds per GiB those runs paid to grow their worker (what a plan counts for growing fresh
    workers), the measured seconds per element of its largest blocks over its smallest (``linear 12 0.8x`` or
    ``quadratic 8 +2 first 1.5 s/GiB 1.6x``: a curve is taken only where the runs support it), and the share a
    curve counts in a block's seconds where it is neither all nor nothing (``linear 6 1.2x quadratic 41%``),
    then how far its runs strayed from it, a log-normal's sigma that the simulator draws a block's seconds with
    (``linear 6 1.2x ~0.36``), and last what a worker's first call of the operator took beyond a later one, paid
    once per worker process (``linear 6 1.2x +0.21 s first call``)."""
    cell = f"{r.get('time_form', '-')} {r.get('time_runs', 0)}"
    cell += f" +{r['first_touch_runs']} first" if r.get("first_touch_runs") else ""
    cell += f" {r['touch_seconds_per_gib']:.1f} s/GiB" if r.get("touch_seconds_per_gib") is not None else ""
    cell += f" {r['time_rate_ratio']:.1f}x" if r.get("time_rate_ratio") is not None else ""
    weight, curve = r.get("time_curve_weight"), r.get("time_curve")
    cell += f" {curve} {weight:.0%}" if curve and weight is not None and 0.0 < weight < 1.0 else ""
    cell += f" ~{r['time_spread']:.2f}" if r.get("time_spread") is not None else ""
    return cell + (f" +{r['first_call_seconds']:.2f} s first call" if r.get("first_call_seconds") else "")


def energy_cell(r: dict[str, Any]) -> str:
    """Learned energy per element in microjoules, with its source: ``2.41 uJ est`` or ``1.90 uJ rapl``."""
    if r.get("joules_per_element") is None:
        return "-"
    source = "est" if r.get("energy_source") == "estimate" else str(r.get("energy_source"))
    return f"{r['joules_per_element'] * 1e6:.2f} uJ {source}"
