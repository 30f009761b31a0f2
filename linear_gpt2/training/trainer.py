"""The training loop: config -> data -> sharded train step -> logs and checkpoints.

``train(cfg)`` runs one job on every device of every process (call
``jax.distributed.initialize`` first on multi-host launches; ``scripts/train.py`` does). It
derives gradient accumulation from ``train.tokens_per_update`` so each update sees the same number
of tokens at every context length, logs every step, saves orbax checkpoints periodically and on
SIGTERM/SIGINT or when ``train.max_hours`` is spent, and resumes exactly (``checkpoint.resume``,
``resume.py``). The programs it runs are built in ``programs.py``.

Each step appends one record to ``metrics.jsonl``: ``step``, ``loss``, ``lr``, ``grad_norm``,
``step_time_s``, ``tokens_per_s``, ``model_tflops`` (the update's model FLOPs, ``flops.py``,
per second per device), ``mfu`` (``model_tflops`` over the device's dense bf16 peak:
``log.peak_tflops``, else ``flops.py``'s table; null when neither knows it), ``hours`` (wall-clock
trained so far, every restart included: checkpoints carry it), ``memory_bytes``, ``skipped``, and
when due the spike count, held-out loss and diagnostics. ``train.max_hours`` is a budget on that
clock, so a requeued job stops where the budget ends and a rerun with it spent trains nothing.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import jax

from linear_gpt2 import kernels
from linear_gpt2.model import count_params, init_params
from linear_gpt2.platform import logs, process, provenance
from linear_gpt2.training import checkpoint as ckpt_lib
from linear_gpt2.training import data as data_lib
from linear_gpt2.training.batches import plan_batches
from linear_gpt2.training.config import Config, save_config
from linear_gpt2.training.logger import RunLogger, plot_loss, read_jsonl
from linear_gpt2.training.loop import Layout, NonFiniteLossError, Start, StepLoop
from linear_gpt2.training.optim import optimizer
from linear_gpt2.training.programs import build_programs
from linear_gpt2.training.resume import (
    RunDirectoryInUseError,
    hours_trained,
    restore_run,
    resume_source,
)
from linear_gpt2.training.run_lock import RunDirectoryLockedError, job_lock
from linear_gpt2.training.sharding import make_mesh, replicated, state_shardings
from linear_gpt2.training.train_step import TrainState, init_state

# plan_batches (batches.py), RunDirectoryInUseError (resume.py) and RunDirectoryLockedError
# (run_lock.py) are imported from here too.
__all__ = [
    "NonFiniteLossError",
    "RunDirectoryInUseError",
    "RunDirectoryLockedError",
    "RunResult",
    "plan_batches",
    "train",
]


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    last_step: int
    stopped_by: str  # "max_steps", "max_hours", "target_val_acc", "signal"
    losses: dict[int, float]  # step -> training loss, for the steps this call ran
    state: TrainState  # final parameters and optimizer state (global arrays)
    signal: int | None = None  # the signal's number when stopped_by is "signal"


def train(cfg: Config) -> RunResult:
    """Run ``cfg`` from step 0 or from the checkpoint ``checkpoint.resume`` finds, to
    ``train.max_steps`` or an earlier stop (a signal, ``train.max_hours`` counted over every
    restart, ``train.target_val_acc``); the run directory then holds a checkpoint of the last
    step. The run directory is locked for the call (``run_lock.py``): a second trainer on it
    raises :class:`RunDirectoryLockedError` before writing anything."""
    process.configure()  # before the first device is used; a caller's own settings are kept
    run_dir = Path(cfg.log.run_dir)
    is_main = jax.process_index() == 0
    layout = _lay_out(cfg)
    with job_lock(run_dir, warn=_warn):
        start = _open(cfg, layout, is_main)
        if is_main:
            save_config(cfg, run_dir / "config.yaml")
            _note_start(run_dir, start)
        log = _start_log(cfg, layout, start, is_main)
        # Kernel choices made by shape when the step is traced, printed as they are made.
        with logs.echo(kernels.CHOICES, lambda choice: log.print(f"kernel: {choice}")):
            programs = build_programs(
                cfg, layout.model_cfg, layout.tx, layout.mesh, layout.plan,
                layout.shardings.params, log,
            )  # fmt: skip
            loop = StepLoop(cfg, layout, programs, log, start)
            try:
                stopped_by = loop.run()
            finally:
                start.checkpointer.close()
                log.close()
                start.loader.close()
        if is_main:
            records = read_jsonl(run_dir / "metrics.jsonl")
            plot_loss(
                records,
                run_dir / "loss.png",
                f"{cfg.log.name}: {cfg.attention.name}, context {cfg.data.context}",
            )
    return RunResult(run_dir, loop.step, stopped_by, loop.losses, loop.state, loop.stop_signal)


# --------------------------------------------------------------------------------------------
# Set-up: the layout, the state to start from, the log


def _lay_out(cfg: Config) -> Layout:
    """The run's layout over every device of every process; refuses (``ConfigError``) a
    ``tokens_per_update`` that does not split into micro-batches on them."""
    mesh = make_mesh(context_parallel=cfg.train.context_parallel)
    plan = plan_batches(cfg, mesh.devices.size, jax.process_count(), jax.process_index())
    model_cfg = cfg.model_config
    tx = optimizer(cfg.train)
    abstract_params = jax.eval_shape(lambda: init_params(model_cfg, cfg.seed))
    n_params = count_params(abstract_params, non_embedding=False)
    abstract_state = jax.eval_shape(lambda: init_state(init_params(model_cfg, cfg.seed), tx))
    sh = state_shardings(abstract_state, mesh, cfg.train.fsdp)
    sh = TrainState(sh.params, sh.opt_state, replicated(mesh))
    return Layout(mesh, plan, model_cfg, tx, n_params, abstract_state, sh)


def _open(cfg: Config, layout: Layout, is_main: bool) -> Start:
    """Restored from the checkpoint ``checkpoint.resume`` names, else a new state at step 0.
    Everything that can refuse this run is checked before anything is written into the run
    directory."""
    warn = _warn if is_main else (lambda message: None)
    rng = jax.random.key(cfg.seed)
    checkpointer = ckpt_lib.Checkpointer(
        Path(cfg.log.run_dir) / "checkpoints", cfg.checkpoint, warn=warn
    )
    source, only_step = resume_source(cfg, checkpointer, warn)
    if source is not None:  # refuse another experiment's checkpoints before opening the data
        source.select(cfg, step=only_step, report=False)
    plan = layout.plan
    loader = data_lib.make_loader(
        cfg.data,
        "train",
        plan.local_sequences,
        plan.loader_index,
        plan.loader_count,
        segments=cfg.attention.doc_reset,
    )
    found = None
    try:
        if source is not None:
            own = source is checkpointer
            found = restore_run(
                source,
                only_step,
                cfg,
                layout.abstract_state,
                layout.shardings,
                rng,
                loader,
                own=own,
            )
            if found is not None:
                metrics = Path(cfg.log.run_dir) / "metrics.jsonl"
                hours = hours_trained(source, found[0], own=own, metrics=metrics)
    except BaseException:
        loader.close()
        checkpointer.close()
        raise
    if found is not None:
        return Start(checkpointer, loader, *found, hours)
    state = jax.jit(
        lambda: init_state(init_params(layout.model_cfg, cfg.seed), layout.tx),
        out_shardings=layout.shardings,
    )()
    return Start(checkpointer, loader, 0, state, rng, 0.0)


RUN_INFO = "run_info.jsonl"


def _note_start(run_dir: Path, start: Start) -> None:
    """Append where and with what this call trains to ``RUN_DIR/run_info.jsonl``: the step it
    starts at, the hours trained before, the device, versions, commit and host
    (``platform.provenance``). One line per start, so a run resumed on other machines or at
    other commits says which steps each trained; reports read it."""
    info = {"start_step": start.step, "hours_before": start.hours, **provenance.environment()}
    info.update(provenance.allocator())
    with (run_dir / RUN_INFO).open("a") as f:
        f.write(json.dumps(info, default=provenance.json_default) + "\n")


def _start_log(cfg: Config, layout: Layout, start: Start, is_main: bool) -> RunLogger:
    """The run's logger (process 0 writes), having printed the config and the run's sizes."""
    total, plan = cfg.train.max_steps, layout.plan
    log = RunLogger(
        cfg,
        Path(cfg.log.run_dir),
        enabled=is_main,
        start_step=start.step,
        total_steps=total,
        warn=_warn,
    )
    log.print(cfg.to_yaml())
    trained = f" after {start.hours:.3f} hours" if start.step else ""
    log.print(
        f"{layout.n_params / 1e6:.2f}M parameters | {_devices(plan, cfg.data.context)} | "
        f"{plan.sequences} x {cfg.data.context} tokens per update = {plan.accum} micro-steps "
        f"of {plan.micro_batch} per {'data group' if plan.seq_shards > 1 else 'device'} | "
        f"starting at step {start.step} of {total}{trained}"
    )
    return log


def _devices(plan, context: int) -> str:
    """How the devices split the work: ``8 devices in 1 process(es)``, and under context
    parallelism the mesh and each device's share of a sequence: ``(data 4 x seq 2: 128 tokens
    of each sequence per device)``."""
    out = f"{plan.devices} devices in {plan.processes} process(es)"
    if plan.seq_shards > 1:
        out += (
            f" (data {plan.data_devices} x seq {plan.seq_shards}: "
            f"{context // plan.seq_shards} tokens of each sequence per device)"
        )
    return out


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)
