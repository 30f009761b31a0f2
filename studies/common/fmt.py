"""Formatting shared by the reports: tables, units, context labels and where a file came from."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from linear_gpt2.experiments.axes import context_label

GiB = 2**30
HOW = ("measured", "compiled", "modelled", "published")

__all__ = [
    "GiB", "HOW", "context_label", "gib", "glue_point", "how", "provenance", "ratio", "short",
    "table",
]  # fmt: skip


def table(header: Sequence[str], rows: Iterable[Sequence[Any]], align: str | None = None) -> str:
    """A markdown table; ``align`` is one character per column, ``l`` or ``r``."""
    rule = [("---:" if a == "r" else "---") for a in (align or "l" * len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule) + "|"]
    for row in rows:
        lines.append("| " + " | ".join("" if c is None else str(c) for c in row) + " |")
    return "\n".join(lines)


def gib(n: float | None, digits: int = 2) -> str:
    return "" if n is None else f"{n / GiB:.{digits}f}"


def glue_point(r: dict[str, Any], times: str = "x") -> str:
    """A glue A/B row's point (``glue_ab_<card>_measured.json``): attention, size, batch
    (``times`` between it and the context) and chunk."""
    b = f"{r['batch']} {times} " if r.get("batch", 1) > 1 else ""
    chunk = f", chunk {r['chunk_size']}" if r.get("chunk_size") else ""
    return f"`{r['attention']}` {r['size']} {b}{context_label(r['context'])}{chunk}"


def ratio(x: float, digits: int = 2) -> str:
    return f"{x:.{digits}f}x"


def short(commit: str | None) -> str:
    """``655d1e40a2...+dirty`` -> ``655d1e4+dirty``; ``unknown`` for None."""
    if not commit:
        return "unknown"
    head, _, rest = commit.partition("+")
    return head[:7] + (f"+{rest}" if rest else "")


def how(prov: dict[str, Any]) -> str:
    """``Measured``, ``Compiled``, ...: how a raw file's numbers were obtained, for a sentence's
    start; ``Obtained (how: not recorded)`` where the file does not say."""
    return prov["how"].capitalize() if prov.get("how") else "Obtained (how: not recorded)"


def provenance(data: Any) -> dict[str, Any]:
    """Where a raw file came from, read from its ``meta``: how (measured / compiled / modelled
    / published), device, jax version, commit and time. Missing fields are None."""
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    env = meta.get("environment", {})
    return {
        "how": meta.get("how"),
        "device": env.get("device_kind"),
        "jax": env.get("jax_version"),
        "commit": env.get("git_commit"),
        "time": env.get("time_utc"),
    }
