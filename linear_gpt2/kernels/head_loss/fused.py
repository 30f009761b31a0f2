"""The tied head and the cross-entropy fused: the ``[N, V]`` logits are never written (Pallas,
Triton on GPU, interpret mode elsewhere). The formulas are :mod:`.naive`'s.

- ``head_loss_fwd``: grid over token tiles of ``bt`` rows; each program walks the vocabulary in
  tiles of ``bv`` columns, forms the ``[bt, bv]`` float32 logits tile by a loop over C in steps
  of ``bk`` (h and w tiles in the compute dtype, float32 accumulation), and keeps an online
  log-sum-exp (running max and rescaled sum, as flash attention's softmax) and the target's
  logit. It writes the partial lse and target logit ``[S, N]`` (float32; S > 1 splits the
  vocabulary over programs when there are too few token tiles to fill the GPU), combined outside
  into nll and lse ``[N]``.
- ``head_loss_bwd``: one program per ``[bt, bv]`` block of the logits (a 1-D grid, swizzled in
  groups of :data:`GROUP` token tiles so that the programs running at once share h and w tiles
  in L2 and spread their atomics): the block's logits recomputed as in the forward, its
  gradient ``dnll (softmax - onehot)`` from the saved lse, rounded to the compute dtype, then a
  loop over C in steps of ``bk`` adding the block's ``[bt, bk]`` share of dh and ``[bv, bk]``
  share of dw into float32 buffers with atomic adds.

Why one backward pass with atomics and not two deterministic kernels (one over token tiles
accumulating dh over the vocabulary, one over vocabulary tiles accumulating dw over tokens):
Pallas' Triton lowering has no shared-memory scratch, so such a kernel's accumulator, a
``[rows, C]`` float32 tile, lives in registers; at C = 768 .. 1600 (2048 as a Triton block) that
leaves at most 16 rows per program before ptxas spills, too few for the tensor cores' tiles, and
splitting C over programs recomputes the logits once per slice of C. The two-kernel form would
also compute the logits three times in all (forward, dh, dw) where this computes them twice
(8 N V C FLOPs in all, against 6 N V C for the head as built). The price: dh and dw are float32
sums in whatever order the atomics land (not bit-reproducible run to run, within float32
rounding), and ``(bt + bv) C`` float32 atomic adds per block. Columns past V and rows past N
are masked on load; the gradient buffers are padded to whole tiles (zero-initialised, sliced
after), so no atomic needs a mask (interpret mode has none).

Precision: float32 inputs are multiplied at full float32 precision (``HIGHEST``: IEEE, not TF32,
on the GPU); other dtypes as they are, accumulated in float32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from linear_gpt2 import kernels
from linear_gpt2.kernels.head_loss.naive import IGNORE_INDEX
from linear_gpt2.platform.cards import H100

F32 = jnp.float32
NEG = -1e30  # masked logits: exp(NEG - m) == 0, and no inf - inf
# Tiles (H100: no register spills at C = 768 and 1600, tests/test_kernels_head_loss.py).
BT, BV, BK = 128, 128, 64
GROUP = 16
# The forward splits the vocabulary over programs below this many (two per H100 SM).
MIN_PROGRAMS = 2 * H100.sms
WARPS = 8
STAGES = 3


def plan(N: int, V: int, C: int, tiles: tuple[int, int, int] | None = None):
    """``(bt, bv, bk, Cp)``: token rows and vocabulary columns per block, the step over C (powers
    of two, >= 16 for Triton's dots) and C padded to a multiple of bk. ``tiles`` overrides
    (bt, bv, bk) (the tests' several tiles at small shapes)."""
    if tiles is None:
        p2 = kernels.padded_head_dim  # next power of two, at least 16
        tiles = (min(BT, p2(N)), min(BV, p2(V)), min(BK, p2(C)))
    bt, bv, bk = tiles
    for name, n in (("bt", bt), ("bv", bv), ("bk", bk)):
        kernels.check_block_size(n, f"head_loss {name}")
    return bt, bv, bk, pl.cdiv(C, bk) * bk


def _precision(dtype):
    return jax.lax.Precision.HIGHEST if jnp.dtype(dtype) == F32 else None


def _logits(h_ref, w_ref, rows, rmask, j, *, V, bt, bv, bk, kt):
    """float32 ``[bt, bv]`` logits of the rows against vocabulary tile j (columns past V:
    NEG), and the tile's column indices."""
    c = j * bv + jnp.arange(bv)
    cols, cmask = pl.ds(j * bv, bv), c < V
    prec = _precision(h_ref.dtype)

    def step(k, acc):
        ks = pl.ds(k * bk, bk)
        hk = plgpu.load(h_ref.at[rows, ks], mask=jnp.broadcast_to(rmask[:, None], (bt, bk)),
                        other=0)  # fmt: skip
        wk = plgpu.load(w_ref.at[cols, ks], mask=jnp.broadcast_to(cmask[:, None], (bv, bk)),
                        other=0)  # fmt: skip
        return acc + jax.lax.dot_general(hk, wk, (((1,), (1,)), ((), ())), precision=prec,
                                         preferred_element_type=F32)  # fmt: skip

    acc = jax.lax.fori_loop(0, kt, step, jnp.zeros((bt, bv), F32))
    return jnp.where(cmask[None, :], acc, NEG), c


def _rows(i, N, bt):
    return pl.ds(i * bt, bt), i * bt + jnp.arange(bt) < N


def _fwd_kernel(h_ref, w_ref, t_ref, lse_ref, picked_ref, *, N, V, bt, bv, bk, kt, per):
    rows, rmask = _rows(pl.program_id(0), N, bt)
    s_id = pl.program_id(1)
    t = plgpu.load(t_ref.at[rows], mask=rmask, other=IGNORE_INDEX)

    def tile(j, carry):
        m, s, picked = carry
        x, c = _logits(h_ref, w_ref, rows, rmask, j, V=V, bt=bt, bv=bv, bk=bk, kt=kt)
        m_new = jnp.maximum(m, jnp.max(x, axis=1))
        s = s * jnp.exp(m - m_new) + jnp.sum(jnp.exp(x - m_new[:, None]), axis=1)
        hit = c[None, :] == t[:, None]
        return m_new, s, picked + jnp.sum(jnp.where(hit, x, 0.0), axis=1)

    init = (jnp.full((bt,), NEG, F32), jnp.zeros((bt,), F32), jnp.zeros((bt,), F32))
    first = s_id * per
    last = jnp.minimum(first + per, pl.cdiv(V, bv))
    m, s, picked = jax.lax.fori_loop(first, last, tile, init)
    # A slice past the vocabulary (s > 0 only) has s = 0: lse = -inf, nothing in the sum.
    plgpu.store(lse_ref.at[s_id, rows], m + jnp.log(s), mask=rmask)
    plgpu.store(picked_ref.at[s_id, rows], picked, mask=rmask)


def _swizzle(pid, nt, vt):
    """Block (token tile, vocabulary tile) of program ``pid``: GROUP token tiles at a time, the
    vocabulary walked within the group (Triton's grouped matmul ordering)."""
    width = GROUP * vt
    first = (pid // width) * GROUP
    size = jnp.minimum(nt - first, GROUP)
    return first + (pid % width) % size, (pid % width) // size


def _bwd_kernel(h_ref, w_ref, t_ref, lse_ref, dn_ref, _dh0, _dw0, dh_ref, dw_ref, *, N, V, bt,
                bv, bk, kt, nt, vt):  # fmt: skip
    i, j = _swizzle(pl.program_id(0), nt, vt)
    rows, rmask = _rows(i, N, bt)
    t = plgpu.load(t_ref.at[rows], mask=rmask, other=IGNORE_INDEX)
    lse = plgpu.load(lse_ref.at[rows], mask=rmask, other=0.0)
    dn = plgpu.load(dn_ref.at[rows], mask=rmask, other=0.0)
    x, c = _logits(h_ref, w_ref, rows, rmask, j, V=V, bt=bt, bv=bv, bk=bk, kt=kt)
    p = jnp.exp(x - lse[:, None])
    onehot = (c[None, :] == t[:, None]).astype(F32)
    dl = jnp.where((t != IGNORE_INDEX)[:, None], dn[:, None] * (p - onehot), 0.0)
    dl = dl.astype(h_ref.dtype)  # naive.backward's rounding: the dots at the dtype's rate
    cols, cmask = pl.ds(j * bv, bv), c < V
    prec = _precision(h_ref.dtype)

    @pl.loop(0, kt)
    def _(k):
        ks = pl.ds(k * bk, bk)
        wk = plgpu.load(w_ref.at[cols, ks], mask=jnp.broadcast_to(cmask[:, None], (bv, bk)),
                        other=0)  # fmt: skip
        hk = plgpu.load(h_ref.at[rows, ks], mask=jnp.broadcast_to(rmask[:, None], (bt, bk)),
                        other=0)  # fmt: skip
        dh = jnp.dot(dl, wk, precision=prec, preferred_element_type=F32)  # [bt, bk]
        dw = jax.lax.dot_general(dl, hk, (((0,), (0,)), ((), ())), precision=prec,
                                 preferred_element_type=F32)  # [bv, bk]  # fmt: skip
        plgpu.atomic_add(dh_ref, (pl.ds(i * bt, bt), ks), dh)
        plgpu.atomic_add(dw_ref, (cols, ks), dw)


def _pad_c(a: jax.Array, Cp: int) -> jax.Array:
    C = a.shape[1]
    return a if C == Cp else jnp.pad(a, ((0, 0), (0, Cp - C)))


def vocab_split(N: int, V: int, bt: int, bv: int) -> tuple[int, int]:
    """``(S, per)``: the forward's programs per token tile along the vocabulary and the
    vocabulary tiles each walks; S > 1 only when the token tiles alone would leave SMs idle
    (at 1k tokens, 8 tiles of 128 rows for 132 SMs): each walks a slice of the vocabulary, and
    their partial log-sum-exps are combined outside (``[S, N]`` floats, flash-decoding's
    split)."""
    nt, vt = pl.cdiv(N, bt), pl.cdiv(V, bv)
    S = max(1, min(vt, pl.cdiv(MIN_PROGRAMS, nt)))
    per = pl.cdiv(vt, S)
    return pl.cdiv(vt, per), per


def head_loss_fwd(h: jax.Array, w: jax.Array, targets: jax.Array, tiles=None):
    """``(nll [N], lse [N])`` float32 (:func:`..naive.nll_and_lse`): h ``[N, C]`` and w
    ``[V, C]`` in one dtype, targets int ``[N]`` (-1 ignored)."""
    N, C = h.shape
    V = w.shape[0]
    bt, bv, bk, Cp = plan(N, V, C, tiles)
    S, per = vocab_split(N, V, bt, bv)
    targets = targets.astype(jnp.int32)
    lse_s, picked_s = pl.pallas_call(
        partial(_fwd_kernel, N=N, V=V, bt=bt, bv=bv, bk=bk, kt=Cp // bk, per=per),
        grid=(pl.cdiv(N, bt), S),
        out_shape=[jax.ShapeDtypeStruct((S, N), F32)] * 2,
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        interpret=kernels.interpret(),
        name="head_loss_fwd",
    )(_pad_c(h, Cp), _pad_c(w, Cp), targets)
    lse = jax.nn.logsumexp(lse_s, axis=0) if S > 1 else lse_s[0]
    return jnp.where(targets != IGNORE_INDEX, lse - picked_s.sum(axis=0), 0.0), lse


def head_loss_bwd(h, w, targets, lse, dnll, tiles=None):
    """``(dh [N, C], dw [V, C])`` float32 (:func:`..naive.backward`) from the forward's lse and
    the per-row cotangent dnll ``[N]``."""
    N, C = h.shape
    V = w.shape[0]
    bt, bv, bk, Cp = plan(N, V, C, tiles)
    nt, vt = pl.cdiv(N, bt), pl.cdiv(V, bv)
    shapes = [jax.ShapeDtypeStruct((nt * bt, Cp), F32), jax.ShapeDtypeStruct((vt * bv, Cp), F32)]
    dh, dw = pl.pallas_call(
        partial(_bwd_kernel, N=N, V=V, bt=bt, bv=bv, bk=bk, kt=Cp // bk, nt=nt, vt=vt),
        grid=(nt * vt,),
        out_shape=shapes,
        # The atomics add into zeroed buffers passed in and aliased to the outputs.
        input_output_aliases={5: 0, 6: 1},
        compiler_params=plgpu.CompilerParams(num_warps=WARPS, num_stages=STAGES),
        interpret=kernels.interpret(),
        name="head_loss_bwd",
    )(_pad_c(h, Cp), _pad_c(w, Cp), targets.astype(jnp.int32), lse.astype(F32),
      dnll.astype(F32), jnp.zeros(shapes[0].shape, F32), jnp.zeros(shapes[1].shape, F32))  # fmt: skip
    return dh[:N, :C], dw[:V, :C]
