"""The loop over updates (``trainer.train`` sets it up and tears it down): one step, its record
and console line, evaluation, loss spikes, checkpoints, and the stop every process agrees on
(``train.max_steps``, ``train.max_hours`` over every restart, ``train.target_val_acc``, a
signal), with what the loop starts from: the run's :class:`Layout` and :class:`Start`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
import optax
from jax.experimental import multihost_utils

from linear_gpt2.model import layer_stats as diag_lib
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.flops import device_peak_flops, flops_per_token
from linear_gpt2.platform.errors import OutOfMemoryError, RunError
from linear_gpt2.platform.memory import is_oom
from linear_gpt2.training import checkpoint as ckpt_lib
from linear_gpt2.training import data as data_lib
from linear_gpt2.training.batches import BatchPlan
from linear_gpt2.training.config import Config
from linear_gpt2.training.logger import RunLogger, read_jsonl
from linear_gpt2.training.optim import lr_at
from linear_gpt2.training.preemption import StopFlag
from linear_gpt2.training.programs import Programs, evaluate
from linear_gpt2.training.sharding import global_batch
from linear_gpt2.training.spikes import SpikeCounter
from linear_gpt2.training.train_step import TrainState


class NonFiniteLossError(RunError):
    """The loss or gradient norm became NaN or infinite (``train.on_nan: stop``)."""


@dataclasses.dataclass(frozen=True)
class Layout:
    """What the run is laid out on: the device mesh, how an update splits into micro-steps,
    the model and optimizer, and the train state's shapes and shardings."""

    mesh: jax.sharding.Mesh
    plan: BatchPlan
    model_cfg: ModelConfig
    tx: optax.GradientTransformation
    n_params: int
    abstract_state: TrainState  # of jax.ShapeDtypeStruct
    shardings: TrainState  # of NamedSharding


@dataclasses.dataclass
class Start:
    """Where the loop starts: the run's checkpointer and training loader, the step, train state
    and RNG, and the wall-clock hours trained before this call (restored with the step)."""

    checkpointer: ckpt_lib.Checkpointer
    loader: data_lib.Loader
    step: int
    state: TrainState
    rng: jax.Array
    hours: float


