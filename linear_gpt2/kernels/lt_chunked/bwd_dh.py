"""State pass, backward: the cotangent of the state leaving every chunk (``lt_chunked_bwd_dh``).

Grid ``(G, B, H, NV)``, the segments of ``fwd_h``. A program walks the L chunks of its segment
in *reverse*, carrying in float32 the segment-local cotangents of the state after the current
chunk, starting from zero:

    dS [D, BV] = sum_{m in the segment, after chunk n} phi(Q_m)^T g_m[:, block]
    dz [D]     = - sum_m phi(Q_m)^T delta_m

(g = dY / (den + eps) is the cotangent of the numerator rows, -delta = -g . y that of the
denominator, precomputed as r = 1 / (den + eps) and delta ``[B, H, T]`` float32 by XLA.) Per
chunk n it writes dh[n] = dS (``[B, H, N, D, D]`` float32) and dz[n] (``[B, H, N, D]``, value
block 0), then adds chunk n's queries: dS = scale_n dS + phi(Q_n)^T g_n (scale as in the
forward pass, ``tiles.chunk_scale``; g rounded to the input dtype for the dot, as phi(K)^T V
in the forward pass), dz -= phi(Q_n)^T delta_n. At the end it writes the
segment's total (``[B, H, G, D, D]``, ``[B, H, G, D]``).

The cotangent of the state after chunk n is dbase[g(n)] + dh[n], with dbase[g] = the cotangent
of the final state + the totals of segments g+1..G-1 (an exact suffix over segments, XLA); the
cotangent of the initial state is that plus segment 0's total.

Reads phi(Q), dY (input dtype) and r, delta; per chunk one [D, c] x [c, BV] dot.

With forgetting it reads b and s as ``fwd_h`` does: dS = carry_n dS + (into phi(Q_n))^T g_n,
each query row weighted by ``tiles.into`` (its weight on the entering state), the carry as in
the forward pass; the segment cotangent bases follow the decayed suffix (``__init__``).
"""

from __future__ import annotations

from functools import partial

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2.kernels.lt_chunked import fwd_h, tiles
from linear_gpt2.kernels.lt_chunked import plan as plan_lib

F32 = jnp.float32


def row_cotangents(dy, y, den, eps: float):
    """r = 1 / (den + eps) and delta = r (dY . y) ``[bt]`` float32 of a row tile (dy, y
    ``[bt, D]``, den ``[bt]``): ``ops.row_cotangents``' numerics, in registers."""
    r = tiles.reciprocal(den, eps)
    return r, r * jnp.sum(dy.astype(F32) * y.astype(F32), axis=1)


def add_tile(fq_ref, dy_ref, r_ref, delta_ref, start, bt, p, carry, *, gate=None, rows_out=None):
    """The cotangent plus row tile p's queries: dS + phi(Q)^T g, dz - phi(Q)^T delta; with
    forgetting (``gate`` = (b_ref, s_ref)) each query row weighted by ``tiles.into``, the weight
    with which it read the state entering the chunk. With ``rows_out`` = (r_out, delta_out,
    block, eps, first_block) r_ref / delta_ref are y ``[L c, D]`` and den ``[L c]``, dy_ref has
    all D columns (``block``: this program's value columns, None for all): r and delta are
    formed here and written (by the value block 0 programs) for the gradient kernels."""
    dS, dz = carry
    rows = pl.ds(start + p * bt, bt)
    q = fq_ref[rows, :]
    q32 = q.astype(F32)
    if gate is not None:
        q32 = q32 * tiles.into(tiles.gate_rows(*gate, rows))[:, None]
        q = q32.astype(q.dtype)
    if rows_out is None:
        r, delta, dy = r_ref[rows], delta_ref[rows], dy_ref[rows, :]
    else:
        r_out, delta_out, block, eps, first_block = rows_out
        r, delta = row_cotangents(dy_ref[rows, :], r_ref[rows, :], delta_ref[rows], eps)

        @pl.when(first_block)
        def _():
            r_out[rows] = r
            delta_out[rows] = delta

        dy = tiles.cols(dy_ref, rows, block)
    g = tiles.cotangent_rows(dy, r).astype(q.dtype)
    return dS + tiles.dot(q.T, g), dz - jnp.sum(q32 * delta[:, None], axis=0)


