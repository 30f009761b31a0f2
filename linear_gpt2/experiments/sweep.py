"""Sweeps: many training runs from one base config, a grid and/or a list of points.

A sweep file (YAML, see ``configs/sweeps/``)::

    name: post-learning-124M        # wandb group (log.wandb_group) and default out_dir runs/<name>
    base: ../post/base.yaml         # the base config, relative to this file
    out_dir: runs/post-learning     # optional; run directories are out_dir/<run name>
    overrides:                      # dotted keys fixed for every point
      model.preset: 124M
      model.block_size: ${data.context}   # OmegaConf interpolation: follows the context
    grid:                           # cartesian product over dotted keys (in this order)
      data.context: [1024, 4096]
      attention.name: [flash, LT_chunked]
      variant:                      # or over a named axis whose values set several keys at once
        - {attention.doc_reset: false}
        - {attention.doc_reset: true, attention.decay: gate}
    points:                         # explicit points (dicts of overrides); with a grid, each
      - {train.micro_batch: 8}      # point is combined with every grid entry
    name_keys: [data.context, attention.name]   # optional: which keys name the runs
    slurm: {gpus_per_node: 8, time: "24:00:00"} # optional: sbatch options for --slurm

Each point becomes overrides for :func:`linear_gpt2.training.config.load_config`, plus ``log.name`` (built
from the keys that vary across points, e.g. ``ctx4096_LT_chunked_c64``), ``log.run_dir`` and
``log.wandb_group`` (the sweep's name, so wandb groups the runs); command-line overrides apply to
every point, last.

What a rerun does with each point (:func:`point_status`) compares the point's config, resolved
now, with the one its run directory last ran with (the ``DONE`` marker's, else ``config.yaml``):

- ``todo``: never ran, or unfinished: it runs, resuming from its last checkpoint;
- ``interrupted``: stopped by a signal (``INTERRUPTED`` marker: the signal and the step of its
  last checkpoint): it runs, resuming from that checkpoint;
- ``done``: finished (``DONE``, written when ``train`` reached ``train.max_steps``,
  ``train.max_hours`` or ``train.target_val_acc``, or a checkpoint at ``max_steps``) with the
  same config: skipped;
- ``changed``: finished, but keys a resumed run may change differ (``train.max_steps``,
  ``train.max_hours``, logging...): it runs again and continues from its checkpoint, e.g. to the
  new ``max_steps``;
- ``stale``: its checkpoints belong to another experiment (model, data, optimisation keys
  differ): not run, reported on stderr with the keys, and the sweep ends with a usage error
  (exit 2, as ``scripts/train.py`` refuses the same rerun; pick another ``out_dir`` or move the
  run directory aside) unless a point also failed (exit 1, :func:`raise_for_outcomes`).

Signals (:func:`run_sweep`): SIGINT (Ctrl-C) or SIGTERM (a scheduler) to the sweep, or to its
process group, reaches the point in training, once: it finishes its step, checkpoints and stops,
its run directory is marked ``INTERRUPTED``, and the sweep starts no other point and ends with one
line ``error: sweep ... interrupted ...``, exit 130 (SIGINT) or 143 (SIGTERM). Running the same
command again resumes that point. A point in a subprocess sits in a process group of its own (the
sweep hands it each signal exactly once) and, on Linux, gets SIGTERM should the sweep die
(``kill -9``): no trainer outlives its sweep.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import yaml

# The sweep file's model and reader (sweep_file.py), imported from here too.
from linear_gpt2.experiments.sweep_file import Point, Sweep, load_sweep
from linear_gpt2.platform.errors import ConfigError, LinearGPT2Error, RunError
from linear_gpt2.training.checkpoint import step_dirs
from linear_gpt2.training.config import Config, diff, load_config, load_config_from_dict
from linear_gpt2.training.trainer import train

# load_sweep (sweep_file.py) is the reading half of a sweep: callers take it from here.
__all__ = [
    "Point", "Sweep", "SweepInterruptedError", "load_sweep", "run_sweep", "run_point",
    "slurm_script",
]  # fmt: skip

REPO = Path(__file__).resolve().parents[2]
DONE = "DONE"
INTERRUPTED = "INTERRUPTED"
# Set in a point's subprocess to the sweep's pid: the point follows its sweep (follow_parent).
PARENT_ENV = "LINEAR_GPT2_SWEEP_PARENT"
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# How a trainer run ends that counts as finished (DONE is written): its step budget, its hours,
# or the held-out accuracy it was to reach (train.target_val_acc).
FINISHED = ("max_steps", "max_hours", "target_val_acc")


def point_config(sweep: Sweep, point: Point) -> Config:
    return load_config(sweep.base, list(point.overrides))


def _saved_config(run_dir: Path) -> Config | None:
    """The config the run directory last ran (or finished) with, if it can be read."""
    try:
        marker = json.loads((run_dir / DONE).read_text())
        if isinstance(marker, dict) and isinstance(marker.get("config"), dict):
            return load_config_from_dict(marker["config"])
    except (OSError, ValueError):
        pass
    try:
        return load_config_from_dict(yaml.safe_load((run_dir / "config.yaml").read_text()))
    except (OSError, ValueError, yaml.YAMLError, TypeError, AttributeError):
        return None


def point_status(cfg: Config) -> tuple[str, str]:
    """``(status, detail)`` of a point's run directory under its resolved config ``cfg``:
    ``todo``, ``done``, ``changed`` or ``stale`` (module docstring); ``detail`` names the keys
    that differ."""
    run_dir = Path(cfg.log.run_dir)
    saved = _saved_config(run_dir)
    changes = diff(saved, cfg) if saved is not None else {}
    detail = ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changes.items())
    experiment = {k for k in changes if not cfg.resume_may_change(k)}
    if experiment and step_dirs(run_dir / "checkpoints"):
        keys = ", ".join(f"{k} {changes[k][0]!r} -> {changes[k][1]!r}" for k in sorted(experiment))
        return "stale", keys
    finished = (run_dir / DONE).exists() or (
        run_dir / "checkpoints" / str(cfg.train.max_steps)
    ).is_dir()
    if not finished:
        marker = _read_json(run_dir / INTERRUPTED)
        if marker is not None:
            return "interrupted", _interrupted_detail(marker)
        return "todo", detail
    return ("done", "") if not changes else ("changed", detail)


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _interrupted_detail(marker: dict) -> str:
    return f"by {marker.get('signal', 'a signal')}, {_checkpointed(marker)}"


def _checkpointed(marker: dict) -> str:
    step = marker.get("step")
    return f"checkpointed at step {step}" if step else "no checkpoint yet"


def _signal_name(signum: int | None) -> str:
    try:
        return signal.Signals(signum).name
    except (TypeError, ValueError):
        return "SIGTERM"


def mark_interrupted(cfg: Config, signum: int | None, write: bool = True) -> dict:
    """Write the point's ``INTERRUPTED`` marker (the signal, the step of its last checkpoint)
    unless ``write`` is false (a process of a job other than the first); returns it. A rerun
    resumes the point from that checkpoint; ``DONE`` replaces the marker. No JAX call: the sweep
    itself must not start a backend (on a GPU it would hold the memory its next point needs)."""
    run_dir = Path(cfg.log.run_dir)
    steps = step_dirs(run_dir / "checkpoints")
    marker = {
        "signal": _signal_name(signum),
        "step": max(steps) if steps else 0,
        "interrupted_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    if write and run_dir.is_dir():
        tmp = run_dir / f"{INTERRUPTED}.tmp"
        tmp.write_text(json.dumps(marker) + "\n")
        tmp.replace(run_dir / INTERRUPTED)
    return marker


def is_done(cfg: Config) -> bool:
    """The run reached its end with this config: skipped when the sweep runs again."""
    return point_status(cfg)[0] == "done"


def train_command(sweep: Sweep, point: Point) -> list[str]:
    """The equivalent ``scripts/train.py`` command line (to run a point by hand elsewhere)."""
    return [sys.executable, str(REPO / "scripts" / "train.py"), str(sweep.base), *point.overrides]


def point_command(sweep: Sweep, point: Point, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``scripts/sweep.py SWEEP --point I``: runs one point with the skip check and marker."""
    return [
        sys.executable,
        str(REPO / "scripts" / "sweep.py"),
        str(sweep.path),
        "--point",
        str(point.index),
        *extra,
    ]


