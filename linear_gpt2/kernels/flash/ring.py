"""``flash`` under context parallelism: ring attention over the mesh's ``seq`` axis with a fused
kernel per block and the log-sum-exp rule between blocks.

Device r holds the r-th contiguous slice of the sequence, queries, keys and values ``[B, S, H,
D]`` (S = T / N). Its queries attend to its own slice causally (the diagonal block) and to every
earlier slice in full (cross blocks); the keys and values of the earlier slices come round the
ring (``lax.ppermute`` to the next device, N - 1 steps), so a device holds two slices of keys
and values at a time, never the whole sequence. Each block is one fused-attention call that
returns its output and its per-row log-sum-exp (``lse``, natural log of the sum of exp of the
scaled scores, ``[B, H, S]`` float32); blocks combine by

    lse = logaddexp(lse_a, lse_b),   o = o_a exp(lse_a - lse) + o_b exp(lse_b - lse),

and a block whose every key is masked for a row has lse = -inf and o = 0 there, which the rule
absorbs (the diagonal block always holds the row's own key, so the combined lse is finite).

Documents (``resets``): global segment ids (a running count of document starts: the slice's own
cumulative count plus the starts of every earlier slice) travel with the keys, and a block masks
query i against key j unless their ids agree (and j <= i on the diagonal). A document spanning a
slice boundary is seen by the cross block; one starting exactly on it is not.

The backward (``jax.custom_vjp``) keeps only the slice's q, k, v, segment ids, the combined
output and its lse: no gathered keys, no ``[S, T]`` scores. It goes round the ring again; each
block recomputes its probabilities from the combined lse (exp(s - lse)), adds its dq locally, and
adds its dk, dv to accumulators that travel with the keys and values and are sent home after the
last step.

Balance (``ring``): with contiguous slices and causal masking device r attends to r + 1 blocks,
so the last device works N steps while the first idles. The balanced ring
(:func:`zigzag_ring_attention`, the default) moves each slice to chunks r and 2N-1-r of 2N first
(:func:`to_zigzag`, two collective-permutes; the output comes back by :func:`from_zigzag`), after
which every device attends half a block at every step.

Per-block ops (:class:`Block`): ``xla`` (any backend, the oracle: the block's ``[S, S]`` scores
materialised, masks from positions and segment ids), the same in tiles (:func:`tiled_block`:
an online softmax over key tiles, for blocks whose scores would not fit: document resets at
long contexts) and ``cudnn`` (cuDNN's fused attention through JAX's internals, which return the
lse and take the combined output and lse in their backward: causal for the diagonal, unmasked
for the cross blocks, bfloat16/float16 only, no document resets yet).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from linear_gpt2.platform.mesh import SEQ


@dataclasses.dataclass(frozen=True)
class Block:
    """One block's fused attention. ``fwd(q, k, v, seg_q, seg_k, causal) -> (o, lse)``: q
    ``[B, Sq, H, D]``, k, v ``[B, Sk, H, D]``, seg ``int32 [B, S*]`` or None, ``o`` float32 ``[B,
    Sq, H, D]``, ``lse`` float32 ``[B, H, Sq]``. ``bwd(q, k, v, seg_q, seg_k, causal, o, lse,
    do) -> (dq, dk, dv)`` float32, with the combined ``o`` and ``lse`` of every block of the
    rows (the probabilities are exp(s - lse))."""

    name: str
    fwd: Callable
    bwd: Callable


# --------------------------------------------------------------------------------------------
# The XLA block (any backend; the oracle of the fused ones)


def block_mask(Sq: int, Sk: int, seg_q, seg_k, causal: bool):
    """bool ``[B or 1, Sq, Sk]``, or None when nothing is masked."""
    mask = None
    if causal:
        mask = (jnp.arange(Sk)[None, :] <= jnp.arange(Sq)[:, None])[None]
    if seg_q is not None:
        same = seg_q[:, :, None] == seg_k[:, None, :]
        mask = same if mask is None else mask & same
    return mask


def _scores(q, k, mask):
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(q.shape[-1]))
    return s if mask is None else jnp.where(mask[:, None], s, -jnp.inf)


def xla_fwd(q, k, v, seg_q, seg_k, causal):
    s = _scores(q, k, block_mask(q.shape[1], k.shape[1], seg_q, seg_k, causal))
    m = jnp.max(s, axis=-1)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # a wholly masked row: exp(-inf - 0) = 0, no NaN
    p = jnp.exp(s - m[..., None])
    den = jnp.sum(p, axis=-1)
    lse = jnp.where(den > 0, m + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
    o = jnp.einsum(
        "bhqk,bkhd->bqhd", p / jnp.where(den > 0, den, 1.0)[..., None], v.astype(p.dtype)
    )
    return o, lse


def xla_bwd(q, k, v, seg_q, seg_k, causal, o, lse, do):
    s = _scores(q, k, block_mask(q.shape[1], k.shape[1], seg_q, seg_k, causal))
    # Masked scores are -inf: p = 0 (a row with no key at all has lse -inf: 0 there too).
    p = jnp.exp(s - jnp.where(jnp.isfinite(lse), lse, 0.0)[..., None])
    do = do.astype(jnp.float32)
    delta = jnp.einsum("bqhd,bqhd->bhq", do, o.astype(jnp.float32))
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, do)
    dp = jnp.einsum("bqhd,bkhd->bhqk", do, v.astype(jnp.float32))
    ds = p * (dp - delta[..., None]) * (1.0 / math.sqrt(q.shape[-1]))
    dq = jnp.einsum("bhqk,bkhd->bqhd", ds, k.astype(jnp.float32))
    dk = jnp.einsum("bhqk,bqhd->bkhd", ds, q.astype(jnp.float32))
    return dq, dk, dv


XLA = Block("xla", xla_fwd, xla_bwd)


# --------------------------------------------------------------------------------------------
# The tiled XLA block: the same function in tiles, for blocks whose scores do not fit


def _tile(S: int, target: int) -> int:
    """The largest divisor of ``S`` not above ``target``."""
    return next(t for t in range(min(S, target), 0, -1) if S % t == 0)


def _tiled_scores(qi, kj, i, j, tq, tk, sq, sk, causal):
    """Scaled float32 scores ``[B, H, tq, tk]`` of query tile i against key tile j, -inf where
    masked (causal by position in the block, documents by segment id)."""
    s = jnp.einsum("bqhd,bkhd->bhqk", qi, kj, preferred_element_type=jnp.float32)
    s = s * (1.0 / math.sqrt(qi.shape[-1]))
    # The masks depend only on tile indices and segment ids. Differentiating the model's layer
    # scan, JAX's partial evaluation would compute them apart from the scores, in a loop of
    # their own, and keep every tile's mask at once ([tiles, tiles, B, H, t, t]); tied to the
    # scores here, they are made where they are used.
    s, i, j, sq, sk = lax.optimization_barrier((s, i, j, sq, sk))
    keep = None
    if causal:
        keep = (j * tk + jnp.arange(tk))[None, :] <= (i * tq + jnp.arange(tq))[:, None]
        keep = keep[None, None]
    if sq is not None:
        same = (sq[:, :, None] == sk[:, None, :])[:, None]
        keep = same if keep is None else keep & same
    return s if keep is None else jnp.where(keep, s, -jnp.inf)


def tiled_block(tile: int = 1024) -> Block:
    """:data:`XLA`'s function computed in ``[tile, tile]`` tiles (fewer where the block's
    length has no such divisor): a loop over query tiles with an online softmax over key tiles
    forward; backward one loop over query tiles for dq and one over key tiles for dk, dv, each
    recomputing its tiles' probabilities from the combined lse. Memory per device is a few
    tiles of scores, not the block's [Sq, Sk]: document resets at long contexts, which cuDNN's
    blocks do not take here, fit. Plain XLA loops, so any backend runs it and the CPU tests it
    against :data:`XLA`."""

    def split(x, t):  # [B, S, ...] -> [S / t, B, t, ...] (the loop's axis first)
        return None if x is None else jnp.moveaxis(x.reshape(x.shape[0], -1, t, *x.shape[2:]), 1, 0)

    def join(x):  # the inverse of split
        return jnp.moveaxis(x, 0, 1).reshape(x.shape[1], -1, *x.shape[3:])

    def fwd(q, k, v, seg_q, seg_k, causal):
        tq, tk = _tile(q.shape[1], tile), _tile(k.shape[1], tile)
        K, V, SK = split(k, tk), split(v, tk), split(seg_k, tk)
        B, H, D = q.shape[0], q.shape[2], q.shape[3]

        def query_tile(args):
            i, qi, sq = args

            def key_tile(carry, args):
                m, l, acc = carry
                j, kj, vj, sk = args
                s = _tiled_scores(qi, kj, i, j, tq, tk, sq, sk, causal)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - safe[..., None])
                fade = jnp.exp(jnp.where(jnp.isfinite(m), m - safe, -jnp.inf))  # [B, H, tq]
                l = l * fade + jnp.sum(p, axis=-1)
                pv = jnp.einsum("bhqk,bkhd->bqhd", p, vj.astype(jnp.float32))
                return (m_new, l, acc * jnp.swapaxes(fade, 1, 2)[..., None] + pv), None

            init = (jnp.full((B, H, tq), -jnp.inf, jnp.float32),
                    jnp.zeros((B, H, tq), jnp.float32), jnp.zeros((B, tq, H, D), jnp.float32))  # fmt: skip
            js = jnp.arange(K.shape[0])
            (m, l, acc), _ = lax.scan(key_tile, init, (js, K, V, SK))
            o = acc / jnp.swapaxes(jnp.where(l > 0, l, 1.0), 1, 2)[..., None]
            lse = jnp.where(l > 0, m + jnp.log(jnp.where(l > 0, l, 1.0)), -jnp.inf)
            return o, lse

        Q = split(q, tq)
        o, lse = lax.map(query_tile, (jnp.arange(Q.shape[0]), Q, split(seg_q, tq)))
        return join(o), jnp.moveaxis(lse, 0, 2).reshape(B, H, -1)

    def bwd(q, k, v, seg_q, seg_k, causal, o, lse, do):
        tq, tk = _tile(q.shape[1], tile), _tile(k.shape[1], tile)
        B, H = q.shape[0], q.shape[2]
        scale = 1.0 / math.sqrt(q.shape[-1])
        do = do.astype(jnp.float32)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, o.astype(jnp.float32))
        # Per query tile: [n, B, H, tq] for the row statistics.
        rows = lambda x: jnp.moveaxis(x.reshape(B, H, -1, tq), 2, 0)  # noqa: E731
        Q, DO, SQ, LSE, DELTA = (
            split(q, tq),
            split(do, tq),
            split(seg_q, tq),
            rows(lse),
            rows(delta),
        )
        K, V, SK = split(k, tk), split(v, tk), split(seg_k, tk)

        def probs(i, j, qi, kj, sq, sk, lse_i):
            s = _tiled_scores(qi, kj, i, j, tq, tk, sq, sk, causal)
            return jnp.exp(s - jnp.where(jnp.isfinite(lse_i), lse_i, 0.0)[..., None])

        def dscores(p, doi, vj, delta_i):
            dp = jnp.einsum("bqhd,bkhd->bhqk", doi, vj.astype(jnp.float32))
            return p * (dp - delta_i[..., None]) * scale

        def dq_tile(args):
            i, qi, doi, sq, lse_i, delta_i = args

            def key_tile(dq, args):
                j, kj, vj, sk = args
                ds = dscores(probs(i, j, qi, kj, sq, sk, lse_i), doi, vj, delta_i)
                return dq + jnp.einsum("bhqk,bkhd->bqhd", ds, kj.astype(jnp.float32)), None

            dq0 = jnp.zeros(qi.shape, jnp.float32)
            return lax.scan(key_tile, dq0, (jnp.arange(K.shape[0]), K, V, SK))[0]

        def dkv_tile(args):
            j, kj, vj, sk = args

            def query_tile(carry, args):
                dk, dv = carry
                i, qi, doi, sq, lse_i, delta_i = args
                p = probs(i, j, qi, kj, sq, sk, lse_i)
                ds = dscores(p, doi, vj, delta_i)
                dv = dv + jnp.einsum("bhqk,bqhd->bkhd", p, doi)
                dk = dk + jnp.einsum("bhqk,bqhd->bkhd", ds, qi.astype(jnp.float32))
                return (dk, dv), None

            zero = jnp.zeros(kj.shape, jnp.float32)
            xs = (jnp.arange(Q.shape[0]), Q, DO, SQ, LSE, DELTA)
            return lax.scan(query_tile, (zero, zero), xs)[0]

        dq = lax.map(dq_tile, (jnp.arange(Q.shape[0]), Q, DO, SQ, LSE, DELTA))
        dk, dv = lax.map(dkv_tile, (jnp.arange(K.shape[0]), K, V, SK))
        return join(dq), join(dk), join(dv)

    return Block(f"xla_tiled{tile}", fwd, bwd)


XLA_TILED = tiled_block()


# --------------------------------------------------------------------------------------------
# The cuDNN block (GPU)


def _cudnn_args(q, causal):
    # cuDNN attention's internals (lse out, combined o and lse into the backward): only when the
    # kernel is chosen, on a GPU or a GPU compile target.
    from jax._src.cudnn import fused_attention_stablehlo as fa

    unused = jnp.zeros(0, dtype=q.dtype)
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    params = dict(
        scale=1.0 / math.sqrt(q.shape[-1]), seed=42, dropout_rate=0.0,
        variadic_args=(False, False), mask_type=mask, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=None,
    )  # fmt: skip
    return fa, (unused,) * 7, params


def cudnn_fwd(q, k, v, seg_q, seg_k, causal):
    assert seg_q is None, "cuDNN blocks take no document resets (checked by ops.context_block)"
    fa, unused, params = _cudnn_args(q, causal)
    fa.check_is_flash_attention(
        q, k, v, params["layout"], fa.check_cudnn_version(), False, True, False
    )
    # The primitives themselves, not the custom-partitioning wrappers of JAX's own API: inside
    # shard_map every operand is one device's, and the wrappers cannot lower there.
    o, lse = fa._dot_product_attention_fwd_impl(q, k, v, *unused, **params, is_training=True)
    return o.astype(jnp.float32), lse


def cudnn_bwd(q, k, v, seg_q, seg_k, causal, o, lse, do):
    fa, unused, params = _cudnn_args(q, causal)
    dq, dk, dv = fa._dot_product_attention_bwd_impl(
        q, k, v, *unused, lse, o.astype(q.dtype), do.astype(q.dtype), **params
    )
    return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)


CUDNN = Block("cudnn", cudnn_fwd, cudnn_bwd)


# --------------------------------------------------------------------------------------------
# The ring


def global_segments(resets, n: int):
    """Global segment ids of this device's slice, int32 ``[B, S]``: its cumulative count of
    document starts plus every earlier slice's (a [B, N] gather of the slices' counts)."""
    local = jnp.cumsum(resets.astype(jnp.int32), axis=1)
    counts = lax.all_gather(local[:, -1], SEQ, axis=1, tiled=False)  # [B, N]
    r = lax.axis_index(SEQ)
    before = jnp.sum(jnp.where(jnp.arange(n)[None] < r, counts, 0), axis=1)
    return local + before[:, None]


def _combine(o, lse, ob, lb):
    new = jnp.logaddexp(lse, lb)
    safe = jnp.where(jnp.isfinite(new), new, 0.0)
    wa = jnp.exp(lse - safe)  # [B, H, S]
    wb = jnp.exp(lb - safe)
    t = lambda w: jnp.swapaxes(w, 1, 2)[..., None]  # -> [B, S, H, 1]  # noqa: E731
    return o * t(wa) + ob * t(wb), new


def _next(x, n):
    return lax.ppermute(x, SEQ, [(i, (i + 1) % n) for i in range(n)])


def _ring(n: int, diag_fwd, step_fwd, diag_bwd, step_bwd):
    """``attend(q, k, v, seg) -> y`` going round the ring of ``n`` devices, with its blockwise
    ``custom_vjp``; a layout gives its four parts (each device's own q, k, v ``[B, S, H, D]``,
    seg int32 ``[B, S]`` or None; ``kv`` the arriving slice's (k, v, seg), from device (r - t)
    mod N at step t):

    - ``diag_fwd(q, k, v, seg) -> (o, lse)``: the device's own keys;
    - ``step_fwd(t, q, seg, kv, o, lse) -> (o, lse)``: fold in the arriving slice;
    - ``diag_bwd(q, k, v, seg, y, lse, dy) -> (dq, dk, dv)``, float32;
    - ``step_bwd(t, q, seg, kv, y, lse, dy, dq, dkv) -> (dq, dkv)``: ``dkv`` the float32
      accumulators that travel with the arriving slice.

    The N - 1 steps are unrolled, not a fori_loop: XLA's GPU compiler (jax 0.11.2) crashed on
    cuDNN attention inside a loop nested in the model's layer scan."""

    def forward(q, k, v, seg):
        o, lse = diag_fwd(q, k, v, seg)
        kv = (k, v, seg)
        for t in range(1, n):
            kv = jax.tree.map(lambda x: _next(x, n), kv)
            o, lse = step_fwd(t, q, seg, kv, o, lse)
        return o.astype(q.dtype), lse

    @jax.custom_vjp
    def attend(q, k, v, seg):
        return forward(q, k, v, seg)[0]

    def fwd(q, k, v, seg):
        y, lse = forward(q, k, v, seg)
        return y, (q, k, v, seg, y, lse)

    def bwd(res, dy):
        q, k, v, seg, y, lse = res
        dq, dk, dv = diag_bwd(q, k, v, seg, y, lse, dy)
        kv, dkv = (k, v, seg), (dk, dv)
        for t in range(1, n):
            kv, dkv = jax.tree.map(lambda x: _next(x, n), (kv, dkv))
            dq, dkv = step_bwd(t, q, seg, kv, y, lse, dy, dq, dkv)
        # Each slice's gradients back home, in the inputs' dtype (summed in float32 round the ring)
        dk, dv = (_next(x.astype(t.dtype), n) for x, t in zip(dkv, (k, v)))
        dseg = None if seg is None else np.zeros(seg.shape, dtype=jax.dtypes.float0)
        return dq.astype(q.dtype), dk, dv, dseg

    attend.defvjp(fwd, bwd)
    return attend


