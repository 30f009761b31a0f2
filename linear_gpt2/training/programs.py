"""The programs a training run compiles: the update (with ``auto`` memory settings resolved by
compiling, ``memory_plan.py``), the held-out evaluation, and the per-layer diagnostics pass.

Each is its own jitted program, so turning evaluation or diagnostics on leaves the compiled
training step exactly as without them. Batches reach every program as global
``[accum, micro, T]`` arrays split over the mesh's ``data`` axis along ``micro``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import optax

from linear_gpt2.model import diagnostics as model_diagnostics
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import OutOfMemoryError
from linear_gpt2.platform.memory import compiled_memory
from linear_gpt2.training import data as data_lib
from linear_gpt2.training import memory_plan
from linear_gpt2.training.batches import BatchPlan
from linear_gpt2.training.config import Config
from linear_gpt2.training.logger import RunLogger
from linear_gpt2.training.memory_plan import device_budget
from linear_gpt2.training.sharding import batch_sharding, traced_on
from linear_gpt2.training.train_step import TrainState, jit_train_step, make_eval_step


@dataclasses.dataclass(frozen=True)
class Programs:
    """A run's compiled programs, built for ``model_cfg`` (the run's, ``auto`` resolved).

    - ``train_step(state, inputs, targets, rng[, segments]) -> (state, metrics)``;
    - ``eval_step(params, inputs, targets[, segments]) -> loss`` (``(loss, hits, counted)``
      with ``log.eval_accuracy``);
    - ``diagnose(params, inputs[, segments]) -> {name: [n_layer]}`` with ``log.diagnostics``,
      else ``None``.
    """

    train_step: Callable[..., tuple[TrainState, dict[str, jax.Array]]]
    eval_step: Callable[..., Any]
    diagnose: Callable[..., dict[str, jax.Array]] | None
    model_cfg: ModelConfig


def build_programs(
    cfg: Config,
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    plan: BatchPlan,
    param_shardings: Any,
    log: RunLogger,
) -> Programs:
    """The run's programs on ``mesh``; the memory setting chosen is printed through ``log``.
    Raises :class:`OutOfMemoryError` when no setting fits."""
    batch3 = batch_sharding(mesh, 3, batch_axis=1)
    train_step, model_cfg = planned_train_step(cfg, model_cfg, tx, mesh, plan, log)
    eval_step = jax.jit(
        traced_on(mesh, make_eval_step(model_cfg, accuracy=cfg.log.eval_accuracy)),
        in_shardings=(
            param_shardings,
            batch3,
            batch3,
            *((batch3,) if cfg.attention.doc_reset else ()),
        ),
    )
    diagnose = diagnostics_fn(model_cfg, mesh) if cfg.log.diagnostics else None
    return Programs(train_step, eval_step, diagnose, model_cfg)


def planned_train_step(
    cfg: Config,
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    mesh: jax.sharding.Mesh,
    plan: BatchPlan,
    log: RunLogger,
):
    """The jitted (or, where memory was planned, compiled) training step and the model config it
    was built for, with ``remat`` / ``loss_chunk`` ``auto`` resolved (``memory_plan.py``)."""

    def build(c):
        return jit_train_step(
            c,
            tx,
            mesh,
            accum=plan.accum,
            batch=plan.global_micro_batch,
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
    shape = memory_plan.StepShape.of(
        plan.global_micro_batch, cfg.data.context, accum=plan.accum, devices=mesh.devices.size,
        context_parallel=cfg.train.context_parallel, fsdp=cfg.train.fsdp,
        devices_per_host=jax.local_device_count(),
    )  # fmt: skip
    chosen = memory_plan.plan(
        model_cfg, compile_candidate, budget, estimate=lambda c: memory_plan.estimate(c, shape)
    )
    log.print(f"memory: {chosen.describe()}")
    if not chosen.fits:
        raise OutOfMemoryError(
            f"the training step does not fit in device memory with any setting: "
            f"{chosen.describe()}. Lower train.micro_batch (accumulation keeps "
            f"tokens_per_update) or data.context, or set train.fsdp=true"
        )
    step = chosen.executable if chosen.executable is not None else build(chosen.config).step
    return step, chosen.config


def diagnostics_fn(model_cfg: ModelConfig, mesh: jax.sharding.Mesh):
    """The jitted per-layer statistics (``log.diagnostics``) of the step's first micro-batch:
    ``(params, inputs[, segments]) -> {name: [n_layer]}``; a program of its own, so the training
    step is compiled exactly as without diagnostics."""

    def stats(params, inputs, segments=None):
        seg = None if segments is None else segments[0]
        return model_diagnostics(params, inputs[0], model_cfg, segment_ids=seg)

    return jax.jit(traced_on(mesh, stats))


def evaluate(
    eval_step: Callable[..., Any],
    params: Any,
    to_global: Callable[[dict[str, np.ndarray]], tuple[jax.Array, ...]],
    cfg: Config,
    plan: BatchPlan,
) -> dict[str, float]:
    """``{"val_loss"}`` (and ``"val_acc"`` with ``log.eval_accuracy``): the mean loss over the
    first ``log.eval_batches`` batches of the held-out split (the same batches at every
    evaluation, so the numbers compare across steps and runs), and the fraction of their counted
    targets predicted exactly. ``to_global`` makes a host batch the program's global arrays."""
    loader = data_lib.make_loader(
        cfg.data,
        "validation",
        plan.local_sequences,
        plan.loader_index,
        plan.loader_count,
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
