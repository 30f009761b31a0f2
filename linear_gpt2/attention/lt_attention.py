"""``LT_attention``: the post's attention formulation, one query position at a time (section 1).

    for i in range(T):
        a_j = phi(q_i) . phi(k_j)              for all j, zeroed where j > i
        y_i = sum_j a_j v_j / (sum_j a_j + eps)

O(T^2 D) FLOPs in T sequential steps (``lax.scan`` over i); each step reads all T keys and masks
the future ones rather than slicing, since the slice length would vary with i. Forward memory is
O(T) per head per step; reverse-mode autodiff stores each step's scores, O(T^2) in all. This is
the slow baseline of the post's plots, not something to train with.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linear_gpt2.attention import linear
from linear_gpt2.attention.spec import quadratic_flops

F32 = jnp.float32


def lt_attention(fq, fk, v, forget: linear.Forget | None = None) -> tuple[jax.Array, jax.Array]:
    """Numerator ``[B, T, H, D]`` and denominator ``[B, T, H]`` (float32), a loop over query
    positions. fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``; ``forget`` see ``kernels.forget.Forget``
    (query i weights key j by exp(A_i - A_j) within its document)."""
    B, T, H, _ = fq.shape
    positions = jnp.arange(T)
    if forget is not None:
        A = jnp.cumsum(
            jnp.zeros((B, T, H), F32) if forget.log_gate is None else forget.log_gate, axis=1
        )  # [B, T, H]
        seg = (
            jnp.zeros((B, T), jnp.int32)
            if forget.resets is None
            else linear.segment_ids(forget.resets)
        )

    def one_query(_, x):
        i, fq_i = x  # fq_i: [B, H, D]
        a = jnp.einsum("bhd,bjhd->bhj", fq_i, fk, preferred_element_type=F32)
        if forget is None:
            a = jnp.where(positions <= i, a, 0.0)  # causal: keys j <= i only
        else:
            mask = (positions <= i)[None, None] & (seg == seg[:, i][:, None])[:, None]
            diff = jnp.swapaxes(A[:, i][:, None] - A, 1, 2)  # [B, H, T]: A_i - A_j
            a = a * jnp.exp(jnp.where(mask, diff, -jnp.inf))
        num_i = jnp.einsum("bhj,bjhd->bhd", a.astype(v.dtype), v, preferred_element_type=F32)
        den_i = a.sum(-1)
        return None, (num_i, den_i)

    _, (num, den) = lax.scan(one_query, None, (positions, jnp.swapaxes(fq, 0, 1)))
    return jnp.swapaxes(num, 0, 1), jnp.swapaxes(den, 0, 1)


def make(options: linear.LinearOptions):
    return linear.attention_fn("LT_attention", lt_attention, options)


SPEC = linear.spec(
    "LT_attention", make, quadratic_flops, description="the attention form, one query at a time"
)
