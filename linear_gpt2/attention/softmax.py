"""``softmax``: causal softmax attention with the T x T score matrix materialised (plain XLA).

Cost O(T^2 D) FLOPs and O(T^2) memory per head. This is nanoGPT's non-flash path, and the
reference the fused variants are checked against.

:func:`make_decoder` is the KV-cache decoder used for sampling by every softmax-family variant
(``flash`` reuses it): each new token attends over the cached keys and values.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from linear_gpt2.attention.spec import AttentionSpec, Decoder, quadratic_flops
from linear_gpt2.kernels.flash.naive import document_mask


def masked_softmax_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array,
    *,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Softmax attention under a boolean mask. q ``[B, Tq, H, D]``; k, v ``[B, Tk, H, D]``;
    mask ``[Tq, Tk]`` or ``[B, 1, Tq, Tk]`` (True = attend; every row needs at least one True)
    -> ``[B, Tq, H, D]``."""
    D = q.shape[-1]
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
    scores = scores / math.sqrt(D)
    scores = jnp.where(mask, scores, -jnp.inf)
    weights = jax.nn.softmax(scores, axis=-1)
    if dropout_rate > 0.0 and dropout_rng is not None:
        keep = jax.random.bernoulli(dropout_rng, 1.0 - dropout_rate, weights.shape)
        weights = jnp.where(keep, weights / (1.0 - dropout_rate), 0.0)
    y = jnp.einsum("bhqk,bkhd->bqhd", weights.astype(v.dtype), v)
    return y.astype(q.dtype)


def softmax_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    resets: jax.Array | None = None,
    dropout_rate: float = 0.0,
    dropout_rng: jax.Array | None = None,
) -> jax.Array:
    """Causal softmax attention. q, k, v: ``[B, T, H, D]`` -> ``[B, T, H, D]``; with ``resets``
    (bool ``[B, T]``, True where a document starts) no query attends across a document start.

    Scores are scaled by 1/sqrt(D) and the softmax is taken in float32 whatever the input dtype,
    as torch autocast does. ``dropout_rate`` > 0 with a ``dropout_rng`` drops attention weights
    (nanoGPT's ``attn_dropout`` site) and rescales the kept ones by 1/(1 - rate), so the output's
    expectation is unchanged; without a ``dropout_rng`` no dropout is applied.
    """
    T = q.shape[1]
    mask = jnp.tril(jnp.ones((T, T), dtype=bool)) if resets is None else document_mask(resets)
    return masked_softmax_attention(
        q, k, v, mask, dropout_rate=dropout_rate, dropout_rng=dropout_rng
    )


def make(options):
    del options  # none of its own
    return softmax_attention


# --------------------------------------------------------------------------------------------
# KV-cache decoder

# state = (k_cache [B, max_len, H, D], v_cache [B, max_len, H, D], pos int32 [], seg int32
# [B, max_len]): the keys, values and document index of the first ``pos`` tokens, the rest of the
# cache unused. Document indices only differ when resets are given (attention.doc_reset).
KVCache = tuple[jax.Array, jax.Array, jax.Array, jax.Array]


def _kv_init(batch: int, n_head: int, head_dim: int, max_len: int, dtype=jnp.float32) -> KVCache:
    """An empty cache with room for ``max_len`` tokens."""
    shape = (batch, max_len, n_head, head_dim)
    return (
        jnp.zeros(shape, dtype),
        jnp.zeros(shape, dtype),
        jnp.zeros((), jnp.int32),
        jnp.zeros((batch, max_len), jnp.int32),
    )


def _check_room(pos: jax.Array, T: int, max_len: int) -> None:
    """Refuse to write tokens ``pos .. pos+T-1`` past the end of a ``max_len`` cache.

    Two guards here, since a traced ``pos`` cannot raise inside ``jit``: a block longer than the
    whole cache is a shape error (always raised); a concrete ``pos`` (eager use) raises.
    Otherwise :func:`_kv_prefill` returns NaN (see there). (A ``checkify`` check would add an
    effect that Flax's ``nn.scan`` over layers refuses, so the model's decode path could not use
    this cache.) The sampler should check
    ``prompt_len + new_tokens <= max_len`` itself before it starts.
    """
    if T > max_len:
        raise ValueError(
            f"cannot attend a block of {T} tokens with a KV cache of max_len={max_len}"
        )
    try:
        p = int(pos)
    except jax.errors.ConcretizationTypeError:  # traced: checked at run time (below)
        p = None
    if p is not None and p + T > max_len:
        raise ValueError(
            f"KV cache overflow: {p} cached tokens + {T} new > max_len={max_len}; "
            f"initialise the decoder with a larger max_len"
        )


