"""``LT_state``: the linear transformer as an RNN, one token at a time (the post's section 1).

    S_i = S_{i-1} + phi(k_i) v_i^T     z_i = z_{i-1} + phi(k_i)     (S_0 = 0, z_0 = 0)
    y_i = phi(q_i)^T S_i / (phi(q_i) . z_i + eps)

With forgetting (``kernels.forget.Forget``) the carry is first multiplied by gamma_i (0 where a document
starts): the recurrence that defines the function.

O(T D^2) FLOPs in T sequential steps (``lax.scan``); the forward keeps one state ``[D, D]`` per
head. Reverse-mode autodiff of the scan stores the carry of every step, so forward+backward
holds T states: O(T D^2) memory, like ``LT_state_parallel``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linear_gpt2.attention import linear
from linear_gpt2.attention.linear import state_step
from linear_gpt2.attention.spec import state_flops

F32 = jnp.float32


def lt_state(fq, fk, v, forget: linear.Forget | None = None) -> tuple[jax.Array, jax.Array]:
    """Numerator ``[B, T, H, D]`` and denominator ``[B, T, H]`` (float32) by the recurrence.
    fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``; ``forget`` see ``kernels.forget.Forget``."""
    B, T, H, Dk = fq.shape
    state = (jnp.zeros((B, H, Dk, v.shape[-1]), F32), jnp.zeros((B, H, Dk), F32))

    def body(state, x):
        out, state = state_step(state, *x)
        return state, out

    # scan runs over the leading axis: time-major [T, B, H, D].
    xs = tuple(jnp.swapaxes(x, 0, 1) for x in (fq, fk, v))
    if forget is not None:
        xs = (*xs, jnp.swapaxes(linear.gammas(forget, (B, T, H)), 0, 1))
    _, (num, den) = lax.scan(body, state, xs)
    return jnp.swapaxes(num, 0, 1), jnp.swapaxes(den, 0, 1)


def make(options: linear.LinearOptions):
    return linear.attention_fn("LT_state", lt_state, options)


SPEC = linear.spec(
    "LT_state", make, state_flops, description="the recurrence, one token at a time (lax.scan)"
)
