"""The MLP's bias + exact GELU in one pass each way (Pallas, Triton).

- ``bias_gelu_fwd``: g = gelu(z + b), one read of z, one write of g.
- ``bias_gelu_bwd``: from z and dg, dz = dg gelu'(z + b) (over dg's buffer) and g again (the
  projection's weight gradient reads it: g is recomputed here rather than kept from the
  forward), and the bias gradient; one read of z and dg, one write of dz and g.

Both: grid ``(F / bf, P)``, program (j, p) owns the columns ``[j bf, (j + 1) bf)`` and walks the
row tiles p, p + P, ... of ``[bt, bf]``; u = z + b is rebuilt in z's dtype (the forward's
rounding), GELU and its derivative in float32. The backward adds each tile's column sums of dz
to a float32 accumulator, written once as the program's partial sums ``[P, F]`` (XLA adds the P
rows): the bias gradient costs no pass of its own and no layout change. Columns past F are
masked (bf is a power of two: Triton's block shapes).

erfc, which Triton lacks, is Numerical Recipes' Chebyshev fit (``erfcc``: fractional error below
1.2e-7 everywhere), in float32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from linear_gpt2 import kernels
from linear_gpt2.kernels import launch
from linear_gpt2.kernels.bias_gelu.naive import INV_SQRT_2PI, SQRT_HALF

F32 = jnp.float32
MAX_COLUMNS = 1024

_ERFCC = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807, -1.13520398,
          1.48851587, -0.82215223, 0.17087277)  # fmt: skip


def erfc(x: jax.Array) -> jax.Array:
    """erfc(x) in float32 from exp and arithmetic (Numerical Recipes' ``erfcc``)."""
    a = jnp.abs(x)
    t = 1.0 / (1.0 + 0.5 * a)
    poly = _ERFCC[-1]
    for c in reversed(_ERFCC[:-1]):
        poly = c + t * poly
    r = t * jnp.exp(-a * a + poly)
    return jnp.where(x >= 0, r, 2.0 - r)


def plan(N: int, F: int, run: launch.Launch) -> tuple[int, int, int, int]:
    """``(bt, bf, P, steps)``: rows per tile, columns per program (a power of two, masked past
    F), programs along the rows and the row tiles each walks, for the launch ``run``."""
    bf = min(MAX_COLUMNS, kernels.padded_head_dim(F))
    bt = max(1, min(run.tile // bf, kernels.next_power_of_2(N)))
    tiles = pl.cdiv(N, bt)
    P = run.programs(tiles)
    return bt, bf, P, pl.cdiv(tiles, P)


def _tiles(N, F, bt, bf, P):
    j, p = pl.program_id(0), pl.program_id(1)
    cols = pl.ds(j * bf, bf)
    cmask = j * bf + jnp.arange(bf) < F

    def at(k):
        t = p + k * P
        mask = (t * bt + jnp.arange(bt) < N)[:, None] & cmask[None, :]
        return pl.ds(t * bt, bt), mask

    return p, cols, cmask, at


def _u(z_ref, b, rows, cols, mask):
    z = plgpu.load(z_ref.at[rows, cols], mask=mask, other=0)
    return (z + b[None, :]).astype(F32)  # the forward's u, rounded to z's dtype


def _fwd_kernel(z_ref, b_ref, g_ref, *, N, F, bt, bf, P, steps):
    _, cols, cmask, at = _tiles(N, F, bt, bf, P)
    b = plgpu.load(b_ref.at[cols], mask=cmask, other=0).astype(z_ref.dtype)

    @pl.loop(0, steps)
    def _(k):
        rows, mask = at(k)
        u = _u(z_ref, b, rows, cols, mask)
        plgpu.store(g_ref.at[rows, cols], (0.5 * u * erfc(-u * SQRT_HALF)).astype(g_ref.dtype),
                    mask=mask)  # fmt: skip


def _bwd_kernel(z_ref, dg_ref, b_ref, dz_ref, g_ref, db_ref, *, N, F, bt, bf, P, steps):
    p, cols, cmask, at = _tiles(N, F, bt, bf, P)
    b = plgpu.load(b_ref.at[cols], mask=cmask, other=0).astype(z_ref.dtype)

    def tile(k, acc):
        rows, mask = at(k)
        u = _u(z_ref, b, rows, cols, mask)
        phi = erfc(-u * SQRT_HALF)
        d = 0.5 * phi + u * jnp.exp(-0.5 * u * u) * INV_SQRT_2PI
        dg = plgpu.load(dg_ref.at[rows, cols], mask=mask, other=0).astype(F32)
        dz = (dg * d).astype(dz_ref.dtype)
        plgpu.store(dz_ref.at[rows, cols], dz, mask=mask)
        plgpu.store(g_ref.at[rows, cols], (0.5 * u * phi).astype(g_ref.dtype), mask=mask)
        return acc + jnp.sum(jnp.where(mask, dz.astype(F32), 0.0), axis=0)

    acc = jax.lax.fori_loop(0, steps, tile, jnp.zeros((bf,), F32))
    plgpu.store(db_ref.at[p, cols], acc, mask=cmask)


def _call(kernel, name, N, F, out_shape, *args, aliases=None):
    run = launch.of(name)
    bt, bf, P, steps = plan(N, F, run)
    return pl.pallas_call(
        partial(kernel, N=N, F=F, bt=bt, bf=bf, P=P, steps=steps),
        grid=(pl.cdiv(F, bf), P),
        out_shape=out_shape,
        input_output_aliases=aliases or {},
        compiler_params=plgpu.CompilerParams(num_warps=run.warps, num_stages=run.stages),
        interpret=kernels.interpret(),
        name=name,
    )(*args)


def bias_gelu_fwd(z: jax.Array, b: jax.Array) -> jax.Array:
    """g ``[N, F]`` in z's dtype: z ``[N, F]``, b ``[F]``."""
    N, F = z.shape
    return _call(_fwd_kernel, "bias_gelu_fwd", N, F, jax.ShapeDtypeStruct((N, F), z.dtype), z, b)


def bias_gelu_bwd(z: jax.Array, b: jax.Array, dg: jax.Array):
    """``(dz, g, db)``: z, dg ``[N, F]``, b ``[F]``; dz and g ``[N, F]`` in z's dtype, db float32
    ``[F]``."""
    N, F = z.shape
    P = plan(N, F, launch.of("bias_gelu_bwd"))[2]
    shapes = [jax.ShapeDtypeStruct((N, F), z.dtype)] * 2 + [jax.ShapeDtypeStruct((P, F), F32)]
    # dz is written over dg (each tile reads its dg before writing its dz): one [N, F] buffer
    # less at the backward's peak.
    dz, g, partial_db = _call(
        _bwd_kernel, "bias_gelu_bwd", N, F, shapes, z, dg.astype(z.dtype), b, aliases={1: 0}
    )
    return dz, g, partial_db.sum(axis=0)
