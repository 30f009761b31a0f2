"""LayerNorm fused with the residual add: one pass forward, one pass backward (Pallas, Triton).

Rows ``[N, C]`` (tokens x channels). Each program loads a tile of ``bt`` whole rows, ``[bt, Cp]``
with Cp = C rounded up to a power of two (Triton's block shapes), the columns past C masked: no
padded copy of the data is made, the masked lanes read and write nothing.

- ``layernorm_fwd`` (grid: row tiles): s = x + h (written, in its dtype, when h is given), the
  row's mean and two-pass variance in float32 from registers, y in the output dtype, and mean,
  rstd ``[N]`` float32 (the backward's statistics). One read of x and h, one write of s and y.
- ``layernorm_bwd`` (grid: P programs, each walking row tiles p, p + P, ...): recomputes xhat
  from s and the statistics, writes dx = ds + LayerNorm's backward (float32, the residual
  stream's cotangent) and dh (h's dtype: the same values, for the branch), and accumulates the
  scale and bias gradients of its rows in registers, written once as ``[P, Cp]`` partial sums
  (XLA sums the P rows: no [N, C] product is ever written for them). One read of s, dy, ds.

The arithmetic is :mod:`.naive`'s, in the same order (float32 statistics; eps 1e-5 by default).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from linear_gpt2 import kernels
from linear_gpt2.kernels import launch

F32 = jnp.float32


def plan(N: int, C: int, tile: int) -> tuple[int, int]:
    """``(bt, Cp)``: rows per tile of ``tile`` floats and the padded row length (a power of two
    >= 16). The launches (``kernels.launch``): one program per tile forward; the backward's
    programs each accumulate their rows' scale and bias gradients, a few per SM."""
    Cp = kernels.padded_head_dim(C)
    bt = max(1, min(tile // Cp, kernels.next_power_of_2(N)))
    return bt, Cp


def _tile(i, bt: int, N: int, C: int, Cp: int):
    """The row and column slices of tile i and its mask (rows < N, columns < C)."""
    r = i * bt + jnp.arange(bt)
    c = jnp.arange(Cp)
    cmask = c < C
    return pl.ds(i * bt, bt), pl.ds(0, Cp), r < N, cmask, (r < N)[:, None] & cmask[None, :]


def _load(ref, rows, cols, mask):
    return plgpu.load(ref.at[rows, cols], mask=mask, other=0).astype(F32)


def _fwd_kernel(*refs, N: int, C: int, Cp: int, bt: int, eps: float, has_h: bool, has_bias: bool):
    refs = list(refs)
    x_ref = refs.pop(0)
    h_ref = refs.pop(0) if has_h else None
    scale_ref = refs.pop(0)
    bias_ref = refs.pop(0) if has_bias else None
    s_ref = refs.pop(0) if has_h else None
    y_ref, mean_ref, rstd_ref = refs
    rows, cols, rmask, cmask, mask = _tile(pl.program_id(0), bt, N, C, Cp)
    s = plgpu.load(x_ref.at[rows, cols], mask=mask, other=0)
    if has_h:
        # x + h in the residual's dtype (s's), as jnp's promotion does.
        h = plgpu.load(h_ref.at[rows, cols], mask=mask, other=0)
        s = s.astype(s_ref.dtype) + h.astype(s_ref.dtype)
        plgpu.store(s_ref.at[rows, cols], s, mask=mask)
    s = s.astype(F32)
    mean = jnp.sum(s, axis=1) / C
    d = jnp.where(cmask[None, :], s - mean[:, None], 0.0)
    var = jnp.sum(d * d, axis=1) / C
    rstd = jax.lax.rsqrt(var + eps)
    scale = plgpu.load(scale_ref.at[cols], mask=cmask, other=0).astype(F32)
    y = d * (rstd[:, None] * scale[None, :])
    if has_bias:
        y = y + plgpu.load(bias_ref.at[cols], mask=cmask, other=0).astype(F32)[None, :]
    plgpu.store(y_ref.at[rows, cols], y.astype(y_ref.dtype), mask=mask)
    plgpu.store(mean_ref.at[rows], mean, mask=rmask)
    plgpu.store(rstd_ref.at[rows], rstd, mask=rmask)


def layernorm_fwd(x, h, scale, bias, eps: float, out_dtype):
    """``(s, y, mean, rstd)``: x, h ``[N, C]`` (h or None), scale, bias ``[C]`` (bias or None);
    s ``[N, C]`` in the promoted dtype of x and h (None when h is None), y ``[N, C]`` in
    ``out_dtype``, mean and rstd ``[N]`` float32."""
    N, C = x.shape
    run = launch.of("layernorm_fwd")
    bt, Cp = plan(N, C, run.tile)
    has_h, has_bias = h is not None, bias is not None
    s_dtype = x.dtype if h is None else jnp.result_type(x.dtype, h.dtype)
    args = [x] + ([h] if has_h else []) + [scale] + ([bias] if has_bias else [])
    out_shape = ([jax.ShapeDtypeStruct((N, C), s_dtype)] if has_h else []) + [
        jax.ShapeDtypeStruct((N, C), jnp.dtype(out_dtype)),
        jax.ShapeDtypeStruct((N,), F32),
        jax.ShapeDtypeStruct((N,), F32),
    ]
    out = pl.pallas_call(
        partial(_fwd_kernel, N=N, C=C, Cp=Cp, bt=bt, eps=eps, has_h=has_h, has_bias=has_bias),
        grid=(pl.cdiv(N, bt),),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=run.warps, num_stages=run.stages),
        interpret=kernels.interpret(),
        name="layernorm_fwd",
    )(*args)
    if not has_h:
        out = [None, *out]
    return tuple(out)


def _bwd_kernel(*refs, N: int, C: int, bt: int, P: int, steps: int, has_ds: bool, has_dh: bool):
    refs = list(refs)
    s_ref, dy_ref = refs.pop(0), refs.pop(0)
    ds_ref = refs.pop(0) if has_ds else None
    mean_ref, rstd_ref, scale_ref, dx_ref = refs.pop(0), refs.pop(0), refs.pop(0), refs.pop(0)
    dh_ref = refs.pop(0) if has_dh else None
    dscale_ref, dbias_ref = refs
    Cp = dscale_ref.shape[1]
    p = pl.program_id(0)
    cols = pl.ds(0, Cp)
    cmask = jnp.arange(Cp) < C
    scale = plgpu.load(scale_ref.at[cols], mask=cmask, other=0).astype(F32)

    def tile(k, acc):
        dscale, dbias = acc
        rows, _, rmask, _, mask = _tile(p + k * P, bt, N, C, Cp)
        mean = plgpu.load(mean_ref.at[rows], mask=rmask, other=0)
        rstd = plgpu.load(rstd_ref.at[rows], mask=rmask, other=0)
        xhat = jnp.where(
            mask, (_load(s_ref, rows, cols, mask) - mean[:, None]) * rstd[:, None], 0.0
        )
        dy = _load(dy_ref, rows, cols, mask)
        g = dy * scale[None, :]
        c1 = jnp.sum(g * xhat, axis=1) / C
        c2 = jnp.sum(g, axis=1) / C
        dx = (g - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
        if has_ds:
            dx = dx + _load(ds_ref, rows, cols, mask)
        plgpu.store(dx_ref.at[rows, cols], dx.astype(dx_ref.dtype), mask=mask)
        if has_dh:
            plgpu.store(dh_ref.at[rows, cols], dx.astype(dh_ref.dtype), mask=mask)
        return dscale + jnp.sum(dy * xhat, axis=0), dbias + jnp.sum(dy, axis=0)

    zeros = jnp.zeros((Cp,), F32)
    dscale, dbias = jax.lax.fori_loop(0, steps, tile, (zeros, zeros))
    dscale_ref[p, :] = dscale
    dbias_ref[p, :] = dbias


def layernorm_bwd(s, mean, rstd, scale, dy, ds, dx_dtype, h_dtype):
    """``(dx, dh, dscale, dbias)``: s ``[N, C]``, mean, rstd ``[N]``, scale ``[C]``, dy ``[N,
    C]``, ds ``[N, C]`` or None; dx ``[N, C]`` in ``dx_dtype`` (x's); dh in ``h_dtype`` (None for
    none);
    dscale, dbias float32 ``[C]`` (the programs' partial sums added by XLA)."""
    N, C = s.shape
    run = launch.of("layernorm_bwd")
    bt, Cp = plan(N, C, run.tile)
    tiles = pl.cdiv(N, bt)
    P = run.programs(tiles)
    steps = pl.cdiv(tiles, P)
    has_ds, has_dh = ds is not None, h_dtype is not None
    args = [s, dy] + ([ds] if has_ds else []) + [mean, rstd, scale]
    out_shape = (
        [jax.ShapeDtypeStruct((N, C), jnp.dtype(dx_dtype))]
        + ([jax.ShapeDtypeStruct((N, C), jnp.dtype(h_dtype))] if has_dh else [])
        + [jax.ShapeDtypeStruct((P, Cp), F32)] * 2
    )
    # dx is written over ds when they share a dtype (each tile reads its ds before writing its
    # dx): one [N, C] buffer less at the backward's peak.
    alias = {2: 0} if has_ds and jnp.dtype(ds.dtype) == jnp.dtype(dx_dtype) else {}
    out = pl.pallas_call(
        partial(_bwd_kernel, N=N, C=C, bt=bt, P=P, steps=steps, has_ds=has_ds, has_dh=has_dh),
        grid=(P,),
        out_shape=out_shape,
        input_output_aliases=alias,
        compiler_params=plgpu.CompilerParams(num_warps=run.warps, num_stages=run.stages),
        interpret=kernels.interpret(),
        name="layernorm_bwd",
    )(*args)
    dx, rest = out[0], list(out[1:])
    dh = rest.pop(0) if has_dh else None
    dscale, dbias = (a.sum(axis=0)[:C] for a in rest)
    return dx, dh, dscale, dbias
