"""Gradient kernels, backward: dphi(Q), dphi(K), dV of every tile in parallel
(``lt_chunked_bwd_dqkv``, or ``_dq`` + ``_dkv`` where one kernel would spill).

Grid ``(N P, B, H, D/bd)``: one program per (row tile, batch, head, column block of the
gradients), fully parallel (nothing carried across chunks). Tile t lies in chunk n = t // P at
position p = t % P. With the state entering
the chunk S, z (``fwd_h`` + segment base), the cotangent of the state after it dS, dz
(``bwd_dh`` + segment dbase), g = dY r and delta = g . y (r = 1 / (den + eps)):

    as a query tile:  dphi(Q)_t = sum_{j <= p} dA_tj phi(K)_j + g_t S^T - delta_t z^T
    as a key tile:    dphi(K)_t = sum_{i >= p} dA_it^T phi(Q)_i + V_t dS^T + 1 dz^T
                      dV_t      = sum_{i >= p} A_it^T g_i      + phi(K)_t dS

over the tiles i, j of chunk n, with A = ``tiles.scores`` and dA = ``tiles.score_cotangents``
(the one place of the mask). The ``- delta z^T`` and ``1 dz^T`` terms and the ``- delta`` in
dA are the normaliser's: dz is the cotangent of the key sum z, which every later query's
denominator reads.

Reads phi(Q), phi(K), V, dY (the tiles of its chunk it needs), r, delta, and the chunk's
h, z, dh, dz (plus segment bases when present); writes dphi(Q), dphi(K), dV ``[B, T, H, D]``
in the input dtype, columns bd of D (``plan.Blocks.bd``: all of D up to 64; at D = 128 two
programs per tile, each recomputing the [bt, bt] scores A and dA, which contract over all of D,
and loading only its rows / columns of the [D, D] states: the price of staying under 255
registers). Each state is loaded where it is used, not live across the other phase.

With forgetting the kernels also read the chunk's b, s and the segment bases' per-chunk factors
(``decay``, ``rdecay`` ``[B, H, N]``), weight A and dA by the pair weights, the state's part of
dphi(Q) by ``tiles.into`` and that of dphi(K), dV by ``tiles.out``, and (with log-gates) write per
row, float32 ``[B, H, D/bd, T]``: gb = phi(q).dphi(q) - phi(k).dphi(k) over the block's columns
(before rounding) and, from the dphi(K) kernel, od = out_j phi(k_j) . (v_j dS^T + dz), the
terms from which ``__init__.log_gate_cotangent`` forms d b. With forgetting the gradients run as
three kernels (dq, dk, dv) at every D: with the pair weights live, two spill.

With an elementwise feature map (``ops``, ``feature_map``) the kernels write the gradients of the
raw q, k: each dphi tile times phi' = ``slope(phi)`` of the phi(Q), phi(K) tile it belongs to
(``tiles.through_phi``, after the log-gate sums, which take dphi), so that no XLA pass follows.

Which gradients one kernel computes is ``plan.Blocks.grad_kernels``: all three in one kernel
where that compiles without spills (D <= 64: the fewest bytes, since every input is read once),
``dq`` and ``dk, dv`` in two kernels where it would not (D = 128; each re-reads the chunk's
inputs). A kernel computing only dphi(K) skips the scores A, one computing only dV skips dA.
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


def dq_tile(fk_ref, v_ref, g, delta, S_rows, z_blk, start, p, *, bt: int, block=None, gate=None):
    """dphi(Q) ``[bt, bd]`` float32 (columns ``block`` of D, all when None) of query tile p of
    the chunk starting at row ``start``; g, delta its row cotangents, S_rows ``[bd, D]`` and
    z_blk ``[bd]`` the block's rows of the state entering the chunk. With forgetting ``gate`` =
    (b_ref, s_ref): the pair weights in dA, the state's part weighted by ``tiles.into``."""
    gq = None if gate is None else tiles.gate_rows(*gate, pl.ds(start + p * bt, bt))

    def key_tile(j, dq):
        rows = pl.ds(start + j * bt, bt)
        gk = None if gate is None else tiles.gate_rows(*gate, rows)
        dA = tiles.score_cotangents(g, v_ref[rows, :], delta, p, j, bt, gq, gk)
        k = tiles.cols(fk_ref, rows, block)
        return dq + tiles.dot(dA.astype(k.dtype), k)

    width = S_rows.shape[0]
    dq = tiles.loop(0, p + 1, key_tile, jnp.zeros((bt, width), F32))
    through_state = tiles.dot(g, S_rows.T) - delta[:, None] * z_blk[None, :]
    if gq is not None:
        through_state = through_state * tiles.into(gq)[:, None]
    return dq + through_state


