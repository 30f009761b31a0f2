"""Fused kernels for the linear-attention family (Pallas, Triton).

Every kernel here implements the interface of its op's oracle (``<op>/naive.py``), e.g.
``lt_attention_parallel.naive.blocked_linear_attention``:

    kernel(fq, fk, v, c, eps) -> y

fq = phi(q), fk = phi(k), v: ``[B, T, H, D]`` in the input dtype, T a multiple of the chunk/block
size c (the ``LT_chunked`` kernels pad T themselves), D <= 128 (:data:`MAX_HEAD_DIM`), y
``[B, T, H, D]`` in v's dtype, normalised (``num / (den + eps)``) inside the kernel.
The feature map phi is applied outside the kernels, in plain JAX: it is elementwise, XLA fuses it
with the projection that produces q and k, and its gradient is then plain autodiff (the kernels'
``custom_vjp`` returns cotangents of phi(q) and phi(k)). Fusing phi into the kernels would save
one write and one read of phi(q), phi(k) (4 T D bytes per head in bfloat16) per pass; not done.

One folder per op (imported lazily by the attention variants, so ``kernel=xla`` never imports
Pallas), each with its pure-JAX oracle beside the kernels (``naive.py``: the XLA path the
attention variants run with ``kernel=xla``, and what every kernel is tested against), as
flash-linear-attention's ``fla/ops/<op>/``:

- :mod:`.lt_chunked`: ``LT_chunked``: the chunk-parallel kernels (state pass, outputs, reverse
  state pass, gradients), the single-pass kernels, the cost model that chooses between them, and
  the jax-triton single pass (GPU only, optional);
- :mod:`.lt_attention_parallel`: ``LT_attention_parallel`` (flash-style tiles, running sums).

This module holds what they share: backend detection, the Triton shape rules (checked on every
backend so that a configuration that would not lower on a GPU fails on CPU too) and head-dim
padding.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp

from linear_gpt2.platform.device import compiling_for_gpu
from linear_gpt2.platform.errors import DeviceError

F32 = jnp.float32

# Triton's tl.dot needs every operand dimension >= 16, and block shapes must be powers of two.
MIN_BLOCK = 16


class KernelUnavailableError(DeviceError):
    """The requested kernel cannot run on this backend, installation or input (every op's)."""


def on_gpu() -> bool:
    """Whether the program being traced is for a GPU: the process's GPU, or a GPU compile target
    (``linear_gpt2.platform.target``: the H100 compiled for on a machine without one)."""
    return compiling_for_gpu()


def interpret() -> bool:
    """Pallas interpret mode everywhere but for a GPU (as ``attention.flash`` does): the kernels
    then run as plain JAX, slowly, which is what the CPU tests exercise."""
    return not on_gpu()


def is_power_of_2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def padded_head_dim(D: int) -> int:
    """The head dim the kernels work with: the next power of two, at least 16 (Triton dots)."""
    return max(MIN_BLOCK, next_power_of_2(D))


def block_size_problem(c: int) -> str | None:
    """Why ``c`` cannot be a kernel's chunk/block size, or None if it can. The [c, c] score tiles
    and [c, D] operand tiles are Triton block shapes: powers of two, >= 16 for tl.dot."""
    if not is_power_of_2(c) or c < MIN_BLOCK:
        return f"must be a power of two >= {MIN_BLOCK} (Triton block shapes and dot sizes)"
    return None


def check_block_size(c: int, what: str) -> None:
    problem = block_size_problem(c)
    if problem:
        raise ValueError(f"{what}={c} {problem}; use e.g. 64, or kernel=xla for any size")


# The largest padded head dim the kernels are built for: their [D, 64] float32 state slices and
# [bt, D] tiles compile without register spills on the H100 up to D = 128 (tests/test_target.py).
MAX_HEAD_DIM = 128


def head_dim_problem(D: int) -> str | None:
    """Why the kernels cannot take head dim D, or None."""
    Dp = padded_head_dim(D)
    if Dp > MAX_HEAD_DIM:
        return (
            f"head dim {D} (padded to {Dp}) is over the kernels' {MAX_HEAD_DIM}: their state "
            f"slices and tiles would spill registers on the H100"
        )
    return None


def check_head_dim(D: int, what: str) -> None:
    problem = head_dim_problem(D)
    if problem:
        raise ValueError(f"{what}: {problem}; use kernel=xla")


def pad_head_dim(x: jax.Array, Dp: int) -> jax.Array:
    """Zero-pad the last axis to Dp. Exact for linear attention: zero feature columns add nothing
    to any score phi(q).phi(k), zero value columns give zero output columns (sliced off), and the
    padded cotangents are dropped by autodiff of the slice."""
    D = x.shape[-1]
    if D == Dp:
        return x
    return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, Dp - D)])