class StepLoop:
    """The loop over updates and what it carries from one to the next: the train state and RNG,
    the step, the last checkpointed step, the losses of this call and the loss-spike counter."""

    def __init__(
        self, cfg: Config, layout: Layout, programs: Programs, log: RunLogger, start: Start
    ):
        self.cfg, self.layout, self.plan, self.programs = cfg, layout, layout.plan, programs
        self.checkpointer, self.loader, self.log = start.checkpointer, start.loader, log
        self.state, self.rng, self.step = start.state, start.rng, start.step
        self.last_saved = start.step if start.step > 0 else None
        self.stop_signal: int | None = None  # SIGINT / SIGTERM when a signal stopped the run
        self.losses: dict[int, float] = {}
        self.spikes = _spike_counter(cfg, log, start.step)
        self.tokens_per_update = self.plan.sequences * cfg.data.context
        self.flops_update = (
            flops_per_token(programs.model_cfg, layout.n_params, cfg.data.context)
            * self.tokens_per_update
        )
        peak_tflops = cfg.log.peak_tflops
        self.peak = peak_tflops * 1e12 if peak_tflops is not None else device_peak_flops()
        self.hours_before = start.hours  # trained before this call, restored with the step
        self.t_start = time.monotonic()

    def hours(self) -> float:
        """Wall-clock hours of training: those restored with the checkpoint plus this call's."""
        return self.hours_before + (time.monotonic() - self.t_start) / 3600

    def run(self) -> str:
        """Updates until ``train.max_steps`` or an earlier stop, then a checkpoint of the last
        step (unless it has one); returns why the run stopped (``RunResult.stopped_by``)."""
        if self._budget_spent():
            return "max_hours"
        stopped_by = None
        with StopFlag() as stop:
            while stopped_by is None and self.step < self.cfg.train.max_steps:
                stopped_by = self._advance(stop)
            stopped_by = stopped_by or "max_steps"
            self.stop_signal = stop.signal
            if self.last_saved != self.step:
                self.save(self.step, force=True)
            if stopped_by not in ("max_steps", "target_val_acc"):
                self.log.print(
                    f"stopped by {stopped_by} at step {self.step}; checkpoint saved in "
                    f"{self.checkpointer.directory}"
                )
        return stopped_by

    def _budget_spent(self) -> bool:
        """Whether ``train.max_hours`` was spent by the earlier calls (said on the console)."""
        max_hours = self.cfg.train.max_hours
        if max_hours is None or self.step >= self.cfg.train.max_steps:
            return False
        if self.hours_before < max_hours:
            return False
        self.log.print(
            f"train.max_hours={max_hours} is spent: {self.hours_before:.3f} hours trained up "
            f"to step {self.step} (checkpoint in {self.checkpointer.directory}); nothing to "
            "train. Raise train.max_hours to train on."
        )
        return True

    def _advance(self, stop: StopFlag) -> str | None:
        """One update, its record and console line, evaluation and checkpoint when due; why
        the run stops after it, or None."""
        cfg, total = self.cfg, self.cfg.train.max_steps
        arrays = self._to_global(next(self.loader))
        metrics, dt = self._update(arrays)
        self.step += 1
        record = self._record(metrics, dt)
        self.losses[self.step] = record["loss"]
        self._stop_if_nonfinite(record)
        self._count_spike(record)
        if cfg.log.eval_every > 0 and (self.step % cfg.log.eval_every == 0 or self.step == total):
            params = self.state.params
            record.update(
                evaluate(self.programs.eval_step, params, self._to_global, cfg, self.plan)
            )
        reached = (
            cfg.train.target_val_acc is not None
            and isinstance(record.get("val_acc"), float)
            and record["val_acc"] >= cfg.train.target_val_acc
        )
        if self.step % cfg.log.every == 0 or self.step == total or reached:
            if self.programs.diagnose is not None:
                stats = self.programs.diagnose(self.state.params, arrays[0], *arrays[2:])
                record.update(diag_lib.flatten(stats))
            self.log.log(record, _console_line(record))
        else:
            self.log.log(record)
        if self.step % cfg.checkpoint.every == 0:
            self.save(self.step)
        return self._stop_reason(record, stop, reached)

    def _to_global(self, batch: dict[str, np.ndarray]) -> tuple[jax.Array, ...]:
        """(inputs, targets[, segments]) as global ``[accum, micro, T]`` arrays."""
        plan = self.plan
        T = self.cfg.data.context
        shape = (plan.accum, plan.local_sequences // plan.accum, T)
        whole = (plan.accum, plan.global_micro_batch, T)
        part = plan.local_positions(T)  # all of T unless a sequence spans processes
        keys = ("inputs", "targets") + (("segments",) if self.cfg.attention.doc_reset else ())
        mesh = self.layout.mesh
        return tuple(
            global_batch(batch[k].astype(np.int32).reshape(shape)[..., part], mesh, 1, whole)
            for k in keys
        )

    def _update(self, arrays: tuple[jax.Array, ...]) -> tuple[dict[str, Any], float]:
        """The training step on one update's arrays: ``(metrics on the host, seconds)``."""
        t0 = time.perf_counter()
        try:
            self.state, metrics = self.programs.train_step(
                self.state, arrays[0], arrays[1], self.rng, *arrays[2:]
            )
            metrics = jax.device_get(metrics)  # waits for the device: the time is real
        except Exception as e:
            if is_oom(e):
                raise OutOfMemoryError(
                    _oom_message(self.cfg, self.plan, self.layout.n_params)
                ) from e
            raise
        return metrics, time.perf_counter() - t0

    def _record(self, metrics: dict[str, Any], dt: float) -> dict[str, Any]:
        """The step's line of ``metrics.jsonl`` (before evaluation and diagnostics)."""
        devices = self.plan.devices
        return {
            "step": self.step,
            "loss": float(metrics["loss"]),
            "lr": lr_at(self.step - 1, self.cfg.train),
            "grad_norm": float(metrics["grad_norm"]),
            "step_time_s": dt,
            "tokens_per_s": self.tokens_per_update / dt,
            "model_tflops": self.flops_update / dt / devices / 1e12,
            "mfu": (self.flops_update / dt / (self.peak * devices)) if self.peak else None,
            "hours": self.hours(),
            "memory_bytes": _memory_in_use(),
            "skipped": not bool(metrics["finite"]),
        }

    def _stop_if_nonfinite(self, record: dict[str, Any]) -> None:
        """With ``train.on_nan=stop``, log a non-finite step and raise, naming the checkpoint
        to go back to."""
        if not record["skipped"] or self.cfg.train.on_nan != "stop":
            return
        self.log.log(record)
        good = (
            f"the last good checkpoint is step {self.last_saved} in {self.checkpointer.directory}"
            if self.last_saved
            else "no checkpoint was saved yet"
        )
        raise NonFiniteLossError(
            f"non-finite loss ({record['loss']}) or gradient norm at step {self.step}; stopped. "
            f"{good}. Lower train.lr, raise train.warmup_steps, or set train.on_nan=skip."
        )

    def _count_spike(self, record: dict[str, Any]) -> None:
        spikes = self.spikes
        if not spikes.enabled:
            return
        base = spikes.baseline
        if spikes.update(self.step, record["loss"]):
            record["diag/spike"] = True
            self.log.print(
                f"loss spike at step {self.step}: {record['loss']:.4f} > baseline "
                f"{base:.4f} + {self.cfg.log.spike_margin} (spike {spikes.count})"
            )
        record["diag/spikes"] = spikes.count

    def _stop_reason(self, record: dict[str, Any], stop: StopFlag, reached: bool) -> str | None:
        reason = None
        if stop.signal is not None:
            reason = "signal"
        elif reached:
            self.log.print(
                f"held-out accuracy {record['val_acc']:.4f} >= train.target_val_acc="
                f"{self.cfg.train.target_val_acc} at step {self.step}: stopping"
            )
            reason = "target_val_acc"
        elif self.cfg.train.max_hours is not None and record["hours"] >= self.cfg.train.max_hours:
            reason = "max_hours"
        return _agreed(reason) if jax.process_count() > 1 else reason

    def save(self, at: int, force: bool = False) -> None:
        meta = {
            "config": self.cfg.to_dict(),
            "step": at,
            "processes": jax.process_count(),
            "loader_shards": self.plan.loader_count,
            "hours": self.hours(),
        }
        self.checkpointer.save(
            at,
            {"train": self.state, "rng": np.asarray(jax.random.key_data(self.rng))},
            meta,
            self.loader.state_dict(),
            force=force,
        )
        self.last_saved = at


_STOPS = (None, "target_val_acc", "max_hours", "signal")  # weakest first


def _agreed(reason: str | None) -> str | None:
    """The stop every process of a job acts on: the strongest any of them has. SIGTERM reaches
    the nodes of a job at different steps and the clocks differ; a process that left the loop
    alone would leave the others waiting in the next step's collectives."""
    codes = multihost_utils.process_allgather(np.int32(_STOPS.index(reason)))
    return _STOPS[int(np.max(codes))]


def _console_line(record: dict[str, Any]) -> str:
    return (
        f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
        f"gnorm {record['grad_norm']:.3f} | {record['step_time_s'] * 1000:.1f} ms | "
        f"{record['tokens_per_s']:,.0f} tok/s"
        + (f" | MFU {record['mfu'] * 100:.1f}%" if record["mfu"] else "")
        + (f" | val {record['val_loss']:.4f}" if "val_loss" in record else "")
        + (f" | acc {record['val_acc']:.4f}" if "val_acc" in record else "")
        + (" | SKIPPED (non-finite)" if record["skipped"] else "")
    )


def _spike_counter(cfg: Config, log: RunLogger, start_step: int) -> SpikeCounter:
    """The loss-spike counter, replayed over the steps this run logged before it resumed."""
    spikes = SpikeCounter(cfg.log.spike_margin, cfg.log.spike_window)
    if log.enabled and start_step > 0 and log.jsonl_path.exists():
        for r in read_jsonl(log.jsonl_path):  # already cut back to start_step
            if isinstance(r.get("loss"), (int, float)):
                spikes.update(int(r["step"]), float(r["loss"]))
    return spikes


def _oom_message(cfg: Config, plan: BatchPlan, n_params: int) -> str:
    return (
        f"out of memory: model {n_params / 1e6:.1f}M parameters, context {cfg.data.context}, "
        f"micro_batch {plan.micro_batch} per device, attention {cfg.attention.name}. Try a smaller "
        "train.micro_batch (accumulation keeps tokens_per_update), model.remat=offload, or "
        "train.fsdp=true to shard parameters and optimizer state."
    )


def _memory_in_use() -> int | None:
    try:
        stats = jax.local_devices()[0].memory_stats()
    except Exception:
        return None
    return int(stats["bytes_in_use"]) if stats and "bytes_in_use" in stats else None
