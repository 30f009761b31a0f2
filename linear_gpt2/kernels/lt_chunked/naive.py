"""The oracle of every ``LT_chunked`` kernel: the pure-JAX chunked form, normalised.

``chunked_linear_attention`` (``linear_gpt2.attention.lt_chunked``) computes the numerator and
denominator by chunks (states by an exclusive cumsum over chunks, causal attention inside each
chunk) from an optional initial state and returns the final state; :func:`chunked_attention`
adds the normaliser with the kernels' interface, so tests compare the two directly (values, and
gradients by autodiff of this function).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2.attention import linear
from linear_gpt2.attention.lt_chunked import chunked_linear_attention

__all__ = ["chunked_attention", "chunked_linear_attention"]


def chunked_attention(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    c: int,
    eps: float,
    initial_state=None,
    return_final_state: bool = False,
):
    """``y = num / (den + eps)`` by chunks of ``c`` (T padded to a multiple of c, as the
    kernels do), in fq's dtype; with ``return_final_state`` also the state ``(S [B, H, D, D],
    z [B, H, D])`` float32 after the T positions."""
    T = fq.shape[1]
    pad = (-T) % c
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        fq, fk, v = (jnp.pad(x, widths) for x in (fq, fk, v))
    (num, den), state = chunked_linear_attention(fq, fk, v, c, state=initial_state)
    y = linear.normalise(num[:, :T], den[:, :T], eps, fq.dtype)
    return (y, state) if return_final_state else y
