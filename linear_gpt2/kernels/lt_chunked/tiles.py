"""Tile math shared by every ``LT_chunked`` kernel (chunk-parallel and fused single-pass).

A chunk of c positions is processed in P = c / bt row tiles of bt rows (``plan.Blocks``); tile
(i, j) of a chunk's [c, c] score matrix pairs query tile i with key tile j (j <= i; tiles above
the diagonal are all masked and never computed). Everything a kernel does inside a chunk goes
through the functions here:

- :func:`weighted` is the *one* place that says which (query, key) pairs of a chunk interact
  and with what weight: the causal mask, and with forgetting (issue 14, a :class:`Gate` of the
  query and key rows) the same-document mask and the decay products e^{b_i - b_j}. Every kernel
  picks it up: the forward scores (:func:`scores`) and the backward score cotangents
  (:func:`score_cotangents`) both go through it.
- :func:`into`, :func:`out`, :func:`carry`: with forgetting, the weight of the state entering
  the chunk per row, of each key row in the state leaving it, and the factor of the state across
  it (:func:`chunk_scale`, 1, without forgetting). All from the chunk-local cumulative
  log-gates b and the document index s within the chunk; every exponent is masked before exp
  and is <= 0.

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

from typing import NamedTuple

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


class Gate(NamedTuple):
    """Forgetting inside a chunk for a tile's rows (issue 14), float32 / int32 ``[bt]``:

    - ``b``: the chunk-local cumulative log-gate, b_i = sum of log gamma from the chunk's first
      position to i (inclusive; <= 0, decreasing along the chunk);
    - ``s``: the document index within the chunk (0 = the document the chunk began in, +1 at
      each reset).

    With them (``weighted``): w_ij = [j <= i, s_i = s_j] e^{b_i - b_j}; the state entering the
    chunk reaches row i with ``into`` = [s_i = 0] e^{b_i}; key row j reaches the state after the
    chunk with ``out`` = [s_j = s_last] e^{b_last - b_j}; the state crosses the chunk with
    ``carry`` = [s_last = 0] e^{b_last}. Every exponent is masked *before* exp and is <= 0."""

    b: jax.Array
    s: jax.Array


def gate_rows(b_ref, s_ref, rows) -> Gate:
    """The :class:`Gate` of ``rows`` (a ``pl.ds``) from the chunk-local log-gate and document
    refs."""
    return Gate(b_ref[rows], s_ref[rows])


def into(gate: Gate) -> jax.Array:
    """``[bt]`` float32: the weight of the state entering the chunk for each row."""
    return jnp.where(gate.s == 0, jnp.exp(jnp.where(gate.s == 0, gate.b, 0.0)), 0.0)


def out(gate: Gate, b_last, s_last) -> jax.Array:
    """``[bt]`` float32: the weight of each key row in the state leaving the chunk."""
    keep = gate.s == s_last
    return jnp.where(keep, jnp.exp(jnp.where(keep, b_last - gate.b, 0.0)), 0.0)


def carry(b_last, s_last):
    """The factor of the state across the whole chunk (a scalar)."""
    return jnp.where(s_last == 0, jnp.exp(jnp.minimum(b_last, 0.0)), 0.0)


def last(b_ref, s_ref, at):
    """``(b_last, s_last)``: the log-gate and document index of the chunk's last row ``at``."""
    return b_ref[at], s_ref[at]


def weighted(x: jax.Array, i, j, bt: int, gq: Gate | None = None, gk: Gate | None = None):
    """``x`` ``[bt, bt]`` (scores or their cotangents, tile (i, j) of the chunk) times the chunk's
    pair weights: the causal mask (``where``, so that a masked inf never becomes NaN), and with
    forgetting (``gq``, ``gk``: the query and key rows' :class:`Gate`) the same-document mask and
    the decay products e^{b_a - b_b}, exponents masked to 0 before exp (all <= 0 where kept)."""
    mask = tile_mask(i, j, bt)
    if gq is not None:
        mask = mask & (gq.s[:, None] == gk.s[None, :])
        x = x * jnp.exp(jnp.where(mask, gq.b[:, None] - gk.b[None, :], 0.0))
    return jnp.where(mask, x, 0.0)


def scores(q: jax.Array, k: jax.Array, i, j, bt: int, gq=None, gk=None) -> jax.Array:
    """Tile (i, j) of the chunk's weighted scores ``W * (phi(Q) phi(K)^T)``, float32 ``[bt, bt]``."""
    return weighted(dot(q, k.T), i, j, bt, gq, gk)


def raw_score_cotangents(g: jax.Array, v: jax.Array, delta: jax.Array) -> jax.Array:
    """``g V^T - delta 1^T`` float32 (g V^T with operands in v's dtype): the cotangent of the
    weighted scores, before the pair weights."""
    return dot(g.astype(v.dtype), v.T) - delta[:, None]


def score_cotangents(
    g: jax.Array, v: jax.Array, delta: jax.Array, i, j, bt: int, gq=None, gk=None
) -> jax.Array:
    """Cotangent of the raw scores of tile (i, j): ``W * (g V^T - delta 1^T)``, float32 (g V^T
    with operands in v's dtype, ``- delta`` in float32).

    g = dY / (den + eps) is the cotangent of the numerator; -delta, delta_a = g_a . y_a, that of
    the denominator. Numerator and denominator are sums over the same weighted scores, so one
    dA carries both into dphi(q) and dphi(k): the normaliser's gradient is the ``- delta``
    term (the term flash-linear-attention once lost for dk, fla #875)."""
    return weighted(raw_score_cotangents(g, v, delta), i, j, bt, gq, gk)


def chunk_scale(n):
    """Factor the carried state is multiplied by while passing chunk n without forgetting
    (1); with it, :func:`carry`."""
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


def through_phi(dphi: jax.Array, f_ref, rows, block, slope) -> jax.Array:
    """The gradient of the raw inputs, ``dphi * phi'``, float32 ``[bt, bd]``, from dphi(x) of
    the rows' columns ``block`` and the features phi(x) the kernel reads at them (``f_ref``):
    phi'(x) = ``slope(phi(x))`` for an elementwise feature map (``attention/feature_maps.py``),
    computed from phi(x) in the input dtype. ``dphi`` unchanged when ``slope`` is None (the
    kernels' inputs are the features themselves)."""
    if slope is None:
        return dphi
    return dphi * slope(cols(f_ref, rows, block).astype(F32))


def chunk_sum(S_ref, z_ref, lo, hi, cut, zcut, shape, zsize: int):
    """``(sum_{m in [lo, hi)} S_ref[m][cut], sum_m z_ref[m][zcut])`` float32 (``shape``,
    ``zsize``: those of one term): a state, or a cotangent, formed from the chunk totals of the state passes
    when every chunk is a segment of its own (``ops``, "own prefix"). ``cut`` / ``zcut``: the
    block of the [D, BV] / [D] totals wanted (slices or ``pl.ds``); an empty range gives
    zeros."""

    def add(m, acc):
        return acc[0] + S_ref[(m, *cut)], acc[1] + z_ref[m, zcut]

    return lax.fori_loop(lo, hi, add, (jnp.zeros(shape, F32), jnp.zeros((zsize,), F32)))
