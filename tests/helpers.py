"""Shared test utilities."""

import numpy as np
import pytest

# Tests (or parameter cases) over ~4 s on an idle 2-core CPU: `make test-fast` leaves them out,
# `make test` (CI) runs them.
SLOW = pytest.mark.slow


def slow(*values):
    """A parameter case marked slow: ``slow("LT_chunked")``, ``slow(shape, c, ...)``."""
    return pytest.param(*values, marks=SLOW)


def rel_err(out, ref) -> float:
    """Scale-aware error ||out - ref|| / ||ref|| in float64."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(out - ref) / (denom if denom > 0 else 1.0))


# A one-layer GPT-2 on random tokens, two sequences of 32 per update, no evaluation, no wandb:
# the overrides the subprocess tests start from (scripts/train.py configs/default.yaml ...).
TINY_OVERRIDES = (
    "data.source=synthetic",
    "model.n_layer=1",
    "model.n_head=2",
    "model.n_embd=32",
    "model.block_size=32",
    "data.context=32",
    "train.tokens_per_update=64",
    "train.micro_batch=2",
)