def run_point(sweep: Sweep, point: Point) -> str:
    """Train one point in this process unless it is done. Returns ``skipped``, or the trainer's
    ``stopped_by`` (``max_steps``, ``max_hours``, ``target_val_acc``). Writes ``DONE`` when
    finished. A stop signal (SIGINT, SIGTERM; the trainer checkpoints its step first) marks the
    run directory ``INTERRUPTED`` and raises :class:`SweepInterruptedError`."""
    cfg = point_config(sweep, point)
    status, detail = point_status(cfg)
    if status == "done":
        return "skipped"
    if status == "stale":
        raise StalePointError(_stale_message(point, cfg, detail))
    try:
        result = train(cfg)
    except KeyboardInterrupt:  # a second Ctrl-C: stopped at once, the last checkpoint stands
        mark_interrupted(cfg, signal.SIGINT, jax.process_index() == 0)
        raise
    except StopSignal as e:  # before the training loop took the signals over
        raise _point_interrupted(point, cfg, e.signum) from None
    if result.stopped_by == "signal":
        raise _point_interrupted(point, cfg, result.signal)
    if result.stopped_by in FINISHED and jax.process_index() == 0:
        marker = {
            "step": result.last_step,
            "stopped_by": result.stopped_by,
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "config": cfg.to_dict(),
        }
        tmp = Path(cfg.log.run_dir) / f"{DONE}.tmp"
        tmp.write_text(json.dumps(marker) + "\n")
        tmp.replace(Path(cfg.log.run_dir) / DONE)
        (Path(cfg.log.run_dir) / INTERRUPTED).unlink(missing_ok=True)
    return result.stopped_by


