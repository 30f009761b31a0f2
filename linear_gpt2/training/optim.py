"""nanoGPT's optimisation: AdamW with decay on rank >= 2 tensors, global-norm clipping, and the
linear-warmup + cosine learning-rate schedule (``train.py: get_lr``)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import optax

from linear_gpt2.training.config import TrainConfig


def lr_at(step: int, cfg: TrainConfig) -> float:
    """nanoGPT's ``get_lr(it)`` for the 0-based update index ``step`` (plain Python, the spec)."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / (cfg.warmup_steps + 1)
    if step > decay_steps:
        return cfg.min_lr
    ratio = (step - cfg.warmup_steps) / max(decay_steps - cfg.warmup_steps, 1)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (cfg.lr - cfg.min_lr)


def schedule(cfg: TrainConfig) -> optax.Schedule:
    """``lr_at`` as a traceable optax schedule of the update count."""
    decay_steps = cfg.lr_decay_steps or cfg.max_steps
    warm = cfg.warmup_steps

    def fn(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        warmup = cfg.lr * (step + 1) / (warm + 1)
        ratio = jnp.clip((step - warm) / max(decay_steps - warm, 1), 0.0, 1.0)
        cosine = cfg.min_lr + 0.5 * (1.0 + jnp.cos(jnp.pi * ratio)) * (cfg.lr - cfg.min_lr)
        return jnp.where(step < warm, warmup, jnp.where(step > decay_steps, cfg.min_lr, cosine))

    return fn


def decay_mask(params):
    """Weight decay on matmul weights and embeddings (rank >= 2), not on biases or LayerNorm.

    Under ``nn.scan`` every block parameter carries a leading layer axis, so a block's rank is its
    rank minus one; the mask uses the per-layer rank, as nanoGPT sees the unstacked tensors."""

    def per_leaf(path, leaf):
        stacked = any(getattr(k, "key", None) == "h" for k in path)
        return leaf.ndim - (1 if stacked else 0) >= 2

    return jax.tree_util.tree_map_with_path(per_leaf, params)


def optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """clip(global norm) -> AdamW(b1, b2, eps, decoupled decay lr * wd on the masked tensors).

    optax.adamw applies the decay as ``lr * wd * param`` added to the Adam step, and torch.AdamW
    multiplies the parameter by ``1 - lr * wd`` before the Adam step: both read the parameter
    before the update, so the results are the same (checked against torch in the parity tests).
    """
    parts = []
    if cfg.grad_clip > 0:
        parts.append(optax.clip_by_global_norm(cfg.grad_clip))
    parts.append(
        optax.adamw(
            schedule(cfg),
            b1=cfg.beta1,
            b2=cfg.beta2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
        )
    )
    return optax.chain(*parts)
