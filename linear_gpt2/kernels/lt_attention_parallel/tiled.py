"""``LT_attention_parallel`` as tiled Pallas kernels (``kernel=pallas_tiled``; Triton-lowered on
GPU, interpret mode elsewhere): resident blocks, streamed tiles, programs longest first, one
backward kernel.

Same function as :func:`linear_gpt2.kernels.lt_attention_parallel.naive.blocked_linear_attention`
(the oracle; with forgetting ``blocked_forget_attention`` there), in the attention form: every
score phi(q_i) . phi(k_j) of the causal triangle is formed, in [bq, tk] or [tq, bk] register
tiles (never a T x T array), and summed with running sums; O(T^2 D) work, O(T D) memory. The
tiles (``plan.Tiles``): the forward keeps a query block of bq rows and streams key tiles of tk,
the backward keeps a key block of bk rows and streams query tiles of tq; at D = 64 and block
size 64, bq = bk = 128, tk = 64, tq = 32 (or resident blocks of one key tile where the cost
model prefers more programs: ``plan.candidates``, ``cost.choose``).

Forward ``lt_attention_parallel_tiled_fwd``, grid (H, B, T/bq), one program per query block n,
the blocks in decreasing order of work (program p takes block T/bq - 1 - p, and the grid's
block axis is its slowest: every head's longest block starts first, the short ones fill the
tail instead of the long ones trailing it):

    num, den = 0, 0                                  float32 [bq, D], [bq]
    for each key tile m on the diagonal (bq / tk of them), then m = n bq/tk - 1 ... 0:
        A = phi(Q_n) phi(K_m)^T  [bq, tk], causal-masked on the diagonal tiles only
        num += A V_m;  den += A 1
    Y_n = num / (den + eps); store Y_n and den

Each loaded key tile meets bq query rows, against the old kernel's 64 (32 at D = 128): half the
operand loads per FLOP or less, which is what bounds a flash-style loop (``cost.py``).

Backward ``lt_attention_parallel_tiled_bwd``, grid (H, B, T/bk), one program per key block j,
longest first (j = 0 first), with g = dY / (den + eps) (rounded to the input dtype for its dots)
and delta = g . y computed once in XLA (an elementwise fusion, as ``LT_chunked``'s r, delta):

    dK, dV = 0, 0                                    float32 [bk, D]
    for each query tile i from the diagonal on (i = j bk/tq, ..., T/tq - 1):
        A = mask(phi(Q_i) phi(K_j)^T),  dA = mask(g_i V_j^T - delta_i 1^T)     [tq, bk]
        dV += A^T g_i;  dK += dA^T phi(Q_i)
        dphi(Q)_i += dA phi(K_j)          atomically, into a float32 [T, D] accumulator
    store dK, dV

Five dots per tile pair instead of the old kernel's six: dA is formed once, and its product with
phi(K_j) goes straight to the query rows it belongs to by an atomic float32 add (as
FlashAttention 2's backward accumulates dQ), so no second loop recomputes it. The price: XLA
zeroes the accumulator and rounds it at the end, and float32 additions in the order the programs
reach a row are not bit-reproducible from run to run on a GPU (interpret mode runs the programs
in order).
Compiled for the H100 the adds are ``acq_rel`` atomics, a GPU-wide memory barrier and an L1
invalidation around each (Pallas's ``atomic_add`` takes no memory order: its Triton lowering
fixes acquire-release, jax 0.11.2), and the three dots with the 32-row query tile on
their M side take the ``mma.sync`` path, not the warpgroup MMA; ``tiled_dq.py``
(``kernel=pallas_tiled_dq``) is FlashAttention 2's backward without either, the one
``kernel=pallas`` runs with this forward since an H200 timed both (``cost.py``, ``cost.MEASURED``);
this one runs when named.

**Forgetting** (:func:`forget_attention`): the kernels also read the block-local cumulative
log-gates b (inclusive: the sum of log gamma from the block's first row to i) and e (exclusive
and reversed: from i + 1 to the block's last row), float32 ``[B, T, H]`` with blocks of the
kernel's streamed tile (tk forward, tq backward: each kernel gets its own, from the log-gates),
and the document ids seg int32 ``[B, T]``. Every tile's scores and score cotangents are
multiplied by the pair weights

    W_ij = [j <= i, seg_i = seg_j] exp(L_i - L_j),   L_i - L_j = b_i - b_j        (same block)
                                                             = b_i + R + e_j      (j's block earlier)

with R the totals of the blocks strictly between, a float32 vector over the resident rows that
the loop adds near to far as it walks away from the diagonal (the forward walks the key tiles
downwards, the backward the query tiles upwards). L, the row's cumulative log-gate, is never
formed: its float32 differences are lost once |L| is large (``blocked.py``). Every exponent is
<= 0 and masked before exp. The backward also writes phi(K_j) . dphi(K_j) per key row (float32,
before rounding); XLA adds phi(Q_i) . dphi(Q_i) from the float32 accumulator, and
dL_i = phi(Q_i) . dphi(Q_i) - phi(K_i) . dphi(K_i) becomes the log-gates' gradient by a reverse
cumulative sum (``kernels.log_gate_cotangent``).

Precision as the other kernels (``lt_chunked/tiles.py``): every dot's operands in the input dtype
(the cotangents g and dA rounded to it), every accumulation float32.

GPU constraints: tiles powers of two >= 16, D <= 128 padded to a power of two; T padded here to
a multiple of the resident blocks; the whole sequence of the streamed operands is one block
(program-local pointer arithmetic). Compiled for the H100 (deviceless) in tests/test_target.py,
spills an error.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_attention_parallel import plan as plan_lib

F32 = jnp.float32
FWD_NAME = "lt_attention_parallel_tiled_fwd"
BWD_NAME = "lt_attention_parallel_tiled_bwd"


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=F32)


def _causal(q0, k0, nq: int, nk: int) -> jax.Array:
    """``[nq, nk]`` bool: query row q0 + a sees key row k0 + b iff the key is not after it."""
    return (q0 + lax.broadcasted_iota(jnp.int32, (nq, nk), 0)) >= (
        k0 + lax.broadcasted_iota(jnp.int32, (nq, nk), 1)
    )


def _rows(start, n: int) -> jax.Array:
    """``[n]`` int32 positions start ... start + n - 1."""
    return start + lax.broadcasted_iota(jnp.int32, (n,), 0)


def _unpack(refs, n_in: int, forget: bool):
    """(inputs, (b, e, seg) or None, outputs)."""
    if not forget:
        return refs[:n_in], None, refs[n_in:]
    return refs[:n_in], refs[n_in : n_in + 3], refs[n_in + 3 :]


def _key_block_gates(gate, k0, bk: int, tq: int):
    """Key block k0's rows of b, e and seg ``[bk]`` and each key row's query tile (the blocks
    of tq its gates are summed in): what both backward key kernels weigh pairs with."""
    b_ref, e_ref, s_ref = gate
    keys = pl.ds(k0, bk)
    return b_ref[keys], e_ref[keys], s_ref[keys], _rows(k0, bk) // tq


def _walk_query_tiles(query_tile, j, bk: int, tq: int, n_tiles: int, Dp: int):
    """Key block j's float32 ``(dk, dv)`` ``[bk, Dp]``: ``query_tile(i, carry, diagonal)`` over
    the block's own (diagonal, masked) query tiles, then every later one (unmasked)."""
    r = bk // tq
    carry = (jnp.zeros((bk, Dp), F32), jnp.zeros((bk, Dp), F32), jnp.zeros((bk,), F32))
    first = j * r
    carry = lax.fori_loop(0, r, lambda i, c: query_tile(first + i, c, True), carry)
    carry = lax.fori_loop(first + r, n_tiles, lambda i, c: query_tile(i, c, False), carry)
    return carry[:2]


