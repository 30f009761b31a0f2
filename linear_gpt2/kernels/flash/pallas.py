"""JAX's Pallas FlashAttention-2 kernel (``kernel=pallas``),
``jax.experimental.pallas.ops.gpu.attention.mha``: Triton-lowered on a GPU, interpret mode
elsewhere (slow; for tests). T is zero-padded at the end to a multiple of the kernel's block
(exact by causality: padded keys come after every real query, padded queries are dropped and get
a zero cotangent); documents are the kernel's segment ids."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from linear_gpt2.kernels import interpret, next_power_of_2
from linear_gpt2.kernels.flash.naive import scale

# Pallas block sizes: JAX's defaults (BlockSizes.get_default(): 128 forward, 32 backward), capped
# for short sequences. Triton needs powers of two, and its dots at least 16 rows.
_BLOCK_FWD = 128
_BLOCK_BWD = 32
_MIN_BLOCK = 16


def block_sizes(T: int) -> tuple[int, int]:
    """``(forward block, backward block)`` used by the Pallas kernel for sequence length T.

    The forward block is 128, or for short sequences the power of two >= T (at least 16); the
    backward block is 32 or the forward block if smaller. Both divide the padded length
    ``ceil(T / forward) * forward``.
    """
    fwd = min(_BLOCK_FWD, max(_MIN_BLOCK, next_power_of_2(T)))
    return fwd, min(_BLOCK_BWD, fwd)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    """q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``; ``resets`` bool ``[B, T]``."""
    # Imported here: picking another kernel never imports Pallas, and the module's import-time
    # DeprecationWarning (pointing to tokamax) is noise for us.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    T = q.shape[1]
    fwd, bwd = block_sizes(T)
    T_pad = -(-T // fwd) * fwd
    segment_ids = None if resets is None else jnp.cumsum(resets.astype(jnp.int32), axis=1)
    if T_pad != T:
        # Zero keys/values after the last real token are masked for every real query by
        # causality; the padded query rows are sliced off below.
        pad = ((0, 0), (0, T_pad - T), (0, 0), (0, 0))
        q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, T_pad - T)), mode="edge")
    blocks = pallas_attention.BlockSizes(
        block_q=fwd,
        block_k=fwd,
        block_q_dkv=bwd,
        block_kv_dkv=bwd,
        block_q_dq=bwd,
        block_kv_dq=bwd,
    )
    y = pallas_attention.mha(
        q,
        k,
        v,
        segment_ids,
        sm_scale=scale(q),  # mha's default is 1.0
        causal=True,
        block_sizes=blocks,
        interpret=interpret(),
    )
    return y[:, :T]
