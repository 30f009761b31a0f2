"""cuDNN's fused attention (``kernel=cudnn``) on one device: through ``jax.nn`` without
documents, through JAX's lower-level cuDNN call with them (cuDNN's packed sequences: ``jax.nn``
has no segment ids). GPU only (or compiling for one: ``linear_gpt2.platform.target``),
bfloat16 / float16; an odd T is padded by one position (exact by causality)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2.kernels import KernelUnavailableError, on_gpu
from linear_gpt2.kernels.flash.naive import scale


def problem(q: jax.Array) -> str | None:
    """Why cuDNN cannot run ``q`` ``[B, T, H, D]`` here, or None; JAX's own checks (cuDNN's
    version, the head dim) run when the call is traced."""
    if not on_gpu():
        return (
            f"needs a CUDA GPU (or a GPU compile target, linear_gpt2.platform.target), but this "
            f"program is for {jax.default_backend()!r}"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bfloat16 or float16 inputs, got {q.dtype}"
    return None


def packed_segments(resets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed-sequence description of the documents of each row: ``offsets`` int32
    ``[B, T + 1]`` (each document's first position, then -1) and ``lengths`` int32 ``[B, T]``
    (each document's length, then -1). ``resets`` bool ``[B, T]``; position 0 always starts one.
    At most T documents per row, so the static bound is T (the arrays are small)."""
    B, T = resets.shape
    starts = resets.at[:, 0].set(True)
    offsets = jax.vmap(lambda r: jnp.nonzero(r, size=T + 1, fill_value=-1)[0])(starts)
    n = starts.sum(axis=1, keepdims=True)  # documents per row
    col = jnp.arange(T)[None]
    nxt = jnp.where(col + 1 < n, offsets[:, 1 : T + 1], T)  # the next start, or T for the last
    lengths = jnp.where(col < n, nxt - offsets[:, :T], -1)
    return offsets.astype(jnp.int32), lengths.astype(jnp.int32)


def _packed(q, k, v, resets):
    # cuDNN attention's internals (packed documents): only when the kernel runs.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    offsets, lengths = packed_segments(resets)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=scale(q), mask_type=cudnn.MaskType.CAUSAL,
    )  # fmt: skip


def attention(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    """q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``; ``resets`` bool ``[B, T]``. Raises
    :class:`KernelUnavailableError` where cuDNN cannot run (:func:`problem`)."""
    why = problem(q)
    if why:
        other = (
            "kernel=xla or kernel=pallas (interpret mode on CPU), or kernel=auto"
            if not on_gpu()
            else "model.dtype=bfloat16, or kernel=auto (falls back to xla) or kernel=xla|pallas"
        )
        raise KernelUnavailableError(f"flash attention kernel='cudnn' {why}; use {other}")
    T = q.shape[1]
    if T % 2:
        # cuDNN's training kernels need an even sequence length; a zero key/value after the last
        # token is masked for every real query by causality, and the padded query is sliced off.
        pad = ((0, 0), (0, 1), (0, 0), (0, 0))
        q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
        if resets is not None:
            resets = jnp.pad(resets, ((0, 0), (0, 1)), constant_values=True)
    if resets is not None:
        y = _packed(q, k, v, resets)
    else:
        y = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=scale(q), implementation="cudnn"
        )
    return y[:, :T]
