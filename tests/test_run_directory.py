"""A run directory under the trainer, as SLURM treats it: one writer (a second trainer refuses
in one line naming the holder, a killed trainer's lock blocks nobody), a metrics log with each
step once (readers refuse one without), and ``train.max_hours`` as a budget over every restart
with ``hours`` that never goes back. Through ``scripts/train.py`` and ``scripts/plot_runs.py``
as subprocesses, as a user runs them."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import filelock
import pytest

from linear_gpt2.platform.errors import DataError, RunError
from linear_gpt2.training import run_lock
from linear_gpt2.training.config import load_config
from linear_gpt2.training.logger import RunLogger
from tests.helpers import SLOW, TINY_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_OVERRIDES,
    "train.warmup_steps=1",
    "log.eval_every=0",
    "log.wandb=disabled",
    "log.every=1000",
]


def _train(run_dir: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    env.pop("LINEAR_GPT2_DEBUG", None)
    return subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "scripts" / "train.py"),
            str(ROOT / "configs" / "default.yaml"),
            *TINY,
            f"log.run_dir={run_dir}",
            *overrides,
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def _records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            pass  # the line being written
    return out


def _wait_for_step(proc: subprocess.Popen, run_dir: Path, step: int, timeout: float = 300):
    deadline = time.monotonic() + timeout
    while max((r["step"] for r in _records(run_dir)), default=0) < step:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"no step {step} in {timeout} s"
        time.sleep(0.05)


def _error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines and lines[-1].startswith("error: "), stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    return lines[-1]


@SLOW
def test_two_trainers_on_one_run_directory_one_trains_the_other_refuses(tmp_path):
    """Started together: one trains (until it is stopped, so that the other cannot come after
    it finished), the other exits 1 before writing anything, in one line naming the holder; the
    log has each step once."""
    run_dir = tmp_path / "run"
    procs = [_train(run_dir, "train.max_steps=100000", "checkpoint.every=1000") for _ in range(2)]
    deadline = time.monotonic() + 300
    while all(p.poll() is None for p in procs):
        assert time.monotonic() < deadline, "neither trainer refused"
        time.sleep(0.05)
    loser = next(p for p in procs if p.poll() is not None)
    winner = next(p for p in procs if p is not loser)
    _, err = loser.communicate()
    assert loser.returncode == 1, err[-3000:]
    line = _error_line(err)
    for word in (
        f"log.run_dir {run_dir}",
        "in use by another trainer",
        f"pid {winner.pid}",
        f"host {socket.gethostname()}",
        "since ",
        "log.run_dir=",
    ):
        assert word in line, (word, line)
    assert len([x for x in err.splitlines() if x.strip()]) == 1, err
    _wait_for_step(winner, run_dir, 1)
    winner.send_signal(signal.SIGTERM)
    out, err = winner.communicate(timeout=300)
    assert winner.returncode == 0 and "stopped by signal" in out, err[-3000:]
    steps = [r["step"] for r in _records(run_dir)]
    assert steps == list(range(1, len(steps) + 1)) and steps
    assert not (run_dir / run_lock.LOCK_FILE).exists()  # released at the end


@SLOW
def test_a_killed_trainers_lock_does_not_block_the_next_run(tmp_path):
    run_dir = tmp_path / "run"
    first = _train(run_dir, "train.max_steps=100000", "checkpoint.every=2")
    _wait_for_step(first, run_dir, 3)
    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    holder = run_lock.read_holder(run_dir)  # the lock file stays, naming the dead process
    assert holder is not None and holder["pid"] == first.pid
    last = max(r["step"] for r in _records(run_dir))
    again = _train(run_dir, f"train.max_steps={last + 2}", "checkpoint.every=2")
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert "starting at step " in out
    assert [r["step"] for r in _records(run_dir)] == list(range(1, last + 3))


@SLOW
def test_max_hours_is_a_budget_over_every_restart(tmp_path):
    """Two preemptions (SIGTERM), then a run to the budget: ``hours`` continues across the
    restarts and never goes back, the run stops at the first step that reaches the budget, and
    a rerun with the budget spent says so and trains nothing."""
    run_dir = tmp_path / "run"
    steps = ("train.max_steps=100000", "checkpoint.every=1000")
    stopped = 0
    for _ in range(2):
        proc = _train(run_dir, *steps, "train.max_hours=1")
        _wait_for_step(proc, run_dir, stopped + 3)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0 and "stopped by signal" in out, err[-3000:]
        stopped = max(r["step"] for r in _records(run_dir))
    # The budget: a second more than the two runs spent, however long they took. Any margin
    # checks the same (the start sees budget left, so at least one step runs, and the run stops
    # at the first step that reaches it); a longer one only trains longer.
    budget_s = _records(run_dir)[-1]["hours"] * 3600 + 1
    args = (*steps, f"train.max_hours={budget_s / 3600}")
    proc = _train(run_dir, *args)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0 and "(max_hours)" in out, err[-3000:]
    records = _records(run_dir)
    assert [r["step"] for r in records] == list(range(1, len(records) + 1))
    hours = [r["hours"] for r in records]
    assert all(a <= b for a, b in zip(hours, hours[1:])), hours
    # Within the budget plus one step: the step before the last had not reached it.
    assert hours[-2] < budget_s / 3600 <= hours[-1], (hours[-2] * 3600, hours[-1] * 3600)
    rerun = _train(run_dir, *args)
    out, err = rerun.communicate(timeout=300)
    assert rerun.returncode == 0, err[-3000:]
    assert "train.max_hours" in out and "is spent" in out and "nothing to train" in out
    assert _records(run_dir) == records  # nothing trained, nothing rewritten
    more = _train(run_dir, *args[:2], f"train.max_hours={hours[-1] + 1 / 3600}")
    more.communicate(timeout=600)
    assert more.returncode == 0
    assert max(r["step"] for r in _records(run_dir)) > len(records)  # a raised budget trains on


def test_an_unwritable_run_directory_names_log_run_dir_and_the_fix(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc = _train(blocker / "run", "train.max_steps=1")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1
    line = _error_line(err)
    assert f"log.run_dir {blocker / 'run'} cannot be written" in line and "log.run_dir" in line
    assert blocker.read_text() == ""
    if os.geteuid() != 0:  # root writes anywhere: the permission case needs another user
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        proc = _train(locked / "run", "train.max_steps=1")
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 1 and "Permission denied" in _error_line(err)
        assert list(locked.iterdir()) == []


def test_plot_runs_refuses_a_log_with_a_step_twice(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.yaml").write_text(load_config(None, TINY).to_yaml())
    lines = [{"step": s, "loss": 10.0 - s, "hours": s / 1000} for s in (1, 2, 3, 1, 4, 2)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_runs.py"), str(run_dir), "--out", "x"],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 1
    line = _error_line(proc.stderr)
    assert str(run_dir / "metrics.jsonl") in line and "step 1 twice" in line
    assert not (tmp_path / "x").exists()


def test_resume_rewrites_a_log_with_a_step_twice_keeping_the_original(tmp_path):
    from linear_gpt2.experiments import runs as runs_lib

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lines = [{"step": s, "loss": float(i)} for i, s in enumerate((1, 2, 3, 1, 4, 2, 5))]
    text = "".join(json.dumps(r) + "\n" for r in lines)
    (run_dir / "metrics.jsonl").write_text(text)
    (run_dir / "config.yaml").write_text(load_config(None, TINY).to_yaml())
    with pytest.raises(DataError, match="step 1 twice"):
        runs_lib.load_run(run_dir)
    warnings = []
    cfg = load_config(None, TINY)
    log = RunLogger(cfg, run_dir, enabled=True, start_step=4, total_steps=9, warn=warnings.append)
    with pytest.raises(RunError, match="append-only by step"):
        log.log({"step": 4, "loss": 0.0})
    log.log({"step": 5, "loss": 9.0})
    log.close()
    kept = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["loss"]) for r in kept] == [
        (1, 3.0),
        (2, 5.0),
        (3, 2.0),
        (4, 4.0),
        (5, 9.0),
    ]
    (original,) = run_dir.glob("metrics.jsonl.*.duplicates")
    assert original.read_text() == text  # nothing lost
    assert len(warnings) == 1 and str(original) in warnings[0]
    assert [r["step"] for r in runs_lib.load_run(run_dir).records] == [1, 2, 3, 4, 5]


@SLOW
def test_a_two_process_job_takes_one_lock_and_refuses_together(tmp_path):
    """jax.distributed: process 0 locks for the job; while another trainer holds the directory
    both processes stop in one line (process 0 naming the holder), and none hangs."""
    run_dir = tmp_path / "run"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    holder = run_lock.RunLock(run_dir)
    holder.acquire()
    try:
        procs = []
        for i in range(2):
            env = {
                **os.environ,
                "JAX_PLATFORMS": "cpu",
                "PYTHONPATH": str(ROOT),
                "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
                "JAX_NUM_PROCESSES": "2",
                "JAX_PROCESS_ID": str(i),
            }
            cmd = [
                sys.executable,
                str(ROOT / "scripts" / "train.py"),
                str(ROOT / "configs" / "default.yaml"),
                *TINY,
                f"log.run_dir={run_dir}",
                "train.max_steps=2",
                "train.micro_batch=1",
            ]
            pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True}
            procs.append(subprocess.Popen(cmd, env=env, cwd=ROOT, **pipes))
        errs = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        holder.release()
    assert [p.returncode for p in procs] == [1, 1], errs
    assert f"pid {os.getpid()}" in _error_line(errs[0])
    assert "process 0 could not lock" in _error_line(errs[1])
    assert not run_dir.exists()  # nothing written: the holder's lock was all there was


def test_a_refused_trainer_waits_for_the_holders_name(tmp_path):
    """The holder writes its record just after it takes the lock: a trainer refused in between
    still names it (not "a process that has not written its name yet")."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock_file = run_dir / run_lock.LOCK_FILE
    holder = filelock.UnixFileLock(lock_file, timeout=0)
    holder.acquire()
    try:
        record = json.dumps({"pid": 4242, "host": "elsewhere"})
        late = threading.Timer(0.3, lambda: lock_file.write_text(record))
        late.start()
        with pytest.raises(run_lock.RunDirectoryLockedError, match="pid 4242 on host elsewhere"):
            run_lock.RunLock(run_dir).acquire()
        late.join()
    finally:
        holder.release()