def ring_attention(block: Block, n: int):
    """``local(q, k, v, seg) -> y`` for one device inside ``shard_map`` over :data:`SEQ` with
    ``n`` contiguous slices: q, k, v ``[B, S, H, D]``, seg int32 ``[B, S]`` (global segment ids)
    or None, y ``[B, S, H, D]`` in q's dtype. Device r attends to slice r - t at step t while
    t <= r and idles after."""

    def diag_fwd(q, k, v, seg):
        return block.fwd(q, k, v, seg, seg, True)

    def step_fwd(t, q, seg, kv, o, lse):
        def attend(o, lse):
            return _combine(o, lse, *block.fwd(q, kv[0], kv[1], seg, kv[2], False))

        return lax.cond(t <= lax.axis_index(SEQ), attend, lambda o, lse: (o, lse), o, lse)

    def diag_bwd(q, k, v, seg, y, lse, dy):
        return block.bwd(q, k, v, seg, seg, True, y, lse, dy)

    def step_bwd(t, q, seg, kv, y, lse, dy, dq, dkv):
        def grads(dq, dkv):
            gq, gk, gv = block.bwd(q, kv[0], kv[1], seg, kv[2], False, y, lse, dy)
            return dq + gq, (dkv[0] + gk, dkv[1] + gv)

        return lax.cond(t <= lax.axis_index(SEQ), grads, lambda dq, dkv: (dq, dkv), dq, dkv)

    return _ring(n, diag_fwd, step_fwd, diag_bwd, step_bwd)