def block_cumsum(log_gate: jax.Array, c: int) -> jax.Array:
    """float32 ``[B, T, H]``: the cumulative log-gates within each block of c positions (T a
    multiple of c), b_i = sum of log gamma from the block's first position to i. What the
    forgetting kernels read instead of the row's cumulative sum, whose float32 differences are
    lost once it is large."""
    B, T, H = log_gate.shape
    return jnp.cumsum(log_gate.astype(jnp.float32).reshape(B, T // c, c, H), axis=2).reshape(
        B, T, H
    )


def log_gate_cotangent(dL: jax.Array) -> jax.Array:
    """d(log gamma) ``[B, T, H]`` from dL, the gradient with respect to the cumulative log-gate
    L_i = sum_{k <= i} log gamma_k: the reverse cumulative sum along T."""
    return jax.lax.cumsum(dL, axis=1, reverse=True)


def normalise(num: jax.Array, den: jax.Array, eps: float, dtype) -> jax.Array:
    """``num / (den + eps)`` in float32, cast to ``dtype``. num ``[..., D]``, den ``[...]``."""
    return (num.astype(F32) / (den.astype(F32) + eps)[..., None]).astype(dtype)


def reciprocal(den: jax.Array, eps: float) -> jax.Array:
    """``1 / (den + eps)``, 0 where that is 1/0 (only all-zero features with eps = 0: then the
    numerator is 0 too and y = 0, as in the XLA path, instead of NaN). Usable inside kernels."""
    d = den + eps
    safe = d > 0
    return jnp.where(safe, 1.0 / jnp.where(safe, d, 1.0), 0.0)


def num_warps(Dp: int) -> int:
    # A [D, D] float32 state held in registers: 4096 floats at D = 64 are 32 per thread with
    # 4 warps; D = 128 quadruples that, so use 8 warps there.
    return 4 if Dp <= 64 else 8


def tiling_problem(chunk_size: int | str, head_dim: int | None = None) -> str | None:
    """Why the linear-attention kernels cannot tile chunks (blocks) of ``chunk_size`` (an int, or
    ``auto``: one they take is chosen) at head dim ``head_dim``, or None."""
    problem = None if chunk_size == "auto" else block_size_problem(int(chunk_size))
    if problem:
        return f"chunk_size={chunk_size} {problem}"
    return None if head_dim is None else head_dim_problem(head_dim)


def resolve_kernel(
    kernel: str, variant: str, *, fused: str = "pallas", problem: str | None = None
) -> str:
    """The implementation behind ``kernel`` for ``variant``, every variant's one rule: ``auto``
    is the ``fused`` kernel when the program is for a GPU (:func:`on_gpu`) and nothing stands
    in its way (``problem`` None), ``xla`` otherwise, with a warning on a GPU saying why;
    another value is the kernel asked for (the variant's options checked it)."""
    if kernel != "auto":
        return kernel
    if not on_gpu():
        return "xla"
    if problem:
        warnings.warn(
            f"{variant}: kernel=auto uses xla, not the {fused} kernel, because {problem}",
            stacklevel=3,
        )
        return "xla"
    return fused


def note_choice(message: str, logger: str = __name__) -> None:
    """Log a choice made by shape at INFO (the caller notes each shape once) on ``logger``, a
    child of ``linear_gpt2.kernels`` (:data:`CHOICES`): the trainer and ``scripts/compile.py``
    print these records (``linear_gpt2.platform.logs.echo``), a library user sees them as
    logging's INFO records."""
    logging.getLogger(logger).info(message)


# The logger whose INFO records are the kernel choices made by shape (every op's module logs
# under it).
CHOICES = __name__


def forget_fallback(kernel: str, name: str, variant: str) -> str:
    """The implementation when resets / decay gates are on and the fused kernel ``name`` does
    not take them: ``kernel=auto`` falls back to xla (with a warning), an explicit fused kernel
    is an error naming the alternatives."""
    if kernel != "auto":
        raise NotImplementedError(
            f"{variant}: kernel={name!r} does not support attention.doc_reset / attention.decay "
            f"yet; use kernel=xla or kernel=auto"
        )
    warnings.warn(
        f"{variant}: the {name} kernel does not take resets / decay gates; using kernel=xla",
        stacklevel=3,
    )
    return "xla"


def check_fused_shape(T: int, D: int, c: int, what: str) -> None:
    """What a fused kernel pair takes: a valid block size c dividing T, and head dim D."""
    check_block_size(c, f"{what}: chunk_size")
    check_head_dim(D, what)
    if T % c:
        raise ValueError(f"{what}: chunk_size={c} does not divide T={T}")


def fused_linear_attention(forward: Callable, backward: Callable, what: str) -> Callable:
    """Wrap a kernel pair into ``(phi(q), phi(k), v, c, eps) -> y``, differentiable.

    ``forward(fq, fk, v, c, eps) -> (y, den)`` and
    ``backward(fq, fk, v, y, dy, den, c, eps) -> (dfq, dfk, dv)`` work on head dims padded to a
    power of two >= 16; this wrapper checks the block size, pads D (exact: zero features and
    values add nothing), ties the two together with a ``custom_vjp`` whose residuals are
    O(T D) (inputs, y, den: the backward recomputes the rest), and slices the padding off.
    fq, fk, v: ``[B, T, H, D]``, T a multiple of c; y ``[B, T, H, D]`` in fq's dtype.
    """

    @partial(jax.custom_vjp, nondiff_argnums=(3, 4))
    def core(fq, fk, v, c: int, eps: float):
        return forward(fq, fk, v, c, eps)[0]

    def core_fwd(fq, fk, v, c, eps):
        y, den = forward(fq, fk, v, c, eps)
        return y, (fq, fk, v, y, den)

    def core_bwd(c, eps, residuals, dy):
        fq, fk, v, y, den = residuals
        return tuple(backward(fq, fk, v, y, dy.astype(y.dtype), den, c, eps))

    core.defvjp(core_fwd, core_bwd)

    def attention(fq: jax.Array, fk: jax.Array, v: jax.Array, c: int, eps: float) -> jax.Array:
        D = v.shape[-1]  # keys of another width share its padded one (``ops``: key_blocks)
        check_fused_shape(fq.shape[1], max(D, fq.shape[-1]), c, what)
        Dp = padded_head_dim(max(D, fq.shape[-1]))
        fq, fk, v = (pad_head_dim(x, Dp) for x in (fq, fk, v.astype(fq.dtype)))
        return core(fq, fk, v, c, float(eps))[..., :D]

    return attention
