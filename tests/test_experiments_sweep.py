"""Sweeps: grid/point expansion and run names, a 2 x 2 sweep that trains and is skipped when
run again, the dry run, the SLURM array script, command-line overrides in every kind of run,
reruns after the config changed, and stop signals (Ctrl-C, SIGTERM) to the sweep's process group
or to the sweep alone."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from linear_gpt2.experiments import sweep as sweep_lib
from linear_gpt2.platform.errors import ConfigError
from tests.helpers import SLOW
from tests.test_experiments_bench import load_script

ROOT = Path(__file__).resolve().parents[1]

# configs/default.yaml shrunk: one layer, random tokens, two updates of 64 tokens.
TINY = {
    "model.n_layer": 1,
    "model.n_head": 2,
    "model.n_embd": 32,
    "model.block_size": 32,
    "data.source": "synthetic",
    "train.tokens_per_update": 64,
    "train.micro_batch": 2,
    "train.max_steps": 2,
    "train.warmup_steps": 1,
    "attention.chunk_size": 8,
    "log.eval_every": 0,
    "log.wandb": "disabled",
    "checkpoint.async_save": False,
}


def write_sweep(tmp_path: Path, **spec) -> Path:
    path = tmp_path / "sweep.yaml"
    spec = {
        "name": "test-sweep",
        "base": str(ROOT / "configs" / "default.yaml"),
        "out_dir": str(tmp_path / "runs"),
        "overrides": TINY,
        **spec,
    }
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


@SLOW
def test_two_by_two_sweep_runs_then_skips(tmp_path, capsys):
    path = write_sweep(
        tmp_path, grid={"data.context": [16, 32], "attention.name": ["softmax", "LT_chunked"]}
    )
    sweep = sweep_lib.load_sweep(path)
    names = [p.name for p in sweep.points]
    assert names == ["ctx16_softmax", "ctx16_LT_chunked", "ctx32_softmax", "ctx32_LT_chunked"]

    outcomes = sweep_lib.run_sweep(sweep, in_process=True, log=lambda *a: None)
    assert outcomes == dict.fromkeys(names, "max_steps")
    for p in sweep.points:
        run = tmp_path / "runs" / p.name
        assert json.loads((run / "DONE").read_text())["step"] == 2
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["log"]["name"] == p.name and cfg["log"]["wandb_group"] == "test-sweep"
        assert cfg["data"]["context"] == p.values["data.context"]
        assert cfg["attention"]["name"] == p.values["attention.name"]
        assert len((run / "metrics.jsonl").read_text().splitlines()) == 2
    stamps = {n: (tmp_path / "runs" / n / "metrics.jsonl").stat().st_mtime_ns for n in names}

    # Run again through the command line: every point is done, nothing trains.
    script = load_script("sweep")
    capsys.readouterr()
    assert script.main([str(path), "--in-process"]) == 0
    out = capsys.readouterr().out
    assert out.count("done, skipped") == 4, out
    assert stamps == {
        n: (tmp_path / "runs" / n / "metrics.jsonl").stat().st_mtime_ns for n in names
    }
    assert script.main([str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("] done ") == 4 and "scripts/train.py" in out

    # A finished run without its marker (killed after the last checkpoint) is done too.
    (tmp_path / "runs" / "ctx16_softmax" / "DONE").unlink()
    assert sweep_lib.is_done(sweep_lib.point_config(sweep, sweep.points[0]))
    # The SLURM script only lists unfinished points: here none.
    assert "nothing to submit" in sweep_lib.slurm_script(sweep)


def test_grid_times_points_names_and_slurm(tmp_path):
    path = write_sweep(
        tmp_path,
        overrides={**TINY, "attention.name": "LT_chunked"},
        grid={"attention.chunk_size": [8, 16]},
        points=[{"data.context": 16, "train.micro_batch": 1}, {"data.context": 32}],
        name_keys=["data.context", "attention.name", "attention.chunk_size"],
        slurm={"gpus_per_node": 4, "partition": "gpu", "max_parallel": 2},
    )
    sweep = sweep_lib.load_sweep(path, ["train.max_steps=5"])
    assert [p.name for p in sweep.points] == [
        "ctx16_LT_chunked_c8",
        "ctx16_LT_chunked_c16",
        "ctx32_LT_chunked_c8",
        "ctx32_LT_chunked_c16",
    ]
    p = sweep.points[1]
    assert p.values == {"attention.chunk_size": 16, "data.context": 16, "train.micro_batch": 1}
    assert p.overrides[-1] == "train.max_steps=5"  # command-line overrides apply last
    cfg = sweep_lib.point_config(sweep, p)
    assert (cfg.attention.chunk_size, cfg.train.micro_batch, cfg.train.max_steps) == (16, 1, 5)
    assert cfg.log.run_dir == str(tmp_path / "runs" / "ctx16_LT_chunked_c16")

    script = sweep_lib.slurm_script(sweep, ["train.max_steps=5"])
    assert "#SBATCH --array=0,1,2,3%2" in script
    assert "#SBATCH --gpus-per-node=4" in script and "#SBATCH --partition=gpu" in script
    assert '--point "$SLURM_ARRAY_TASK_ID" train.max_steps=5' in script
    assert "#   3: ctx32_LT_chunked_c16" in script

    # Without name_keys the name uses the keys that vary.
    path = write_sweep(tmp_path, grid={"data.context": [16, 32]}, points=[{"seed": 1}])
    assert [p.name for p in sweep_lib.load_sweep(path).points] == ["ctx16", "ctx32"]


def test_sweep_errors(tmp_path):
    with pytest.raises(ConfigError, match="unknown key"):
        sweep_lib.load_sweep(write_sweep(tmp_path, gird={"seed": [1]}))
    with pytest.raises(ConfigError, match="would both be named"):
        sweep_lib.load_sweep(
            write_sweep(tmp_path, grid={"seed": [1, 2]}, name_keys=["model.n_layer"])
        )
    # A bad point fails before anything trains, naming the key.
    sweep = sweep_lib.load_sweep(write_sweep(tmp_path, grid={"data.context": [16, 64]}))
    with pytest.raises(ConfigError, match="block_size"):
        sweep_lib.run_sweep(sweep, in_process=True, log=lambda *a: None)


def test_shipped_sweeps_resolve():
    for path in sorted((ROOT / "configs" / "sweeps").glob("*.yaml")):
        sweep = sweep_lib.load_sweep(path)
        for p in sweep.points:
            sweep_lib.point_config(sweep, p)  # every point is a valid config
    chunk = sweep_lib.load_sweep(ROOT / "configs" / "sweeps" / "chunk_size.yaml")
    assert chunk.points[1].name == "ctx16384_LT_chunked_c64"


def _steps(run: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]


@SLOW
def test_overrides_reach_subprocesses_in_process_runs_and_the_slurm_script(tmp_path, capsys):
    """``key=value`` before or after the options, in a local run (each point a subprocess), an
    ``--in-process`` run and the generated SLURM array script, executed here with bash; raising
    ``train.max_steps`` on a finished point continues it instead of skipping it."""
    path = write_sweep(
        tmp_path,
        grid={"data.context": [16]},
        name_keys=["data.context"],
        slurm={"python": sys.executable},
    )
    run = tmp_path / "runs" / "ctx16"
    script = [sys.executable, str(ROOT / "scripts" / "sweep.py")]
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}

    # Local run, overrides after the file: the child (sweep.py FILE --point 0 key=value) gets them.
    out = subprocess.run(
        [*script, str(path), "train.max_steps=1"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "1 points, 0 failed" in out.stdout
    assert _steps(run) == [1] and json.loads((run / "DONE").read_text())["step"] == 1

    # In process, option first: max_steps raised from 1 to 2 continues the finished point.
    sweep_script = load_script("sweep")
    assert sweep_script.main(["--in-process", str(path), "train.max_steps=2"]) == 0
    printed = capsys.readouterr().out
    assert "config changed: train.max_steps 1 -> 2" in printed, printed
    assert _steps(run) == [1, 2]
    assert sweep_script.main([str(path), "train.max_steps=2", "--dry-run"]) == 0
    assert "[0] done ctx16" in capsys.readouterr().out

    # The SLURM array script carries the overrides into the task's command.
    sh = tmp_path / "array.sh"
    assert sweep_script.main([str(path), "--slurm", str(sh), "train.max_steps=3"]) == 0
    text = sh.read_text()
    assert "#SBATCH --array=0" in text and "train.max_steps=3" in text
    task = subprocess.run(
        ["bash", "-c", f'srun() {{ "$@"; }}; export -f srun; bash {sh}'],
        env={**env, "SLURM_ARRAY_TASK_ID": "0"},
        capture_output=True,
        text=True,
    )
    assert task.returncode == 0, task.stdout[-2000:] + task.stderr[-2000:]
    assert _steps(run) == [1, 2, 3] and json.loads((run / "DONE").read_text())["step"] == 3
    assert "nothing to submit" in sweep_lib.slurm_script(
        sweep_lib.load_sweep(path, ["train.max_steps=3"])
    )

    # Another experiment in the same run directory is stale: reported on stderr, not run, exit 2
    # (the rerun train.py would refuse with the same code).
    assert sweep_script.main([str(path), "train.max_steps=3", "train.lr=0.01", "--in-process"]) == 2
    captured = capsys.readouterr()
    assert "stale" in captured.out
    err = captured.err.strip().splitlines()
    assert "train.lr" in err[0] and "out_dir" in err[0] and err[-1].startswith("error: sweep")
    assert _steps(run) == [1, 2, 3]
    assert "not submitted, stale" in sweep_lib.slurm_script(
        sweep_lib.load_sweep(path, ["train.max_steps=3", "train.lr=0.01"])
    )


def test_sweep_command_line_errors(tmp_path, capsys):
    sweep_script = load_script("sweep")
    assert sweep_script.main([str(tmp_path / "nope.yaml")]) == 2
    err = capsys.readouterr().err
    assert (
        err.startswith("error: sweep file")
        and "configs/sweeps/" in err
        and len(err.splitlines()) == 1
    )
    path = write_sweep(tmp_path, grid={"data.context": [16]})
    assert sweep_script.main([str(path), "train.max_step=3", "--dry-run"]) == 2
    assert "did you mean 'max_steps'" in capsys.readouterr().err
    assert sweep_script.main([str(path), "--point", "5"]) == 2
    assert "--point 5 is not a point" in capsys.readouterr().err
    # --help cites sweep files that exist.
    doc = sweep_script.__doc__
    for word in doc.split():
        if word.startswith("configs/sweeps/"):
            assert (ROOT / word).is_file(), word


# --------------------------------------------------------------------------------------------
# Signals (issue 38): the point in training checkpoints, the sweep stops and says so

# Steps that never end on their own, metrics every step, checkpoints only when stopped.
ENDLESS = {**TINY, "train.max_steps": 100000, "checkpoint.every": 100000, "log.every": 100000}


def _start_sweep(path: Path, *args: str) -> subprocess.Popen:
    """``scripts/sweep.py`` as a user's shell starts it: a process group of its own."""
    return subprocess.Popen(
        [sys.executable, str(ROOT / "scripts" / "sweep.py"), str(path), *args],
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for_steps(proc: subprocess.Popen, run: Path, steps: int = 2, timeout: float = 180):
    metrics, t0 = run / "metrics.jsonl", time.monotonic()
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= steps):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < timeout, "the point never trained"
        time.sleep(0.2)