def dkv_tile(
    fq_ref, dy_ref, r_ref, delta_ref, k, v, load_dS, start, p, P, *, bt, parts, block, gate=None
):
    """dphi(K) and/or dV (``parts``) ``[bt, bd]`` float32 (columns ``block`` of D, all when
    None) of key tile p of the chunk starting at row ``start``; k, v: the tile's rows (all of
    D; only what a part reads is given). ``load_dS()`` gives the cotangent of the state after the
    chunk, ``{"rows": dS[block, :] [bd, D], "dz": dz[block] [bd]}`` for dphi(K) and
    ``{"cols": dS[:, block] [D, bd]}`` for dV; it is called after the loop over query tiles so
    that the state is not live during it. With forgetting ``gate`` = (b_ref, s_ref, b_last,
    s_last): the pair weights in A and dA, the state's part weighted by ``tiles.out``; then a
    third result (with dphi(K)): the rows' ``out_j * d out_j`` over the block's columns,
    ``out_j phi(k_j)[block] . (v_j dS[block, :]^T + dz[block])``, for the log-gate gradient."""
    want_dk, want_dv = "dk" in parts, "dv" in parts
    gk = None if gate is None else tiles.gate_rows(*gate[:2], pl.ds(start + p * bt, bt))

    def query_tile(i, carry):
        rows = pl.ds(start + i * bt, bt)
        q, r = fq_ref[rows, :], r_ref[rows]
        gq = None if gate is None else tiles.gate_rows(*gate[:2], rows)
        dt = q.dtype
        out = []
        if want_dk:  # dA^T phi(Q)[:, block]
            g = tiles.cotangent_rows(dy_ref[rows, :], r)
            dA = tiles.score_cotangents(g, v, delta_ref[rows], i, p, bt, gq, gk)
            q_blk = q if block is None else fq_ref[rows, block]
            out.append(carry[len(out)] + tiles.dot(dA.astype(dt).T, q_blk))
        if want_dv:  # A^T g[:, block]
            A = tiles.scores(q, k, i, p, bt, gq, gk)
            g_blk = tiles.cotangent_rows(tiles.cols(dy_ref, rows, block), r)
            out.append(carry[len(out)] + tiles.dot(A.astype(dt).T, g_blk.astype(dt)))
        return tuple(out)

    width = fq_ref.shape[-1] if block is None else block.size
    acc = tiles.loop(p, P, query_tile, tuple(jnp.zeros((bt, width), F32) for _ in parts))
    dS = load_dS()
    w = None if gate is None else tiles.out(gk, gate[2], gate[3])[:, None]
    out = []
    od = None
    if want_dk:
        dk_state = tiles.dot(v.astype(F32), dS["rows"].T) + dS["dz"][None, :]
        if w is not None:
            dk_state = dk_state * w
            od = jnp.sum(dS["k_blk"].astype(F32) * dk_state, axis=1)
        out.append(acc[0] + dk_state)
    if want_dv:
        dv_state = tiles.dot(k.astype(F32), dS["cols"])
        out.append(acc[-1] + (dv_state if w is None else dv_state * w))
    return tuple(out) + (() if od is None else (od,))