def _query_block_gates(gate, q0, bq: int, tk: int):
    """Query block q0's rows of b and seg ``[bq]`` and each query row's key tile (the blocks of
    tk its gates are summed in): what the forward and the query backward weigh pairs with."""
    b_ref, _, s_ref = gate
    return b_ref[pl.ds(q0, bq)], s_ref[pl.ds(q0, bq)], _rows(q0, bq) // tk


def _key_tile_weights(gate, rows_gates, m, tk: int, R, mask, diagonal: bool):
    """Key tile m's pair weights ``[bq, tk]`` for a query block (the forward's and the query
    backward's): W_ij = [mask, seg_i = seg_j] exp(b_i + key_j), key_j = -b_j for the keys of
    the query row's own tile, R_i + e_j for earlier tiles (R: the tiles strictly between).
    Returns (W, the mask with the segments, R after tile m)."""
    b_ref, e_ref, s_ref = gate
    b_rows, s_rows, q_tile = rows_gates
    keys = pl.ds(m * tk, tk)
    same = s_rows[:, None] == s_ref[keys][None, :]
    mask = same if mask is None else mask & same
    e_k = e_ref[keys]
    if diagonal:
        own = (q_tile == m)[:, None]
        key = jnp.where(own, -b_ref[keys][None, :], R[:, None] + e_k[None, :])
    else:
        key = R[:, None] + e_k[None, :]
    w = jnp.exp(jnp.where(mask, b_rows[:, None] + key, 0.0))
    return w, mask, R + jnp.where(m < q_tile, b_ref[m * tk + tk - 1], 0.0)  # near to far


