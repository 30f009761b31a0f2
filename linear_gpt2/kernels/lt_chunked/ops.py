"""The differentiable ``LT_chunked`` ops over the Pallas kernels (Triton-lowered on GPU,
interpret mode elsewhere).

Two designs of the same function, both with float32 states and normaliser sums:

- **chunk-parallel** (``pallas_chunk``): a state pass parallel over (segment, batch, head,
  value block) and sequential over the chunks of its segment writes the state entering every
  chunk to HBM; the sequence is split into G segments whose totals are prefix-summed in XLA
  (exact: the update is a sum) so that the pass has enough programs even at batch 1; then the
  outputs, parallel over (row tile, batch, head, value block). Backward: the state pass is
  recomputed, a reverse state pass writes the cotangent of every chunk's state, and one kernel
  parallel over (row tile, batch, head) gives dphi(q), dphi(k), dv (two at D = 128). As fla's
  ``chunk_fwd_h`` / ``chunk_fwd_o`` / ``chunk_bwd_dh`` / ``chunk_bwd_dqkwg``, and the post's
  own ``LT_chunked``.
- **fused single pass** (``pallas_fused_chunk``): one program per (batch, head[, value block])
  walks all chunks, carrying the state in registers; nothing but den goes to HBM besides the
  outputs. The least traffic and the fewest launches, but only B H programs: it wins when
  B H occupies most of the 132 SMs, or at 1k tokens with B H = 24 or so (``cost.choose``).

``kernel="pallas"`` chooses between them by shape with the model in ``cost`` (logged once per
shape); the two names force one. The interface, for both: :func:`chunked_attention`.

Residuals of the ``custom_vjp``: phi(q), phi(k), v, y, den and the initial state: O(T D); the
backward recomputes the per-chunk states (one more state pass) rather than keeping T/c D^2.

**Own prefix** (:func:`own_prefix`): with one chunk per segment (G = N, which ``plan.segments``
gives short sequences at small batch: 1k tokens in chunks of 128 at batch 1), at most
``plan.OWN_PREFIX_CHUNKS`` chunks, no initial / final state and no forgetting, every
segment-local state is zero and every state is a sum of chunk totals. Then the state passes
write only the totals, the output and gradient kernels sum the totals before (states) or after
(cotangents) their chunk themselves (``tiles.chunk_sum``), and the forward's totals (N [D, D]:
O(T D) at N <= 8) are a residual instead of a recomputed pass: four Pallas launches in all
and no XLA prefix or suffix.

**The feature map** (``feature_map``): with an elementwise map (``attention.feature_maps``:
softplus, elu1, relu, exp) the op takes the raw q, k. phi is applied in XLA inside the
``custom_vjp``, in float32 and rounded to the input dtype (``attention.linear.features``'
numerics), where XLA fuses it into the producer of q, k (the bias add and split after
``c_attn``); the residuals are the features, not q and k. The gradient kernels return dq = dphi(q)
phi'(q) and dk likewise, with phi' = ``slope(phi)`` computed in registers from the phi(q),
phi(k) tiles they read (``tiles.through_phi``; every elementwise map is monotone, so its
derivative is a function of its value), so no XLA pass multiplies the gradients by phi'. The
raw inputs are padded with -inf (phi(-inf) = 0: zero features). Without a map (None) the op
takes the features and returns dphi(q), dphi(k): the expanding maps, the decoder.

**Forgetting** (issue 14: document resets, decay gates; chunk-parallel design only). XLA
prepares b ``[B, T, H]`` float32, the cumulative log-gates *within each chunk*, and s ``[B, T]``
int32, the document index within the chunk (:func:`forgetting`); the kernels build every weight
from them (``tiles``). Per-chunk carries [no reset in the chunk] e^{b_last} give the decayed
segment prefix (an associative scan of (carry product, state) pairs over the G segments,
:func:`_decayed_bases`, and its reverse, :func:`_decayed_dbases`) and each chunk's factor of its
segment's base (:func:`chunk_factors`). The log-gate gradient: the weights depend on b_i only
through phi(q_i) e^{b_i} and phi(k_i) e^{-b_i} and, at the chunk's last row, through the state
leaving the chunk, so

    d b_i = phi(q_i) . dphi(q_i) - phi(k_i) . dphi(k_i)
            + [i = last] (sum_j out_j d out_j + carry <dS_after, S_in> + carry <dz_after, z_in>)

(the first line summed in float32 by the gradient kernels, the chunk sums in XLA:
:func:`log_gate_cotangent`), equal to the per-tile rowsum(dA o A) - colsum(dA o A) plus the
state terms; d(log_gate) is its transpose through the chunk-local cumsum (autodiff: a reverse
cumsum within each chunk). Without log-gates (resets only) none of it is computed.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.kernels import key_blocks
from linear_gpt2.kernels.forget import cumprod, decayed_scan
from linear_gpt2.kernels.lt_chunked import (
    CHUNK,
    FUSED,
    NAMES,
    bwd_dh,
    bwd_dqkv,
    cost,
    fused_chunk,
    fwd_h,
    fwd_o,
)
from linear_gpt2.kernels.lt_chunked import plan as plan_lib

F32 = jnp.float32


# --------------------------------------------------------------------------------------------
# Segment prefixes (XLA): the exact sums that join the state pass's segments


def _bases(ht, zt, state, need_final: bool):
    """Per-segment bases ``(S [B, H, G, D, D], z [B, H, G, D])``: the initial state plus the
    totals of the earlier segments (None when G = 1 and there is no initial state: zero), and
    the final state (None unless ``need_final``)."""
    G = ht.shape[2]
    if state is None:
        state = (jnp.zeros_like(ht[:, :, 0]), jnp.zeros_like(zt[:, :, 0]))
        if G == 1:
            final = (ht[:, :, 0], zt[:, :, 0]) if need_final else None
            return None, final
    S0, z0 = state
    S_incl = S0[:, :, None] + jnp.cumsum(ht, axis=2)
    z_incl = z0[:, :, None] + jnp.cumsum(zt, axis=2)
    base = (
        jnp.concatenate([S0[:, :, None], S_incl[:, :, :-1]], axis=2),
        jnp.concatenate([z0[:, :, None], z_incl[:, :, :-1]], axis=2),
    )
    return base, ((S_incl[:, :, -1], z_incl[:, :, -1]) if need_final else None)


def _dbases(dht, dzt, final_ct, need_initial: bool):
    """Per-segment cotangent bases: the final state's cotangent plus the totals of the later
    segments (None when G = 1 and there is no final-state cotangent: zero), and the initial
    state's cotangent (None unless ``need_initial``)."""
    G = dht.shape[2]
    if final_ct is None:
        final_ct = (jnp.zeros_like(dht[:, :, 0]), jnp.zeros_like(dzt[:, :, 0]))
        if G == 1:
            initial = (dht[:, :, 0], dzt[:, :, 0]) if need_initial else None
            return None, initial
    dSf, dzf = final_ct
    dS_incl = dSf[:, :, None] + jnp.flip(jnp.cumsum(jnp.flip(dht, 2), axis=2), 2)
    dz_incl = dzf[:, :, None] + jnp.flip(jnp.cumsum(jnp.flip(dzt, 2), axis=2), 2)
    dbase = (
        jnp.concatenate([dS_incl[:, :, 1:], dSf[:, :, None]], axis=2),
        jnp.concatenate([dz_incl[:, :, 1:], dzf[:, :, None]], axis=2),
    )
    return dbase, ((dS_incl[:, :, 0], dz_incl[:, :, 0]) if need_initial else None)