def _point_interrupted(point: Point, cfg: Config, signum: int | None) -> SweepInterruptedError:
    marker = mark_interrupted(cfg, signum, jax.process_index() == 0)
    return SweepInterruptedError(
        f"sweep point {point.index} ({point.name}) interrupted {_interrupted_detail(marker)} in "
        f"{cfg.log.run_dir}; run the sweep again to resume it",
        signum,
    )


class SweepInterruptedError(LinearGPT2Error):
    """A sweep or one of its points stopped on SIGINT or SIGTERM: exit 130 or 143 (128 + the
    signal, as a shell reports a process the signal ended)."""

    exit_code = 128 + signal.SIGTERM  # 130 for the instances SIGINT stopped

    def __init__(self, message: str, signum: int | None):
        super().__init__(message)
        self.signum = signum or signal.SIGTERM
        self.exit_code = 128 + int(self.signum)


class StopSignal(BaseException):
    """A stop signal where no training loop has taken the signals over (setting a point up,
    between points): like ``KeyboardInterrupt``, not caught by ``except Exception``."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class StalePointError(ConfigError):
    """A point whose run directory holds another experiment's checkpoints (exit 2)."""


class SweepFailedError(RunError):
    """Points of a sweep failed (exit 1); their own errors were reported as they ran."""


