"""The training loop: config -> data -> sharded train step -> logs and checkpoints.

``train(cfg)`` runs one job on every device of every process (call
``jax.distributed.initialize`` first on multi-host launches; ``scripts/train.py`` does). It
derives gradient accumulation from ``train.tokens_per_update`` so each update sees the same number
of tokens at every context length, logs every step, saves orbax checkpoints periodically and on
SIGTERM/SIGINT or when ``train.max_hours`` is spent, and resumes exactly (``checkpoint.resume``).
"""

from __future__ import annotations

import dataclasses
import signal
import sys
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from linear_gpt2 import kernels
from linear_gpt2.model import count_params, init_params
from linear_gpt2.model import diagnostics as model_diagnostics
from linear_gpt2.model import layer_stats as diag_lib
from linear_gpt2.model.flops import device_peak_flops, flops_per_token
from linear_gpt2.platform.errors import (
    CheckpointError,
    OutOfMemoryError,
    RunError,
    UsageError,
)
from linear_gpt2.platform.memory import compiled_memory, is_oom
from linear_gpt2.training import checkpoint as ckpt_lib
from linear_gpt2.training import data as data_lib
from linear_gpt2.training import memory_plan
from linear_gpt2.training.batches import BatchPlan, plan_batches
from linear_gpt2.training.config import Config, save_config
from linear_gpt2.training.logger import RunLogger, plot_loss, read_jsonl
from linear_gpt2.training.memory_plan import device_budget
from linear_gpt2.training.optim import lr_at, optimizer
from linear_gpt2.training.sharding import (
    batch_sharding,
    global_batch,
    make_mesh,
    replicated,
    state_shardings,
)
from linear_gpt2.training.spikes import SpikeCounter
from linear_gpt2.training.train_step import TrainState, init_state, jit_train_step, make_eval_step


class NonFiniteLossError(RunError):
    """The loss or gradient norm became NaN or infinite (``train.on_nan: stop``)."""


def _oom_message(cfg: Config, plan: BatchPlan, n_params: int) -> str:
    return (
        f"out of memory: model {n_params / 1e6:.1f}M parameters, context {cfg.data.context}, "
        f"micro_batch {plan.micro_batch} per device, attention {cfg.attention.name}. Try a smaller "
        "train.micro_batch (accumulation keeps tokens_per_update), model.remat=offload, or "
        "train.fsdp=true to shard parameters and optimizer state."
    )


