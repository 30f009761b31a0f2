"""The oracle of the cross-entropy kernel: one block of float32 logits to its losses and gradient.

For rows of logits ``[M, V]`` (float32), targets int ``[M]`` (-1: ignored) and ``count`` (the
number of counted targets of the whole batch, so that the mean is over all chunks)::

    lse_i = log sum_v exp(logits_iv)           (float32, max-shifted)
    nll_i = lse_i - logits_i,t_i                (0 where t_i = -1)
    dlogits_iv = (exp(logits_iv - lse_i) - [v = t_i]) / count   (0 where t_i = -1)

dlogits is d(sum nll / count) / d logits: the gradient of the mean loss, which ``model/loss.py``
forms in the forward pass (the loss is the step's last op). These are the operations of its
chunk body, in the same order.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
IGNORE_INDEX = -1


def nll_and_grad(logits: jax.Array, targets: jax.Array, count: jax.Array):
    """``(nll [M], dlogits [M, V])`` float32 for logits ``[M, V]`` float32, targets int ``[M]``
    and count a float32 scalar (>= 1)."""
    V = logits.shape[-1]
    valid = targets != IGNORE_INDEX
    safe = jnp.where(valid, targets, 0)
    log_z = jax.nn.logsumexp(logits, axis=-1)
    picked = jnp.take_along_axis(logits, safe[:, None], axis=-1)[:, 0]
    nll = jnp.where(valid, log_z - picked, 0.0)
    p = jnp.exp(logits - log_z[:, None])
    onehot = jnp.arange(V)[None, :] == safe[:, None]
    dlogits = jnp.where(valid[:, None], (p - onehot) / count, 0.0)
    return nll, dlogits