def raise_for_outcomes(sweep: Sweep | str, outcomes: dict[str, str]) -> None:
    """One error for a sweep's failed (:class:`SweepFailedError`) or stale points
    (:class:`StalePointError`, when none failed); nothing when every point finished or was
    skipped. ``outcomes`` as :func:`run_sweep` returns them."""
    name = sweep if isinstance(sweep, str) else sweep.name
    failed = [k for k, v in outcomes.items() if v.startswith("failed")]
    stale = [k for k, v in outcomes.items() if v.startswith("stale")]
    not_run = f"; not run, holding another experiment: {', '.join(stale)}" if stale else ""
    if failed:
        raise SweepFailedError(
            f"sweep {name}: {len(failed)} of {len(outcomes)} points failed ({', '.join(failed)})"
            f"{not_run}; their errors are above. Run the sweep again to retry them (finished "
            "points are skipped)"
        )
    if stale:
        raise StalePointError(
            f"sweep {name}: {len(stale)} of {len(outcomes)} points not run, their run "
            f"directories hold another experiment ({', '.join(stale)}; the keys are above); set "
            "another out_dir in the sweep file, or move those run directories aside"
        )


def _stale_message(point: Point, cfg: Config, keys: str) -> str:
    return (
        f"sweep point {point.index} ({point.name}): {cfg.log.run_dir} holds a run of another "
        f"experiment ({keys}); set another out_dir in the sweep file, or move that run "
        "directory aside to rerun the point"
    )


def run_sweep(
    sweep: Sweep,
    *,
    in_process: bool = False,
    extra: list[str] | tuple[str, ...] = (),
    log=print,
    warn=None,
) -> dict[str, str]:
    """Run every point in turn; returns ``{run name: outcome}``. Outcomes: ``skipped`` (done
    before), ``max_steps``/``max_hours``/``target_val_acc`` (in process), ``ok`` (subprocess),
    ``stale (...)`` (not run) or ``failed (...)``. A failing point (an OOM, say) does not stop
    the others; every point's config is checked before the first one trains. Progress goes to
    ``log`` (stdout), refused and failed points to ``warn`` (stderr, ``warning: ...``).

    By default each point is a subprocess (``scripts/sweep.py SWEEP --point I``): a point that
    runs out of memory or crashes cannot leave device memory or JAX state behind for the next.
    ``in_process`` trains in this process (fast for tiny sweeps and tests).

    SIGINT or SIGTERM stops the sweep (module docstring): the point in training checkpoints and
    is marked ``INTERRUPTED``, nothing else starts, and :class:`SweepInterruptedError` (exit 130
    or 143) says which point stopped where and how many were not started.
    """
    warn = warn or _warn_stderr
    outcomes: dict[str, str] = {}
    configs = [point_config(sweep, p) for p in sweep.points]  # every point valid before training
    with _SweepSignals() as signals:
        try:
            for p, cfg in zip(sweep.points, configs):
                _run_one(sweep, p, cfg, outcomes, signals, in_process, extra, log, warn)
        except StopSignal as e:  # between points, or setting one up in process
            signals.received = signals.received or e.signum
        except SweepInterruptedError as e:  # the point in process stopped on a signal
            signals.received = signals.received or e.signum
    if signals.received is None:
        return outcomes
    stopped = [p for p in sweep.points if outcomes.get(p.name, "").startswith("interrupted")]
    where = ""
    if stopped:
        run_dir = {p.name: c for p, c in zip(sweep.points, configs)}[stopped[0].name].log.run_dir
        marker = _read_json(Path(run_dir) / INTERRUPTED) or {}
        where = f": point {stopped[0].index} ({stopped[0].name}) {_checkpointed(marker)}"
    left = len(sweep.points) - len(outcomes)
    raise SweepInterruptedError(
        f"sweep {sweep.name} interrupted by {_signal_name(signals.received)}{where}; {left} "
        f"point{'s' if left != 1 else ''} not started; run the same command again to resume",
        signals.received,
    )