# --------------------------------------------------------------------------------------------
# Forgetting (issue 14): per-position inputs and the decayed segment prefixes (XLA)


class Forgetting(NamedTuple):
    """What the kernels read of ``linear.Forget``, prepared in XLA around them (padded T):

    - ``b`` ``[B, T, H]`` float32: the chunk-local cumulative log-gates, b_i = sum of log gamma
      from the chunk's first position to i (a cumsum within each chunk only, never over the
      sequence: every b_i and every b_i - b_j used is a sum over at most c gates, <= 0);
    - ``s`` ``[B, T]`` int32: the document index within the chunk (0 = the document the chunk
      began in, +1 at each reset);
    - ``gated``: whether log-gates were given (then their gradient is computed)."""

    b: jax.Array
    s: jax.Array
    gated: bool


def forgetting(log_gate, resets, B: int, T: int, H: int, c: int) -> Forgetting:
    """:class:`Forgetting` from ``log_gate`` float32 ``[B, T, H]`` and ``resets`` bool ``[B, T]``
    (either None; T a multiple of c). Differentiable in log_gate: the gradient of b reaches it
    through the transpose of the chunk-local cumsum, a reverse cumsum within each chunk."""
    N = T // c
    if log_gate is None:
        b = jnp.zeros((B, T, H), F32)
    else:
        b = kernels.block_cumsum(log_gate, c)
    if resets is None:
        s = jnp.zeros((B, T), jnp.int32)
    else:
        s = jnp.cumsum(resets.reshape(B, N, c).astype(jnp.int32), axis=2).reshape(B, T)
    return Forgetting(b, s, log_gate is not None)


