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

from typing import NamedTuple

import jax
import jax.numpy as jnp


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
