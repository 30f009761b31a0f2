"""What flash's ``kernel`` runs for given inputs: on one device (:func:`attention`) and per
block of the ring under context parallelism (:func:`context_block`). ``auto`` is decided by the
kernels' one rule (:func:`linear_gpt2.kernels.resolve_kernel`): cuDNN when the program is for a
GPU and cuDNN takes the inputs, XLA otherwise."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.kernels import KernelUnavailableError
from linear_gpt2.kernels.flash import cudnn, naive, ring


def attention(kernel: str, q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    """Causal softmax attention with ``kernel`` (one of ``flash.KERNELS``) on one device: q, k,
    v ``[B, T, H, D]`` -> y in q's dtype; ``resets`` bool ``[B, T]``."""
    impl = kernels.resolve_kernel(kernel, "flash", fused="cudnn", problem=cudnn.problem(q))
    if impl == "xla":
        return naive.attention(q, k, v, resets).astype(q.dtype)
    if impl == "pallas":
        from linear_gpt2.kernels.flash import pallas  # Pallas: only when picked

        return pallas.attention(q, k, v, resets).astype(q.dtype)
    if kernel == "cudnn":
        return cudnn.attention(q, k, v, resets).astype(q.dtype)
    try:
        # JAX's own cuDNN support checks (cuDNN present, its version, the head dim) run in
        # Python when the call is traced, so a rejection surfaces here, also under jit and grad.
        return cudnn.attention(q, k, v, resets).astype(q.dtype)
    except (KernelUnavailableError, NotImplementedError, ValueError, RuntimeError) as e:
        warnings.warn(
            f"flash: kernel=auto uses xla, not the cudnn kernel, because cuDNN cannot run q "
            f"{q.shape} {q.dtype} ({e}) (O(T^2) memory)",
            stacklevel=2,
        )
        return naive.attention(q, k, v, resets).astype(q.dtype)


# Above this many bytes of one block's float32 scores (all heads and rows), the ring's XLA blocks
# are computed in tiles (ring.tiled_block): at 124M's 12 heads, slices from 4k tokens.
_WHOLE_BLOCK_BYTES = 256 * 2**20


def _xla_block(q: jax.Array, n: int) -> ring.Block:
    S = q.shape[1] // n
    whole = q.shape[0] * q.shape[2] * S * S * 4
    return ring.XLA if whole <= _WHOLE_BLOCK_BYTES else ring.XLA_TILED


def _block_problem(q: jax.Array, resets) -> str | None:
    """Why the ring cannot use cuDNN blocks for ``q`` ``[B, T, H, D]``, or None."""
    if not kernels.on_gpu():
        return f"needs a CUDA GPU (or a GPU compile target); this is {jax.default_backend()!r}"
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        return f"needs bfloat16 or float16 inputs, got {q.dtype}"
    if q.shape[-1] % 8 or q.shape[-1] > 256:
        return f"needs a head dim that is a multiple of 8 and at most 256, got {q.shape[-1]}"
    if resets is not None:
        return "takes no document resets under context parallelism yet"
    return None


def context_block(kernel: str, q: jax.Array, resets, n: int) -> ring.Block:
    """The per-block op of the ring (:mod:`.ring`) for ``kernel`` and ``q`` ``[B, T, H, D]``
    split into ``n`` slices: cuDNN on a GPU (or a GPU compile target) for bfloat16/float16
    without document resets, XLA otherwise (in tiles where a block's scores would be large). An
    explicit kernel that cannot run is an error; ``auto`` on a GPU warns when it falls back."""
    if kernel == "pallas":
        raise NotImplementedError(
            "flash kernel=pallas does not run under context parallelism (its segment ids are "
            "one array for queries and keys, which cannot mask a block of one slice's queries "
            "against another slice's keys); use kernel=cudnn, kernel=auto or kernel=xla"
        )
    problem = _block_problem(q, resets)
    if kernel == "cudnn" and problem:
        raise KernelUnavailableError(
            f"flash kernel=cudnn under context parallelism {problem}; use kernel=xla or "
            "kernel=auto (falls back to XLA blocks)"
        )
    block = _xla_block(q, n)
    if problem and kernel == "auto" and kernels.on_gpu():
        how = "in tiles, flash-style loops in XLA" if block is ring.XLA_TILED else "whole"
        problem = f"cuDNN {problem}; ring attention with XLA blocks ({how}; slower than cuDNN's)"
    impl = kernels.resolve_kernel(kernel, "flash under context parallelism", fused="cudnn",
                                  problem=problem)  # fmt: skip
    return ring.CUDNN if impl == "cudnn" else block