def _kernel(*refs, c, bt, L, forget: bool, local: bool = True, eps=None):
    """fq ``[L c, D]``, dy ``[L c, BV]``, r and delta ``[L c]`` (the segment), (b, s ``[L c]``);
    (dh ``[L, D, BV]``, dz ``[L, D]``: unless not ``local``), dht ``[D, BV]``, dzt ``[D]``.
    With ``eps`` (the row cotangents formed here): dy ``[L c, D]``, y ``[L c, D]`` and den
    ``[L c]`` in place of r and delta, which are the last two outputs, ``[L c]`` each."""
    fq_ref, dy_ref, r_ref, delta_ref = refs[:4]
    gate = tuple(refs[4:6]) if forget else None
    outs = refs[6 if forget else 4 :]
    rows_out = None
    first_block = pl.program_id(3) == 0
    if eps is not None:
        *outs, r_out, delta_out = outs
        BV = outs[-2].shape[-1]
        block = None if BV == dy_ref.shape[-1] else pl.ds(pl.program_id(3) * BV, BV)
        rows_out = (r_out, delta_out, block, eps, first_block)
    dht_ref, dzt_ref = outs[-2:]
    dh_ref, dz_ref = outs[-4:-2] if local else (None, None)
    D, BV = fq_ref.shape[-1], dht_ref.shape[-1]

    def chunk(i, carry):
        dS, dz = carry
        n = L - 1 - i
        if local:
            dh_ref[n] = dS

            @pl.when(first_block)
            def _():
                dz_ref[n] = dz

        if forget:
            scale = tiles.carry(*tiles.last(*gate, n * c + c - 1))
        else:
            scale = tiles.chunk_scale(n)
        add = partial(
            add_tile, fq_ref, dy_ref, r_ref, delta_ref, n * c, bt, gate=gate, rows_out=rows_out
        )
        return tiles.loop(0, c // bt, add, (dS * scale, dz * scale))

    dS, dz = lax.fori_loop(0, L, chunk, (jnp.zeros((D, BV), F32), jnp.zeros((D,), F32)))
    dht_ref[...] = dS

    @pl.when(first_block)
    def _():
        dzt_ref[...] = dz


def chunk_bwd_dh(
    fq, dy, r, delta, blocks: plan_lib.Blocks, b=None, s=None, local=True, rows_from=None
):  # fmt: skip
    """``(dh [B, H, N, D, D], dz [B, H, N, D], dht [B, H, G, D, D], dzt [B, H, G, D])``,
    float32: segment-local cotangents of the state after each chunk and each segment's total.
    fq, dy ``[B, T, H, D]``; r, delta ``[B, H, T]`` float32; with forgetting b ``[B, T, H]``
    float32 and s ``[B, T]`` int32 as in ``fwd_h``. Without ``local`` (G = N) only
    ``(dht, dzt)``, as ``fwd_h.chunk_fwd_h``.

    ``rows_from`` = ``(y [B, T, H, D], den [B, H, T] float32, eps)``: the row cotangents are
    formed in the kernel (``row_cotangents``) from the forward's y and den instead of read (r,
    delta then None), and returned after the states, ``r, delta [B, H, T]`` float32: no XLA
    pass of their own. Each program then reads dY's rows in all D columns (for dY . y)."""
    B, T, H, D = fq.shape
    c, BV, G = blocks.c, blocks.state_block, blocks.segments
    L = T // c // G
    seg = pl.BlockSpec((None, L * c, None, D), lambda g, b, h, iv: (b, g, h, 0))
    seg_v = pl.BlockSpec((None, L * c, None, BV), lambda g, b, h, iv: (b, g, h, iv))
    rows = pl.BlockSpec((None, None, L * c), lambda g, b, h, iv: (b, h, g))
    if rows_from is None:
        in_specs, args, eps, extra = [seg, seg_v, rows, rows], [fq, dy, r, delta], None, 0
    else:
        y, den, eps = rows_from
        in_specs, args, extra = [seg, seg, seg, rows], [fq, dy, y, den], 2
    return fwd_h.launch_state_pass(
        partial(_kernel, eps=eps), "bwd_dh", in_specs, args, (B, T, H, D), blocks, b, s,
        local=local, row_outputs=extra,
    )  # fmt: skip