def _alive(path: Path) -> list[int]:
    """Processes still running this sweep file (the sweep or a point of it)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(path) in cmd and state != "Z":
            found.append(int(proc.name))
    return found


def _stopped_point(tmp_path: Path, proc: subprocess.Popen, code: int, sig: str) -> int:
    """The checks after a stop signal: exit code, one line saying so, the first point marked
    interrupted at the step it checkpointed (every step it logged, each once), the second
    never started, nothing left running. Returns the step."""
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == code, out[-3000:] + err[-3000:]
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(
        f"error: sweep test-sweep interrupted by {sig}"
    )
    assert "1 point not started" in errors[0] and "run the same command again" in errors[0]
    run = tmp_path / "runs" / "ctx16"
    marker = json.loads((run / "INTERRUPTED").read_text())
    step = marker["step"]
    assert marker["signal"] == sig and step >= 2 and not (run / "DONE").exists()
    assert sorted(int(p.name) for p in (run / "checkpoints").iterdir()) == [step]
    assert _steps(run) == list(range(1, step + 1))
    assert f"checkpointed at step {step}" in errors[0]
    assert not (tmp_path / "runs" / "ctx32").exists()
    assert _alive(tmp_path / "sweep.yaml") == []
    return step


@SLOW
def test_ctrl_c_to_the_sweeps_group_stops_it_and_a_rerun_resumes_the_point(tmp_path, capsys):
    path = write_sweep(tmp_path, overrides=ENDLESS, grid={"data.context": [16, 32]})
    proc = _start_sweep(path)
    _wait_for_steps(proc, tmp_path / "runs" / "ctx16")
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C: the terminal signals the foreground group
    step = _stopped_point(tmp_path, proc, 130, "SIGINT")

    script = load_script("sweep")
    assert script.main([str(path), "--dry-run"]) == 0
    assert f"[0] interrupted ctx16 (by SIGINT, checkpointed at step {step})" in (
        capsys.readouterr().out
    )
    # The same command, two more steps: the point resumes from its checkpoint, then the next runs.
    assert script.main([str(path), "--in-process", f"train.max_steps={step + 2}"]) == 0
    assert "[0] ctx16: running (resuming: interrupted by SIGINT" in capsys.readouterr().out
    assert _steps(tmp_path / "runs" / "ctx16") == list(range(1, step + 3))
    assert _steps(tmp_path / "runs" / "ctx32") == list(range(1, step + 3))
    assert not (tmp_path / "runs" / "ctx16" / "INTERRUPTED").exists()


@SLOW
@pytest.mark.parametrize("in_process", [False, True], ids=["subprocess", "in-process"])
def test_sigterm_to_the_sweep_alone_stops_the_point_and_the_sweep(tmp_path, in_process):
    path = write_sweep(tmp_path, overrides=ENDLESS, grid={"data.context": [16, 32]})
    proc = _start_sweep(path, *(["--in-process"] if in_process else []))
    _wait_for_steps(proc, tmp_path / "runs" / "ctx16")
    proc.send_signal(signal.SIGTERM)  # a scheduler's notice to the sweep's process only
    _stopped_point(tmp_path, proc, 143, "SIGTERM")
