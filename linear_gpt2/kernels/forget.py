"""What the linear state forgets between positions, as every kernel and oracle takes it.

- ``log_gate`` float32 ``[B, T, H]``, log gamma_i <= 0: the recurrence becomes
  S_i = gamma_i S_{i-1} + phi(k_i) v_i^T, i.e. the pair (i, j <= i) is weighted by
  prod_{j < l <= i} gamma_l = exp(A_i - A_j) with A the cumulative sum of log gamma;
- ``resets`` bool ``[B, T]``, True where a document starts: the state before it is dropped, i.e.
  the pair (i, j) counts only if no document starts in (j, i] (same segment).

Resets are masks, not gamma = 0: a log-space -inf would make exp(A_i - A_j) = exp(-inf + inf) a
NaN for two positions after the same reset.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_gpt2.platform.mesh import sequence_shards


class Forget(NamedTuple):
    """``log_gate`` float32 ``[B, T, H]`` (log gamma_i <= 0) or None (gamma = 1); ``resets`` bool
    ``[B, T]`` (True where a document starts) or None."""

    log_gate: jax.Array | None = None
    resets: jax.Array | None = None


def as_forget(log_gate=None, resets=None) -> Forget | None:
    """A :class:`Forget`, or None when there is nothing to forget (the plain code paths)."""
    if log_gate is None and resets is None:
        return None
    return Forget(None if log_gate is None else log_gate.astype(jnp.float32), resets)


def causal_mask(T: int) -> jax.Array:
    """``[T, T]`` bool, True where key j <= query i."""
    return jnp.tril(jnp.ones((T, T), dtype=bool))


def segment_ids(resets: jax.Array) -> jax.Array:
    """int32 ``[B, T]``: the number of document starts at or before each position."""
    return jnp.cumsum(resets.astype(jnp.int32), axis=1)


# --------------------------------------------------------------------------------------------
# The decayed prefix: x_n = g_n x_{n-1} + P_n, and products of decays


def _combine(x, y):
    """Composition of two affine state maps S -> g S + P (x first, then y); S ``[..., D, D]``,
    z ``[..., D]``, g ``[...]``."""
    (gx, Px, px), (gy, Py, py) = x, y
    return gx * gy, gy[..., None, None] * Px + Py, gy[..., None] * px + py


def _sequential(fn, init, elems, axis: int, reverse: bool):
    """``lax.scan`` of ``fn(carry, x) -> (carry, y)`` along ``axis`` of every array in
    ``elems``; the per-step outputs stacked back on ``axis``."""
    moved = jax.tree.map(lambda a: jnp.moveaxis(a, axis, 0), elems)
    _, ys = jax.lax.scan(fn, init, moved, reverse=reverse)
    return jax.tree.map(lambda a: jnp.moveaxis(a, 0, axis), ys)


def decayed_scan(gates: jax.Array, S: jax.Array, z: jax.Array, axis: int, reverse: bool = False):
    """Inclusive prefixes along ``axis`` (``reverse``: from the end) of the first-order
    recurrence ``x_n = g_n x_{n-1} + P_n`` from zero, for the state pair: returns ``(prod g,
    S, z)`` with ``gates`` ``[..., N, ...]``, S ``[..., N, ..., D, D]``, z ``[..., N, ..., D]``.

    Log depth (``lax.associative_scan``), except in a program whose sequence is split over the
    mesh (context parallelism): there, inside ``shard_map``, Shardy (jax 0.11.2) crashes
    compiling the gradient of a multiplicative associative scan (``jnp.cumprod`` too), so the
    recurrence runs as a sequential ``lax.scan``: the same sums, in order
    (``tests/test_context_parallel.py``)."""
    if sequence_shards() == 1:
        if reverse:
            flip = partial(jnp.flip, axis=axis)
            out = jax.lax.associative_scan(_combine, (flip(gates), flip(S), flip(z)), axis=axis)
            return tuple(flip(a) for a in out)
        return jax.lax.associative_scan(_combine, (gates, S, z), axis=axis)

    def step(carry, x):
        carry = _combine(carry, x)
        return carry, carry

    g0 = jnp.ones_like(jnp.take(gates, 0, axis=axis))
    init = (g0, jnp.zeros_like(jnp.take(S, 0, axis=axis)), jnp.zeros_like(jnp.take(z, 0, axis)))
    return _sequential(step, init, (gates, S, z), axis, reverse)


def cumprod(x: jax.Array, axis: int, reverse: bool = False) -> jax.Array:
    """Inclusive products along ``axis`` (``reverse``: from the end), as ``jnp.cumprod``;
    sequential under context parallelism for the reason :func:`decayed_scan` gives."""
    if sequence_shards() == 1:
        if reverse:
            return jnp.flip(jnp.cumprod(jnp.flip(x, axis), axis=axis), axis)
        return jnp.cumprod(x, axis=axis)

    def step(carry, xi):
        carry = carry * xi
        return carry, carry

    init = jnp.ones_like(jnp.take(x, 0, axis=axis))
    return _sequential(step, init, x, axis, reverse)
