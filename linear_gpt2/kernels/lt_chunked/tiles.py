"""Tile math shared by every ``LT_chunked`` kernel (chunk-parallel and fused single-pass).

A chunk of c positions is processed in P = c / bt row tiles of bt rows (``plan.Blocks``); tile
(i, j) of a chunk's [c, c] score matrix pairs query tile i with key tile j (j <= i; tiles above
the diagonal are all masked and never computed). Everything a kernel does inside a chunk goes
through the functions here:

- :func:`weighted` is the *one* place that says which (query, key) pairs of a chunk interact
  and with what weight: the causal mask today. Per-position decay gates and document resets
  (issue 14) multiply a [c, c] decay/segment factor in here, and every kernel picks it up:
  the forward scores (:func:`scores`) and the backward score cotangents
  (:func:`score_cotangents`) both go through it.
- :func:`chunk_scale` is the factor the carried state is multiplied by while it passes a chunk
  (1 today; the chunk's cumulative decay with gates).

Precision: every dot between two sequence tiles takes its operands in the input dtype (phi(q),
phi(k), v, the scores A, and in the backward pass the cotangents g and dA too, rounded to the
input dtype as flash-linear-attention does: bfloat16 tensor-core dots, half the registers of
float32 ones); every dot with a [D, D] state (S, dS) takes float32 operands (the state is never
rounded); every accumulation is float32 (``preferred_element_type``), and so are the states,
the normaliser sums and the row cotangents r, delta. In float32 all of it is float32. The
oracle (``attention.lt_chunked.chunked_linear_attention``, differentiated by autodiff) keeps
the cotangents in float32: bfloat16 gradients differ from it by the rounding of g and dA
(tests/test_kernels.py bounds it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from linear_gpt2 import kernels

F32 = jnp.float32


def dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=F32)


def tile_mask(i, j, bt: int) -> jax.Array:
    """``[bt, bt]`` bool: query row a of tile i sees key row b of tile j (tile indices inside the
    chunk) iff the key is at or before the query."""
    row = jnp.arange(bt)
    return (i * bt + row)[:, None] >= (j * bt + row)[None, :]


def weighted(x: jax.Array, i, j, bt: int) -> jax.Array:
    """``x`` ``[bt, bt]`` (scores or their cotangents, tile (i, j) of the chunk) times the chunk's
    pair weights: the causal mask today (``where``, so that a masked inf never becomes NaN).
    Issue 14's decay products exp(G_a - G_b) and document-segment mask multiply in here."""
    return jnp.where(tile_mask(i, j, bt), x, 0.0)


def scores(q: jax.Array, k: jax.Array, i, j, bt: int) -> jax.Array:
    """Tile (i, j) of the chunk's weighted scores ``W * (phi(Q) phi(K)^T)``, float32 ``[bt, bt]``."""
    return weighted(dot(q, k.T), i, j, bt)


def score_cotangents(g: jax.Array, v: jax.Array, delta: jax.Array, i, j, bt: int) -> jax.Array:
    """Cotangent of the raw scores of tile (i, j): ``W * (g V^T - delta 1^T)``, float32 (g V^T
    with operands in v's dtype, ``- delta`` in float32).

    g = dY / (den + eps) is the cotangent of the numerator; -delta, delta_a = g_a . y_a, that of
    the denominator. Numerator and denominator are sums over the same weighted scores, so one
    dA carries both into dphi(q) and dphi(k): the normaliser's gradient is the ``- delta``
    term (the term flash-linear-attention once lost for dk, fla #875)."""
    return weighted(dot(g.astype(v.dtype), v.T) - delta[:, None], i, j, bt)


def chunk_scale(n):
    """Factor the carried state is multiplied by while passing chunk n, S_{n+1} = scale_n S_n +
    phi(K_n)^T V_n (and the cotangent dS_n = scale_n dS_{n+1} + phi(Q_n)^T g_n): 1, no decay.
    Issue 14: the chunk's cumulative gate product, from log-space sums in float32."""
    del n
    return 1.0


def reciprocal(den: jax.Array, eps: float) -> jax.Array:
    return kernels.reciprocal(den, eps)


def cotangent_rows(dy: jax.Array, r: jax.Array) -> jax.Array:
    """g = dY * r, float32: the cotangent of the numerator rows (r = 1 / (den + eps))."""
    return dy.astype(F32) * r[:, None]


def loop(lo, hi, body, init):
    """``fori_loop(lo, hi, body, init)``, or the body once when the range is statically one
    iteration (c = bt: a chunk is one tile). Tile loops stay loops otherwise: unrolling them
    multiplies the shared memory Triton stages dot operands in (over the H100's limit at
    c = D = 128)."""
    if isinstance(lo, int) and isinstance(hi, int) and hi - lo == 1:
        return body(lo, init)
    return lax.fori_loop(lo, hi, body, init)


def cols(ref, rows, block):
    """``ref[rows, block]``: the rows' columns in ``block`` (a ``pl.ds``), or all of them when
    ``block`` is None."""
    return ref[rows, :] if block is None else ref[rows, block]
