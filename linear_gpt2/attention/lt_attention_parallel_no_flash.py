"""``LT_attention_parallel_no_flash``: the attention formulation as matmuls (the post's section 2).

    A = (phi(Q) phi(K)^T) * M          M: causal mask, A is [T, T] per head
    Y = (A V) / (A 1 + eps)

O(T^2 D) FLOPs and O(T^2) memory per head (A is materialised, and kept for the backward pass),
in the input dtype: 2 T^2 bytes per head in bfloat16.
The same structure as ``softmax`` without the exponential and with the row sum as normaliser.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2.attention import linear
from linear_gpt2.attention.spec import quadratic_flops

F32 = jnp.float32


def lt_attention_parallel_no_flash(
    fq: jax.Array, fk: jax.Array, v: jax.Array, forget: linear.Forget | None = None
) -> tuple[jax.Array, jax.Array]:
    """Numerator ``[B, T, H, D]`` and denominator ``[B, T, H]`` (float32) with the ``[B, H, T, T]``
    score matrix materialised. fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``; ``forget`` (see
    ``kernels.forget.Forget``) multiplies the scores by the pair weights exp(A_i - A_j) (same document)."""
    T, H = fq.shape[1], fq.shape[2]
    # The [T, T] scores are a matmul operand: kept in the input dtype (bfloat16 in training, as
    # torch autocast keeps them), accumulated in float32 inside the matmul and in the row sums.
    # Half the memory of float32 scores: what lets 124M reach the post's 32k on one H100.
    A = jnp.einsum("bihd,bjhd->bhij", fq, fk, preferred_element_type=fq.dtype)
    if forget is None:
        A = jnp.where(linear.causal_mask(T), A, jnp.zeros((), A.dtype))
    else:
        A = (A.astype(F32) * linear.pair_weights(forget, T, H)).astype(fq.dtype)
    num = jnp.einsum("bhij,bjhd->bihd", A.astype(v.dtype), v, preferred_element_type=F32)
    den = jnp.swapaxes(A.sum(-1, dtype=F32), 1, 2)  # [B, H, T] -> [B, T, H]
    return num, den


def make(options: linear.LinearOptions):
    return linear.attention_fn(
        "LT_attention_parallel_no_flash", lt_attention_parallel_no_flash, options
    )


SPEC = linear.spec(
    "LT_attention_parallel_no_flash",
    make,
    quadratic_flops,
    description="the attention form as matmuls, the T x T scores materialised",
)