class _StopFlag:
    """Set by SIGTERM/SIGINT; the loop saves a checkpoint at the end of the current step."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners): no handler
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    last_step: int
    stopped_by: str  # "max_steps", "max_hours", "target_val_acc", "signal"
    losses: dict[int, float]  # step -> training loss, for the steps this call ran
    state: TrainState  # final parameters and optimizer state (global arrays)


def train(cfg: Config) -> RunResult:
    run_dir = Path(cfg.log.run_dir)
    is_main = jax.process_index() == 0
    mesh = make_mesh()
    plan = plan_batches(cfg, mesh.devices.size, jax.process_count())
    model_cfg = cfg.model_config
    tx = optimizer(cfg.train)

    abstract_params = jax.eval_shape(lambda: init_params(model_cfg, cfg.seed))
    n_params = count_params(abstract_params, non_embedding=False)
    abstract_state = jax.eval_shape(lambda: init_state(init_params(model_cfg, cfg.seed), tx))
    state_sh = state_shardings(abstract_state, mesh, cfg.train.fsdp)
    state_sh = TrainState(state_sh.params, state_sh.opt_state, replicated(mesh))
    rng = jax.random.key(cfg.seed)

    # Everything that can refuse this run is checked before anything is written into run_dir.
    warn = _warn if is_main else (lambda message: None)
    checkpointer = ckpt_lib.Checkpointer(run_dir / "checkpoints", cfg.checkpoint, warn=warn)
    source, only_step = _resume_source(cfg, checkpointer, warn)
    if source is not None:  # refuse another experiment's checkpoints before opening the data
        source.select(cfg, step=only_step, report=False)
    loader = data_lib.make_loader(
        cfg.data,
        "train",
        plan.local_sequences,
        jax.process_index(),
        jax.process_count(),
        segments=cfg.attention.doc_reset,
    )
    state, start_step = None, 0
    try:
        if source is not None:
            abstract_ckpt = {
                "train": ckpt_lib.abstract(abstract_state, state_sh),
                "rng": np.asarray(jax.random.key_data(rng)),
            }
            found = _restore(source, only_step, cfg, abstract_ckpt, own=source is checkpointer)
            if found is not None:
                start_step, restored, data_state = found
                state, rng = restored["train"], jax.random.wrap_key_data(restored["rng"])
                try:
                    loader.load_state_dict(data_state)
                except ValueError as e:
                    raise ckpt_lib.IncompatibleCheckpointError(
                        f"checkpoint {source.directory / str(start_step)}: {e}; start a new run "
                        "(another log.name) to train on other data"
                    ) from None
    except BaseException:
        loader.close()
        checkpointer.close()
        raise
    if state is None:
        state = jax.jit(
            lambda: init_state(init_params(model_cfg, cfg.seed), tx), out_shardings=state_sh
        )()
    if is_main:
        save_config(cfg, run_dir / "config.yaml")

    total = cfg.train.max_steps
    log = RunLogger(cfg, run_dir, enabled=is_main, start_step=start_step, total_steps=total)
    log.print(cfg.to_yaml())
    log.print(
        f"{n_params / 1e6:.2f}M parameters | {plan.devices} devices in {plan.processes} process(es) | "
        f"{plan.sequences} x {cfg.data.context} tokens per update = {plan.accum} micro-steps of "
        f"{plan.micro_batch} per device | starting at step {start_step} of {total}"
    )

    batch3 = batch_sharding(mesh, 3, batch_axis=1)
    train_step, model_cfg = _planned_train_step(cfg, model_cfg, tx, mesh, plan, log)
    eval_step = jax.jit(
        make_eval_step(model_cfg, accuracy=cfg.log.eval_accuracy),
        in_shardings=(
            state_sh.params,
            batch3,
            batch3,
            *((batch3,) if cfg.attention.doc_reset else ()),
        ),
    )

    diagnose = _diagnostics_fn(model_cfg) if cfg.log.diagnostics else None
    spikes = SpikeCounter(cfg.log.spike_margin, cfg.log.spike_window)
    if is_main and start_step > 0 and (run_dir / "metrics.jsonl").exists():
        for r in read_jsonl(run_dir / "metrics.jsonl"):  # already cut back to start_step
            if isinstance(r.get("loss"), (int, float)):
                spikes.update(int(r["step"]), float(r["loss"]))

    tokens_per_update = plan.sequences * cfg.data.context
    flops_update = flops_per_token(model_cfg, n_params, cfg.data.context) * tokens_per_update
    peak = device_peak_flops()
    last_saved = start_step if start_step > 0 else None
    losses: dict[int, float] = {}
    t_start = time.monotonic()
    stopped_by = "max_steps"
    step = start_step

    def to_global(batch: dict[str, np.ndarray]) -> tuple[jax.Array, ...]:
        """(inputs, targets[, segments]) as global ``[accum, micro, T]`` arrays."""
        local_micro = plan.local_sequences // plan.accum
        shape = (plan.accum, local_micro, cfg.data.context)
        keys = (
            ("inputs", "targets", "segments") if cfg.attention.doc_reset else ("inputs", "targets")
        )
        return tuple(global_batch(batch[k].astype(np.int32).reshape(shape), mesh, 1) for k in keys)

    def save(at: int, force: bool = False) -> None:
        nonlocal last_saved
        meta = {"config": cfg.to_dict(), "step": at, "processes": jax.process_count()}
        checkpointer.save(
            at,
            {"train": state, "rng": np.asarray(jax.random.key_data(rng))},
            meta,
            loader.state_dict(),
            force=force,
        )
        last_saved = at

    try:
        with _StopFlag() as stop:
            while step < total:
                arrays = to_global(next(loader))
                t0 = time.perf_counter()
                try:
                    state, metrics = train_step(state, arrays[0], arrays[1], rng, *arrays[2:])
                    metrics = jax.device_get(metrics)  # waits for the device: the time is real
                    for choice in kernels.new_choices():  # made by shape when first traced
                        log.print(f"kernel: {choice}")
                except Exception as e:
                    if is_oom(e):
                        raise OutOfMemoryError(_oom_message(cfg, plan, n_params)) from e
                    raise
                dt = time.perf_counter() - t0
                step += 1
                loss = float(metrics["loss"])
                losses[step] = loss
                record = {
                    "step": step,
                    "loss": loss,
                    "lr": lr_at(step - 1, cfg.train),
                    "grad_norm": float(metrics["grad_norm"]),
                    "step_time_s": dt,
                    "tokens_per_s": tokens_per_update / dt,
                    "mfu": (flops_update / dt / (peak * plan.devices)) if peak else None,
                    "hours": (time.monotonic() - t_start) / 3600,
                    "memory_bytes": _memory_in_use(),
                    "skipped": not bool(metrics["finite"]),
                }
                if not bool(metrics["finite"]) and cfg.train.on_nan == "stop":
                    log.log(record)
                    good = (
                        f"the last good checkpoint is step {last_saved} in {checkpointer.directory}"
                        if last_saved
                        else "no checkpoint was saved yet"
                    )
                    raise NonFiniteLossError(
                        f"non-finite loss ({loss}) or gradient norm at step {step}; stopped. {good}. "
                        "Lower train.lr, raise train.warmup_steps, or set train.on_nan=skip."
                    )
                if spikes.enabled:
                    base = spikes.baseline
                    if spikes.update(step, loss):
                        record["diag/spike"] = True
                        log.print(
                            f"loss spike at step {step}: {loss:.4f} > baseline "
                            f"{base:.4f} + {cfg.log.spike_margin} (spike {spikes.count})"
                        )
                    record["diag/spikes"] = spikes.count
                if cfg.log.eval_every > 0 and (step % cfg.log.eval_every == 0 or step == total):
                    record.update(_evaluate(eval_step, state.params, to_global, cfg, plan))
                reached = (
                    cfg.train.target_val_acc is not None
                    and isinstance(record.get("val_acc"), float)
                    and record["val_acc"] >= cfg.train.target_val_acc
                )
                if step % cfg.log.every == 0 or step == total or reached:
                    if diagnose is not None:
                        stats = diagnose(state.params, arrays[0], *arrays[2:])
                        record.update(diag_lib.flatten(stats))
                    line = (
                        f"step {step:>6} | loss {loss:.4f} | lr {record['lr']:.2e} | "
                        f"gnorm {record['grad_norm']:.3f} | {dt * 1000:.1f} ms | "
                        f"{record['tokens_per_s']:,.0f} tok/s"
                        + (f" | MFU {record['mfu'] * 100:.1f}%" if record["mfu"] else "")
                        + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else "")
                        + (f" | acc {record['val_acc']:.4f}" if "val_acc" in record else "")
                        + (" | SKIPPED (non-finite)" if record["skipped"] else "")
                    )
                    log.log(record, line)
                else:
                    log.log(record)
                if step % cfg.checkpoint.every == 0:
                    save(step)
                if stop.signal is not None:
                    stopped_by = "signal"
                    break
                if reached:
                    stopped_by = "target_val_acc"
                    log.print(
                        f"held-out accuracy {record['val_acc']:.4f} >= train.target_val_acc="
                        f"{cfg.train.target_val_acc} at step {step}: stopping"
                    )
                    break
                if cfg.train.max_hours is not None and record["hours"] >= cfg.train.max_hours:
                    stopped_by = "max_hours"
                    break
            if last_saved != step:
                save(step, force=True)
            if stopped_by not in ("max_steps", "target_val_acc"):
                log.print(
                    f"stopped by {stopped_by} at step {step}; checkpoint saved in {checkpointer.directory}"
                )
    finally:
        checkpointer.close()
        log.close()
        loader.close()
    if is_main:
        records = read_jsonl(run_dir / "metrics.jsonl")
        plot_loss(
            records,
            run_dir / "loss.png",
            f"{cfg.log.name}: {cfg.attention.name}, context {cfg.data.context}",
        )
    return RunResult(run_dir, step, stopped_by, losses, state)


def _planned_train_step(cfg: Config, model_cfg, tx, mesh, plan: BatchPlan, log):
    """The jitted (or, where memory was planned, compiled) training step and the model config it
    was built for, with ``remat`` / ``loss_chunk`` ``auto`` resolved (``memory_plan.py``)."""

    def build(c):
        return jit_train_step(
            c,
            tx,
            mesh,
            accum=plan.accum,
            batch=plan.micro_batch * plan.devices,
            context=cfg.data.context,
            fsdp=cfg.train.fsdp,
            skip_nonfinite=cfg.train.on_nan == "skip",
        )

    def compile_candidate(c):
        program = build(c)
        compiled = program.step.lower(*program.args).compile()
        return compiled_memory(compiled), compiled

    budget = (
        device_budget(list(mesh.devices.flat)) if not memory_plan.is_resolved(model_cfg) else None
    )
    chosen = memory_plan.plan(model_cfg, compile_candidate, budget)
    log.print(f"memory: {chosen.describe()}")
    if not chosen.fits:
        raise OutOfMemoryError(
            f"the training step does not fit in device memory with any setting: "
            f"{chosen.describe()}. Lower train.micro_batch (accumulation keeps "
            f"tokens_per_update) or data.context, or set train.fsdp=true"
        )
    step = chosen.executable if chosen.executable is not None else build(chosen.config).step
    return step, chosen.config


def _warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


def _resume_source(
    cfg: Config, own: ckpt_lib.Checkpointer, warn
) -> tuple[ckpt_lib.Checkpointer | None, int | None]:
    """Where this run continues from: ``(checkpointer, step or None for its newest)``, or
    ``(None, None)`` to start at step 0. Refusals raise before anything is written."""
    resume = cfg.checkpoint.resume
    if resume == "auto":
        return own, None
    if resume == "never":
        if own.steps():
            raise RunDirectoryInUseError(
                f"{own.directory} already holds checkpoints (latest step {own.latest_step()}) and "
                "checkpoint.resume=never; continue that run with checkpoint.resume=auto, start a "
                f"new one with another log.name or log.run_dir, or move {own.directory.parent} "
                "aside to start it over"
            )
        return None, None
    if own.steps():  # a preempted run that started from another checkpoint: continue its own
        warn(
            f"checkpoint.resume={resume}: {own.directory} already holds this run's checkpoints; "
            "continuing from those"
        )
        return own, None
    directory, step = ckpt_lib.resolve_checkpoint(resume)
    source = ckpt_lib.Checkpointer(directory, cfg.checkpoint, warn=warn)
    if not source.steps():
        raise CheckpointError(
            f"checkpoint.resume={resume!r} holds no checkpoint (no step directories in "
            f"{directory}); point it at a run directory or a checkpoints directory, or use "
            "checkpoint.resume=auto"
        )
    return source, step


def _restore(source: ckpt_lib.Checkpointer, step: int | None, cfg: Config, abstract, own: bool):
    """``(step, state, loader position)`` of the newest intact checkpoint, or ``None``. Damaged
    checkpoints of this run are moved aside (by process 0, once every process agreed on the
    step); another run's are only skipped."""
    if jax.process_count() == 1 and step is None:
        try:
            return source.restore_latest(cfg, abstract, move_damaged=own)
        finally:
            if not own:
                source.close()
    chosen = source.select(cfg, move_damaged=False, step=step)
    if jax.process_count() > 1:
        chosen_all = int(
            multihost_utils.broadcast_one_to_all(np.int64(-1 if chosen is None else chosen))
        )
        chosen = None if chosen_all < 0 else chosen_all
        if own and jax.process_index() == 0:
            for s, reason in source.last_damaged:
                if chosen is None or s > chosen:
                    source.move_aside(s, reason)
        multihost_utils.sync_global_devices("linear_gpt2: damaged checkpoints moved aside")
    if chosen is None:
        return None
    try:
        state, data_state = source.restore(chosen, abstract)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {source.directory / str(chosen)} could not be restored "
            f"({ckpt_lib.short_error(e)}); if it is damaged, move it to "
            f"{source.directory / ckpt_lib.DAMAGED}/ and run again"
        ) from e
    finally:
        if not own:
            source.close()
    return chosen, state, data_state


