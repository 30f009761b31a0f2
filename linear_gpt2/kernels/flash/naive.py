"""The oracle of flash's kernels and its XLA path (``kernel=xla``): causal softmax attention with
the ``[T, T]`` scores materialised by ``jax.nn.dot_product_attention(implementation="xla")``.
Any backend, any dtype; O(T^2) memory per head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def scale(q: jax.Array) -> float:
    """The softmax's scale, 1 / sqrt(D) for q ``[..., D]``."""
    return 1.0 / math.sqrt(q.shape[-1])


def document_mask(resets: jax.Array) -> jax.Array:
    """bool ``[B, 1, T, T]``: causal and within one document (``resets`` bool ``[B, T]``, True
    where a document starts)."""
    T = resets.shape[1]
    seg = jnp.cumsum(resets.astype(jnp.int32), axis=1)
    same = seg[:, None, :, None] == seg[:, None, None, :]
    return same & jnp.tril(jnp.ones((T, T), dtype=bool))


def attention(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    """q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``; ``resets`` bool ``[B, T]``: no query
    attends across a document start."""
    if resets is not None:
        return jax.nn.dot_product_attention(
            q, k, v, mask=document_mask(resets), scale=scale(q), implementation="xla"
        )
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=scale(q), implementation="xla"
    )