def chunk_factors(b, s, c: int, G: int):
    """Per-chunk factors of the state (``[B, H, N]`` float32, N = T / c chunks in G segments):
    ``carry`` = [no reset in the chunk] e^{b_last}, the factor across the chunk; ``decay``: the
    product of the carries of the segment's earlier chunks (the factor of the segment's base
    entering the chunk); ``rdecay``: that of its later chunks (the factor of the cotangent
    base); ``total`` ``[B, H, G]``: the product over each segment. Products of factors in
    [0, 1]: they underflow to 0, never to NaN."""
    B, T, H = b.shape
    N = T // c
    L = N // G
    b_last = jnp.moveaxis(b.reshape(B, N, c, H)[:, :, -1], 1, 2)  # [B, H, N]
    s_last = s.reshape(B, N, c)[:, None, :, -1]  # [B, 1, N]
    carry = jnp.where(s_last == 0, jnp.exp(jnp.minimum(b_last, 0.0)), 0.0)
    seg = carry.reshape(B, H, G, L)
    incl = cumprod(seg, axis=-1)
    ones = jnp.ones_like(seg[..., :1])
    decay = jnp.concatenate([ones, incl[..., :-1]], axis=-1).reshape(B, H, N)
    rincl = cumprod(seg, axis=-1, reverse=True)
    rdecay = jnp.concatenate([rincl[..., 1:], ones], axis=-1).reshape(B, H, N)
    return carry, decay, rdecay, incl[..., -1]


def _decayed_bases(ht, zt, total, state, need_final: bool):
    """As :func:`_bases` with forgetting: base[g+1] = total_g base[g] + ht[g] (an associative
    scan over the G segments)."""
    G = ht.shape[2]
    if state is None:
        if G == 1:
            return None, ((ht[:, :, 0], zt[:, :, 0]) if need_final else None)
        state = (jnp.zeros_like(ht[:, :, 0]), jnp.zeros_like(zt[:, :, 0]))
    S0, z0 = state
    Gp, Q, q = decayed_scan(total, ht, zt, axis=2)
    S_after = Gp[..., None, None] * S0[:, :, None] + Q
    z_after = Gp[..., None] * z0[:, :, None] + q
    base = (
        jnp.concatenate([S0[:, :, None], S_after[:, :, :-1]], axis=2),
        jnp.concatenate([z0[:, :, None], z_after[:, :, :-1]], axis=2),
    )
    return base, ((S_after[:, :, -1], z_after[:, :, -1]) if need_final else None)


