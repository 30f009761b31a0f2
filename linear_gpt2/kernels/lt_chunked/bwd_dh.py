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


def add_tile(fq_ref, dy_ref, r_ref, delta_ref, start, bt, p, carry, *, gate=None):
    """The cotangent plus row tile p's queries: dS + phi(Q)^T g, dz - phi(Q)^T delta; with
    forgetting (``gate`` = (b_ref, s_ref)) each query row weighted by ``tiles.into``, the weight
    with which it read the state entering the chunk."""
    dS, dz = carry
    rows = pl.ds(start + p * bt, bt)
    q = fq_ref[rows, :]
    q32 = q.astype(F32)
    if gate is not None:
        q32 = q32 * tiles.into(tiles.gate_rows(*gate, rows))[:, None]
        q = q32.astype(q.dtype)
    g = tiles.cotangent_rows(dy_ref[rows, :], r_ref[rows]).astype(q.dtype)
    return dS + tiles.dot(q.T, g), dz - jnp.sum(q32 * delta_ref[rows][:, None], axis=0)


def _kernel(*refs, c, bt, L, forget: bool):
    """fq ``[L c, D]``, dy ``[L c, BV]``, r and delta ``[L c]`` (the segment), (b, s ``[L c]``);
    dh ``[L, D, BV]``, dz ``[L, D]``, dht ``[D, BV]``, dzt ``[D]``."""
    fq_ref, dy_ref, r_ref, delta_ref = refs[:4]
    gate = tuple(refs[4:6]) if forget else None
    dh_ref, dz_ref, dht_ref, dzt_ref = refs[-4:]
    first_block = pl.program_id(3) == 0
    D, BV = fq_ref.shape[-1], dy_ref.shape[-1]

    def chunk(i, carry):
        dS, dz = carry
        n = L - 1 - i
        dh_ref[n] = dS

        @pl.when(first_block)
        def _():
            dz_ref[n] = dz

        if forget:
            scale = tiles.carry(*tiles.last(*gate, n * c + c - 1))
        else:
            scale = tiles.chunk_scale(n)
        add = partial(add_tile, fq_ref, dy_ref, r_ref, delta_ref, n * c, bt, gate=gate)
        return tiles.loop(0, c // bt, add, (dS * scale, dz * scale))

    dS, dz = lax.fori_loop(0, L, chunk, (jnp.zeros((D, BV), F32), jnp.zeros((D,), F32)))
    dht_ref[...] = dS

    @pl.when(first_block)
    def _():
        dzt_ref[...] = dz


def chunk_bwd_dh(fq, dy, r, delta, blocks: plan_lib.Blocks, b=None, s=None):
    """``(dh [B, H, N, D, D], dz [B, H, N, D], dht [B, H, G, D, D], dzt [B, H, G, D])``,
    float32: segment-local cotangents of the state after each chunk and each segment's total.
    fq, dy ``[B, T, H, D]``; r, delta ``[B, H, T]`` float32; with forgetting b ``[B, T, H]``
    float32 and s ``[B, T]`` int32 as in ``fwd_h``."""
    B, T, H, D = fq.shape
    c, BV, G = blocks.c, blocks.bv, blocks.segments
    L = T // c // G
    seg = pl.BlockSpec((None, L * c, None, D), lambda g, b, h, iv: (b, g, h, 0))
    seg_v = pl.BlockSpec((None, L * c, None, BV), lambda g, b, h, iv: (b, g, h, iv))
    rows = pl.BlockSpec((None, None, L * c), lambda g, b, h, iv: (b, h, g))
    in_specs, args = [seg, seg_v, rows, rows], [fq, dy, r, delta]
    return fwd_h.launch_state_pass(_kernel, "bwd_dh", in_specs, args, (B, T, H, D), blocks, b, s)