def _walk_key_tiles(key_tile, n, r: int, carry):
    """Query block n's carry after ``key_tile(m, carry, diagonal)`` over its own (diagonal,
    masked) r key tiles, nearest first, then every earlier one, near to far."""
    top = (n + 1) * r - 1  # the last key tile of the diagonal block
    carry = lax.fori_loop(0, r, lambda i, c: key_tile(top - i, c, True), carry)
    return lax.fori_loop(0, n * r, lambda i, c: key_tile(n * r - 1 - i, c, False), carry)


def _store_key_grads(outs, fk, dk, dv, forget: bool) -> None:
    """dk, dv into their refs in their dtypes; with forgetting phi(K) . dphi(K) ``[bk]``."""
    outs[0][...] = dk.astype(outs[0].dtype)
    outs[1][...] = dv.astype(outs[1].dtype)
    if forget:
        outs[2][...] = jnp.sum(fk.astype(F32) * dk, axis=1)


# --------------------------------------------------------------------------------------------
# Forward


def _fwd_kernel(
    *refs, t: plan_lib.Tiles, n_blocks: int, eps: float, forget: bool, normalise: bool = True
):
    """Query block n: fq / y refs ``[bq, D]``, den ``[bq]``; fk, v ``[T, D]``; with forgetting
    b, e (float32) and seg (int32) ``[T]``."""
    (fq_ref, fk_ref, v_ref), gate, (y_ref, den_ref) = _unpack(refs, 3, forget)
    bq, tk = t.bq, t.tk
    r = bq // tk
    n = n_blocks - 1 - pl.program_id(2)  # longest first
    q0 = n * bq
    fq = fq_ref[...]
    rows_gates = _query_block_gates(gate, q0, bq, tk) if forget else None

    def key_tile(m, carry, diagonal: bool):
        num, den, R = carry
        keys = pl.ds(m * tk, tk)
        fk, v = fk_ref[keys, :], v_ref[keys, :]
        S = _dot(fq, fk.T)  # [bq, tk], before the gates are loaded: fewer live registers
        mask = _causal(q0, m * tk, bq, tk) if diagonal else None
        if forget:
            w, mask, R = _key_tile_weights(gate, rows_gates, m, tk, R, mask, diagonal)
            S = S * w
        A = S if mask is None else jnp.where(mask, S, 0.0)
        return num + _dot(A.astype(v.dtype), v), den + jnp.sum(A, axis=1), R

    Dp = fq.shape[-1]
    carry = (jnp.zeros((bq, Dp), F32), jnp.zeros((bq,), F32), jnp.zeros((bq,), F32))
    num, den, _ = _walk_key_tiles(key_tile, n, r, carry)
    if normalise:
        num = num * kernels.reciprocal(den, eps)[:, None]
    y_ref[...] = num.astype(y_ref.dtype)
    den_ref[...] = den


