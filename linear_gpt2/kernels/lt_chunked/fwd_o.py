"""Output kernel, forward: every output tile in parallel (``lt_chunked_fwd_o``).

Grid ``(N P, B, H, NV)``: one program per (row tile, batch, head, value block), T/bt row tiles
of bt rows (P = c / bt tiles per chunk, ``plan.Blocks``), fully parallel: nothing is carried
across chunks. Tile t lies in chunk n = t // P at position p = t % P; with S = base[g(n)] + h[n]
and z likewise (the state entering the chunk, from ``fwd_h``):

    num = phi(Q_t) S[:, block] + sum_{j <= p} A_tj V_j[:, block]       A_tj = tiles.scores
    den = phi(Q_t) . z        + sum_{j <= p} A_tj 1                    (tiles j of chunk n)
    Y_t[:, block] = num / (den + eps)

Reads phi(Q) (its tile), phi(K) and V (the tiles of its chunk up to p), h[n], z[n] (and the
segment base when there is one); writes Y ``[B, T, H, D]`` (input dtype) and den
``[B, H, T]`` float32 (value block 0), the residual the backward pass needs.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_chunked import plan as plan_lib
from linear_gpt2.kernels.lt_chunked import tiles

F32 = jnp.float32


def output_tile(q, S, z, fk_ref, v_ref, start, p, *, bt: int, eps: float):
    """y ``[bt, BV]`` float32 and den ``[bt]`` of query tile p of a chunk whose rows start at
    ``start`` in fk_ref / v_ref, given the state (S ``[D, BV]``, z ``[D]``) entering the chunk.
    Shared with the fused single-pass kernel."""
    q32 = q.astype(F32)
    num = tiles.dot(q32, S)
    den = jnp.sum(q32 * z[None, :], axis=1)

    def key_tile(j, carry):
        num, den = carry
        rows = pl.ds(start + j * bt, bt)
        v = v_ref[rows, :]
        A = tiles.scores(q, fk_ref[rows, :], p, j, bt)
        return num + tiles.dot(A.astype(v.dtype), v), den + jnp.sum(A, axis=1)

    num, den = tiles.loop(0, p + 1, key_tile, (num, den))
    return num * tiles.reciprocal(den, eps)[:, None], den


def _kernel(*refs, c: int, bt: int, eps: float, has_base: bool):
    """fq ``[bt, D]``, fk ``[c, D]``, v ``[c, BV]`` (the chunk), h ``[D, BV]``, z ``[D]``,
    (base ``[D, BV]``, zbase ``[D]``); y ``[bt, BV]``, den ``[bt]``."""
    if has_base:
        fq_ref, fk_ref, v_ref, h_ref, z_ref, base_ref, zbase_ref, y_ref, den_ref = refs
    else:
        fq_ref, fk_ref, v_ref, h_ref, z_ref, y_ref, den_ref = refs
    P = c // bt
    p = 0 if P == 1 else pl.program_id(0) % P
    S, z = h_ref[...], z_ref[...]
    if has_base:
        S, z = S + base_ref[...], z + zbase_ref[...]
    y, den = output_tile(fq_ref[...], S, z, fk_ref, v_ref, 0, p, bt=bt, eps=eps)
    y_ref[...] = y.astype(y_ref.dtype)

    @pl.when(pl.program_id(3) == 0)
    def _():
        den_ref[...] = den


def chunk_fwd_o(fq, fk, v, h, z, base, eps: float, blocks: plan_lib.Blocks):
    """``(y [B, T, H, D], den [B, H, T] float32)``. fq, fk, v ``[B, T, H, D]``; h, z from
    ``fwd_h``; base ``(S [B, H, G, D, D], z [B, H, G, D])`` or None (zero)."""
    B, T, H, D = fq.shape
    c, bt, BV, G = blocks.c, blocks.bt, blocks.bv, blocks.segments
    P, N = c // bt, T // c
    L = N // G
    tile = pl.BlockSpec((None, bt, None, D), lambda t, b, h, iv: (b, t, h, 0))
    chunk = pl.BlockSpec((None, c, None, D), lambda t, b, h, iv: (b, t // P, h, 0))
    chunk_v = pl.BlockSpec((None, c, None, BV), lambda t, b, h, iv: (b, t // P, h, iv))
    state = pl.BlockSpec((None, None, None, D, BV), lambda t, b, h, iv: (b, h, t // P, 0, iv))
    zvec = pl.BlockSpec((None, None, None, D), lambda t, b, h, iv: (b, h, t // P, 0))
    in_specs = [tile, chunk, chunk_v, state, zvec]
    args = [fq, fk, v, h, z]
    if base is not None:
        in_specs += [
            pl.BlockSpec((None, None, None, D, BV), lambda t, b, h, iv: (b, h, t // P // L, 0, iv)),
            pl.BlockSpec((None, None, None, D), lambda t, b, h, iv: (b, h, t // P // L, 0)),
        ]
        args += list(base)
    return pl.pallas_call(
        partial(_kernel, c=c, bt=bt, eps=eps, has_base=base is not None),
        grid=(T // bt, B, H, D // BV),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bt, None, BV), lambda t, b, h, iv: (b, t, h, iv)),
            pl.BlockSpec((None, None, bt), lambda t, b, h, iv: (b, h, t)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, D), v.dtype),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        compiler_params=plan_lib.compiler_params("fwd_o", D, blocks),
        interpret=kernels.interpret(),
        name="lt_chunked_fwd_o",
    )(*args)
