"""Per-step metrics to the console (rich progress), a JSONL file in the run directory, and wandb.

Only process 0 writes. wandb curves use our own ``step`` as their x-axis (``define_metric``), and
the run id is kept in the run directory, so a resumed run continues the same wandb run and its
curves. The JSONL file is append-only by step: it is cut back to the checkpoint's step on resume
(rewritten whole, then renamed over the old one), so steps replayed after a preemption appear
once, and a step at or below one already written is refused. A log that holds a step twice
(written by two trainers at once, before run directories were locked) is rewritten with the
newest record of each step, the original kept beside it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from linear_gpt2.platform.errors import RunError
from linear_gpt2.training.config import Config, flat_items


def _fmt(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)  # JSON has no NaN/inf
    return v


class RunLogger:
    def __init__(
        self,
        cfg: Config,
        run_dir: Path,
        *,
        enabled: bool,
        start_step: int,
        total_steps: int,
        warn: Callable[[str], None] | None = None,
    ):
        self.enabled = enabled
        self.run_dir = run_dir
        self.jsonl_path = run_dir / "metrics.jsonl"
        self.last_step = start_step
        self.warn = warn or (lambda message: print(f"warning: {message}", file=sys.stderr))
        self.console = Console(stderr=False, highlight=False)
        # Not a terminal (a file, a pipe, a job's log): each line whole, not cut at 80 columns.
        self.console.soft_wrap = not self.console.is_terminal
        self.wandb_run = None
        self.progress = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        self._truncate_jsonl(start_step)
        self._jsonl = self.jsonl_path.open("a")
        if cfg.log.wandb != "disabled":
            self._init_wandb(cfg)
        self.progress = Progress(
            TextColumn("[bold]train"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[status]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=self.console,
            transient=False,
        )
        self.task = self.progress.add_task(
            "train", total=total_steps, completed=start_step, status=""
        )
        self.progress.start()

    def _truncate_jsonl(self, start_step: int) -> None:
        """Keep the records up to ``start_step``, the newest of each step, in step order."""
        if not self.jsonl_path.exists():
            return
        by_step: dict[int, str] = {}
        lines = self.jsonl_path.read_text().splitlines()
        duplicates = 0
        for line in lines:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut by the kill that preempted the run
            step = rec.get("step") if isinstance(rec, dict) else None
            if isinstance(step, int) and step <= start_step:
                duplicates += step in by_step
                by_step[step] = line
        if duplicates:
            kept_as = self.jsonl_path.with_name(
                f"{self.jsonl_path.name}.{time.strftime('%Y%m%dT%H%M%S')}.duplicates"
            )
            os.replace(self.jsonl_path, kept_as)
            self.warn(
                f"{self.jsonl_path} held {duplicates} step(s) twice (two trainers wrote it at "
                f"once); kept the newest record of each step, the original is {kept_as}"
            )
        tmp = self.jsonl_path.with_name(f".{self.jsonl_path.name}.tmp")
        tmp.write_text("".join(by_step[k] + "\n" for k in sorted(by_step)))
        os.replace(tmp, self.jsonl_path)

    def _init_wandb(self, cfg: Config) -> None:
        # wandb is heavy and optional at run time (log.wandb: disabled skips it).
        import wandb

        id_file = self.run_dir / "wandb_id.txt"
        run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:12]
        id_file.write_text(run_id)
        self.wandb_run = wandb.init(
            project=cfg.log.wandb_project,
            name=cfg.log.name,
            group=cfg.log.wandb_group,
            tags=list(cfg.log.tags),
            config=flat_items(cfg),
            id=run_id,
            resume="allow",
            mode=cfg.log.wandb,
            dir=str(self.run_dir),
        )
        self.wandb_run.define_metric("step")
        self.wandb_run.define_metric("*", step_metric="step")

    def print(self, *args: Any) -> None:
        if self.enabled:
            self.console.print(*args)

    def log(self, record: dict[str, Any], console_line: str | None = None) -> None:
        if not self.enabled:
            return
        step = record.get("step")
        if isinstance(step, int):
            if step <= self.last_step:
                raise RunError(
                    f"{self.jsonl_path}: step {step} would be written after step "
                    f"{self.last_step}; the log is append-only by step (a bug: report it)"
                )
            self.last_step = step
        record = {k: _fmt(v) for k, v in record.items()}
        self._jsonl.write(json.dumps(record) + "\n")
        self._jsonl.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if isinstance(v, (int, float))})
        if self.progress is not None:
            loss = record.get("loss")
            status = f"loss {loss:.4f}" if isinstance(loss, float) else ""
            self.progress.update(self.task, completed=record.get("step", 0), status=status)
        if console_line:
            self.console.print(console_line)

    def close(self) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.stop()
        self._jsonl.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def plot_loss(records: list[dict[str, Any]], path: Path, title: str) -> None:
    """Training (and held-out) loss against step, saved as a PNG."""
    # matplotlib: imported only to draw the loss curve.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [(r["step"], r["loss"]) for r in records if isinstance(r.get("loss"), (int, float))]
    val = [
        (r["step"], r["val_loss"]) for r in records if isinstance(r.get("val_loss"), (int, float))
    ]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="held-out")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