def _run_one(sweep, p, cfg, outcomes, signals, in_process, extra, log, warn) -> None:
    status, detail = point_status(cfg)
    if status == "done":
        outcomes[p.name] = "skipped"
        log(f"[{p.index}] {p.name}: done, skipped")
        return
    if status == "stale":
        outcomes[p.name] = f"stale ({detail})"
        warn(f"not run: {_stale_message(p, cfg, detail)}")
        return
    why = {"changed": f" (finished, config changed: {detail})",
           "interrupted": f" (resuming: interrupted {detail})"}.get(status, "")  # fmt: skip
    log(f"[{p.index}] {p.name}: running{why}")
    if in_process:
        try:
            outcomes[p.name] = run_point(sweep, p)
        except (SweepInterruptedError, StopSignal) as e:
            outcomes[p.name] = _interrupted_outcome(cfg, e.signum)
            raise
        except Exception as e:  # an OOM or a NaN stop: record it, go on with the next
            outcomes[p.name] = f"failed ({type(e).__name__}: {str(e).splitlines()[0]})"
    else:
        rc, stopped = signals.run_child(point_command(sweep, p, extra))
        if stopped is not None:
            outcomes[p.name] = _interrupted_outcome(cfg, stopped)
            raise StopSignal(signals.received or stopped)
        outcomes[p.name] = "ok" if rc == 0 else f"failed (exit {rc})"
    if outcomes[p.name].startswith("failed"):
        warn(f"sweep point {p.index} ({p.name}): {outcomes[p.name]}")
    else:
        log(f"[{p.index}] {p.name}: {outcomes[p.name]}")
    if signals.received is not None:  # arrived as the point ended on its own: stop here
        raise StopSignal(signals.received)


def _interrupted_outcome(cfg: Config, signum: int | None) -> str:
    """``interrupted (...)``, the point's marker written (again: a subprocess killed before its
    training loop began wrote none)."""
    marker = _read_json(Path(cfg.log.run_dir) / INTERRUPTED)
    if marker is None or marker.get("signal") != _signal_name(signum):
        marker = mark_interrupted(cfg, signum)
    return f"interrupted ({_interrupted_detail(marker)})"