def _decayed_dbases(dht, dzt, total, final_ct, need_initial: bool):
    """As :func:`_dbases` with forgetting: the cotangent entering segment g is total_g dbase[g]
    + dht[g], and is dbase[g-1] (a reverse associative scan)."""
    G = dht.shape[2]
    if final_ct is None:
        if G == 1:
            return None, ((dht[:, :, 0], dzt[:, :, 0]) if need_initial else None)
        final_ct = (jnp.zeros_like(dht[:, :, 0]), jnp.zeros_like(dzt[:, :, 0]))
    dSf, dzf = final_ct
    Gp, Q, q = decayed_scan(total, dht, dzt, axis=2, reverse=True)
    dS_in = Gp[..., None, None] * dSf[:, :, None] + Q
    dz_in = Gp[..., None] * dzf[:, :, None] + q
    dbase = (
        jnp.concatenate([dS_in[:, :, 1:], dSf[:, :, None]], axis=2),
        jnp.concatenate([dz_in[:, :, 1:], dzf[:, :, None]], axis=2),
    )
    return dbase, ((dS_in[:, :, 0], dz_in[:, :, 0]) if need_initial else None)


def _full(h, base, factor, G: int):
    """The state at every chunk ``[B, H, N, ...]``: the segment-local h plus its segment's base
    times ``factor`` ``[B, H, N]`` (fused by XLA into its consumer)."""
    if base is None:
        return h
    B, H, N = h.shape[:3]
    L = N // G
    hs = h.reshape(B, H, G, L, *h.shape[3:])
    f = factor.reshape(B, H, G, L, *(1,) * (h.ndim - 3))
    return (hs + f * base[:, :, :, None]).reshape(h.shape)


def log_gate_cotangent(gb, od, carry, inner, c: int):
    """d b ``[B, T, H]`` from the gradient kernels' rows (module docstring, "log-gate gradient"):
    gb_i = phi(q_i).dphi(q_i) - phi(k_i).dphi(k_i), plus at each chunk's last row the terms of
    b_last in the state leaving the chunk: sum_j out_j d out_j (``od``) + carry <dS_after, S_in>."""
    B, H, T = gb.shape
    N = T // c
    last = od.reshape(B, H, N, c).sum(-1) + carry * inner  # [B, H, N]
    db = gb.reshape(B, H, N, c).at[..., -1].add(last)
    return jnp.moveaxis(db.reshape(B, H, T), 1, 2)


def row_cotangents(dy, y, den, eps: float):
    """r = 1 / (den + eps) and delta = r (dY . y) ``[B, H, T]`` float32: the cotangent of the
    numerator rows is g = r dY, that of the denominator -delta. dy, y ``[B, T, H, D]``."""
    r = kernels.reciprocal(den, eps)
    dot = jnp.einsum("bthd,bthd->bht", dy.astype(F32), y.astype(F32))
    return r, r * dot


# --------------------------------------------------------------------------------------------
# The chunk-parallel design