def _kernel(
    *refs, c: int, bt: int, bd: int, L: int, parts, has_base: bool, has_dbase: bool,
    forget: bool, gated: bool, slope=None, prefix: bool = False,
):  # fmt: skip
    """fq, fk, v, dy ``[c, D]`` (the chunk), r, delta ``[c]``, h, dh ``[D, D]``, z, dz ``[D]``
    (with ``prefix``: every chunk's totals, ``[N, D, D]``, ``[N, D]``, summed over the chunks
    before / after this one),
    (b, s ``[c]``), (base, zbase, (decay ``[L]``)), (dbase, dzbase, (rdecay ``[L]``)); one
    ``[bt, bd]`` output per part, then with ``gated`` ``gb [bt]`` (phi(q).dphi(q) -
    phi(k).dphi(k) over the block's columns) and, with dphi(K), ``od [bt]``."""
    refs = list(refs)
    fq_ref, fk_ref, v_ref, dy_ref, r_ref, delta_ref, h_ref, z_ref, dh_ref, dz_ref = refs[:10]
    rest = refs[10:]
    gate = base_refs = dbase_refs = None
    if forget:
        gate, rest = tuple(rest[:2]), rest[2:]
    nb = 3 if forget else 2
    if has_base:
        base_refs, rest = rest[:nb], rest[nb:]
    if has_dbase:
        dbase_refs, rest = rest[:nb], rest[nb:]
    outs = dict(zip(parts, rest))
    rest = rest[len(parts) :]
    D = fq_ref.shape[-1]
    P = c // bt
    p = 0 if P == 1 else pl.program_id(0) % P
    own = pl.ds(p * bt, bt)
    block = None if bd == D else pl.ds(pl.program_id(3) * bd, bd)
    rows_of = slice(None) if block is None else block
    n = pl.program_id(0) // P
    at = n % L  # the chunk's index within its segment
    width = D if block is None else bd

    def state(S_ref, z_ref, extra, cut, window):
        if prefix:  # the totals of the chunks in ``window``: before (S) / after (dS) chunk n
            shape = (width, D) if cut[0] is rows_of else (D, width)
            return tiles.chunk_sum(S_ref, z_ref, *window, cut, rows_of, shape, width)
        S, z = S_ref[cut], z_ref[rows_of]
        if extra is not None:
            a = extra[2][at] if forget else 1.0
            S, z = S + a * extra[0][cut], z + a * extra[1][rows_of]
        return S, z

    gb = None
    if "dq" in parts:  # as a query tile
        g = tiles.cotangent_rows(dy_ref[own, :], r_ref[own])
        S_rows, z_blk = state(h_ref, z_ref, base_refs, (rows_of, slice(None)), (0, n))
        dq = dq_tile(
            fk_ref, v_ref, g, delta_ref[own], S_rows, z_blk, 0, p, bt=bt, block=block, gate=gate
        )
        if gated:
            gb = jnp.sum(tiles.cols(fq_ref, own, block).astype(F32) * dq, axis=1)
        dq = tiles.through_phi(dq, fq_ref, own, block, slope)
        outs["dq"][...] = dq.astype(outs["dq"].dtype)

    kv_parts = tuple(x for x in parts if x != "dq")
    if kv_parts:  # as a key tile
        after = (n + 1, dh_ref.shape[0]) if prefix else None

        def load_dS():
            out = {}
            if "dk" in kv_parts:
                out["rows"], out["dz"] = state(
                    dh_ref, dz_ref, dbase_refs, (rows_of, slice(None)), after
                )
                if forget:
                    out["k_blk"] = tiles.cols(fk_ref, own, block)
            if "dv" in kv_parts:
                if block is None and "rows" in out:
                    out["cols"] = out["rows"]
                else:
                    cut = (slice(None), rows_of)
                    out["cols"] = state(dh_ref, dz_ref, dbase_refs, cut, after)[0]
            return out

        k = fk_ref[own, :] if "dv" in kv_parts else None
        v = v_ref[own, :] if "dk" in kv_parts else None
        kv_gate = None if gate is None else gate + tiles.last(*gate, c - 1)
        res = dkv_tile(
            fq_ref, dy_ref, r_ref, delta_ref, k, v, load_dS, 0, p, P,
            bt=bt, parts=kv_parts, block=block, gate=kv_gate,
        )  # fmt: skip
        if gated and "dk" in kv_parts:
            gk = jnp.sum(tiles.cols(fk_ref, own, block).astype(F32) * res[0], axis=1)
            gb = -gk if gb is None else gb - gk
            rest[-1][...] = res[-1]  # od
        grads = dict(zip(kv_parts, res))
        # dV written first: its registers are free while phi' of the key tile is computed (the
        # dk, dv kernel at D = 128, c = 128 spilled the other way round)
        if "dv" in grads:
            outs["dv"][...] = grads["dv"].astype(outs["dv"].dtype)
        if "dk" in grads:
            dk = tiles.through_phi(grads["dk"], fk_ref, own, block, slope)
            outs["dk"][...] = dk.astype(outs["dk"].dtype)
    if gated:
        rest[0][...] = gb if gb is not None else jnp.zeros((bt,), F32)


def kernel_name(parts) -> str:
    """``lt_chunked_bwd_dqkv``, ``_dq``, ``_dkv``, ``_dk``, ``_dv``: the gradients a kernel gives."""
    return "lt_chunked_bwd_d" + "".join(x[1] for x in parts)


