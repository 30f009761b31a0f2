"""The oracle of the fused bias gradients: the bias added in the compute dtype (Flax's
``Dense``), then

- ``split_qkv``: ``c_attn``'s output ``u = z + b`` ``[B, T, 3C]`` split into q, k, v
  ``[B, T, H, D]``; backward ``dz = concat(dq, dk, dv)`` (z's dtype), ``db`` = the sum of dz
  over rows (float32);
- ``add_residual``: ``s = x + (z + b)`` with x the residual stream (float32) and z the MLP's
  ``c_proj`` matmul output; backward ``dx = ds``, ``dz = ds`` in z's dtype, ``db`` = the sum
  of dz over rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def split_qkv(z: jax.Array, b: jax.Array, n_head: int):
    """q, k, v ``[B, T, H, D]`` in z's dtype: z ``[B, T, 3C]``, b ``[3C]``."""
    B, T, C3 = z.shape
    u = z + b.astype(z.dtype)
    return tuple(t.reshape(B, T, n_head, C3 // 3 // n_head) for t in jnp.split(u, 3, axis=-1))


def add_residual(x: jax.Array, z: jax.Array, b: jax.Array) -> jax.Array:
    """``x + (z + b)``: the bias in z's dtype, the sum in the promoted dtype."""
    return x + (z + b.astype(z.dtype))


def backward(cotangents, dtype):
    """``(dz [..., k C] in dtype, db [k C] float32)`` from k cotangents ``[..., C]`` (or ``[B,
    T, H, D]``, flattened to C = H D): their concatenation and its sum over rows."""
    lead = cotangents[0].shape[:2]
    dz = jnp.concatenate([d.reshape(*lead, -1).astype(dtype) for d in cotangents], axis=-1)
    return dz, jnp.sum(dz.astype(F32), axis=tuple(range(dz.ndim - 1)))
