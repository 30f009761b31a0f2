"""The linear state across slices of the sequence (context parallelism).

With the T positions split into N contiguous slices, one per device on a mesh axis, a device
needs of everything before its slice only the state entering it, ``(S [B, H, D, D], z [B, H, D])``
float32, whatever the length before. Every function here runs on one device's slice, inside a
``shard_map`` over that axis:

1. :func:`slice_state`: the state after the slice from a zero state, and the factor G that
   carries a state across it (the product of the slice's decays; 0 if a document starts in it):
   ``S_out = G S_in + S``;
2. :func:`entering_state`: the slices' ``(G, S, z)`` gathered along the axis (N x a [D, D]
   state per head: small next to the activations) and scanned exclusively, so slice r gets
   ``S_in(r) = sum_{s < r} (prod_{s < t < r} G_t) S_s``; the backward pass is the same scan in
   reverse, by autodiff of the gather;
3. :func:`entering_weights`: the weight of the entering state at each position, kept_i
   e^{A_i} with A the cumulative log-gate from the slice's start (0 once a document started).

A variant then computes its outputs from the state it receives: the chunked form and the kernels
take it as their initial state; a form without one adds ``w_i phi(q_i) S_in`` to its numerator
and ``w_i phi(q_i) . z_in`` to its denominator.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


def entering_weights(log_gate, resets, shape: tuple[int, int, int]) -> jax.Array:
    """float32 ``[B, T, H]``: the weight of the state entering the slice at each position,
    [no document start in 0..i] e^{sum_{l <= i} log gamma_l}. ``log_gate`` ``[B, T, H]`` or
    None (gamma = 1), ``resets`` bool ``[B, T]`` or None."""
    B, T, H = shape
    if log_gate is None:
        w = jnp.ones((B, T, H), F32)
    else:
        w = jnp.exp(jnp.cumsum(log_gate.astype(F32), axis=1))
    if resets is not None:
        kept = jnp.cumsum(resets.astype(jnp.int32), axis=1) == 0  # [B, T]
        w = jnp.where(kept[..., None], w, 0.0)
    return w


def slice_state(fk: jax.Array, v: jax.Array, log_gate=None, resets=None):
    """``(G [B, H], S [B, H, D, D], z [B, H, D])`` float32 of one slice: fk = phi(k), v
    ``[B, T, H, D]``. Position j's outer product reaches the slice's end decayed by the log-gates
    after it (summed backwards from the end: no difference of long sums) and is dropped if a
    document starts after it; G is the weight of the last position (:func:`entering_weights`)."""
    B, T, H, _ = fk.shape
    if log_gate is None:
        # gamma = 1: no sum to take (a cumulative sum of a constant is folded by XLA at compile
        # time, minutes at a million positions, once per layer with the blocks unrolled).
        w = jnp.ones((B, T, H), F32)
    else:
        # Sum of log gamma over (j, T): the reverse cumulative sum shifted by one position.
        a = log_gate.astype(F32)
        after = jnp.pad(lax.cumsum(a, axis=1, reverse=True)[:, 1:], ((0, 0), (0, 1), (0, 0)))
        w = jnp.exp(after)
    if resets is not None:
        r = resets.astype(jnp.int32)
        later = jnp.pad(lax.cumsum(r, axis=1, reverse=True)[:, 1:], ((0, 0), (0, 1)))
        w = jnp.where((later == 0)[..., None], w, 0.0)
    wk = fk.astype(F32) * w[..., None]
    S = jnp.einsum("bthd,bthe->bhde", wk.astype(fk.dtype), v, preferred_element_type=F32)
    z = wk.sum(axis=1)
    G = entering_weights(log_gate, resets, (B, T, H))[:, -1]
    return G, S, z


def entering_state(G: jax.Array, S: jax.Array, z: jax.Array, axis: str):
    """``(S_in [B, H, D, D], z_in [B, H, D])``: the state entering this device's slice, from
    every slice's :func:`slice_state` along mesh axis ``axis`` (call inside ``shard_map``)."""
    Gs, Ss, zs = (lax.all_gather(x, axis) for x in (G, S, z))  # [N, ...]
    n = Gs.shape[0]
    acc_S, acc_z = jnp.zeros_like(S), jnp.zeros_like(z)
    before_S, before_z = [], []
    for s in range(n):  # N is the static mesh size: a short exclusive scan
        before_S.append(acc_S)
        before_z.append(acc_z)
        acc_S = Gs[s][..., None, None] * acc_S + Ss[s]
        acc_z = Gs[s][..., None] * acc_z + zs[s]
    r = lax.axis_index(axis)
    return jnp.stack(before_S)[r], jnp.stack(before_z)[r]