# --------------------------------------------------------------------------------------------
# The balanced ("zigzag") ring

RINGS = ("zigzag", "contiguous")


def check_ring(ring: str) -> None:
    if ring not in RINGS:
        raise ValueError(f"ring={ring!r} is not a ring layout; use one of {', '.join(RINGS)}")


def _owner(c: int, n: int) -> int:
    """The device that holds chunk ``c`` of ``2n`` in the balanced layout (chunks c and 2n-1-c
    on device c)."""
    return c if c < n else 2 * n - 1 - c


def to_zigzag(x, n: int):
    """Device r's contiguous slice (chunks 2r, 2r+1 of 2N) ``[B, S, ...]`` -> its balanced slice
    (chunks r, 2N-1-r) ``[B, S, ...]``. Every device receives one even and one odd chunk, so
    two collective-permutes move them; differentiable (a permute's transpose is the inverse)."""
    h = x.shape[1] // 2
    even = lax.ppermute(x[:, :h], SEQ, [(r, _owner(2 * r, n)) for r in range(n)])
    odd = lax.ppermute(x[:, h:], SEQ, [(r, _owner(2 * r + 1, n)) for r in range(n)])
    first = lax.axis_index(SEQ) % 2 == 0  # chunk r is the even one on even devices
    return jnp.concatenate([jnp.where(first, even, odd), jnp.where(first, odd, even)], axis=1)


