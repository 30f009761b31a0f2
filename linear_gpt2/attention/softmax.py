"""``softmax``: causal softmax attention with the T x T score matrix materialised (plain XLA).

Cost O(T^2 D) FLOPs and O(T^2) memory per head. This is nanoGPT's non-flash path, and the
reference the fused variants are checked against.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

OPTIONS: tuple[str, ...] = ()
SUPPORTS_DROPOUT = True


def softmax_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Causal softmax attention. q, k, v: ``[B, T, H, D]`` -> ``[B, T, H, D]``.

    Scores are scaled by 1/sqrt(D) and the softmax is taken in float32 whatever the input dtype,
    as torch autocast does. ``dropout_rate`` > 0 with a ``dropout_rng`` drops attention weights
    (nanoGPT's ``attn_dropout`` site).
    """
    T, D = q.shape[1], q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(D)
    causal = jnp.tril(jnp.ones((T, T), dtype=bool))
    scores = jnp.where(causal, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
    return y.astype(q.dtype)


def make():
    return softmax_attention
