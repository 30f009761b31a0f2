"""Where a result was obtained: device, versions, commit, host and time.

:func:`environment` is what each benchmark writes into its raw file's ``meta`` and what the
trainer appends to a run directory's ``run_info.jsonl`` at every start; the renderers of the
reports (``studies.common``) read it back, so a table never loses where its numbers came
from.
"""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import jax
import numpy as np

REPO = Path(__file__).resolve().parents[2]


# What a run writes (raw files and the pages rendered from them) and prose: changes there do not
# change the code a number came from. A benchmark that writes its file after each point would
# otherwise mark every later point dirty by its own output.
NOT_CODE = ("benchmarks/results", "docs", "README.md")


# A copy of the work tree without its git folder (a lent GPU machine's) is told its commit by
# this variable (make gpu-check's runner sets it from what make gpu-compile recorded).
COMMIT_ENV = "LINEAR_GPT2_GIT_COMMIT"


def git_commit() -> str | None:
    """The repository's HEAD commit, with ``+dirty`` when the work tree has changes to tracked
    files other than :data:`NOT_CODE`; without git, ``$LINEAR_GPT2_GIT_COMMIT``."""
    if not (REPO / ".git").exists() and os.environ.get(COMMIT_ENV):
        return os.environ[COMMIT_ENV]
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [
                "git",
                "status",
                "--porcelain",
                "--untracked-files=no",
                "--",
                ".",
                *(f":(exclude){p}" for p in NOT_CODE),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except Exception:
        return os.environ.get(COMMIT_ENV) or None


def environment() -> dict[str, Any]:
    """Where the numbers were measured: device, versions, commit, host."""
    dev = jax.devices()[0]
    return {
        "device_kind": getattr(dev, "device_kind", str(dev)),
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "jax_version": jax.__version__,
        "jaxlib_version": _dist_version("jaxlib"),
        "python": sys.version.split()[0],
        "git_commit": git_commit(),
        "host": platform.node(),
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def allocator() -> dict[str, Any]:
    """The share of the GPU the allocator takes (``XLA_PYTHON_CLIENT_MEM_FRACTION``; the
    package sets a default, ``linear_gpt2/__init__.py``) and the limit it reports; None on a
    CPU, which has neither. What ``auto``'s memory settings were resolved against."""
    dev = jax.devices()[0]
    if dev.platform != "gpu":
        return {"allocator_fraction": None, "allocator_bytes_limit": None}
    value = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION")
    stats = dev.memory_stats() or {}
    return {
        "allocator_fraction": float(value) if value else None,
        "allocator_fraction_set_by": f"XLA_PYTHON_CLIENT_MEM_FRACTION={value}" if value else None,
        "allocator_bytes_limit": stats.get("bytes_limit"),
    }


def _dist_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def device_slug(kind: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia_h100_80gb_hbm3``: a file-name-safe device name."""
    return "".join(c if c.isalnum() else "_" for c in kind.lower()).strip("_") or "device"


def json_default(o: Any) -> Any:
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