def chunk_bwd_grads(
    fq, fk, v, dy, r, delta, h, z, dh, dz, base, dbase, blocks: plan_lib.Blocks, forget=None,
    slope=None, prefix: bool = False,
):  # fmt: skip
    """``(dphi(Q), dphi(K), dV)`` ``[B, T, H, D]`` in the input dtypes, by the kernels of
    ``blocks.grad_kernels`` (each a tuple of the gradients it computes). h, z / dh, dz: the
    segment-local states from ``fwd_h`` / ``bwd_dh``; base, dbase: ``(S [B, H, G, D, D],
    z [B, H, G, D])`` per segment or None (zero). With ``slope`` (an elementwise feature map's
    phi' as a function of phi, ``tiles.through_phi``): dQ, dK, the gradients of the raw q, k,
    instead of dphi(Q), dphi(K). With ``prefix`` (one chunk per segment, no bases, no
    forgetting: ``ops``, "own prefix") h, z / dh, dz are the chunks' totals of the two state
    passes, and each program sums those before / after its chunk itself.

    ``forget``: None, or ``(b, s, decay, rdecay, gated)``: b ``[B, T, H]`` float32 and s
    ``[B, T]`` int32 as in ``fwd_h``, decay / rdecay ``[B, H, N]`` the factors of the segment's
    base / dbase at each chunk, and ``gated``: also return, per row, ``gb`` = phi(q).dphi(q) -
    phi(k).dphi(k) and ``od`` = out_j d out_j (``[B, H, T]`` float32, summed over column
    blocks), from which the caller forms the log-gate gradient (``__init__``)."""
    B, T, H, D = fq.shape
    c, bt, bd, G = blocks.c, blocks.bt, blocks.bd, blocks.segments
    P, N = c // bt, T // c
    L = N // G
    nd = D // bd
    chunk = pl.BlockSpec((None, c, None, D), lambda t, b, h, d: (b, t // P, h, 0))
    rows = pl.BlockSpec((None, None, c), lambda t, b, h, d: (b, h, t // P))
    state = pl.BlockSpec((None, None, None, D, D), lambda t, b, h, d: (b, h, t // P, 0, 0))
    zvec = pl.BlockSpec((None, None, None, D), lambda t, b, h, d: (b, h, t // P, 0))
    seg_state = pl.BlockSpec((None, None, None, D, D), lambda t, b, h, d: (b, h, t // P // L, 0, 0))
    seg_zvec = pl.BlockSpec((None, None, None, D), lambda t, b, h, d: (b, h, t // P // L, 0))
    seg_decay = pl.BlockSpec((None, None, L), lambda t, b, h, d: (b, h, t // P // L))
    if prefix:  # every chunk's totals: the program sums those before / after its chunk
        assert base is None and dbase is None and forget is None and G == N, "one chunk a segment"
        state = pl.BlockSpec((None, None, N, D, D), lambda t, b, h, d: (b, h, 0, 0, 0))
        zvec = pl.BlockSpec((None, None, N, D), lambda t, b, h, d: (b, h, 0, 0))
    in_specs = [chunk, chunk, chunk, chunk, rows, rows, state, zvec, state, zvec]
    args = [fq, fk, v, dy, r, delta, h, z, dh, dz]
    gated = False
    if forget is not None:
        b, s, decay, rdecay, gated = forget
        in_specs += [
            pl.BlockSpec((None, c, None), lambda t, b, h, d: (b, t // P, h)),
            pl.BlockSpec((None, c), lambda t, b, h, d: (b, t // P)),
        ]
        args += [b, s]
    for extra, factor in ((base, "decay"), (dbase, "rdecay")):
        if extra is not None:
            in_specs += [seg_state, seg_zvec]
            args += list(extra)
            if forget is not None:
                in_specs.append(seg_decay)
                args.append(decay if factor == "decay" else rdecay)
    tile = pl.BlockSpec((None, bt, None, bd), lambda t, b, h, d: (b, t, h, d))
    row_out = pl.BlockSpec((None, None, None, bt), lambda t, b, h, d: (b, h, d, t))
    like = {"dq": fq, "dk": fk, "dv": v}
    grads = {}
    gb = od = None
    for parts in blocks.grad_kernels:
        extra_out = []
        if gated:
            extra_out = ["gb"] + (["od"] if "dk" in parts else [])
        outs = pl.pallas_call(
            partial(
                _kernel,
                c=c,
                bt=bt,
                bd=bd,
                L=L,
                parts=parts,
                has_base=base is not None,
                has_dbase=dbase is not None,
                forget=forget is not None,
                gated=gated,
                slope=slope,
                prefix=prefix,
            ),  # fmt: skip
            grid=(T // bt, B, H, nd),
            in_specs=in_specs,
            out_specs=[tile] * len(parts) + [row_out] * len(extra_out),
            out_shape=[jax.ShapeDtypeStruct(like[x].shape, like[x].dtype) for x in parts]
            + [jax.ShapeDtypeStruct((B, H, nd, T), F32)] * len(extra_out),
            compiler_params=plan_lib.compiler_params(kernel_name(parts)[11:], D, blocks),
            interpret=kernels.interpret(),
            name=kernel_name(parts),
        )(*args)
        grads.update(zip(parts, outs))
        for name, x in zip(extra_out, outs[len(parts) :]):
            x = x.sum(axis=2)
            if name == "gb":
                gb = x if gb is None else gb + x
            else:
                od = x
    if gated:
        return grads["dq"], grads["dk"], grads["dv"], gb, od
    return grads["dq"], grads["dk"], grads["dv"]
