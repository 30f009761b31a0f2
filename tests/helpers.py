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


# A script's ``main`` on each argument list in one subprocess: the entry point's own error
# reporting (one line, its exit code) for many cases without a process start each.
_ENTRY_POINT_CALLS = """
import contextlib, importlib.util, io, json, sys
spec = importlib.util.spec_from_file_location("entry_point", sys.argv[1])
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
for args in json.loads(sys.argv[2]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = script.main(args)
    print("CALL " + json.dumps([code, err.getvalue()]))
"""


def entry_point_calls(script, calls, env=None, cwd=None) -> list[tuple[int, str]]:
    """``(exit code, stderr)`` of ``script``'s ``main(args)`` for each ``args`` in ``calls``,
    run in one fresh Python process (``env`` its environment)."""
    import json
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _ENTRY_POINT_CALLS, str(script), json.dumps(calls)],
        capture_output=True, text=True, cwd=cwd, env=env, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = [json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("CALL ")]
    assert len(out) == len(calls), proc.stdout[-3000:]
    return [(code, err) for code, err in out]
