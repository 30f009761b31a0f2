"""What the tables and figures share: the post's context labels and log-log slopes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Least-squares slope of log y on log x (y ~ x^slope); None for fewer than two points."""
    pts = [(a, b) for a, b in zip(x, y) if a and b and a > 0 and b > 0]
    if len(pts) < 2:
        return None
    return float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0])


def context_label(t: int) -> str:
    """1024 -> ``1k``, 65536 -> ``64k``, 1048576 -> ``1M``; the post's axis labels."""
    if t >= 2**20 and t % 2**20 == 0:
        return f"{t // 2**20}M"
    if t >= 1024 and t % 1024 == 0:
        return f"{t // 1024}k"
    return str(t)
