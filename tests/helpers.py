"""Shared test utilities."""

import numpy as np


def rel_err(out, ref) -> float:
    """Scale-aware error ||out - ref|| / ||ref|| in float64."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))