def _kv_prefill(state: KVCache, q: jax.Array, k: jax.Array, v: jax.Array, *, resets=None):
    """Append a block of T tokens after the ``pos`` cached ones and attend, causally within the
    block. q, k, v ``[B, T, H, D]`` -> ``(y [B, T, H, D], state)``; ``resets`` bool ``[B, T]``:
    documents start there (a query then sees only its own document's keys).

    The scores are taken against the whole ``max_len`` cache with the unused part masked, so one
    call costs O(T * max_len * D) whatever ``pos`` is (no recompilation as ``pos`` grows).

    A traced overflow (``pos + T > max_len``) yields NaN outputs, and every later call on that
    state too, instead of the silently wrong answer ``lax.dynamic_update_slice`` would give (it
    clamps the write position).
    """
    k_cache, v_cache, pos, seg_cache = state
    T, max_len = q.shape[1], k_cache.shape[1]
    _check_room(pos, T, max_len)
    start = (0, pos, 0, 0)
    k_cache = lax.dynamic_update_slice(k_cache, k.astype(k_cache.dtype), start)
    v_cache = lax.dynamic_update_slice(v_cache, v.astype(v_cache.dtype), start)
    # The document of each new token: the last cached token's, plus the starts up to it.
    last = lax.dynamic_index_in_dim(seg_cache, jnp.maximum(pos - 1, 0), axis=1, keepdims=False)
    seg = last[:, None] + (0 if resets is None else jnp.cumsum(resets.astype(jnp.int32), axis=1))
    seg_cache = lax.dynamic_update_slice(seg_cache, seg.astype(jnp.int32), (0, pos))
    # Query i of the block sits at absolute position pos + i and sees keys 0 .. pos + i of its
    # own document.
    mask = jnp.arange(max_len)[None, :] <= pos + jnp.arange(T)[:, None]
    mask = mask[None, None] & (seg_cache[:, None, None, :] == seg[:, None, :, None])
    y = masked_softmax_attention(q, k_cache, v_cache, mask)
    new_pos = pos + T
    y = jnp.where(new_pos <= max_len, y, jnp.nan)
    return y, (k_cache, v_cache, new_pos, seg_cache)


def _kv_step(state: KVCache, q: jax.Array, k: jax.Array, v: jax.Array, *, reset=None):
    """One token: q, k, v ``[B, H, D]`` -> ``(y [B, H, D], state)``; a prefill of length 1."""
    resets = None if reset is None else reset[:, None]
    y, state = _kv_prefill(state, q[:, None], k[:, None], v[:, None], resets=resets)
    return y[:, 0], state


def make_decoder(options=None) -> Decoder:
    """The KV-cache :class:`~linear_gpt2.attention.Decoder` of causal softmax attention.

    State ``(k_cache [B, max_len, H, D], v_cache [B, max_len, H, D], pos int32 [], seg int32
    [B, max_len])`` in the ``dtype`` given to ``init``; scores and softmax in float32 as in
    :func:`softmax_attention`. Per-token cost is O(max_len * D) per head, growing with the context
    the cache is sized for. Writing past ``max_len`` raises where it can and yields NaN where it
    cannot (inside ``jit``); see :func:`_check_room`. ``step`` / ``prefill`` take ``reset`` /
    ``resets`` (documents start there, ``attention.doc_reset``).
    """
    return Decoder(init=_kv_init, step=_kv_step, prefill=_kv_prefill, kind="KV cache")


SPEC = AttentionSpec(
    name="softmax",
    family="softmax",
    make=make,
    flops=quadratic_flops,
    make_decoder=make_decoder,
    resets=True,
    dropout=True,
    description="causal softmax, the T x T scores materialised (plain XLA)",
)
