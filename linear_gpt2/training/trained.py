"""A trained model from a run or checkpoint directory: parameters and configs, for sampling and
evaluation."""

from __future__ import annotations

from pathlib import Path

import jax

from linear_gpt2.model.api import Params, init_params
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import CheckpointError
from linear_gpt2.training.checkpoint import Checkpointer, short_error
from linear_gpt2.training.checkpoint import resolve_checkpoint as resolve
from linear_gpt2.training.config import CheckpointConfig, Config, load_config_from_dict
from linear_gpt2.training.optim import optimizer
from linear_gpt2.training.train_step import init_state


def resolve_checkpoint(path: str | Path) -> tuple[Path, int | None]:
    """``(checkpoints directory, step or None for the latest)`` from a run directory
    (``RUN/checkpoints/<step>``), a checkpoints directory, or one step's directory."""
    return resolve(path)


def load(path: str | Path) -> tuple[Params, ModelConfig, Config, int]:
    """``(params, model config, run config, step)`` from a run or checkpoint directory (the
    trainer's orbax layout). Parameters come back float32 on the default device.

    Without an explicit step the newest intact checkpoint is used: damaged ones are skipped with
    a warning (and left where they are; the trainer moves them aside when the run resumes)."""
    directory, step = resolve_checkpoint(path)
    ckpt = Checkpointer(directory, CheckpointConfig())
    if not ckpt.steps():
        raise CheckpointError(
            f"{directory} holds no checkpoint (no step directories); give a run directory "
            "whose training saved at least one (checkpoint.every, or at the end of the run)"
        )
    try:
        step = ckpt.select(None, move_damaged=False, step=step)
        if step is None:  # pragma: no cover - select raises when every step is damaged
            raise CheckpointError(f"{directory} holds no intact checkpoint")
        cfg = load_config_from_dict(ckpt.read_meta(step)["config"])
        model_cfg = cfg.model_config
        tx = optimizer(cfg.train)
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {
            "train": jax.eval_shape(lambda: init_state(init_params(model_cfg, 0), tx)),
            "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
        }
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract
        )
        try:
            restored = ckpt.restore_state(step, abstract)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {directory / str(step)} could not be read ({short_error(e)}); give "
                f"an older step directory ({directory}/<step>)"
            ) from e
    finally:
        ckpt.close()
    return restored["train"].params, model_cfg, cfg, int(step)