def own_prefix(blocks, T: int, state, forget, return_state: bool) -> bool:
    """Whether the kernels form the states from the chunks' totals themselves ("own prefix"):
    with one chunk per segment (G = N: short sequences at small batch, e.g. 1k tokens in chunks
    of 128 at batch 1), at most ``plan.OWN_PREFIX_CHUNKS`` chunks, no initial or final state and
    no forgetting. Then every segment-local state is zero and the state entering chunk n is the
    sum of the totals of chunks 0..n-1: ``fwd_h`` writes only the totals, the output and
    gradient kernels sum the totals they need (n of them, from L2: a few [D, D] per chunk), and
    the totals are kept for the backward (N [D, D] states, O(T D) at N <= 8) rather than
    recomputed; no XLA prefix runs. Elsewhere the general path (module docstring)."""
    return (
        plan_lib.own_prefix(blocks, T // blocks.c)
        and state is None
        and forget is None
        and not return_state
    )


def _chunk_forward(fq, fk, v, state, forget, blocks, eps, return_state, normalise=True):
    """``(y, den, final, totals)``: totals ``(ht, zt)`` on the own-prefix path (the backward's
    residual, :func:`own_prefix`), else None."""
    if forget is None:
        if own_prefix(blocks, fq.shape[1], state, forget, return_state):
            ht, zt = fwd_h.chunk_fwd_h(fk, v, blocks, local=False)
            y, den = fwd_o.chunk_fwd_o(
                fq, fk, v, ht, zt, None, eps, blocks, normalise=normalise, prefix=True
            )
            return y, den, None, (ht, zt)
        h, z, ht, zt = fwd_h.chunk_fwd_h(fk, v, blocks)
        base, final = _bases(ht, zt, state, return_state)
        y, den = fwd_o.chunk_fwd_o(fq, fk, v, h, z, base, eps, blocks, normalise=normalise)
        return y, den, final, None
    b, s, _ = forget
    _, decay, _, total = chunk_factors(b, s, blocks.c, blocks.segments)
    h, z, ht, zt = fwd_h.chunk_fwd_h(fk, v, blocks, b, s)
    base, final = _decayed_bases(ht, zt, total, state, return_state)
    y, den = fwd_o.chunk_fwd_o(
        fq, fk, v, h, z, base, eps, blocks, (b, s, decay), normalise=normalise
    )
    return y, den, final, None


def _chunk_backward(
    fq, fk, v, r, delta, state, forget, dy, final_ct, blocks, slope=None, totals=None,
    rows_from=None,
):  # fmt: skip
    """The gradients from the row cotangents r = 1 / (den + eps) and delta = r (dY . y)
    (:func:`row_cotangents`): ``(dphi(q), dphi(k), dv, dstate, db)``; with ``slope`` (the
    feature map's phi' from phi) dq, dk of the raw q, k instead of dphi(q), dphi(k). ``totals``:
    the forward's chunk totals on the own-prefix path (:func:`own_prefix`), else None.
    ``rows_from`` = (y, den, eps): r and delta (then None) are formed by the reverse state pass
    (``bwd_dh``, ``rows_from``) rather than by XLA."""

    def state_cotangents(*gate, local=True):
        """``bwd_dh``'s outputs and the row cotangents (its own when it forms them)."""
        out = bwd_dh.chunk_bwd_dh(fq, dy, r, delta, blocks, *gate, local=local, rows_from=rows_from)
        return (out, (r, delta)) if rows_from is None else (out[:-2], out[-2:])

    if totals is not None:  # one chunk per segment: the kernels sum the totals themselves
        ht, zt = totals
        (dht, dzt), (r, delta) = state_cotangents(local=False)
        dq, dk, dv = bwd_dqkv.chunk_bwd_grads(
            fq, fk, v, dy, r, delta, ht, zt, dht, dzt, None, None, blocks, slope=slope,
            prefix=True,
        )  # fmt: skip
        return dq, dk, dv, None, None
    if forget is None:
        h, z, ht, zt = fwd_h.chunk_fwd_h(fk, v, blocks)  # recomputed: O(T D) residuals only
        base, _ = _bases(ht, zt, state, False)
        (dh, dz, dht, dzt), (r, delta) = state_cotangents()
        dbase, dstate = _dbases(dht, dzt, final_ct, state is not None)
        dq, dk, dv = bwd_dqkv.chunk_bwd_grads(
            fq, fk, v, dy, r, delta, h, z, dh, dz, base, dbase, blocks, slope=slope
        )
        return dq, dk, dv, dstate, None
    b, s, gated = forget
    G = blocks.segments
    carry, decay, rdecay, total = chunk_factors(b, s, blocks.c, G)
    h, z, ht, zt = fwd_h.chunk_fwd_h(fk, v, blocks, b, s)
    base, _ = _decayed_bases(ht, zt, total, state, False)
    (dh, dz, dht, dzt), (r, delta) = state_cotangents(b, s)
    dbase, dstate = _decayed_dbases(dht, dzt, total, final_ct, state is not None)
    out = bwd_dqkv.chunk_bwd_grads(
        fq, fk, v, dy, r, delta, h, z, dh, dz, base, dbase, blocks,
        forget=(b, s, decay, rdecay, gated), slope=slope,
    )  # fmt: skip
    if not gated:
        return (*out, dstate, None)
    dq, dk, dv, gb, od = out
    # <dS_after_n, S_n> + <dz_after_n, z_n> with the full states (one fused XLA reduction)
    S_in, z_in = _full(h, base and base[0], decay, G), _full(z, base and base[1], decay, G)
    dS_out, dz_out = (
        _full(dh, dbase and dbase[0], rdecay, G),
        _full(dz, dbase and dbase[1], rdecay, G),
    )
    inner = jnp.sum(S_in * dS_out, axis=(-2, -1)) + jnp.sum(z_in * dz_out, axis=-1)
    db = log_gate_cotangent(gb, od, carry, inner, blocks.c)
    return dq, dk, dv, dstate, db


def _fused_forward(fq, fk, v, state, forget, blocks, eps, return_state):
    assert forget is None, "the single-pass kernels take no forgetting (choose)"
    return (*fused_chunk.fused_fwd(fq, fk, v, state, blocks, eps, return_state), None)


def _fused_backward(
    fq, fk, v, r, delta, state, forget, dy, final_ct, blocks, slope=None, totals=None,
    rows_from=None,
):  # fmt: skip
    assert totals is None and rows_from is None, "the single pass reads r, delta (_core_bwd)"
    return (*fused_chunk.fused_bwd(fq, fk, v, dy, r, delta, state, final_ct, blocks, slope), None)


_DESIGNS = {CHUNK: (_chunk_forward, _chunk_backward), FUSED: (_fused_forward, _fused_backward)}


def _forward(fq, fk, v, state, b, s, gated, design, blocks, eps, return_state, nk):
    """``(y [B, T, H, Dp], den [B, H, T], final, totals)`` (totals: the own-prefix path's
    residual, :func:`own_prefix`, or None). With nk > 1 key blocks (fq, fk, state
    folded into H nk heads, ``key_blocks``; v, b unfolded) the kernels run unnormalised on the
    folded heads and the blocks' numerators and denominators are summed before the division."""
    if nk == 1:
        forget = None if b is None else (b, s, gated)
        return _DESIGNS[design][0](fq, fk, v, state, forget, blocks, eps, return_state)
    forget = None if b is None else (key_blocks.repeat_heads(b, nk, 2), s, gated)
    vf = key_blocks.repeat_heads(v, nk, 2)
    num, den, final, totals = _chunk_forward(
        fq, fk, vf, state, forget, blocks, eps, return_state, False
    )
    num = key_blocks.sum_heads(num, nk, 2)
    den = key_blocks.sum_heads(den, nk, 1)
    r = jnp.swapaxes(kernels.reciprocal(den, eps), 1, 2)[..., None]
    return (num * r).astype(v.dtype), den, final, totals


def _features(q, k, phi):
    """phi(q), phi(k) in the input dtype, computed in float32 (``attention.linear.features``'
    numerics; XLA fuses it into the producer of q and k); q, k themselves when phi is None."""
    if phi is None:
        return q, k
    return tuple(phi.fn(x.astype(F32)).astype(x.dtype) for x in (q, k))


@partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9, 10, 11, 12))
def _core(
    q, k, v, state, b, s, gated, design: str, blocks, eps: float, return_state: bool, nk, phi
):  # fmt: skip
    fq, fk = _features(q, k, phi)
    y, _, final, _ = _forward(fq, fk, v, state, b, s, gated, design, blocks, eps, return_state, nk)
    return (y, final) if return_state else y