def _gate_specs(T: int):
    """b, e ``[B, T, H]`` and seg ``[B, T]``: the whole sequence of one (b, h)."""
    seq = pl.BlockSpec((None, T, None), lambda h, b, n: (b, 0, h))
    return [seq, seq, pl.BlockSpec((None, T), lambda h, b, n: (b, 0))]


def forward(fq, fk, v, t: plan_lib.Tiles, eps: float, gate=None, normalise: bool = True):
    """y ``[B, T, H, D]`` (input dtype) and den float32 ``[B, H, T]``; T a multiple of t.pad, D
    padded. ``gate`` = (b, e, seg) with forgetting. Without ``normalise`` the numerator,
    float32, instead of y (``ops``: keys wider than the values)."""
    B, T, H, D = fq.shape
    nb = T // t.bq
    forget = gate is not None
    block = pl.BlockSpec((None, t.bq, None, D), lambda h, b, p: (b, nb - 1 - p, h, 0))
    seq = pl.BlockSpec((None, T, None, D), lambda h, b, p: (b, 0, h, 0))
    den = pl.BlockSpec((None, None, t.bq), lambda h, b, p: (b, h, nb - 1 - p))
    return pl.pallas_call(
        partial(_fwd_kernel, t=t, n_blocks=nb, eps=eps, forget=forget, normalise=normalise),
        grid=(H, B, nb),
        in_specs=[block, seq, seq, *(_gate_specs(T) if forget else [])],
        out_specs=[block, den],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, D), v.dtype if normalise else F32),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        compiler_params=plan_lib.compiler_params("fwd", D),
        interpret=kernels.interpret(),
        name=FWD_NAME,
    )(fq, fk, v, *(gate if forget else ()))


# --------------------------------------------------------------------------------------------
# Backward


def _bwd_kernel(*refs, t: plan_lib.Tiles, n_tiles: int, forget: bool):
    """Key block j: fk / v refs ``[bk, D]``; fq, g ``[T, D]``, delta ``[T]``; with forgetting
    b, e, seg ``[T]``; the float32 dq accumulator ``[T, D]`` (aliased: in and out); dk, dv
    ``[bk, D]``; with forgetting phi(K) . dphi(K) ``[bk]``."""
    from jax.experimental.pallas import triton as plgpu  # Pallas's Triton primitives

    (fq_ref, fk_ref, v_ref, g_ref, delta_ref, _), gate, outs = _unpack(refs, 6, forget)
    dq_ref = outs[0]
    bk, tq = t.bk, t.tq
    j = pl.program_id(2)  # key block 0 has the most query tiles: longest first
    k0 = j * bk
    fk, v = fk_ref[...], v_ref[...]
    dt = fk.dtype
    if forget:
        b_ref, _, s_ref = gate
        b_k, e_k, s_k, k_tile = _key_block_gates(gate, k0, bk, tq)

    def query_tile(i, carry, diagonal: bool):
        dk, dv, R = carry
        rows = pl.ds(i * tq, tq)
        fq, g, delta = fq_ref[rows, :], g_ref[rows, :], delta_ref[rows]
        S = _dot(fq, fk.T)  # [tq, bk]
        dS = _dot(g, v.T) - delta[:, None]
        mask = _causal(i * tq, k0, tq, bk) if diagonal else None
        if forget:
            same = s_ref[rows][:, None] == s_k[None, :]
            mask = same if mask is None else mask & same
            # keys of block i: -b_j; keys of earlier blocks: R_j + e_j (R: blocks strictly between)
            key = jnp.where(k_tile == i, -b_k, R + e_k) if diagonal else R + e_k
            w = jnp.exp(jnp.where(mask, b_ref[rows][:, None] + key[None, :], 0.0))
            S, dS = S * w, dS * w
            R = R + jnp.where(i > k_tile, b_ref[i * tq + tq - 1], 0.0)  # near to far
        if mask is not None:
            S, dS = jnp.where(mask, S, 0.0), jnp.where(mask, dS, 0.0)
        dA = dS.astype(dt)
        plgpu.atomic_add(dq_ref, (rows, slice(None)), _dot(dA, fk))
        return dk + _dot(dA.T, fq), dv + _dot(S.astype(dt).T, g), R

    dk, dv = _walk_query_tiles(query_tile, j, bk, tq, n_tiles, fk.shape[-1])
    _store_key_grads(outs[1:], fk, dk, dv, forget)


