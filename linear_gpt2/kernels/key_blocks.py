"""Keys wider than values: the expanded feature maps (issue 39) as blocks of the square kernels.

The Pallas kernels of both ops are built for phi(q), phi(k) and v of one padded width Dp (their
tiles and [Dp, bv] state slices are what compiles without spills on the H100). An expanding
feature map gives d' key features for D value columns (153 for Based's Taylor map of 16
dimensions at D = 64, 2,080 for the symmetric power of degree 2 at D = 64). Every sum of linear
attention is linear in the split of the key features into blocks:

    phi(q) . phi(k) = sum_b phi_b(q) . phi_b(k)      over NK blocks of Dp features

so the numerator and the denominator are sums over the blocks of what the square kernels
compute for (phi_b(q), phi_b(k), v), and only the division follows the sum. The ops fold the
blocks into the head axis (head h, block b -> head h NK + b, v repeated per block), run the
kernels unnormalised (their numerators, float32), sum over the blocks and divide. The backward
needs nothing new: with g = dY / (den + eps) and delta = g . y from the *summed* den and y, the
kernels' backward of each block gives that block's dphi_b(q), dphi_b(k) and its share of dv
(summed over blocks), because it only ever reads g and delta (``lt_chunked.ops.row_cotangents``).

The price: the intra-block products A V (and A^T g) are formed once per block, NK times instead
of once; the phi(q) phi(k)^T scores, the states and everything else are the d' features' own
work. The cost models count it (``lt_chunked.cost``, ``lt_attention_parallel.cost``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2.kernels import padded_head_dim


def plan(Dk: int, Dv: int) -> tuple[int, int]:
    """``(Dp, NK)``: the kernels' width (the padded value dim) and the number of key blocks of
    that width covering the Dk key features (1 when the keys fit the value width)."""
    Dp = padded_head_dim(Dv)
    return Dp, max(1, -(-Dk // Dp))


def fold_keys(x: jax.Array, NK: int, Dp: int, fill: float = 0.0) -> jax.Array:
    """``[B, T, H, Dk]`` -> ``[B, T, H NK, Dp]``: the features zero-padded to NK Dp (zero
    features add nothing to any score) and split into blocks, block b of head h at h NK + b.
    ``fill``: the padding value (-inf for raw inputs of a feature map with phi(-inf) = 0)."""
    B, T, H, Dk = x.shape
    x = jnp.pad(x, ((0, 0), (0, 0), (0, 0), (0, NK * Dp - Dk)), constant_values=fill)
    return x.reshape(B, T, H * NK, Dp)


def unfold_keys(x: jax.Array, H: int, Dk: int) -> jax.Array:
    """The inverse of :func:`fold_keys`: ``[B, T, H NK, Dp]`` -> ``[B, T, H, Dk]``."""
    B, T, HN, Dp = x.shape
    return x.reshape(B, T, H, (HN // H) * Dp)[..., :Dk]


def repeat_heads(x: jax.Array, NK: int, axis: int) -> jax.Array:
    """Each head repeated for its NK blocks along ``axis`` (head h -> h NK .. h NK + NK - 1)."""
    return x if NK == 1 else jnp.repeat(x, NK, axis=axis)


def sum_heads(x: jax.Array, NK: int, axis: int) -> jax.Array:
    """The sum over each head's NK blocks along ``axis``: the transpose of :func:`repeat_heads`."""
    if NK == 1:
        return x
    shape = x.shape
    x = x.reshape(*shape[:axis], shape[axis] // NK, NK, *shape[axis + 1 :])
    return x.sum(axis=axis + 1)


def fold_state(S: jax.Array, z: jax.Array, NK: int, Dp: int):
    """A state ``(S [B, H, Dk, Dv], z [B, H, Dk])`` as the folded heads' ``([B, H NK, Dp, Dp],
    [B, H NK, Dp])`` (zero-padded)."""
    B, H, Dk, Dv = S.shape
    S = jnp.pad(S, ((0, 0), (0, 0), (0, NK * Dp - Dk), (0, Dp - Dv)))
    z = jnp.pad(z, ((0, 0), (0, 0), (0, NK * Dp - Dk)))
    return S.reshape(B, H * NK, Dp, Dp), z.reshape(B, H * NK, Dp)


def unfold_state(S: jax.Array, z: jax.Array, H: int, Dk: int, Dv: int):
    """The inverse of :func:`fold_state`."""
    B, HN, Dp, _ = S.shape
    NK = HN // H
    return (
        S.reshape(B, H, NK * Dp, Dp)[:, :, :Dk, :Dv],
        z.reshape(B, H, NK * Dp)[:, :, :Dk],
    )
