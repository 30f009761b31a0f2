"""The oracle of the fused head + loss: per-row cross-entropy of the tied head's logits, plain JAX.

For hidden states h ``[N, C]``, the tied embedding w ``[V, C]`` (both in the compute dtype) and
targets int ``[N]`` (-1: ignored)::

    logits = h @ w^T                          ([N, V], float32 accumulation)
    lse_i  = log sum_v exp(logits_iv)         (float32, max-shifted)
    nll_i  = lse_i - logits_i,t_i             (0 where t_i = -1)

and for a cotangent dnll ``[N]`` of the per-row losses::

    dlogits_iv = dnll_i (exp(logits_iv - lse_i) - [v = t_i])   (0 where t_i = -1), float32
    dh = dlogits @ w,  dw = dlogits^T @ h     (dlogits rounded to the compute dtype first)

The kernels compute exactly these, never holding more than a tile of the logits. The one
rounding that autodiff of :func:`nll` does not make is dlogits to the compute dtype before the two
gradient matmuls (in float32 it is no rounding); it is what lets those matmuls run at the
tensor cores' bfloat16 rate (llm.c and Cut Cross-Entropy do the same). :func:`nll` is the plain
function whose autodiff the kernels are also tested against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
IGNORE_INDEX = -1


def logits_of(h: jax.Array, w: jax.Array) -> jax.Array:
    """float32 ``[N, V]``: h ``[N, C]`` @ w ``[V, C]``^T, operands in their dtype."""
    return jnp.dot(h, w.T, preferred_element_type=F32)


def nll_and_lse(h: jax.Array, w: jax.Array, targets: jax.Array):
    """``(nll [N], lse [N])`` float32 (module doc)."""
    logits = logits_of(h, w)
    valid = targets != IGNORE_INDEX
    safe = jnp.where(valid, targets, 0)
    lse = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    return jnp.where(valid, lse - picked, 0.0), lse


def nll(h: jax.Array, w: jax.Array, targets: jax.Array) -> jax.Array:
    """float32 ``[N]``: the per-row losses, differentiable by autodiff (the plain head)."""
    return nll_and_lse(h, w, targets)[0]


def backward(h, w, targets, lse, dnll):
    """``(dh [N, C], dw [V, C])`` float32 from the saved ``lse [N]`` and the cotangent
    ``dnll [N]`` (module doc)."""
    logits = logits_of(h, w)
    V = w.shape[0]
    valid = targets != IGNORE_INDEX
    onehot = jnp.arange(V)[None, :] == jnp.where(valid, targets, 0)[:, None]
    p = jnp.exp(logits - lse[:, None])
    dl = jnp.where(valid[:, None], dnll[:, None].astype(F32) * (p - onehot), 0.0).astype(h.dtype)
    dh = jnp.dot(dl, w, preferred_element_type=F32)
    dw = jnp.dot(dl.T, h, preferred_element_type=F32)
    return dh, dw
