"""``LT_attention_parallel``'s tiled kernels with FlashAttention 2's backward
(``kernel=pallas_tiled_dq``): the forward of ``tiled.py``, and two backward kernels without
atomics, one per key block for dphi(k) and dv, one per query block for dphi(q). What
``kernel=pallas`` runs wherever it picks the tiled design (``cost.choose``: measured faster than
the atomic backward, ``cost.MEASURED``).

Same function as ``tiled.py`` (the oracle: ``naive.blocked_linear_attention``, with forgetting
``naive.blocked_forget_attention``), and the same forward kernel; only the backward differs.
``tiled.py``'s backward forms each tile pair's score cotangents once and adds their product with
phi(K) into a float32 dphi(q) accumulator by atomic adds. Compiled for the H100 that design has
two costs the roofline of ``cost.py`` did not price: each add is an ``acq_rel`` atomic (a
GPU-wide memory barrier and an L1 invalidation around every one, in every loop step; Pallas's
``atomic_add`` takes no memory order, so a relaxed add is not available to it),
and the query tiles of 32 rows that the atomic kernel's registers allow put three of its five
dots on the older ``mma.sync`` path (warpgroup MMAs need 64 rows). Here every dot has a
64-row (or wider) side and nothing is atomic; the price is a sixth dot per tile pair (the score
cotangents are formed by both kernels).

With g = dY / (den + eps) (rounded to the input dtype for its dots) and delta = g . y computed
once in XLA (``tiled.row_cotangents``):

Key kernel ``lt_attention_parallel_tiled_dkv``, grid (H, B, T/bk), one program per key block j
(j = 0, the longest, first), streaming query tiles of tq rows from the diagonal on. The scores
are formed transposed, so that the key block's rows are every dot's M side:

    dK, dV = 0, 0                                      float32 [bk, D]
    for each query tile i from the diagonal on:
        S^T = mask(phi(K_j) phi(Q_i)^T),  dS^T = mask(V_j g_i^T - 1 delta_i^T)   [bk, tq]
        dV += S^T g_i;  dK += dS^T phi(Q_i)
    store dK, dV (and, with forgetting, phi(K_j) . dK per row)

Query kernel ``lt_attention_parallel_tiled_dq``, grid (H, B, T/bq), the forward's shape: one
program per query block n (the longest first), streaming key tiles of tk rows up to the
diagonal, two dots per step as the forward's:

    dQ = 0                                             float32 [bq, D]
    for each key tile m on the diagonal, then downwards:
        dS = mask(g_n V_m^T - delta_n 1^T)             [bq, tk]
        dQ += dS phi(K_m)
    store dQ (and, with forgetting, phi(Q_n) . dQ per row)

**Forgetting**: the pair weights W_ij = [j <= i, seg_i = seg_j] exp(L_i - L_j) of ``tiled.py``,
from block-local cumulative log-gates whose blocks are each kernel's streamed tile (tq for the
key kernel, tk for the query kernel, which reads them as the forward does); each kernel writes
its rows' phi . dphi in float32 before rounding, and dL_i = phi(Q_i) . dphi(Q_i) -
phi(K_i) . dphi(K_i) becomes the log-gates' gradient by a reverse cumulative sum
(``kernels.log_gate_cotangent``). dphi(q) is deterministic (no atomics).

Tiles (``plan.dq_candidates``): the forward's (bq, tk) for the query kernel (the same registers),
and for the key kernel resident blocks of two key tiles or one (128 or 64 rows at block size 64)
streaming query tiles of 32, the block size capping every tile; at D = 64 both backward kernels
fit two programs per SM, as the forward. Every tiling compiles for the H100 without spills at
D = 16 ... 128 with and without forgetting (tests/test_target.py compiles the largest).

Precision as the other kernels: every dot's operands in the input dtype (g and the score
cotangents rounded to it), every accumulation float32.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_attention_parallel import plan as plan_lib
from linear_gpt2.kernels.lt_attention_parallel import tiled

F32 = jnp.float32
DKV_NAME = "lt_attention_parallel_tiled_dkv"
DQ_NAME = "lt_attention_parallel_tiled_dq"
_dot, _causal, _unpack = tiled._dot, tiled._causal, tiled._unpack


# --------------------------------------------------------------------------------------------
# Key kernel: dphi(k), dv


def _dkv_kernel(*refs, bk: int, tq: int, n_tiles: int, forget: bool):
    """Key block j: fk / v refs ``[bk, D]``; fq, g ``[T, D]``, delta ``[T]``; with forgetting
    b, e, seg ``[T]`` (blocks of tq); dk, dv ``[bk, D]``; with forgetting phi(K) . dphi(K)
    ``[bk]``."""
    (fq_ref, fk_ref, v_ref, g_ref, delta_ref), gate, outs = _unpack(refs, 5, forget)
    j = pl.program_id(2)  # key block 0 meets the most query tiles: longest first
    k0 = j * bk
    fk, v = fk_ref[...], v_ref[...]
    dt = fk.dtype
    if forget:
        b_ref, _, s_ref = gate
        b_k, e_k, s_k, k_tile = tiled._key_block_gates(gate, k0, bk, tq)

    def query_tile(i, carry, diagonal: bool):
        dk, dv, R = carry
        rows = pl.ds(i * tq, tq)
        fq, g, delta = fq_ref[rows, :], g_ref[rows, :], delta_ref[rows]
        St = _dot(fk, fq.T)  # [bk, tq]: the key rows are the M side of every dot
        dSt = _dot(v, g.T) - delta[None, :]
        mask = _causal(i * tq, k0, tq, bk).T if diagonal else None
        if forget:
            same = s_k[:, None] == s_ref[rows][None, :]
            mask = same if mask is None else mask & same
            # keys of block i: -b_j; keys of earlier blocks: R_j + e_j (R: blocks strictly between)
            key = jnp.where(k_tile == i, -b_k, R + e_k) if diagonal else R + e_k
            w = jnp.exp(jnp.where(mask, key[:, None] + b_ref[rows][None, :], 0.0))
            St, dSt = St * w, dSt * w
            R = R + jnp.where(i > k_tile, b_ref[i * tq + tq - 1], 0.0)  # near to far
        if mask is not None:
            St, dSt = jnp.where(mask, St, 0.0), jnp.where(mask, dSt, 0.0)
        return dk + _dot(dSt.astype(dt), fq), dv + _dot(St.astype(dt), g), R

    dk, dv = tiled._walk_query_tiles(query_tile, j, bk, tq, n_tiles, fk.shape[-1])
    tiled._store_key_grads(outs, fk, dk, dv, forget)


# --------------------------------------------------------------------------------------------
# Query kernel: dphi(q)


def _dq_kernel(*refs, bq: int, tk: int, n_blocks: int, forget: bool):
    """Query block n: fq (read with forgetting only), g refs ``[bq, D]``, delta ``[bq]``; fk, v
    ``[T, D]``; with forgetting b, e, seg ``[T]`` (blocks of tk); dq ``[bq, D]``; with
    forgetting phi(Q) . dphi(Q) ``[bq]``."""
    (fq_ref, g_ref, delta_ref, fk_ref, v_ref), gate, outs = _unpack(refs, 5, forget)
    r = bq // tk
    n = n_blocks - 1 - pl.program_id(2)  # longest first
    q0 = n * bq
    g, delta = g_ref[...], delta_ref[...]
    rows_gates = tiled._query_block_gates(gate, q0, bq, tk) if forget else None

    def key_tile(m, carry, diagonal: bool):
        dq, R = carry
        keys = pl.ds(m * tk, tk)
        fk, v = fk_ref[keys, :], v_ref[keys, :]
        dS = _dot(g, v.T) - delta[:, None]  # [bq, tk]
        mask = _causal(q0, m * tk, bq, tk) if diagonal else None
        if forget:  # the forward's weights of the same pairs
            w, mask, R = tiled._key_tile_weights(gate, rows_gates, m, tk, R, mask, diagonal)
            dS = dS * w
        if mask is not None:
            dS = jnp.where(mask, dS, 0.0)
        return dq + _dot(dS.astype(fk.dtype), fk), R

    Dp = g.shape[-1]
    carry = (jnp.zeros((bq, Dp), F32), jnp.zeros((bq,), F32))
    dq, _ = tiled._walk_key_tiles(key_tile, n, r, carry)
    outs[0][...] = dq.astype(outs[0].dtype)
    if forget:
        outs[1][...] = jnp.sum(fq_ref[...].astype(F32) * dq, axis=1)


# --------------------------------------------------------------------------------------------
# The launches


def backward(fq, fk, v, y, dy, den, t: plan_lib.Tiles, eps: float, gates=None):
    """dphi(q), dphi(k), dv ``[B, T, H, D]`` in the input dtype; with forgetting also
    phi(q) . dphi(q) and phi(k) . dphi(k) float32 ``[B, H, T]``. T a multiple of t.pad, D padded;
    ``gates`` = ((b, e) in blocks of t.tk, (b, e) in blocks of t.tq, seg) with forgetting."""
    B, T, H, D = fq.shape
    forget = gates is not None
    g, delta = tiled.row_cotangents(dy, y, den, eps)
    seq = pl.BlockSpec((None, T, None, D), lambda h, b, p: (b, 0, h, 0))
    rows = pl.BlockSpec((None, None, T), lambda h, b, p: (b, h, 0))
    if forget:
        (bq_gate, eq_gate), (bk_gate, ek_gate), seg = gates

    nk = T // t.bk
    kblock = pl.BlockSpec((None, t.bk, None, D), lambda h, b, j: (b, j, h, 0))
    dkv_specs = [kblock, kblock]
    dkv_shape = [jax.ShapeDtypeStruct(fk.shape, fk.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    if forget:
        dkv_specs.append(pl.BlockSpec((None, None, t.bk), lambda h, b, j: (b, h, j)))
        dkv_shape.append(jax.ShapeDtypeStruct((B, H, T), F32))
    dkv = pl.pallas_call(
        partial(_dkv_kernel, bk=t.bk, tq=t.tq, n_tiles=T // t.tq, forget=forget),
        grid=(H, B, nk),
        in_specs=[seq, kblock, kblock, seq, rows, *(tiled._gate_specs(T) if forget else [])],
        out_specs=dkv_specs,
        out_shape=dkv_shape,
        compiler_params=plan_lib.compiler_params("dkv", D),
        interpret=kernels.interpret(),
        name=DKV_NAME,
    )(fq, fk, v, g, delta, *((bk_gate, ek_gate, seg) if forget else ()))

    nq = T // t.bq
    qblock = pl.BlockSpec((None, t.bq, None, D), lambda h, b, p: (b, nq - 1 - p, h, 0))
    qrows = pl.BlockSpec((None, None, t.bq), lambda h, b, p: (b, h, nq - 1 - p))
    dq_specs = [qblock]
    dq_shape = [jax.ShapeDtypeStruct(fq.shape, fq.dtype)]
    if forget:
        dq_specs.append(qrows)
        dq_shape.append(jax.ShapeDtypeStruct((B, H, T), F32))
    dq = pl.pallas_call(
        partial(_dq_kernel, bq=t.bq, tk=t.tk, n_blocks=nq, forget=forget),
        grid=(H, B, nq),
        in_specs=[qblock, qblock, qrows, seq, seq, *(tiled._gate_specs(T) if forget else [])],
        out_specs=dq_specs,
        out_shape=dq_shape,
        compiler_params=plan_lib.compiler_params("dq", D),
        interpret=kernels.interpret(),
        name=DQ_NAME,
    )(fq, g, delta, fk, v, *((bq_gate, eq_gate, seg) if forget else ()))
    if forget:
        return dq[0], dkv[0], dkv[1], dq[1], dkv[2]
    return dq[0], dkv[0], dkv[1]


def _gates(log_gate, seg, t: plan_lib.Tiles):
    """The forward's and query kernel's (b, e) in blocks of tk, the key kernel's in blocks of tq,
    and seg; None without forgetting."""
    if log_gate is None:
        return None
    fwd = tiled.block_gates(log_gate, t.tk)
    return fwd, fwd if t.tq == t.tk else tiled.block_gates(log_gate, t.tq), seg


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _core(fq, fk, v, log_gate, seg, t: plan_lib.Tiles, eps: float):
    return _core_fwd(fq, fk, v, log_gate, seg, t, eps)[0]


def _core_fwd(fq, fk, v, log_gate, seg, t, eps):
    gates = _gates(log_gate, seg, t)
    y, den = tiled.forward(fq, fk, v, t, eps, None if gates is None else (*gates[0], seg))
    return y, (fq, fk, v, log_gate, seg, y, den)


def _core_bwd(t, eps, residuals, dy):
    fq, fk, v, log_gate, seg, y, den = residuals
    gates = _gates(log_gate, seg, t)
    out = backward(fq, fk, v, y, dy.astype(y.dtype), den, t, eps, gates)
    dq, dk, dv = out[:3]
    if gates is None:
        return dq, dk, dv, None, None
    # dL_i = phi(q_i) . dphi(q_i) - phi(k_i) . dphi(k_i), both float32 before rounding
    dL = jnp.swapaxes(out[3] - out[4], 1, 2)
    dseg = np.zeros(seg.shape, dtype=jax.dtypes.float0)
    return dq, dk, dv, kernels.log_gate_cotangent(dL), dseg


_core.defvjp(_core_fwd, _core_bwd)

WHAT = "LT_attention_parallel kernel=pallas_tiled_dq"


def attention(fq, fk, v, c: int, eps: float, tiles: plan_lib.Tiles | None = None) -> jax.Array:
    """Normalised causal linear attention, tiled, with the two-kernel backward; differentiable.

    fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``, any T (padded to the resident blocks), any
    D <= 128 (padded to a power of two >= 16); c, the block size, a power of two >= 16 (it caps
    the tiles). ``tiles``: default ``plan.dq_largest``. Returns y ``[B, T, H, D]`` in fq's
    dtype. The interface of ``lt_attention_parallel.IMPLEMENTATIONS``."""
    B, T, H, D = v.shape
    plan_lib.check(c, D, WHAT)
    t = tiles or plan_lib.dq_largest(c, kernels.padded_head_dim(D))
    fq_p, fk_p, v_p, _ = tiled._prepare(fq, fk, v, t)
    return _core(fq_p, fk_p, v_p, None, None, t, float(eps))[:, :T, :, :D]


def forget_attention(
    fq, fk, v, log_gate, seg, c: int, eps: float, tiles: plan_lib.Tiles | None = None
) -> jax.Array:
    """:func:`attention` with document resets and decay (the interface of
    ``naive.blocked_forget_attention``): log_gate float32 ``[B, T, H]`` (<= 0), seg int32
    ``[B, T]``; differentiable in fq, fk, v and log_gate."""
    B, T, H, D = v.shape
    plan_lib.check(c, D, WHAT)
    t = tiles or plan_lib.dq_largest(c, kernels.padded_head_dim(D))
    fq_p, fk_p, v_p, pad_t = tiled._prepare(fq, fk, v, t)
    # Padded positions: gamma = 1 and the last document id; they follow every real position.
    log_gate = jnp.pad(log_gate.astype(F32), ((0, 0), (0, pad_t), (0, 0)))
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad_t)), mode="edge")
    return _core(fq_p, fk_p, v_p, log_gate, seg, t, float(eps))[:, :T, :, :D]