def _core_fwd(q, k, v, state, b, s, gated, design, blocks, eps, return_state, nk, phi):
    fq, fk = _features(q, k, phi)
    y, den, final, totals = _forward(
        fq, fk, v, state, b, s, gated, design, blocks, eps, return_state, nk
    )
    out = (y, final) if return_state else y
    return out, (fq, fk, v, y, den, state, b, s, totals)


def _core_bwd(gated, design, blocks, eps, return_state, nk, phi, residuals, ct):
    fq, fk, v, y, den, state, b, s, totals = residuals
    dy, final_ct = ct if return_state else (ct, None)
    dy = dy.astype(y.dtype)
    # The chunk-parallel design's reverse state pass forms r, delta itself (``bwd_dh``,
    # ``rows_from``): no XLA pass over dY, y. With key blocks they are those of the summed
    # rows, repeated over the blocks: formed here.
    rows_from = r = delta = None
    if design == CHUNK and nk == 1:
        rows_from = (y, den, eps)
    else:
        r, delta = row_cotangents(dy, y, den, eps)
    if nk > 1:  # every block reads the summed row cotangents (key_blocks)
        r, delta = (key_blocks.repeat_heads(x, nk, 1) for x in (r, delta))
        dy = key_blocks.repeat_heads(dy, nk, 2)
        v = key_blocks.repeat_heads(v, nk, 2)
        b = None if b is None else key_blocks.repeat_heads(b, nk, 2)
    forget = None if b is None else (b, s, gated)
    dq, dk, dv, dstate, db = _DESIGNS[design][1](
        fq, fk, v, r, delta, state, forget, dy, final_ct, blocks,
        None if phi is None else phi.slope, totals, rows_from,
    )  # fmt: skip
    if nk > 1:
        dv = key_blocks.sum_heads(dv, nk, 2)
        db = None if db is None else key_blocks.sum_heads(db, nk, 2)
    if b is not None and db is None:
        db = jnp.zeros_like(residuals[6])
    return dq, dk, dv, dstate, db, None


