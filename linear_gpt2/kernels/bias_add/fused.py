"""The backward of a bias add in one pass (Pallas, Triton): ``bias_add_bwd``.

k cotangents ``[N, C]`` (dq, dk, dv of the split into heads, k = 3; the residual stream's, k =
1) become the projection's cotangent dz ``[N, k C]`` in the compute dtype and the bias gradient.
Grid ``(k C / bc, P)``: program (j, p) owns the columns ``[j bc, (j + 1) bc)`` of dz (a block
of one cotangent: bc divides C) and walks the row tiles p, p + P, ... of ``[bt, bc]``: it copies
the block, cast, into dz and adds its column sums to a float32 accumulator, written once as the
program's partial sums ``[P, k C]`` (XLA adds the P rows). One read of the cotangents, one write
of dz, no reduction kernel: what XLA did as a concatenation (an input fusion) or a cast and a
reduction over tokens for the bias.
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
MAX_COLUMNS = 1024


def plan(N: int, C: int, run: launch.Launch) -> tuple[int, int, int, int]:
    """``(bt, bc, P, steps)``: rows per tile; columns per program, a power of two that divides
    C (at most 1024; C itself padded to a power of two, masked, when no power of two >= 16
    divides it); programs along the rows and the row tiles each walks."""
    bc = min(MAX_COLUMNS, C & -C)
    if bc < kernels.MIN_BLOCK:
        bc = kernels.padded_head_dim(C)
    bt = max(1, min(run.tile // bc, kernels.next_power_of_2(N)))
    tiles = pl.cdiv(N, bt)
    P = run.programs(tiles)
    return bt, bc, P, pl.cdiv(tiles, P)


def _kernel(*refs, N, C, bt, bc, P, steps):
    *srcs, dz_ref, db_ref = refs
    j, p = pl.program_id(0), pl.program_id(1)
    per = pl.cdiv(C, bc)  # column blocks per head gradient
    src, block = j // per, j % per
    c = block * bc + jnp.arange(bc)
    cmask = c < C
    src_cols, dst_cols = pl.ds(block * bc, bc), pl.ds(src * C + block * bc, bc)

    def copy(ref):
        def tile(k, acc):
            t = p + k * P
            rows = pl.ds(t * bt, bt)
            mask = (t * bt + jnp.arange(bt) < N)[:, None] & cmask[None, :]
            x = plgpu.load(ref.at[rows, src_cols], mask=mask, other=0).astype(dz_ref.dtype)
            plgpu.store(dz_ref.at[rows, dst_cols], x, mask=mask)
            return acc + jnp.sum(x.astype(F32), axis=0)

        acc = jax.lax.fori_loop(0, steps, tile, jnp.zeros((bc,), F32))
        plgpu.store(db_ref.at[p, dst_cols], acc, mask=cmask)

    if len(srcs) == 1:
        copy(srcs[0])
    for i, ref in enumerate(srcs if len(srcs) > 1 else ()):
        pl.when(src == i)(partial(copy, ref))


def bias_add_bwd(cotangents, dtype):
    """``(dz [N, k C] in dtype, db [k C] float32)``: k cotangents ``[N, C]``."""
    k = len(cotangents)
    N, C = cotangents[0].shape
    run = launch.of("bias_add_bwd")
    bt, bc, P, steps = plan(N, C, run)
    dz, partial_db = pl.pallas_call(
        partial(_kernel, N=N, C=C, bt=bt, bc=bc, P=P, steps=steps),
        grid=(k * pl.cdiv(C, bc), P),
        out_shape=[
            jax.ShapeDtypeStruct((N, k * C), jnp.dtype(dtype)),
            jax.ShapeDtypeStruct((P, k * C), F32),
        ],  # fmt: skip
        compiler_params=plgpu.CompilerParams(num_warps=run.warps, num_stages=run.stages),
        interpret=kernels.interpret(),
        name="bias_add_bwd",
    )(*cotangents)
    return dz, partial_db.sum(axis=0)
