"""Running the plan: each unit a subprocess, its folder its record, a progress bar per stage.

The run folder (``runs/gpu_check/<device>/`` by default) holds ``<stage>/<unit>/``: the unit's
output, its log and ``done.json`` (exit code, seconds, when). A unit with ``done.json`` is done
and is not run again, also when it failed at this commit (a failure that repeats would spend
the GPU's time again; ``--retry-failed`` runs failed units again); one that failed at another
commit (or one not recorded) runs again, since a fix lands as a new commit. So a run that
stopped, at a time limit, a crash or the machine going back, resumes where it stopped when the
same command runs again over the same folder (on a fresh machine: carry the folder).

``time_limit`` bounds one invocation (one window: ``plan.windows``), counted from ``start``
(the process's own start: the wheels and the probe count): a unit is not started when its
estimate would end past the limit, and one that runs past it is stopped and left undone. Units
of a stage with ``concurrent > 1`` (the small learning runs, which leave the GPU mostly idle)
run side by side, each with its share of the GPU's memory. ``report`` hears of every unit as
it ends: the caller merges and packs there, so a window cut short keeps what it measured.

Step units run under the store of steps compiled here (``compiled.py``): the units' environment
names the store and the target, and each unit's look-ups are logged in its folder
(``compiled.jsonl``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from linear_gpt2.platform.provenance import REPO, git_commit
from studies.gpu_check.plan import Plan, Stage, Unit

DONE = "done.json"


@dataclasses.dataclass
class Outcome:
    stage: str
    unit: str
    status: str  # ok, failed, stopped (time limit: not done), skipped (time limit: not started)
    seconds: float
    estimate_s: float
    returncode: int | None = None


def unit_dir(run_dir: Path, stage: str, unit: str) -> Path:
    return run_dir / stage / unit


def read_done(run_dir: Path, stage: str, unit: str) -> dict | None:
    path = unit_dir(run_dir, stage, unit) / DONE
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def done_units(run_dir: Path, plan: Plan) -> dict[tuple[str, str], dict]:
    """``(stage, unit)`` -> its ``done.json``, for every unit of ``plan`` that finished."""
    out = {}
    for s in plan.stages:
        for u in s.units:
            d = read_done(run_dir, s.name, u.name)
            if d is not None:
                out[(s.name, u.name)] = d
    return out


def command(unit: Unit, run_dir: Path, stage: str) -> list[str]:
    out = unit_dir(run_dir, stage, unit.name)
    args = [
        a.replace("{out}", str(out)).replace("{stage}", str(run_dir / stage)) for a in unit.argv
    ]
    if args[0] == "-m":
        return [sys.executable, *args]
    return [sys.executable, str(REPO / args[0]), *args[1:]]


def child_env(
    run_dir: Path, share: float | None = None, unit_out: Path | None = None,
    store: Path | None = None, target: str = "h100",
) -> dict[str, str]:  # fmt: skip
    """The units' environment: one JAX compilation cache for the whole run (a program an
    earlier unit compiled, the profile's and the memory check's steps, loads in seconds), the
    repository on the path, and the store of steps compiled here with its target."""
    from studies.gpu_check import compiled

    env = dict(os.environ)
    env.setdefault("JAX_COMPILATION_CACHE_DIR", str(run_dir / "jax_cache"))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    if share is not None:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = f"{share:.2f}"
    if store is not None:
        env[compiled.STORE_ENV] = str(store)
        env[compiled.TARGET_ENV] = target
    if unit_out is not None:
        env[compiled.LOG_ENV] = str(unit_out / "compiled.jsonl")
    return env


class Runner:
    """Runs ``plan`` over ``run_dir``; ``report(outcome)`` hears of every unit."""

    def __init__(
        self,
        plan: Plan,
        run_dir: Path,
        *,
        time_limit: float | None = None,
        retry_failed: bool = False,
        report: Callable[[Outcome], None] | None = None,
        progress=None,
        start: float | None = None,
        store: Path | None = None,
        target: str = "h100",
    ):
        self.plan, self.run_dir = plan, Path(run_dir)
        self.time_limit = time_limit
        self.retry_failed = retry_failed
        self.report = report or (lambda o: None)
        self.progress = progress
        self.start = time.monotonic() if start is None else start
        self.stopped = False
        self.store, self.target = store, target
        self.commit = git_commit()  # the tree the units run: their records and retries

    def left(self) -> float | None:
        return (
            None if self.time_limit is None else self.time_limit - (time.monotonic() - self.start)
        )

    def todo(self, stage: Stage) -> list[Unit]:
        out = []
        for u in stage.units:
            d = read_done(self.run_dir, stage.name, u.name)
            if not settled(d, self.retry_failed, self.commit):
                out.append(u)
        return out

    def run(self, segments: list[tuple[Stage, list[Unit]]] | None = None) -> list[Outcome]:
        """Every stage of the plan, or ``segments`` (a window's: ``Window.segments()``)."""
        if segments is None:
            segments = [(s, list(s.units)) for s in self.plan.stages]
        outcomes: list[Outcome] = []
        for stage, units in segments:
            if self.stopped:
                outcomes += [Outcome(stage.name, u.name, "skipped", 0.0, u.seconds)
                             for u in self.todo(stage) if u in units]  # fmt: skip
                continue
            todo = [u for u in self.todo(stage) if u in units]
            task = None
            if self.progress is not None:
                task = self.progress.add_task(
                    stage.name, total=len(units), completed=len(units) - len(todo)
                )
            outcomes += self._stage(stage, todo, task)
        return outcomes

    def _stage(self, stage: Stage, todo: list[Unit], task) -> list[Outcome]:
        width = stage.concurrent
        share = 0.9 / width if width > 1 else None
        outcomes: list[Outcome] = []
        running: list[tuple[Unit, subprocess.Popen, float, object]] = []
        queue = list(todo)
        while queue or running:
            while queue and len(running) < width and not self.stopped:
                unit = queue[0]
                left = self.left()
                if left is not None and unit.seconds / width > left:
                    self.stopped = True
                    break
                queue.pop(0)
                running.append((unit, *self._start(stage, unit, share)))
                self._describe(task, stage, running)
            if self.stopped and not running:
                outcomes += [Outcome(stage.name, u.name, "skipped", 0.0, u.seconds) for u in queue]
                break
            finished = self._wait(stage, running)
            for item in finished:
                running.remove(item)
                unit, proc, t0, log = item
                outcome = self._finish(stage, unit, proc, t0, log)
                outcomes.append(outcome)
                self.report(outcome)
                if self.progress is not None and outcome.status in ("ok", "failed"):
                    self.progress.advance(task)
                self._describe(task, stage, running)
        return outcomes

    def _describe(self, task, stage: Stage, running) -> None:
        if self.progress is not None and task is not None:
            names = ", ".join(u.name for u, *_ in running)
            self.progress.update(
                task, description=f"{stage.name}: {names}" if names else stage.name
            )

    def _start(self, stage: Stage, unit: Unit, share: float | None):
        out = unit_dir(self.run_dir, stage.name, unit.name)
        out.mkdir(parents=True, exist_ok=True)
        log = open(out / "log.txt", "a")  # noqa: SIM115 - closed in _finish
        cmd = command(unit, self.run_dir, stage.name)
        log.write(f"$ {' '.join(cmd)}\n")
        log.flush()
        env = child_env(self.run_dir, share, out, self.store, self.target)
        proc = subprocess.Popen(
            cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )  # fmt: skip
        return proc, time.monotonic(), log

    def _wait(self, stage: Stage, running) -> list:
        """The running units that ended; stops those past the time limit."""
        while True:
            ended = [item for item in running if item[1].poll() is not None]
            if ended:
                return ended
            left = self.left()
            if left is not None and left <= 0:
                for _, proc, *_ in running:
                    proc.terminate()
                    try:
                        proc.wait(timeout=30)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait()
                self.stopped = True
                return list(running)
            time.sleep(0.2)

    def _finish(self, stage: Stage, unit: Unit, proc, t0: float, log) -> Outcome:
        seconds = time.monotonic() - t0
        log.close()
        rc = proc.returncode
        left = self.left()
        if self.stopped and left is not None and left <= 0 and rc != 0:
            return Outcome(stage.name, unit.name, "stopped", seconds, unit.seconds, rc)
        status = "ok" if rc == 0 else "failed"
        record = {
            "stage": stage.name, "unit": unit.name, "status": status, "returncode": rc,
            "seconds": round(seconds, 3), "estimate_s": round(unit.seconds, 3),
            "argv": list(unit.argv), "work": unit.work,
            "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "git_commit": self.commit,
        }  # fmt: skip
        out = unit_dir(self.run_dir, stage.name, unit.name)
        (out / DONE).write_text(json.dumps(record, indent=1) + "\n")
        return Outcome(stage.name, unit.name, status, seconds, unit.seconds, rc)


def settled(done: dict | None, retry_failed: bool = False, commit: str | None = None) -> bool:
    """Whether a unit with record ``done`` (its ``done.json``, None when it has none) is not to
    run again: it finished ok, or it failed at this commit (``commit``, default the tree's;
    ``+dirty`` aside) and ``retry_failed`` is off."""
    if done is None:
        return False
    if done.get("status") == "ok":
        return True
    if retry_failed:
        return False
    commit = git_commit() if commit is None else commit
    base = (done.get("git_commit") or "").removesuffix("+dirty")
    return bool(base) and base == (commit or "").removesuffix("+dirty")


def log_tail(run_dir: Path, stage: str, unit: str, lines: int = 3) -> str:
    """The last lines of a unit's log: what a failure said."""
    path = unit_dir(run_dir, stage, unit) / "log.txt"
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])
