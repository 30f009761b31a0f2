"""Cross-entropy and its gradient over a block of float32 logits in one kernel (Pallas, Triton).

Grid: row tiles of ``bt`` rows. Each program walks the vocabulary in tiles of ``bv`` columns
twice: first an online log-sum-exp (running max and rescaled sum, as flash attention's softmax)
and the target's logit, giving nll; then exp(logits - lse) minus the one-hot, divided by the
count, written over the logits (the output aliases the input: no second ``[M, V]`` buffer).
HBM: the logits read twice (the second read may hit L2), the gradient written once, where XLA's
fusions read them three times (max, sum of exponentials, the gradient) and wrote the gradient,
two of those reads in reduction kernels. Columns past V are masked (bv is a power of two).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from linear_gpt2 import kernels
from linear_gpt2.kernels import launch
from linear_gpt2.kernels.cross_entropy.naive import IGNORE_INDEX

F32 = jnp.float32
NEG = -1e30  # masked logits: exp(NEG - m) == 0, and no inf - inf
MAX_COLUMNS = 2048


def plan(M: int, V: int, tile: int) -> tuple[int, int]:
    """``(bt, bv)``: rows per program and vocabulary columns per tile of ``tile`` floats (powers
    of two)."""
    bv = min(MAX_COLUMNS, kernels.padded_head_dim(V))
    bt = max(1, min(tile // bv, kernels.next_power_of_2(M)))
    return bt, bv


def _kernel(logits_ref, t_ref, count_ref, dl_ref, nll_ref, *, M: int, V: int, bt: int, bv: int):
    i = pl.program_id(0)
    rows = pl.ds(i * bt, bt)
    rmask = i * bt + jnp.arange(bt) < M
    t = plgpu.load(t_ref.at[rows], mask=rmask, other=IGNORE_INDEX)
    valid = t != IGNORE_INDEX
    tiles = pl.cdiv(V, bv)

    def at(j):
        c = j * bv + jnp.arange(bv)
        return pl.ds(j * bv, bv), c, rmask[:, None] & (c < V)[None, :]

    def stats(j, carry):
        m, s, picked = carry
        cols, c, mask = at(j)
        x = plgpu.load(logits_ref.at[rows, cols], mask=mask, other=NEG)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        hit = c[None, :] == t[:, None]
        return m_new, s, picked + jnp.sum(jnp.where(hit, x, 0.0), axis=1)

    init = (jnp.full((bt,), NEG, F32), jnp.zeros((bt,), F32), jnp.zeros((bt,), F32))
    m, s, picked = jax.lax.fori_loop(0, tiles, stats, init)
    lse = m + jnp.log(s)
    plgpu.store(nll_ref.at[rows], jnp.where(valid, lse - picked, 0.0), mask=rmask)
    count = count_ref[0]

    @pl.loop(0, tiles)
    def _(j):
        cols, c, mask = at(j)
        x = plgpu.load(logits_ref.at[rows, cols], mask=mask, other=NEG)
        p = jnp.exp(x - lse[:, None])
        onehot = (c[None, :] == t[:, None]).astype(F32)
        dl = jnp.where(valid[:, None], (p - onehot) / count, 0.0)
        plgpu.store(dl_ref.at[rows, cols], dl, mask=mask)


def cross_entropy(logits: jax.Array, targets: jax.Array, count: jax.Array):
    """``(nll [M], dlogits [M, V])`` float32 (:func:`..naive.nll_and_grad`): logits ``[M, V]``
    float32 (its buffer is reused for dlogits), targets int32 ``[M]``, count float32 scalar."""
    M, V = logits.shape
    run = launch.of("cross_entropy")
    bt, bv = plan(M, V, run.tile)
    dl, nll = pl.pallas_call(
        partial(_kernel, M=M, V=V, bt=bt, bv=bv),
        grid=(pl.cdiv(M, bt),),
        out_shape=[jax.ShapeDtypeStruct((M, V), F32), jax.ShapeDtypeStruct((M,), F32)],
        input_output_aliases={0: 0},
        compiler_params=plgpu.CompilerParams(num_warps=run.warps, num_stages=run.stages),
        interpret=kernels.interpret(),
        name="cross_entropy",
    )(logits.astype(F32), targets.astype(jnp.int32), jnp.reshape(count, (1,)).astype(F32))
    return nll, dl
