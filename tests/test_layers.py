"""The library's layers hold: import-linter's contracts in pyproject.toml (platform -> kernels ->
attention -> model -> training -> experiments, no cycles between the modules of a package, flash's
kernels apart from the linear ones, the library imports no study, the studies import no other
study) are kept, and they are not vacuous: an upward import, a cycle, the library importing a
study or a study another breaks them. Importing the library changes nothing in the process."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_layer_contracts_are_kept():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "5 kept, 0 broken" in proc.stdout


def test_an_upward_import_and_a_cycle_break_them(tmp_path):
    _copy(tmp_path)
    flops = tmp_path / "linear_gpt2" / "model" / "flops.py"
    flops.write_text(flops.read_text() + "\nfrom linear_gpt2.training import trainer  # noqa\n")
    loss = tmp_path / "linear_gpt2" / "model" / "loss.py"
    loss.write_text(loss.read_text() + "\nfrom linear_gpt2.model import flops as _f  # noqa\n")
    flops.write_text(flops.read_text() + "\nfrom linear_gpt2.model import loss as _l  # noqa\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0
    assert "3 kept, 2 broken" in proc.stdout, proc.stdout[-3000:]
    assert "linear_gpt2.model.flops -> linear_gpt2.training.trainer" in proc.stdout


def _copy(tmp_path: Path) -> Path:
    for package in ("linear_gpt2", "studies"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    return tmp_path


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}  # noqa\n")


def test_the_library_importing_a_study_and_a_study_another_break_them(tmp_path):
    """The studies' contracts: the library never imports studies/, a study never another (but
    through the GPU command above them), the report machinery (studies.common) no study."""
    root = _copy(tmp_path)
    _append(root / "linear_gpt2" / "experiments" / "runs.py", "from studies.common import core")
    _append(root / "studies" / "mqar" / "mqar.py", "from studies.train_step import step_time")
    _append(root / "studies" / "common" / "fmt.py", "from studies.learning import report")
    proc = _lint(root)
    assert proc.returncode != 0
    assert "3 kept, 2 broken" in proc.stdout, proc.stdout[-3000:]
    for imported in (
        "linear_gpt2.experiments.runs -> studies.common.core",
        "studies.mqar.mqar -> studies.train_step.step_time",
        "studies.common.fmt -> studies.learning.report",
    ):
        assert imported in proc.stdout, (imported, proc.stdout[-3000:])


@pytest.mark.slow
def test_importing_the_library_changes_nothing_in_the_process():
    """Every library module imported (after JAX, Flax, optax and orbax, whose own imports set
    variables of theirs) leaves ``os.environ`` as it was: the process settings are one explicit
    call, ``platform.process.configure`` (tested in test_context_parallel.py and
    test_memory_options.py). ``platform.cli``, the entry points' module, is left out: importing
    it quiets XLA's native log, which jaxlib reads only as it loads (``platform/logs.py``)."""
    code = """
import importlib, json, os, pkgutil, sys
import jax, flax.linen, optax, orbax.checkpoint  # noqa: F401
before = dict(os.environ)
import linear_gpt2
seen = []
for info in pkgutil.walk_packages(linear_gpt2.__path__, "linear_gpt2."):
    if info.name == "linear_gpt2.platform.cli":
        continue
    try:
        importlib.import_module(info.name)
        seen.append(info.name)
    except ImportError:  # an optional dependency (triton, torch) is missing here
        pass
after = dict(os.environ)
changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
print(json.dumps({"changed": changed, "modules": len(seen), "cli": "linear_gpt2.platform.cli" in sys.modules}))
"""
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = __import__("json").loads(proc.stdout.strip().splitlines()[-1])
    assert out["modules"] > 100 and out["changed"] == [], out
    assert not out["cli"], "a library module imports the entry points' cli module"