class RunDirectoryInUseError(UsageError):
    """``checkpoint.resume=never`` on a run directory that already holds checkpoints."""


def _diagnostics_fn(model_cfg):
    """The jitted per-layer statistics (``log.diagnostics``) of the step's first micro-batch:
    ``(params, inputs[, segments]) -> {name: [n_layer]}``; a program of its own, so the training
    step is compiled exactly as without diagnostics."""

    def stats(params, inputs, segments=None):
        seg = None if segments is None else segments[0]
        return model_diagnostics(params, inputs[0], model_cfg, segment_ids=seg)

    return jax.jit(stats)


def _evaluate(eval_step, params, to_global, cfg: Config, plan: BatchPlan) -> dict[str, float]:
    """``{"val_loss"}`` (and ``"val_acc"`` with ``log.eval_accuracy``): the mean loss over the
    first ``log.eval_batches`` batches of the held-out split (the same batches at every
    evaluation, so the numbers compare across steps and runs), and the fraction of their counted
    targets predicted exactly."""
    loader = data_lib.make_loader(
        cfg.data,
        "validation",
        plan.local_sequences,
        jax.process_index(),
        jax.process_count(),
        segments=cfg.attention.doc_reset,
    )
    losses, hits, counted = [], 0, 0
    try:
        for _, batch in zip(range(cfg.log.eval_batches), loader):
            out = eval_step(params, *to_global(batch))
            if cfg.log.eval_accuracy:
                out, h, c = out
                hits, counted = hits + int(h), counted + int(c)
            losses.append(float(out))
    finally:
        loader.close()
    result: dict[str, float] = {"val_loss": float(np.mean(losses)) if losses else None}
    if cfg.log.eval_accuracy:
        result["val_acc"] = hits / counted if counted else None
    return result


def _memory_in_use() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        return None
    return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None