_core.defvjp(_core_fwd, _core_bwd)


# --------------------------------------------------------------------------------------------
# The interface

_LOGGED: set = set()


def choose(
    kernel: str, B: int, T: int, H: int, D: int, c: int, dtype, forget: bool = False,
    nk: int = 1,
) -> str:  # fmt: skip
    """The design behind ``kernel`` at this (padded) shape: ``pallas`` asks the cost model
    (``cost.choose``) and logs the choice once per shape; the explicit names are returned. With
    forgetting (resets / decay gates), or keys wider than the values (``nk`` > 1 key blocks, an
    expanding feature map), ``pallas`` is the chunk-parallel design, the only one that takes
    them; the single pass is a one-line error."""
    if kernel not in NAMES:
        raise ValueError(f"LT_chunked: unknown Pallas kernel {kernel!r}; valid: {', '.join(NAMES)}")
    if forget or nk > 1:
        if kernel == FUSED:
            what = (
                "attention.doc_reset / attention.decay"
                if forget
                else f"keys wider than the values ({nk} blocks: an expanding feature map)"
            )
            raise NotImplementedError(
                f"LT_chunked: kernel={FUSED!r} does not support {what} yet; use "
                f"kernel={CHUNK}, pallas, auto or xla"
            )
        return CHUNK
    if kernel != "pallas":
        return kernel
    choice = cost.choose(B, T, H, D, c, jnp.dtype(dtype).itemsize)
    key = (B, T, H, D, c, jnp.dtype(dtype).name)
    if key not in _LOGGED:
        _LOGGED.add(key)
        kernels.note_choice(
            f"LT_chunked kernel=pallas at [B={B}, T={T}, H={H}, D={D}] c={c} "
            f"{jnp.dtype(dtype).name}: {choice.kernel} ({choice.reason})",
            __name__,
        )
    return choice.kernel


def problem(c: int, D: int) -> str | None:
    """Why the kernels cannot run chunk size c at (value) head dim D, or None: c must be a power
    of two >= 16 (Triton block shapes), D at most 128 once padded. Every other (c, D), c = 16
    ... T, compiles without spills for the H100 (row tiles keep the registers independent of
    c); keys of any width are blocks of D (``key_blocks``)."""
    bad = kernels.block_size_problem(c)
    if bad:
        return f"chunk_size={c} {bad}"
    return kernels.head_dim_problem(D)


def check_chunk(c: int, D: int, kernel: str = "pallas") -> None:
    """The one-line error for a (c, D) the kernels cannot run (:func:`problem`)."""
    bad = problem(c, D)
    if bad:
        raise ValueError(f"LT_chunked kernel={kernel}: {bad}; use kernel=xla for any size")


