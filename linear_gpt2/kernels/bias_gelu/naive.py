"""The oracle of the fused MLP activation: bias, exact GELU and the projection after it, plain JAX.

nanoGPT's MLP is ``c_proj(gelu(c_fc(x)))`` with the exact-erf GELU. With z = x @ W1 (the c_fc
matmul's output, in the compute dtype), the op here is

    u = z + b (in z's dtype, as Flax's Dense adds its bias),
    g = u / 2 * erfc(-u / sqrt(2))   (float32 arithmetic, rounded once to z's dtype),
    y = g @ W2                        (W2 in z's dtype; c_proj's bias is added by the caller),

and its backward, with dy the cotangent of y::

    dg = dy @ W2^T,   dz = dg * gelu'(u) (float32 arithmetic, z's dtype),
    db = sum over rows of dz,   dW2 = g^T @ dy.

GELU in float32 rounded once, and its derivative in float32, is what torch computes for
bfloat16 inputs; Flax's ``nn.gelu`` on a bfloat16 u rounds each intermediate to bfloat16 (the
model's ``xla`` path keeps that; the two agree to a bfloat16 rounding).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

F32 = jnp.float32
INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
SQRT_HALF = math.sqrt(0.5)


def _dot(a, b):
    return jax.lax.dot_general(a, b, (((a.ndim - 1,), (0,)), ((), ())))


def forward(z: jax.Array, b: jax.Array) -> jax.Array:
    """g ``[..., F]`` in z's dtype: ``gelu(z + b)``, exact (erf) GELU; b ``[F]`` (any float)."""
    u = (z + b.astype(z.dtype)).astype(F32)
    return (0.5 * u * jax.lax.erfc(-u * SQRT_HALF)).astype(z.dtype)


def derivative(u: jax.Array) -> jax.Array:
    """gelu'(u) in float32."""
    u = u.astype(F32)
    return 0.5 * jax.lax.erfc(-u * SQRT_HALF) + u * jnp.exp(-0.5 * u * u) * INV_SQRT_2PI


def backward(z: jax.Array, b: jax.Array, dg: jax.Array):
    """``(dz, g, db)``: dz and g (the forward's output, recomputed) in z's dtype, db float32
    ``[F]`` (the sum of dz over rows)."""
    u = z + b.astype(z.dtype)
    dz = (dg.astype(F32) * derivative(u)).astype(z.dtype)
    return dz, forward(z, b), jnp.sum(dz.astype(F32), axis=tuple(range(z.ndim - 1)))


def gelu_matmul(z: jax.Array, b: jax.Array, w: jax.Array) -> jax.Array:
    """``y = gelu(z + b) @ w`` in z's dtype (w cast to it): z ``[..., F]``, b ``[F]``, w ``[F,
    C]``. Differentiable by autodiff."""
    return _dot(forward(z, b), w.astype(z.dtype))