def from_zigzag(x, n: int):
    """The inverse of :func:`to_zigzag`."""
    h = x.shape[1] // 2
    first = lax.axis_index(SEQ) % 2 == 0
    lo, hi = x[:, :h], x[:, h:]
    even, odd = jnp.where(first, lo, hi), jnp.where(first, hi, lo)
    even = lax.ppermute(even, SEQ, [(_owner(2 * r, n), r) for r in range(n)])
    odd = lax.ppermute(odd, SEQ, [(_owner(2 * r + 1, n), r) for r in range(n)])
    return jnp.concatenate([even, odd], axis=1)


def zigzag_ring_attention(block: Block, n: int):
    """``local(q, k, v, seg) -> y`` over the balanced layout: the sequence cut into 2N chunks,
    device r holding chunks r and 2N-1-r (``[B, S, H, D]``, S / 2 each, as :func:`to_zigzag`
    gives them; y likewise). Keys from device s != r are either all earlier than one of r's
    chunks and later than the other's whole (s > r: r's second half against all of s) or hold one
    chunk earlier than both of r's and one later (s < r: all of r against s's first half): half a
    block either way, so every device does the same work at every step of the ring, where the
    contiguous ring gives device N-1 N blocks and device 0 one."""

    def halves(x):
        return (None, None) if x is None else (x[:, : x.shape[1] // 2], x[:, x.shape[1] // 2 :])

    def early(t):  # the arriving slice came from s = (r - t) mod N < r
        r = lax.axis_index(SEQ)
        return (r - t) % n < r

    def diag_fwd(q, k, v, seg):
        # Chunk r causally; chunk 2N-1-r against chunk r in full, itself causally.
        (qa, qb), (ka, kb), (va, vb), (sa, sb) = halves(q), halves(k), halves(v), halves(seg)
        oa, la = block.fwd(qa, ka, va, sa, sa, True)
        ob, lb = block.fwd(qb, ka, va, sb, sa, False)
        ob, lb = _combine(ob, lb, *block.fwd(qb, kb, vb, sb, sb, True))
        return jnp.concatenate([oa, ob], axis=1), jnp.concatenate([la, lb], axis=2)

    def step_fwd(t, q, seg, kv, o, lse):
        (k_s, v_s, seg_s), h = kv, q.shape[1] // 2

        def all_queries(o, lse):  # against the source's first chunk
            first = None if seg_s is None else seg_s[:, :h]
            return _combine(o, lse, *block.fwd(q, k_s[:, :h], v_s[:, :h], seg, first, False))

        def second_half(o, lse):  # r's second chunk against both of the source's
            sb = None if seg is None else seg[:, h:]
            ob, lb = block.fwd(q[:, h:], k_s, v_s, sb, seg_s, False)
            ob, lb = _combine(o[:, h:], lse[..., h:], ob, lb)
            return (jnp.concatenate([o[:, :h], ob], axis=1),
                    jnp.concatenate([lse[..., :h], lb], axis=2))  # fmt: skip

        return lax.cond(early(t), all_queries, second_half, o, lse)

    def diag_bwd(q, k, v, seg, y, lse, dy):
        (qa, qb), (ka, kb), (va, vb), (sa, sb) = halves(q), halves(k), halves(v), halves(seg)
        (ya, yb), (dya, dyb), h = halves(y), halves(dy), q.shape[1] // 2
        la, lb = lse[..., :h], lse[..., h:]
        gqa, gka, gva = block.bwd(qa, ka, va, sa, sa, True, ya, la, dya)
        gqb, gka2, gva2 = block.bwd(qb, ka, va, sb, sa, False, yb, lb, dyb)
        gqb2, gkb, gvb = block.bwd(qb, kb, vb, sb, sb, True, yb, lb, dyb)
        cat = lambda a, b: jnp.concatenate([a, b], axis=1)  # noqa: E731
        return cat(gqa, gqb + gqb2), cat(gka + gka2, gkb), cat(gva + gva2, gvb)

    def step_bwd(t, q, seg, kv, y, lse, dy, dq, dkv):
        (k_s, v_s, seg_s), h = kv, q.shape[1] // 2

        def all_queries(dq, dkv):
            first = None if seg_s is None else seg_s[:, :h]
            gq, gk, gv = block.bwd(q, k_s[:, :h], v_s[:, :h], seg, first, False, y, lse, dy)
            pad = lambda g: jnp.concatenate([g, jnp.zeros_like(g)], axis=1)  # noqa: E731
            return dq + gq, (dkv[0] + pad(gk), dkv[1] + pad(gv))

        def second_half(dq, dkv):
            sb = None if seg is None else seg[:, h:]
            gq, gk, gv = block.bwd(
                q[:, h:], k_s, v_s, sb, seg_s, False, y[:, h:], lse[..., h:], dy[:, h:]
            )
            dq = jnp.concatenate([dq[:, :h], dq[:, h:] + gq], axis=1)
            return dq, (dkv[0] + gk, dkv[1] + gv)

        return lax.cond(early(t), all_queries, second_half, dq, dkv)

    return _ring(n, diag_fwd, step_fwd, diag_bwd, step_bwd)


def ring_local(block: Block, n: int, ring: str = "zigzag"):
    """The per-slice function ``linear_gpt2.attention.context.over_sequence`` runs: the
    balanced ring (``zigzag``: each slice's q, k, v, segment ids moved to the balanced layout
    and the output moved back, :func:`to_zigzag`) or the ``contiguous`` one."""
    check_ring(ring)
    if ring == "contiguous":
        attend = ring_attention(block, n)
    else:
        zz = zigzag_ring_attention(block, n)

        def attend(q, k, v, seg):
            q, k, v = (to_zigzag(x, n) for x in (q, k, v))
            return from_zigzag(zz(q, k, v, None if seg is None else to_zigzag(seg, n)), n)

    def local(q, k, v, resets=None, log_gate=None):
        del log_gate  # softmax attention has no decay
        seg = None if resets is None else global_segments(resets, n)
        return attend(q, k, v, seg)

    return local


def modelled_ring_bytes(
    B: int, T: int, H: int, D: int, n: int, itemsize: int, ring: str = "zigzag"
) -> dict:
    """Bytes one device sends per layer round the ring (a MODEL): the forward passes N - 1 of
    its N slices of K and V, (N - 1) / N of the whole K and V; the backward passes K, V again
    and their float32 gradient accumulators N - 1 times, plus one last hop of the gradients home
    in the inputs' dtype. The balanced ring adds the relayout (``relayout``, in both totals):
    forward q, k, v to the balanced layout and the output back (four slices), backward their
    cotangents the other way (four slices). Segment ids (4 bytes a token, with resets) are left
    out."""
    S = T // n
    kv = 2 * B * S * H * D * itemsize
    dkv = 2 * B * S * H * D * 4
    relayout = 4 * B * S * H * D * itemsize if ring == "zigzag" else 0
    return {
        "forward": (n - 1) * kv + relayout,
        "backward": (n - 1) * (kv + dkv) + kv + relayout,
        "relayout": relayout,
        "kv_whole_sequence": 2 * B * T * H * D * itemsize,
    }


def modelled_critical_blocks(n: int, ring: str = "zigzag") -> float:
    """The attention work on the ring's critical path, in units of one [T/N, T/N] block of
    scores (a MODEL; a causal block counts half): every step waits for the slowest device. The
    contiguous ring's device N-1 attends to every earlier slice, 1/2 + (N-1); the balanced
    ring's devices each do half a block a step, 1/2 + (N-1)/2."""
    return 0.5 + (n - 1) * (0.5 if ring == "zigzag" else 1.0)