def chunked_attention(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    c: int,
    eps: float,
    initial_state=None,
    return_final_state: bool = False,
    kernel: str = "pallas",
    log_gate: jax.Array | None = None,
    resets: jax.Array | None = None,
    feature_map=None,
):
    """Normalised causal linear attention by chunks of ``c``, fused; differentiable.

    fq = phi(q), fk = phi(k) ``[B, T, H, Dk]`` and v ``[B, T, H, D]`` (same dtype); any T
    (padded to a multiple of c: zero features and values add nothing), any D (zero-padded to a
    power of two Dp >= 16), any Dk (keys wider than Dp run as NK blocks of Dp features folded
    into the heads, ``key_blocks``); c a power of two >= 16. ``initial_state``: ``(S [B, H, Dk,
    D], z [B, H, Dk])`` float32 to continue from (the decoder's prefill), differentiable too;
    ``return_final_state``: also return the state after the T positions. ``kernel``:
    ``pallas`` (chosen by shape), ``pallas_chunk`` or ``pallas_fused_chunk`` (square keys
    only). Forgetting (``linear.Forget``): ``log_gate`` float32 ``[B, T, H]`` (log gamma <= 0,
    differentiable) and / or ``resets`` bool ``[B, T]`` (a document starts here; a reset at
    position 0 drops ``initial_state``): the chunk-parallel kernels only. Returns y ``[B, T,
    H, D]`` in fq's dtype (and the final state).

    ``feature_map``: None (fq, fk are the features), or an elementwise map (``fn``, and
    ``slope``: phi' as a function of phi; ``attention.feature_maps``, a map with fn(-inf) = 0):
    then fq, fk are the raw q, k, phi is applied to them in XLA inside the op (fused with their
    producer; the features are the residuals, not q and k), and the gradient kernels return the
    gradients of q and k, phi' applied in registers (``tiles.through_phi``): no XLA pass
    multiplies them by phi'. Padding is then -inf (zero features)."""
    B, T, H, Dk = fq.shape
    D = v.shape[-1]
    check_chunk(c, D, kernel)
    if feature_map is not None and getattr(feature_map, "slope", None) is None:
        raise ValueError(
            f"LT_chunked kernels: feature_map {getattr(feature_map, 'name', feature_map)!r} is "
            "not elementwise (no slope); pass its features with feature_map=None"
        )
    Dp, nk = key_blocks.plan(Dk, D)
    pad_t = (-T) % c
    Tp = T + pad_t

    def prep(x, keys: bool):
        # raw keys are padded with -inf, whose feature is 0 (``feature_map``)
        fill = -jnp.inf if keys and feature_map is not None else 0.0
        x = x.astype(fq.dtype)
        x = key_blocks.fold_keys(x, nk, Dp, fill) if keys else kernels.pad_head_dim(x, Dp)
        if not pad_t:
            return x
        return jnp.pad(x, ((0, 0), (0, pad_t), (0, 0), (0, 0)), constant_values=fill)

    fq_p, fk_p, v_p = prep(fq, True), prep(fk, True), prep(v, False)
    state = None
    if initial_state is not None:
        state = key_blocks.fold_state(*(x.astype(F32) for x in initial_state), nk, Dp)
    forget = log_gate is not None or resets is not None
    design = choose(kernel, B, Tp, H, Dp, c, fq.dtype, forget, nk)
    if design == FUSED:
        blocks = fused_chunk.blocks(B, Tp, H, Dp, c)
    else:
        blocks = cost.plan_blocks(B, Tp, H * nk, Dp, c, forget=forget)
    b = s = None
    gated = False
    if forget:  # padded positions: gamma = 1, no reset (they follow T; their keys are zero)
        if log_gate is not None and pad_t:
            log_gate = jnp.pad(log_gate, ((0, 0), (0, pad_t), (0, 0)))
        if resets is not None and pad_t:
            resets = jnp.pad(resets, ((0, 0), (0, pad_t)))
        b, s, gated = forgetting(log_gate, resets, B, Tp, H, c)
    out = _core(
        fq_p, fk_p, v_p, state, b, s, gated, design, blocks, float(eps), return_final_state, nk,
        feature_map,
    )  # fmt: skip
    y, final = out if return_final_state else (out, None)
    y = y[:, :T, :, :D]
    if not return_final_state:
        return y
    return y, key_blocks.unfold_state(*final, H, Dk, D)
