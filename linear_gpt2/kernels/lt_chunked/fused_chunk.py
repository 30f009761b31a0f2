"""The single-pass kernels (``pallas_fused_chunk``): one program walks all chunks of a head.

Forward, ``lt_chunked_fused_fwd``, grid ``(B, H, NV)``: a program per (batch, head, value
block) walks the T/c chunks in order, carrying in float32 S ``[D, bv]`` (from the initial state,
or zero) and z ``[D]``; per chunk it computes the outputs of its P row tiles exactly as the
output kernel does (``fwd_o.output_tile``: phi(Q) S plus the chunk's causal scores) and then
adds the chunk to the state (S = scale_n S + phi(K_n)^T V_n, z += phi(K_n)^T 1). Writes Y,
den ``[B, H, T]`` (value block 0) and, when asked, the final state; no per-chunk state goes to
HBM.

Backward, kernels of grid ``(B, H, D/bd)`` (one kernel with both loops held both states and
spilled on the H100; bd as in ``bwd_dqkv``):

- ``lt_chunked_fused_bwd_dq`` walks the chunks forward, recomputing the rows S[block, :],
  z[block] of the state from the initial state, and writes dphi(Q) of every tile
  (``bwd_dqkv.dq_tile``);
- ``lt_chunked_fused_bwd_dkv`` walks them in reverse carrying the cotangent of the state after
  the chunk (from the final state's cotangent, or zero): dS[block, :] and dz[block] for dphi(K),
  dS[:, block] for dV; it writes dphi(K), dV (``bwd_dqkv.dkv_tile``), then the initial state's
  cotangent. Where carrying both slices would spill (``plan.Blocks.grad_kernels``), dphi(K) and
  dV are two such kernels (``_dk``, ``_dv``), each carrying one slice.

r = 1 / (den + eps) and delta = r (dY . y) come precomputed (XLA), as for the chunk-parallel
backward. With an elementwise feature map the dq and dk kernels apply phi' as ``bwd_dqkv``
does (``tiles.through_phi``); the dq kernel then also reads its block's columns of phi(Q). The same tile functions as the chunk-parallel kernels, so the two designs differ only
in where the state lives (registers here, HBM there) and how many programs share the work:
B H (x NV) here, which the cost model (``cost``) weighs against the extra traffic of the other.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_chunked import plan as plan_lib
from linear_gpt2.kernels.lt_chunked import tiles
from linear_gpt2.kernels.lt_chunked.bwd_dqkv import dkv_tile, dq_tile
from linear_gpt2.kernels.lt_chunked.fwd_h import add_tile
from linear_gpt2.kernels.lt_chunked.fwd_o import output_tile

F32 = jnp.float32


blocks = plan_lib.fused_blocks


# --------------------------------------------------------------------------------------------
# Forward


def _fwd_kernel(*refs, c: int, bt: int, N: int, eps: float, has_init: bool, has_final: bool):
    """fq, fk ``[T, D]``, v ``[T, bv]`` (S0 ``[D, bv]``, z0 ``[D]``); y ``[T, bv]``, den ``[T]``
    (Sf ``[D, bv]``, zf ``[D]``)."""
    refs = list(refs)
    fq_ref, fk_ref, v_ref = refs[:3]
    refs = refs[3:]
    if has_init:
        S0_ref, z0_ref = refs[:2]
        refs = refs[2:]
    y_ref, den_ref = refs[:2]
    first_block = pl.program_id(2) == 0
    D, BV = fk_ref.shape[-1], v_ref.shape[-1]
    P = c // bt

    def chunk(n, carry):
        S, z = carry
        start = n * c

        def out_tile(p, _):
            rows = pl.ds(start + p * bt, bt)
            y, den = output_tile(fq_ref[rows, :], S, z, fk_ref, v_ref, start, p, bt=bt, eps=eps)
            y_ref[rows, :] = y.astype(y_ref.dtype)

            @pl.when(first_block)
            def _():
                den_ref[rows] = den

            return 0

        tiles.loop(0, P, out_tile, 0)
        scale = tiles.chunk_scale(n)
        return tiles.loop(0, P, partial(add_tile, fk_ref, v_ref, start, bt), (S * scale, z * scale))

    if has_init:
        init = (S0_ref[...], z0_ref[...])
    else:
        init = (jnp.zeros((D, BV), F32), jnp.zeros((D,), F32))
    S, z = lax.fori_loop(0, N, chunk, init)
    if has_final:
        Sf_ref, zf_ref = refs[2:4]
        Sf_ref[...] = S

        @pl.when(first_block)
        def _():
            zf_ref[...] = z


def fused_fwd(fq, fk, v, state, blocks: plan_lib.Blocks, eps: float, return_state: bool):
    """``(y [B, T, H, D], den [B, H, T] float32, final state or None)``."""
    B, T, H, D = fq.shape
    c, bt, BV = blocks.c, blocks.bt, blocks.bv
    seq = pl.BlockSpec((None, T, None, D), lambda b, h, iv: (b, 0, h, 0))
    seq_v = pl.BlockSpec((None, T, None, BV), lambda b, h, iv: (b, 0, h, iv))
    S_spec = pl.BlockSpec((None, None, D, BV), lambda b, h, iv: (b, h, 0, iv))
    z_spec = pl.BlockSpec((None, None, D), lambda b, h, iv: (b, h, 0))
    in_specs, args = [seq, seq, seq_v], [fq, fk, v]
    if state is not None:
        in_specs += [S_spec, z_spec]
        args += list(state)
    out_specs = [seq_v, pl.BlockSpec((None, None, T), lambda b, h, iv: (b, h, 0))]
    out_shape = [jax.ShapeDtypeStruct((B, T, H, D), v.dtype), jax.ShapeDtypeStruct((B, H, T), F32)]
    if return_state:
        out_specs += [S_spec, z_spec]
        out_shape += [
            jax.ShapeDtypeStruct((B, H, D, D), F32),
            jax.ShapeDtypeStruct((B, H, D), F32),
        ]
    outs = pl.pallas_call(
        partial(
            _fwd_kernel,
            c=c,
            bt=bt,
            N=T // c,
            eps=eps,
            has_init=state is not None,
            has_final=return_state,
        ),  # fmt: skip
        grid=(B, H, D // BV),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plan_lib.compiler_params("fused_fwd", D, blocks),
        interpret=kernels.interpret(),
        name="lt_chunked_fused_fwd",
    )(*args)
    y, den = outs[:2]
    return y, den, (tuple(outs[2:]) if return_state else None)


# --------------------------------------------------------------------------------------------
# Backward: programs per (batch, head, column block bd of the gradients)


def _dq_kernel(*refs, c: int, bt: int, bd: int, N: int, has_init: bool, slope=None):
    """fk, v, dy ``[T, D]``, r, delta ``[T]`` (S0 ``[bd, D]``, z0 ``[bd]``: this block's rows),
    (with ``slope``: fq ``[T, bd]``, this block's columns); dq ``[T, bd]``. Carries S[block, :]
    ``[bd, D]`` and z[block]."""
    refs = list(refs)
    fk_ref, v_ref, dy_ref, r_ref, delta_ref = refs[:5]
    refs = refs[5:]
    if has_init:
        S0_ref, z0_ref = refs[:2]
        refs = refs[2:]
    if slope is not None:
        fq_ref, refs = refs[0], refs[1:]
    (dq_ref,) = refs
    D = fk_ref.shape[-1]
    P = c // bt
    block = None if bd == D else pl.ds(pl.program_id(2) * bd, bd)

    def chunk(n, carry):
        S_rows, z_blk = carry
        start = n * c

        def dq_rows(p, _):
            rows = pl.ds(start + p * bt, bt)
            g = tiles.cotangent_rows(dy_ref[rows, :], r_ref[rows])
            dq = dq_tile(
                fk_ref, v_ref, g, delta_ref[rows], S_rows, z_blk, start, p, bt=bt, block=block
            )
            if slope is not None:  # fq_ref holds this block's columns only
                dq = tiles.through_phi(dq, fq_ref, rows, None, slope)
            dq_ref[rows, :] = dq.astype(dq_ref.dtype)
            return 0

        tiles.loop(0, P, dq_rows, 0)

        def add(p, carry):  # S[block, :] += phi(K)[:, block]^T V
            S_rows, z_blk = carry
            rows = pl.ds(start + p * bt, bt)
            k = tiles.cols(fk_ref, rows, block)
            return S_rows + tiles.dot(k.T, v_ref[rows, :]), z_blk + jnp.sum(k.astype(F32), 0)

        scale = tiles.chunk_scale(n)
        return tiles.loop(0, P, add, (S_rows * scale, z_blk * scale))

    if has_init:
        init = (S0_ref[...], z0_ref[...])
    else:
        init = (jnp.zeros((bd, D), F32), jnp.zeros((bd,), F32))
    lax.fori_loop(0, N, chunk, init)


def _dkv_kernel(*refs, c, bt, bd, N, parts, has_final_ct: bool, has_init: bool, slope=None):
    """fq, fk, v, dy ``[T, D]``, r, delta ``[T]`` (dSf ``[D, D]``, dzf ``[D]``); one ``[T, bd]``
    output per part (and dS0 ``[bd, D]``, dz0 ``[bd]`` when dphi(K) is a part). Carries the
    cotangent of the state after the chunk, as far as the parts read it: dS[block, :] ``[bd, D]``
    and dz[block] for dphi(K), dS[:, block] ``[D, bd]`` for dV (one array when bd = D)."""
    refs = list(refs)
    fq_ref, fk_ref, v_ref, dy_ref, r_ref, delta_ref = refs[:6]
    refs = refs[6:]
    if has_final_ct:
        dSf_ref, dzf_ref = refs[:2]
        refs = refs[2:]
    outs = dict(zip(parts, refs))
    D = fk_ref.shape[-1]
    P = c // bt
    want_dk, want_dv = "dk" in parts, "dv" in parts
    block = None if bd == D else pl.ds(pl.program_id(2) * bd, bd)
    rows_of = slice(None) if block is None else block
    shared = want_dk and want_dv and block is None  # dS[block, :] is dS[:, block]: carry one
    # carry layout: (dS rows, dz) for dk, then (dS cols) for dv unless shared

    def unpack(carry):
        dS = {}
        if want_dk:
            dS["rows"], dS["dz"] = carry[0], carry[1]
        if want_dv:
            dS["cols"] = dS["rows"] if shared else carry[-1]
        return dS

    def chunk(i, carry):
        n = N - 1 - i
        start = n * c

        def grad_rows(p, _):
            rows = pl.ds(start + p * bt, bt)
            k = fk_ref[rows, :] if want_dv else None
            v = v_ref[rows, :] if want_dk else None
            res = dkv_tile(
                fq_ref, dy_ref, r_ref, delta_ref, k, v, lambda: unpack(carry), start, p, P,
                bt=bt, parts=parts, block=block,
            )  # fmt: skip
            for name, x in zip(parts, res):
                if name == "dk":
                    x = tiles.through_phi(x, fk_ref, rows, block, slope)
                outs[name][rows, :] = x.astype(outs[name].dtype)
            return 0

        tiles.loop(0, P, grad_rows, 0)

        def add(p, carry):  # dS += phi(Q)^T g, dz -= phi(Q)^T delta, the slices carried
            rows = pl.ds(start + p * bt, bt)
            r = r_ref[rows]
            out = []
            if want_dk:
                q = tiles.cols(fq_ref, rows, block)
                g = tiles.cotangent_rows(dy_ref[rows, :], r).astype(q.dtype)
                dz = carry[1] - jnp.sum(q.astype(F32) * delta_ref[rows][:, None], axis=0)
                out += [carry[0] + tiles.dot(q.T, g), dz]
            if want_dv and not shared:
                q = fq_ref[rows, :]
                g = tiles.cotangent_rows(tiles.cols(dy_ref, rows, block), r).astype(q.dtype)
                out.append(carry[-1] + tiles.dot(q.T, g))
            return tuple(out)

        scale = tiles.chunk_scale(n)
        return tiles.loop(0, P, add, tuple(x * scale for x in carry))

    init = []
    if want_dk:
        if has_final_ct:
            init += [dSf_ref[rows_of, :], dzf_ref[rows_of]]
        else:
            init += [jnp.zeros((bd, D), F32), jnp.zeros((bd,), F32)]
    if want_dv and not shared:
        init.append(dSf_ref[:, rows_of] if has_final_ct else jnp.zeros((D, bd), F32))
    out = lax.fori_loop(0, N, chunk, tuple(init))
    if has_init:  # the initial state's cotangent: row block of dS and dz
        dS0_ref, dz0_ref = refs[len(parts) : len(parts) + 2]
        dS0_ref[...] = out[0]
        dz0_ref[...] = out[1]


def fused_bwd(fq, fk, v, dy, r, delta, state, final_ct, blocks: plan_lib.Blocks, slope=None):
    """``(dphi(Q), dphi(K), dV, initial-state cotangent or None)``: the dq kernel, then the
    reverse kernels of ``blocks.grad_kernels`` (the one with dphi(K) also gives the initial
    state's cotangent). With ``slope`` (``tiles.through_phi``) dQ, dK of the raw q, k; the dq
    kernel then also reads phi(Q)'s columns of its block."""
    B, T, H, D = fq.shape
    c, bt, bd = blocks.c, blocks.bt, blocks.bd
    N = T // c
    seq = pl.BlockSpec((None, T, None, D), lambda b, h, d: (b, 0, h, 0))
    seq_cols = pl.BlockSpec((None, T, None, bd), lambda b, h, d: (b, 0, h, d))
    rows = pl.BlockSpec((None, None, T), lambda b, h, d: (b, h, 0))
    S_full = pl.BlockSpec((None, None, D, D), lambda b, h, d: (b, h, 0, 0))
    z_full = pl.BlockSpec((None, None, D), lambda b, h, d: (b, h, 0))
    S_rows = pl.BlockSpec((None, None, bd, D), lambda b, h, d: (b, h, d, 0))
    z_rows = pl.BlockSpec((None, None, bd), lambda b, h, d: (b, h, d))
    common = dict(interpret=kernels.interpret(), grid=(B, H, D // bd))

    in_specs, args = [seq, seq, seq, rows, rows], [fk, v, dy, r, delta]
    if state is not None:
        in_specs += [S_rows, z_rows]
        args += list(state)
    if slope is not None:
        in_specs.append(seq_cols)
        args.append(fq)
    grads = {
        "dq": pl.pallas_call(
            partial(_dq_kernel, c=c, bt=bt, bd=bd, N=N, has_init=state is not None, slope=slope),
            in_specs=in_specs,
            out_specs=seq_cols,
            out_shape=jax.ShapeDtypeStruct(fq.shape, fq.dtype),
            compiler_params=plan_lib.compiler_params("fused_bwd_dq", D, blocks),
            name="lt_chunked_fused_bwd_dq",
            **common,
        )(*args)
    }

    in_specs, args = [seq, seq, seq, seq, rows, rows], [fq, fk, v, dy, r, delta]
    if final_ct is not None:
        in_specs += [S_full, z_full]
        args += list(final_ct)
    like = {"dk": fk, "dv": v}
    dstate = None
    for parts in blocks.grad_kernels:
        parts = tuple(x for x in parts if x != "dq")
        if not parts:
            continue
        with_init = state is not None and "dk" in parts
        out_specs = [seq_cols] * len(parts)
        out_shape = [jax.ShapeDtypeStruct(like[x].shape, like[x].dtype) for x in parts]
        if with_init:
            out_specs += [S_rows, z_rows]
            out_shape += [jax.ShapeDtypeStruct(x.shape, F32) for x in state]
        name = "fused_bwd_d" + "".join(x[1] for x in parts)
        outs = pl.pallas_call(
            partial(
                _dkv_kernel,
                c=c,
                bt=bt,
                bd=bd,
                N=N,
                parts=parts,
                has_final_ct=final_ct is not None,
                has_init=with_init,
                slope=slope,
            ),  # fmt: skip
            in_specs=in_specs,
            out_specs=out_specs,
            out_shape=out_shape,
            compiler_params=plan_lib.compiler_params(name, D, blocks),
            name="lt_chunked_" + name,
            **common,
        )(*args)
        grads.update(zip(parts, outs))
        if with_init:
            dstate = tuple(outs[len(parts) :])
    return grads["dq"], grads["dk"], grads["dv"], dstate
