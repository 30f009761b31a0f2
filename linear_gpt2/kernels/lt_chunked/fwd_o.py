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

With forgetting it also reads the chunk's b and s (``fwd_h``) and, with a segment base, the
chunk's factor of it (``decay`` ``[B, H, N]``: the carries of the segment's earlier chunks):
S = h[n] + decay_n base[g]; the state's part of row i is weighted by ``tiles.into`` = [no reset
in the chunk up to i] e^{b_i}, the scores by the pair weights (``tiles.weighted``).
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


def output_tile(
    q, S, z, fk_ref, v_ref, start, p, *, bt: int, eps: float, gate=None, normalise: bool = True
):
    """y ``[bt, BV]`` float32 and den ``[bt]`` of query tile p of a chunk whose rows start at
    ``start`` in fk_ref / v_ref, given the state (S ``[D, BV]``, z ``[D]``) entering the chunk.
    With forgetting, ``gate`` = (b_ref, s_ref) of the chunk's rows: the state's part is
    weighted by ``tiles.into``, the scores by the pair weights. Without ``normalise`` the
    numerator instead of y (a block of the key features: ``ops``, keys wider than values).
    Shared with the fused kernel."""
    q32 = q.astype(F32)
    num = tiles.dot(q32, S)
    den = jnp.sum(q32 * z[None, :], axis=1)
    gq = None
    if gate is not None:
        gq = tiles.gate_rows(*gate, pl.ds(start + p * bt, bt))
        w = tiles.into(gq)
        num, den = num * w[:, None], den * w

    def key_tile(j, carry):
        num, den = carry
        rows = pl.ds(start + j * bt, bt)
        v = v_ref[rows, :]
        gk = None if gate is None else tiles.gate_rows(*gate, rows)
        A = tiles.scores(q, fk_ref[rows, :], p, j, bt, gq, gk)
        return num + tiles.dot(A.astype(v.dtype), v), den + jnp.sum(A, axis=1)

    num, den = tiles.loop(0, p + 1, key_tile, (num, den))
    if not normalise:
        return num, den
    return num * tiles.reciprocal(den, eps)[:, None], den


