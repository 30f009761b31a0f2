"""The library's layers hold: import-linter's contracts in pyproject.toml (platform -> kernels ->
attention -> model -> training -> experiments, and no cycles between the modules of a package)
are kept, and they are not vacuous: an upward import or a cycle breaks them."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(LINT), "--no-cache", "--no-logo"], cwd=cwd, capture_output=True, text=True, timeout=300
    )


def test_the_layer_contracts_are_kept():
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "2 kept, 0 broken" in proc.stdout


def test_an_upward_import_and_a_cycle_break_them(tmp_path):
    shutil.copytree(ROOT / "linear_gpt2", tmp_path / "linear_gpt2",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    flops = tmp_path / "linear_gpt2" / "model" / "flops.py"
    flops.write_text(flops.read_text() + "\nfrom linear_gpt2.training import trainer  # noqa\n")
    loss = tmp_path / "linear_gpt2" / "model" / "loss.py"
    loss.write_text(loss.read_text() + "\nfrom linear_gpt2.model import flops as _f  # noqa\n")
    flops.write_text(flops.read_text() + "\nfrom linear_gpt2.model import loss as _l  # noqa\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0
    assert "0 kept, 2 broken" in proc.stdout, proc.stdout[-3000:]
    assert "linear_gpt2.model.flops -> linear_gpt2.training.trainer" in proc.stdout
