"""Stability diagnostics: per-layer statistics of the attention.

The post's linear GPT-2 learns worse as the context grows, with loss spikes. These numbers let a
run show where it happens (``log.diagnostics: true``; off by default):

- ``den_min``, ``den_mean``: the linear normaliser phi(q_i) . z_i (z_i = sum_{j <= i} of the
  weighted phi(k_j), the denominator before ``eps``), min and mean over rows, positions and
  heads. A normaliser near 0 divides a small numerator by a small number: the output, and its
  gradient, blow up.
- ``state_norm``: the Frobenius norm of the state S = sum_j phi(k_j) v_j^T at the end of the row
  (after the last position; with resets, of the row's last document), mean over rows and heads.
  Without forgetting it grows with the context.
- ``out_rms``: the attention output's root mean square (every attention).
- ``gamma_mean``: the mean decay gamma_i (``attention.decay`` fixed or gate).

They are computed by :func:`layer_stats` inside each attention layer when the Flax collection
``diagnostics`` is mutable, which only :func:`linear_gpt2.model.diagnostics` makes it: the
training step never traces this code, so with diagnostics off (or on: the trainer runs them as a
separate jitted forward pass on one micro-batch every ``log.every`` steps) the compiled step is the
same program. What a variant adds (the linear normaliser and state) comes from its spec's
``stats`` (``attention.linear.layer_stats`` for the post's linear variants).

Loss spikes are counted on the host (``training.spikes``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from linear_gpt2.model.config import ModelConfig

F32 = jnp.float32
COLLECTION = "diagnostics"
PREFIX = "diag/"
# Statistics per layer, in the order they are reported.
LAYER_STATS = ("den_min", "den_mean", "state_norm", "out_rms", "gamma_mean")


def layer_stats(
    cfg: ModelConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    y: jax.Array,
    resets: jax.Array | None = None,
    log_gate: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """float32 scalars for one layer: q, k, v, y ``[B, T, H, D]`` (y the attention output before
    ``c_proj``), ``resets`` bool ``[B, T]``, ``log_gate`` ``[B, T, H]`` as the attention got
    them. ``out_rms`` always, what the variant's spec adds (``stats``), ``gamma_mean`` only
    with a decay."""
    stats = {"out_rms": jnp.sqrt(jnp.mean(jnp.square(y.astype(F32))))}
    spec = cfg.spec
    if spec.stats is not None:
        stats.update(spec.stats(q, k, v, y, resets, log_gate, cfg.attention_options))
    if log_gate is not None:
        stats["gamma_mean"] = jnp.exp(log_gate.astype(F32)).mean()
    return stats


def flatten(stats: dict[str, Any]) -> dict[str, float]:
    """``{"diag/layer0/den_min": ..., ...}`` from the model's ``{name: [n_layer]}`` arrays: the
    post's statistics in :data:`LAYER_STATS` order, then any a variant adds, by name."""
    out: dict[str, float] = {}
    order = [n for n in LAYER_STATS if n in stats] + sorted(set(stats) - set(LAYER_STATS))
    for name in order:
        for i, value in enumerate(jax.device_get(stats[name]).reshape(-1)):
            out[f"{PREFIX}layer{i}/{name}"] = float(value)
    return out