def row_cotangents(dy, y, den, eps: float):
    """g = dY / (den + eps) in dY's dtype ``[B, T, H, D]`` and delta = g . y float32
    ``[B, H, T]`` (computed in float32): the cotangents of the numerator and, negated, of the
    denominator rows."""
    r = jnp.swapaxes(kernels.reciprocal(den, eps), 1, 2)[..., None]  # [B, T, H, 1]
    g32 = dy.astype(F32) * r
    delta = jnp.einsum("bthd,bthd->bht", g32, y.astype(F32))
    return g32.astype(dy.dtype), delta


def backward(fq, fk, v, y, dy, den, t: plan_lib.Tiles, eps: float, gate=None):
    """dphi(q) float32, dphi(k), dv ``[B, T, H, D]`` (the last two in the input dtype); with
    forgetting also phi(k) . dphi(k) float32 ``[B, H, T]``."""
    B, T, H, D = fq.shape
    nb = T // t.bk
    forget = gate is not None
    g, delta = row_cotangents(dy, y, den, eps)
    block = pl.BlockSpec((None, t.bk, None, D), lambda h, b, j: (b, j, h, 0))
    seq = pl.BlockSpec((None, T, None, D), lambda h, b, j: (b, 0, h, 0))
    rows = pl.BlockSpec((None, None, T), lambda h, b, j: (b, h, 0))
    out_specs = [seq, block, block]
    out_shape = [
        jax.ShapeDtypeStruct((B, T, H, D), F32),
        jax.ShapeDtypeStruct(fk.shape, fk.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
    ]
    if forget:
        out_specs.append(pl.BlockSpec((None, None, t.bk), lambda h, b, j: (b, h, j)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, T), F32))
    dq0 = jnp.zeros((B, T, H, D), F32)
    return pl.pallas_call(
        partial(_bwd_kernel, t=t, n_tiles=T // t.tq, forget=forget),
        grid=(H, B, nb),
        in_specs=[seq, block, block, seq, rows, seq, *(_gate_specs(T) if forget else [])],
        out_specs=out_specs,
        out_shape=out_shape,
        input_output_aliases={5: 0},
        compiler_params=plan_lib.compiler_params("bwd", D),
        interpret=kernels.interpret(),
        name=BWD_NAME,
    )(fq, fk, v, g, delta, dq0, *(gate if forget else ()))


# --------------------------------------------------------------------------------------------
# The differentiable ops


def block_gates(log_gate: jax.Array, bs: int):
    """b (inclusive) and e (exclusive, reversed) cumulative log-gates within each block of bs
    rows, float32 ``[B, T, H]``: b_i + e_i is the block's total, and e is 0 at its last row
    exactly."""
    b = kernels.block_cumsum(log_gate, bs)
    B, T, H = log_gate.shape
    x = log_gate.astype(F32).reshape(B, T // bs, bs, H)
    after = jnp.concatenate([x[:, :, 1:], jnp.zeros_like(x[:, :, :1])], axis=2)  # x_{i+1}
    e = lax.cumsum(after, axis=2, reverse=True)  # x_{i+1} + ... + x_last
    return b, e.reshape(B, T, H)


def _gates(log_gate, seg, tile: int):
    """(b, e, seg) with blocks of ``tile`` rows, or None without forgetting."""
    return None if log_gate is None else (*block_gates(log_gate, tile), seg)


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _core(fq, fk, v, log_gate, seg, t: plan_lib.Tiles, eps: float):
    return forward(fq, fk, v, t, eps, _gates(log_gate, seg, t.tk))[0]


def _core_fwd(fq, fk, v, log_gate, seg, t, eps):
    y, den = forward(fq, fk, v, t, eps, _gates(log_gate, seg, t.tk))
    return y, (fq, fk, v, log_gate, seg, y, den)


def _core_bwd(t, eps, residuals, dy):
    fq, fk, v, log_gate, seg, y, den = residuals
    gate = _gates(log_gate, seg, t.tq)  # the backward's blocks: its query tiles
    out = backward(fq, fk, v, y, dy.astype(y.dtype), den, t, eps, gate)
    dq32, dk, dv = out[:3]
    dq = dq32.astype(fq.dtype)
    if gate is None:
        return dq, dk, dv, None, None
    # dL_i = phi(q_i) . dphi(q_i) - phi(k_i) . dphi(k_i), both float32 before rounding
    dL = jnp.einsum("bthd,bthd->bth", fq.astype(F32), dq32) - jnp.swapaxes(out[3], 1, 2)
    dseg = np.zeros(seg.shape, dtype=jax.dtypes.float0)
    return dq, dk, dv, kernels.log_gate_cotangent(dL), dseg


_core.defvjp(_core_fwd, _core_bwd)


def _prepare(fq, fk, v, t: plan_lib.Tiles):
    """Pad D to a power of two >= 16 and T to a multiple of the resident blocks (zero features:
    the padded keys add nothing, the padded queries are dropped)."""
    B, T, H, _ = fq.shape
    Dp = kernels.padded_head_dim(max(fq.shape[-1], v.shape[-1]))
    pad_t = plan_lib.padded_length(T, t) - T

    def prep(x):
        x = kernels.pad_head_dim(x.astype(fq.dtype), Dp)
        return jnp.pad(x, ((0, 0), (0, pad_t), (0, 0), (0, 0))) if pad_t else x

    return prep(fq), prep(fk), prep(v), pad_t


def attention(fq, fk, v, c: int, eps: float, tiles: plan_lib.Tiles | None = None) -> jax.Array:
    """Normalised causal linear attention, tiled, fused; differentiable.

    fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``, any T (padded here to a multiple of the
    resident blocks), any D <= 128 (padded to a power of two >= 16); c, the block size, a power
    of two >= 16 (it caps the streamed tile). ``tiles``: the tiling (default: the largest,
    ``plan.largest``; ``ops`` passes the cost model's). Returns y ``[B, T, H, D]`` in fq's
    dtype. The interface of ``lt_attention_parallel.IMPLEMENTATIONS``."""
    B, T, H, D = v.shape
    plan_lib.check(c, D, "LT_attention_parallel kernel=pallas_tiled")
    t = tiles or plan_lib.largest(c, kernels.padded_head_dim(D))
    fq_p, fk_p, v_p, _ = _prepare(fq, fk, v, t)
    return _core(fq_p, fk_p, v_p, None, None, t, float(eps))[:, :T, :, :D]


def forget_attention(
    fq, fk, v, log_gate, seg, c: int, eps: float, tiles: plan_lib.Tiles | None = None
) -> jax.Array:
    """:func:`attention` with document resets and decay: pair weights
    [j <= i, seg_i = seg_j] exp(L_i - L_j), the interface of
    ``kernels.lt_attention_parallel.naive.blocked_forget_attention`` (the oracle).

    log_gate float32 ``[B, T, H]`` log gamma per position (<= 0), seg int32 ``[B, T]`` the
    document id of each position. Differentiable in fq, fk, v and log_gate (residuals O(T D):
    the inputs, the block-local log-gates, y and den)."""
    B, T, H, D = v.shape
    plan_lib.check(c, D, "LT_attention_parallel kernel=pallas_tiled")
    t = tiles or plan_lib.largest(c, kernels.padded_head_dim(D))
    fq_p, fk_p, v_p, pad_t = _prepare(fq, fk, v, t)
    # Padded positions: gamma = 1 and the last document id; they follow every real position.
    log_gate = jnp.pad(log_gate.astype(F32), ((0, 0), (0, pad_t), (0, 0)))
    seg = jnp.pad(seg.astype(jnp.int32), ((0, 0), (0, pad_t)), mode="edge")
    return _core(fq_p, fk_p, v_p, log_gate, seg, t, float(eps))[:, :T, :, :D]
