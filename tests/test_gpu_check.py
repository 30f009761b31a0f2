"""``make gpu-check`` (scripts/gpu_check.py, linear_gpt2/experiments/gpu_check/) without a GPU:
the dry run's stages and estimate within budget, the one-line refusal on a machine without a
GPU, and every stage's CPU path on tiny shapes: its units, the result files and their page,
resumption (a unit done is not run again) and ``--only`` / ``--skip`` / ``--time-limit``."""

from __future__ import annotations

import gzip
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from linear_gpt2.experiments import reports
from linear_gpt2.experiments.gpu_check import learning, plan, profile, runner, stages, testfiles
from linear_gpt2.platform.errors import UsageError
from tests.helpers import SLOW

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
HAS_GPU = any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0"))


def run_script(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def test_dry_run_lists_every_stage_and_fits_the_budgets():
    r = run_script("--dry-run")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for name in ("tests", "kernels", "step", "profile", "sample", "memory", "mqar", "context"):
        assert re.search(rf"^\s+\d\. {name}\s", out, re.M), name
    for phase in plan.PHASES:
        minutes = float(re.search(rf"^{phase}: estimated ([\d.]+) min", out, re.M).group(1))
        assert 0 < minutes <= plan.PHASE_BUDGET_S[phase] / 60, (phase, minutes)
    # Each stage's work and the assumptions it rests on, stated.
    assert "work: " in out and "priced from measured: " in out
    assert re.search(r"^assumptions .*\n  \w+ = ", out, re.M)
    assert "step_time_h100_124M_flash_LT_chunked.json" in out  # priced from the measured H100


@SLOW
def test_make_honours_dry_run_and_args():
    for cmd in (["make", "-n", "gpu-check"], ["make", "gpu-check", "ARGS=--dry-run"]):
        r = subprocess.run([*cmd, f"PY={sys.executable}"], capture_output=True, text=True,
                           cwd=ROOT, timeout=300)  # fmt: skip
        assert r.returncode == 0, r.stderr
        assert "(dry run: nothing runs)" in r.stdout and "learning: estimated" in r.stdout


@pytest.mark.skipif(HAS_GPU, reason="checks the refusal on a machine without a GPU")
def test_without_a_gpu_it_says_so_in_one_line_and_does_nothing(tmp_path):
    r = run_script("--run-dir", str(tmp_path / "run"), "--results", str(tmp_path / "res"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA GPU"), r.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "res").exists()


def test_select_only_skip_and_a_bad_name():
    p = stages.build(ROOT / "benchmarks" / "results", tiny=True)
    assert [s.name for s in p.select(["step", "learning"]).stages] == ["step", "mqar", "context"]
    assert "tests" not in [s.name for s in p.select(skip=["tests"]).stages]
    with pytest.raises(UsageError, match="unknown stage 'steps'; the stages are checks, learning"):
        p.select(["steps"])


def test_counts_gpu_tests_from_the_source():
    src = """
import pytest
CASES = [1, 2, 3]
KERNELS = {"a": 1, "b": 2}
@pytest.mark.gpu
@pytest.mark.parametrize("k", list(KERNELS))
@pytest.mark.parametrize("d", ["f32", "bf16"])
def test_a(k, d): pass
@pytest.mark.gpu
@pytest.mark.parametrize("c", CASES)
def test_b(c): pass
def test_not_gpu(): pass
"""
    assert testfiles.count_gpu_tests(src) == 2 * 2 + 3
    files = testfiles.gpu_test_files(ROOT)
    assert "tests/test_kernels.py" in files and all(n > 0 for n in files.values())


def test_learning_summaries():
    s = learning.curve_summary([(25, 6.0), (50, 5.5), (75, 5.4), (100, 5.45), (125, 5.6)])
    assert (s["min_step"], s["min_loss"], s["rising_from"], s["final_loss"]) == (75, 5.4, 100, 5.6)
    assert learning.curve_summary([(1, 3.0), (2, 2.0)])["rising_from"] is None
    rows = [
        {"variant": "flash", "context": 128, "seed": 0, "final_loss": 5.0},
        {"variant": "flash", "context": 128, "seed": 1, "final_loss": 5.1},
        {"variant": "LT", "context": 128, "seed": 0, "final_loss": 5.4},
        {"variant": "LT", "context": 128, "seed": 1, "final_loss": 5.5},
    ]
    (g,) = learning.gaps(rows)
    assert g["variant"] == "LT" and g["gap"] == pytest.approx(0.4)
    assert g["seed_noise"] == pytest.approx(0.1) and g["above_noise"] is True


def test_profile_parses_device_ops_and_their_shares(tmp_path):
    events = [
        {"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/host:CPU"}},
        {"ph": "M", "name": "process_name", "pid": 2, "args": {"name": "/device:GPU:0"}},
        {"ph": "X", "pid": 1, "name": "PjitFunction(step)", "ts": 0, "dur": 900.0},
        *({"ph": "X", "pid": 2, "name": "gemm", "ts": i, "dur": 300.0} for i in range(4)),
        *({"ph": "X", "pid": 2, "name": "flash_fwd", "ts": i, "dur": 100.0} for i in range(4)),
    ]
    path = tmp_path / "perfetto_trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    p = profile.parse_trace(path, steps=2)
    assert p["where"] == "GPU" and p["device_ms"] == pytest.approx(0.8)
    assert [(o["name"], o["count"], o["share"]) for o in p["top"]] == [
        ("gemm", 2, pytest.approx(0.75)), ("flash_fwd", 2, pytest.approx(0.25))
    ]  # fmt: skip


def _page_is_rendered(path: Path) -> None:
    text = path.read_text()
    new, _ = reports.render_text(text, path.parent, path.name)
    assert new == text and "<!-- generated:" in text


@SLOW
def test_tiny_run_of_every_stage_resumes_and_skips(tmp_path):
    """Every stage's CPU path on tiny shapes, in subprocesses as on the GPU: the units finish,
    their results land in the results folder with provenance and render; a second run runs
    nothing; a unit whose record is removed runs again, and only it; --time-limit stops before
    a unit whose estimate does not fit."""
    run, res = tmp_path / "run", tmp_path / "res"
    args = ("--tiny", "--run-dir", str(run), "--results", str(res), "--no-progress")
    r = run_script(*args, timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    p = stages.build(ROOT / "benchmarks" / "results", tiny=True)
    done = runner.done_units(run, p)
    assert set(done) == {(s.name, u.name) for s in p.stages for u in s.units}
    assert all(d["status"] == "ok" for d in done.values()), done
    dev = "tiny_cpu"
    for name in ("gpu_tests", "kernels", "step_time", "profile", "sample_time", "memory_check",
                 "mqar", "context", "gpu_check"):  # fmt: skip
        data = json.loads((res / f"{name}_{dev}_measured.json").read_text())
        assert data["meta"]["how"] == "measured", name
    step = json.loads((res / f"step_time_{dev}_measured.json").read_text())
    assert {r["attention"] for r in step["results"]} == {"softmax", "LT_chunked"}
    assert all(r["min_ms"] <= r["median_ms"] <= r["max_ms"] for r in step["results"])
    assert step["meta"]["environment"]["git_commit"]
    ctx = json.loads((res / f"context_{dev}_measured.json").read_text())
    assert len(ctx["runs"]) == 2 and all(r["curve"] for r in ctx["runs"])
    page = res / f"gpu_check_{dev}_measured.md"
    _page_is_rendered(page)
    for heading in ("GPU tests", "Kernels", "Training step", "Where the step's time goes",
                    "Sampling", "Memory", "MQAR", "Context study"):  # fmt: skip
        assert f"## {heading}" in page.read_text(), heading

    again = run_script(*args, "--only", "checks")
    assert again.returncode == 0 and ": ok in" not in again.stdout, again.stdout
    (run / "step" / "tiny_64" / runner.DONE).unlink()
    redo = run_script(*args, "--skip", "learning")
    assert redo.returncode == 0, redo.stderr
    assert re.findall(r"^(\S+): ok in", redo.stdout, re.M) == ["step/tiny_64"], redo.stdout

    (run / "memory" / p.stage("memory").units[0].name / runner.DONE).unlink()
    stopped = run_script(*args, "--only", "memory", "--time-limit", "0.001")
    assert stopped.returncode == 0 and "stopped at the time limit with 1 units" in stopped.stdout
    assert not (run / "memory" / p.stage("memory").units[0].name / runner.DONE).exists()