def _kernel(
    *refs, c: int, bt: int, L: int, eps: float, has_base: bool, forget: bool, normalise: bool,
    prefix: bool = False,
):  # fmt: skip
    """fq ``[bt, D]``, fk ``[c, D]``, v ``[c, BV]`` (the chunk), h ``[D, BV]``, z ``[D]`` (with
    ``prefix``: every chunk's total, ``[N, D, BV]``, ``[N, D]``), (b ``[c]``, s ``[c]``), (base
    ``[D, BV]``, zbase ``[D]``, (decay ``[L]``)); y ``[bt, BV]``, den ``[bt]``."""
    refs = list(refs)
    fq_ref, fk_ref, v_ref, h_ref, z_ref = refs[:5]
    rest = refs[5:]
    gate = None
    if forget:
        gate, rest = tuple(rest[:2]), rest[2:]
    if has_base:
        base_ref, zbase_ref, rest = rest[0], rest[1], rest[2:]
        if forget:
            decay_ref, rest = rest[0], rest[1:]
    y_ref, den_ref = rest
    P = c // bt
    p = 0 if P == 1 else pl.program_id(0) % P
    if prefix:  # the state entering chunk n: the sum of the earlier chunks' totals
        D, BV = h_ref.shape[-2:]
        cut = (slice(None), slice(None))
        S, z = tiles.chunk_sum(h_ref, z_ref, 0, pl.program_id(0) // P, cut, cut[0], (D, BV), D)
    else:
        S, z = h_ref[...], z_ref[...]
    if has_base:
        if forget:  # the segment's base decays over the segment's earlier chunks
            a = decay_ref[(pl.program_id(0) // P) % L]
            S, z = S + a * base_ref[...], z + a * zbase_ref[...]
        else:
            S, z = S + base_ref[...], z + zbase_ref[...]
    y, den = output_tile(
        fq_ref[...], S, z, fk_ref, v_ref, 0, p, bt=bt, eps=eps, gate=gate, normalise=normalise
    )
    y_ref[...] = y.astype(y_ref.dtype)

    @pl.when(pl.program_id(3) == 0)
    def _():
        den_ref[...] = den


def chunk_fwd_o(
    fq, fk, v, h, z, base, eps: float, blocks: plan_lib.Blocks, forget=None, normalise=True,
    prefix=False,
):  # fmt: skip
    """``(y [B, T, H, D], den [B, H, T] float32)``. fq, fk, v ``[B, T, H, D]``; h, z from
    ``fwd_h``; base ``(S [B, H, G, D, D], z [B, H, G, D])`` or None (zero). With ``prefix``
    (one chunk per segment, no base, no forgetting: ``ops``, "own prefix") h, z are the chunks'
    totals (``fwd_h`` without ``local``) and each program sums those before its chunk, in
    place of an XLA prefix over segments. ``forget``: None, or
    ``(b [B, T, H] float32, s [B, T] int32, decay [B, H, N] float32)``: the chunk-local
    cumulative log-gates, documents within the chunk, and the factor of the segment's base at
    each chunk (the carries of the segment's earlier chunks; read only with a base). Without
    ``normalise``: the numerator, float32, instead of y."""
    B, T, H, D = fq.shape
    c, bt, BV, G = blocks.c, blocks.bt, blocks.bv, blocks.segments
    P, N = c // bt, T // c
    L = N // G
    tile = pl.BlockSpec((None, bt, None, D), lambda t, b, h, iv: (b, t, h, 0))
    chunk = pl.BlockSpec((None, c, None, D), lambda t, b, h, iv: (b, t // P, h, 0))
    chunk_v = pl.BlockSpec((None, c, None, BV), lambda t, b, h, iv: (b, t // P, h, iv))
    state = pl.BlockSpec((None, None, None, D, BV), lambda t, b, h, iv: (b, h, t // P, 0, iv))
    zvec = pl.BlockSpec((None, None, None, D), lambda t, b, h, iv: (b, h, t // P, 0))
    if prefix:  # every chunk's total: the program sums those before its chunk
        assert base is None and forget is None and G == N, "prefix: one chunk per segment only"
        state = pl.BlockSpec((None, None, N, D, BV), lambda t, b, h, iv: (b, h, 0, 0, iv))
        zvec = pl.BlockSpec((None, None, N, D), lambda t, b, h, iv: (b, h, 0, 0))
    in_specs = [tile, chunk, chunk_v, state, zvec]
    args = [fq, fk, v, h, z]
    if forget is not None:
        in_specs += [
            pl.BlockSpec((None, c, None), lambda t, b, h, iv: (b, t // P, h)),
            pl.BlockSpec((None, c), lambda t, b, h, iv: (b, t // P)),
        ]
        args += list(forget[:2])
    if base is not None:
        in_specs += [
            pl.BlockSpec((None, None, None, D, BV), lambda t, b, h, iv: (b, h, t // P // L, 0, iv)),
            pl.BlockSpec((None, None, None, D), lambda t, b, h, iv: (b, h, t // P // L, 0)),
        ]
        args += list(base)
        if forget is not None:
            in_specs.append(pl.BlockSpec((None, None, L), lambda t, b, h, iv: (b, h, t // P // L)))
            args.append(forget[2])
    return pl.pallas_call(
        partial(
            _kernel,
            c=c,
            bt=bt,
            L=L,
            eps=eps,
            has_base=base is not None,
            forget=forget is not None,
            normalise=normalise,
            prefix=prefix,
        ),  # fmt: skip
        grid=(T // bt, B, H, D // BV),
        in_specs=in_specs,
        out_specs=[
            pl.BlockSpec((None, bt, None, BV), lambda t, b, h, iv: (b, t, h, iv)),
            pl.BlockSpec((None, None, bt), lambda t, b, h, iv: (b, h, t)),
        ],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, D), v.dtype if normalise else F32),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        compiler_params=plan_lib.compiler_params("fwd_o", D, blocks),
        interpret=kernels.interpret(),
        name="lt_chunked_fwd_o",
    )(*args)