class _SweepSignals:
    """The sweep's SIGINT and SIGTERM handlers while it runs.

    With a point's subprocess running, each signal is handed to it (it sits in a process group
    of its own, so a signal to the sweep's group reaches it once, through here: a first SIGINT or
    SIGTERM makes the trainer checkpoint and stop, a second SIGINT stops it at once, the
    trainer's own rules) and the sweep waits for it to end. Anywhere else (between points, or a
    point in process before its training loop takes the signals over) a signal raises
    :class:`StopSignal`. The first signal is kept in ``received``."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.child: subprocess.Popen | None = None
        self._starting = False
        self._previous: dict[int, object] = {}

    def __enter__(self) -> _SweepSignals:
        for sig in STOP_SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: signals stay as they were
                pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.received = self.received or signum
        if self.child is not None:
            if self.child.poll() is None:
                self.child.send_signal(signum)
        elif not self._starting:
            raise StopSignal(signum)

    def run_child(self, cmd: list[str]) -> tuple[int, int | None]:
        """Run a point's command to its end: ``(exit code, the signal it stopped on or None)``:
        one that a signal ended, or that exited 130 / 143 (a point's interruption), stopped on
        that signal."""
        self._starting = True  # a signal now is handed over once the child exists
        try:
            env = {**os.environ, PARENT_ENV: str(os.getpid())}
            self.child = subprocess.Popen(cmd, cwd=Path.cwd(), env=env, start_new_session=True)
        finally:
            self._starting = False
        if self.received is not None:
            self.child.send_signal(self.received)
        try:
            rc = self.child.wait()
        finally:
            self.child = None
        if rc < 0 and -rc in STOP_SIGNALS:
            return rc, -rc
        if rc - 128 in STOP_SIGNALS:
            return rc, rc - 128
        return rc, None


def follow_parent() -> None:
    """In a point's subprocess (``PARENT_ENV`` set by the sweep): SIGTERM before the training
    loop takes the signals over (setting the point up, compiling) ends it through
    :class:`StopSignal`, so it unwinds (locks, loaders) and says ``interrupted``; and, on Linux,
    the kernel sends it SIGTERM should the sweep die, whatever kills it, so it checkpoints and
    stops instead of training on alone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent:
        return
    signal.signal(signal.SIGTERM, _raise_interrupt)
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != int(parent):  # the sweep died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _raise_interrupt(signum, frame) -> None:
    raise StopSignal(signum)


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def dry_run(sweep: Sweep) -> list[tuple[Point, tuple[str, str], list[str]]]:
    """``(point, (status, detail), train command)`` for every point, without running anything
    (statuses as :func:`point_status`)."""
    return [
        (p, point_status(point_config(sweep, p)), train_command(sweep, p)) for p in sweep.points
    ]


def slurm_script(sweep: Sweep, extra: list[str] | tuple[str, ...] = ()) -> str:
    """An ``sbatch`` array script with one task per unfinished point; each task runs
    ``scripts/sweep.py SWEEP --point $SLURM_ARRAY_TASK_ID`` (one process per node, as the
    trainer expects; it re-checks the done marker, so a requeued task that finished exits at
    once). ``slurm:`` in the sweep file sets ``nodes``, ``gpus_per_node``, ``time``,
    ``partition``, ``account``, ``max_parallel`` and ``python``."""
    status = {p.index: point_status(point_config(sweep, p)) for p in sweep.points}
    todo = [p for p in sweep.points if status[p.index][0] in ("todo", "changed", "interrupted")]
    stale = [p for p in sweep.points if status[p.index][0] == "stale"]
    s = {"nodes": 1, "gpus_per_node": 8, "time": "24:30:00", **sweep.slurm}
    python = str(s.get("python") or sys.executable)
    array = ",".join(str(p.index) for p in todo) or "none"
    if todo and s.get("max_parallel"):
        array += f"%{s['max_parallel']}"
    log_dir = sweep.out_dir / "slurm"
    lines = [
        "#!/bin/bash",
        f"# Sweep {sweep.name} ({sweep.path}): {len(todo)} of {len(sweep.points)} points to run.",
        *(f"#   {p.index}: {p.name}" for p in todo),
        *(f"#   not submitted, stale: {p.index}: {p.name} ({status[p.index][1]})" for p in stale),
        f"#SBATCH --job-name={sweep.name}",
        f"#SBATCH --array={array}",
        f"#SBATCH --nodes={s['nodes']}",
        "#SBATCH --ntasks-per-node=1",
        f"#SBATCH --gpus-per-node={s['gpus_per_node']}",
        f"#SBATCH --time={s['time']}",
        "#SBATCH --signal=TERM@120        # the trainer checkpoints and exits; --requeue resumes",
        "#SBATCH --requeue",
        f"#SBATCH --output={log_dir}/%x_%A_%a.out",
    ]
    for key in ("partition", "account", "qos"):
        if s.get(key):
            lines.append(f"#SBATCH --{key}={s[key]}")
    # Absolute paths, and the directory the script was written from: relative paths in the
    # overrides (data.path=...) mean the same in the job as on the command line.
    script = REPO / "scripts" / "sweep.py"
    cmd = [shlex.quote(python), shlex.quote(str(script)), shlex.quote(str(sweep.path))]
    cmd += ["--point", '"$SLURM_ARRAY_TASK_ID"', *(shlex.quote(e) for e in extra)]
    lines += [
        "set -euo pipefail",
        f"cd {shlex.quote(str(Path.cwd()))}",
        f"mkdir -p {shlex.quote(str(log_dir))}",
        " ".join(["srun", *cmd]),
    ]
    if not todo:
        lines.insert(1, "# every point is done: nothing to submit")
    return "\n".join(lines) + "\n"
