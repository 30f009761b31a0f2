"""``LT_attention_parallel`` as a flash-style Pallas kernel, the first design
(``kernel=pallas_blocked``; ``tiled.py`` is the second, which ``kernel=pallas`` runs wherever the
cost model prefers it; Triton-lowered on GPU, interpret mode elsewhere): tiles of c queries x c
keys, running numerator and denominator, no T x T in memory.
Here c is the kernel's block, ``tile(c, D)``: the block size asked for, at most 64 rows (32 at
D = 128), so that the [c, c] and [c, D] tiles compile without spills on the H100.

Same function as :func:`linear_gpt2.kernels.lt_attention_parallel.naive.blocked_linear_attention`
(the oracle; with forgetting ``blocked_forget_attention`` there). Forward, grid (T/c, B, H), one program per query block n:

    num, den = 0, 0                                      float32 [c, D], [c]
    for m = 0 .. n:                                      blocks m > n are all masked: skipped
        A = phi(Q_n) phi(K_m)^T, causal-masked when m = n   [c, c]
        num += A V_m;  den += A 1
    Y_n = num / (den + eps);  store Y_n and den (T floats per head, for the backward pass)

Unlike softmax there is no running maximum: scores are sums of nonnegative products and simply
add. Skipping the blocks above the diagonal halves the oracle's T^2 D work: the kernel does
about 2 T^2 D FLOPs per head forward (A and A V, causal half), 6 T^2 D backward (six dots per
tile pair: dA is formed in both loops).

Backward (``custom_vjp``), grid (T/c, B, H) as JAX's Pallas flash attention does: program j
computes key block j's dphi(K), dV (loop over query blocks i >= j) and query block j's dphi(Q)
(loop over key blocks m <= j). With g = dY / (den + eps) and delta_i = g_i . y_i, recomputed per
tile from dY, Y and den (elementwise, cheap next to the dots):

    A = mask(phi(Q_i) phi(K_j)^T),   dA = mask(g_i V_j^T - delta_i 1^T)
    dV_j += A^T g_i,   dphi(K)_j += dA^T phi(Q_i),   dphi(Q)_i += dA phi(K_j)

Memory: O(T D) per head (inputs, outputs, den); the [c, c] tiles live in registers.

With document resets and decay gates (:func:`blocked_forget_attention`, the same two kernels
with two more inputs): b float32 ``[B, T, H]``, the cumulative log-gate *within each block*, and
seg int32 ``[B, T]``, the document id of each position, both read per tile as ``[c]`` vectors.
Every tile's scores and score cotangents are multiplied by the pair weights

    W_ij = [j <= i, seg_i = seg_j] exp(L_i - L_j)          float32 [c, c], once per tile

with L the cumulative log-gate over the row, never formed: a float32 L loses the difference of
two nearby positions once |L| is large (gamma = 0.3 over 1M tokens puts |L| near 1e6, an error
near 0.07 in the exponent). For query block i and key block j < i,
L_i - L_j = b_i + R + (G_j - b_j), with G_j block j's total and R the totals of the blocks
strictly between, a float32 scalar each loop accumulates near to far (the forward and the dphi(Q)
loop walk the key blocks downwards from the diagonal, the dphi(K) loop the query blocks upwards);
on the diagonal it is b_i - b_j. Every term is <= 0 and the exponent is masked before exp, so
nothing overflows; A and dA above become W * (...). The backward also writes dL (float32, per
block j), the gradient with respect to L, which the wrapper turns into the log-gates' by a
reverse cumulative sum:

    dL_j = rowsum(dS * S) over keys m <= j - colsum(dS * S) over queries i >= j
         = phi(Q_j) . dphi(Q)_j - phi(K_j) . dphi(K)_j       (S = W * phi(Q) phi(K)^T)

the identity of the ``LT_chunked`` kernels: s_ij depends on L only through phi(q_i) e^{L_i} and
phi(k_j) e^{-L_j}. Program j holds both float32 gradients before rounding them, so dL costs two
[c] row sums instead of an extra [c, c] product per tile (the backward's registers are the
binding limit). Both loops stay in one kernel: with the weights it still compiles without
spills (255 / 174 registers at D = 64 / 128, forward 128 / 121: the D = 64 backward is at the
ceiling, so the gate vectors are loaded after the tile's first dot).

Precision as in the ``LT_chunked`` kernels (``lt_chunked/tiles.py``): every dot's operands in the
input dtype, the backward's cotangents g and dA rounded to it for their dots, every accumulation
float32.

GPU constraints: c and the padded head dim are powers of two >= 16, D <= 128; the whole
sequence of K and V is one block (program-local pointer arithmetic, as in JAX's mha), only
[c, Dp] tiles are loaded. Compiled for the H100 (deviceless) in tests/test_target.py, spills an
error: forward 118 / 80 registers, backward 236 / 139 at D = 64 / 128 (8 warps backward).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_chunked import plan, tiles

F32 = jnp.float32


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=F32)


def _gate(b_ref, seg_ref, rows) -> tiles.Gate | None:
    """The forgetting inputs of ``rows`` (a ``pl.ds``, one block): block-local cumulative
    log-gates and document ids ``[c]``; None without forgetting."""
    return None if b_ref is None else tiles.Gate(b_ref[rows], seg_ref[rows])


def _total(b_ref, block, c: int) -> jax.Array:
    """Block ``block``'s summed log-gate G (b at its last row), a float32 scalar loaded from the
    ref: a masked sum over the loaded [c] vector costs the forward 40 registers."""
    return b_ref[block * c + c - 1]


def _pairs(i, j, c: int, gq: tiles.Gate | None, gk: tiles.Gate | None, R=None, G=None):
    """Which pairs of query block i and key block j interact, and how much: the mask ``[c, c]``
    (causal; with forgetting also same document) and the weights exp(L_i - L_j) float32
    ``[c, c]`` (None without forgetting). Computed once per tile, used by both of its scores and
    cotangents. L_i - L_j is b_i - b_j when i = j, else b_i + R + (G_j - b_j) with R the summed
    log-gates of the blocks strictly between and G key block j's total (the module docstring); every term is <= 0 and
    none is a difference of long sums. The exponent is masked before exp, so exp never
    overflows and a masked pair never becomes inf * 0."""
    mask = tiles.tile_mask(i, j, c)
    if gq is None:
        return mask, None
    mask = mask & (gq.s[:, None] == gk.s[None, :])
    # e_j = G_j - b_j first (block-local; exactly 0 for the last key), then R
    key = jnp.where(i == j, -gk.b, R + (G - gk.b))
    return mask, jnp.exp(jnp.where(mask, gq.b[:, None] + key[None, :], 0.0))


def _weigh(x: jax.Array, pairs) -> jax.Array:
    mask, w = pairs
    return jnp.where(mask, x if w is None else x * w, 0.0)


def _unpack(refs, n_in: int, forget: bool):
    """Split a kernel's refs into (inputs, b, seg, outputs): the forgetting inputs, when there,
    follow the ``n_in`` others."""
    if not forget:
        return refs[:n_in], None, None, refs[n_in:]
    return refs[:n_in], refs[n_in], refs[n_in + 1], refs[n_in + 2 :]


def _fwd_kernel(*refs, c: int, eps: float, forget: bool, normalise: bool = True):
    """Query block n = program_id(0): fq/y refs ``[c, Dp]``, fk/v refs ``[T, Dp]``, den ``[c]``;
    with forgetting b (float32, block-local) and seg (int32) refs ``[T]``."""
    (fq_ref, fk_ref, v_ref), b_ref, seg_ref, (y_ref, den_ref) = _unpack(refs, 3, forget)
    n = pl.program_id(0)
    Dp = fq_ref.shape[-1]
    fq = fq_ref[...]
    gq = _gate(b_ref, seg_ref, pl.ds(n * c, c))

    def key_block(t, carry):
        num, den, R = carry
        m = n - t if forget else t  # with forgetting downwards, so that R grows near to far
        rows = pl.ds(m * c, c)
        fk, v = fk_ref[rows, :], v_ref[rows, :]
        scores = _dot(fq, fk.T)  # before the gates are loaded: fewer live registers
        gk = _gate(b_ref, seg_ref, rows)
        G = _total(b_ref, m, c) if forget else None
        A = _weigh(scores, _pairs(n, m, c, gq, gk, R, G))
        if forget:
            R = R + jnp.where(m < n, G, 0.0)
        return num + _dot(A.astype(v.dtype), v), den + jnp.sum(A, axis=1), R

    init = (jnp.zeros((c, Dp), F32), jnp.zeros((c,), F32), jnp.zeros((), F32))
    num, den, _ = lax.fori_loop(0, n + 1, key_block, init)
    if normalise:
        num = num * kernels.reciprocal(den, eps)[:, None]
    y_ref[...] = num.astype(y_ref.dtype)
    den_ref[...] = den


def _cotangents(dy_ref, y_ref, den_ref, rows, eps: float):
    """g = dY / (den + eps) ``[c, Dp]`` and delta = rowsum(g * Y) ``[c]``, float32."""
    r = kernels.reciprocal(den_ref[rows], eps)
    g = dy_ref[rows, :].astype(F32) * r[:, None]
    return g, jnp.sum(g * y_ref[rows, :].astype(F32), axis=1)


def _key_block_grads(
    j, fq_ref, fk_ref, v_ref, y_ref, dy_ref, den_ref, b_ref, seg_ref, c, n_blocks, eps
):
    """dphi(K)_j, dV_j float32 ``[c, Dp]`` of key block j: query blocks i >= j (earlier ones do
    not see it)."""
    own = pl.ds(j * c, c)
    fk_j, v_j = fk_ref[own, :], v_ref[own, :]
    gk = _gate(b_ref, seg_ref, own)
    G_j = None if gk is None else _total(b_ref, j, c)
    dt = fk_j.dtype

    def query_block(i, carry):  # upwards from j: R grows near to far
        dk, dv, R = carry
        rows = pl.ds(i * c, c)
        fq = fq_ref[rows, :]
        g, delta = _cotangents(dy_ref, y_ref, den_ref, rows, eps)
        gq = _gate(b_ref, seg_ref, rows)
        pairs = _pairs(i, j, c, gq, gk, R, G_j)
        A = _weigh(_dot(fq, fk_j.T), pairs)
        dA = _weigh(_dot(g.astype(dt), v_j.T) - delta[:, None], pairs)
        if gq is not None:
            R = R + jnp.where(i > j, _total(b_ref, i, c), 0.0)
        return dk + _dot(dA.astype(dt).T, fq), dv + _dot(A.astype(dt).T, g.astype(dt)), R

    zeros = jnp.zeros((c, fk_j.shape[-1]), F32)
    dk, dv, _ = lax.fori_loop(j, n_blocks, query_block, (zeros, zeros, jnp.zeros((), F32)))
    return dk, dv


def _query_block_grads(j, fk_ref, v_ref, y_ref, dy_ref, den_ref, b_ref, seg_ref, c, eps):
    """dphi(Q)_j float32 ``[c, Dp]`` of query block j: key blocks m <= j."""
    own = pl.ds(j * c, c)
    g_j, delta_j = _cotangents(dy_ref, y_ref, den_ref, own, eps)
    gq = _gate(b_ref, seg_ref, own)
    dt = fk_ref.dtype

    def key_block(t, carry):
        dq, R = carry
        m = j - t if gq is not None else t  # as in the forward
        rows = pl.ds(m * c, c)
        fk, v = fk_ref[rows, :], v_ref[rows, :]
        dS = _dot(g_j.astype(dt), v.T) - delta_j[:, None]
        gk = _gate(b_ref, seg_ref, rows)
        G = None if gk is None else _total(b_ref, m, c)
        dA = _weigh(dS, _pairs(j, m, c, gq, gk, R, G))
        if gk is not None:
            R = R + jnp.where(m < j, G, 0.0)
        return dq + _dot(dA.astype(dt), fk), R

    init = (jnp.zeros((c, fk_ref.shape[-1]), F32), jnp.zeros((), F32))
    return lax.fori_loop(0, j + 1, key_block, init)[0]


def _log_gate_part(x_ref, dx, rows) -> jax.Array:
    """``[c]`` float32 rowsum(phi(X) * dphi(X)) of ``rows``, dphi(X) before rounding: a block's
    share of dL (see the module docstring)."""
    return jnp.sum(x_ref[rows, :].astype(F32) * dx, axis=1)


def _bwd_kernel(*refs, c: int, n_blocks: int, eps: float, forget: bool):
    """Block j = program_id(0): inputs ``[T, Dp]`` (den, b, seg ``[T]``), outputs ``[c, Dp]``
    (dL ``[c]``)."""
    ins, b_ref, seg_ref, outs = _unpack(refs, 6, forget)
    fq_ref, fk_ref, v_ref, y_ref, dy_ref, den_ref = ins
    j = pl.program_id(0)
    own = pl.ds(j * c, c)
    dk, dv = _key_block_grads(
        j, fq_ref, fk_ref, v_ref, y_ref, dy_ref, den_ref, b_ref, seg_ref, c, n_blocks, eps
    )
    outs[1][...] = dk.astype(outs[1].dtype)
    outs[2][...] = dv.astype(outs[2].dtype)
    if forget:  # only a [c] vector stays live across the second loop
        cols = _log_gate_part(fk_ref, dk, own)
    dq = _query_block_grads(j, fk_ref, v_ref, y_ref, dy_ref, den_ref, b_ref, seg_ref, c, eps)
    outs[0][...] = dq.astype(outs[0].dtype)
    if forget:
        outs[3][...] = _log_gate_part(fq_ref, dq, own) - cols


def _compiler_params(Dp: int, backward: bool = False):
    # Pallas's Triton backend: imported when a kernel is built.
    from jax.experimental.pallas import triton as plgpu

    warps = 8 if backward else kernels.num_warps(Dp)
    return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def tile(c: int, Dp: int) -> int:
    """The kernel's block of rows: the block size c, at most 64 rows (32 at D = 128), the tiles
    of the ``LT_chunked`` kernels (``lt_chunked.plan.tile``); with 128-row blocks the backward
    spills (D = 64) or needs more shared memory than the H100 has (D = 128). A larger block size
    only changes how far T is padded."""
    return plan.tile(c, Dp)


def _forget_specs(T: int):
    """BlockSpecs of b ``[B, T, H]`` and seg ``[B, T]``: the whole sequence of one (b, h)."""
    return [
        pl.BlockSpec((None, T, None), lambda n, b, h: (b, 0, h)),
        pl.BlockSpec((None, T), lambda n, b, h: (b, 0)),
    ]


def _forward(fq, fk, v, c: int, eps: float, b=None, seg=None, normalise: bool = True):
    """y ``[B, T, H, Dp]`` and den float32 ``[B, H, T]``; with forgetting when b (float32, block-local
    ``[B, T, H]``) and seg (int32 ``[B, T]``) are given. Without ``normalise`` the numerator,
    float32, instead of y (``ops``: keys wider than the values)."""
    B, T, H, Dp = fq.shape
    c = tile(c, Dp)
    forget = b is not None
    block = pl.BlockSpec((None, c, None, Dp), lambda n, b, h: (b, n, h, 0))
    seq = pl.BlockSpec((None, T, None, Dp), lambda n, b, h: (b, 0, h, 0))
    den = pl.BlockSpec((None, None, c), lambda n, b, h: (b, h, n))
    return pl.pallas_call(
        partial(_fwd_kernel, c=c, eps=eps, forget=forget, normalise=normalise),
        grid=(T // c, B, H),
        in_specs=[block, seq, seq, *(_forget_specs(T) if forget else [])],
        out_specs=[block, den],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, Dp), v.dtype if normalise else F32),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        compiler_params=_compiler_params(Dp),
        interpret=kernels.interpret(),
        name="lt_attention_parallel_forward",
    )(fq, fk, v, *((b, seg) if forget else ()))


def _backward(fq, fk, v, y, dy, den, c: int, eps: float, b=None, seg=None):
    """dphi(q), dphi(k), dv ``[B, T, H, Dp]``; with forgetting also dL float32 ``[B, T, H]``."""
    B, T, H, Dp = fq.shape
    c = tile(c, Dp)
    forget = b is not None
    block = pl.BlockSpec((None, c, None, Dp), lambda n, b, h: (b, n, h, 0))
    seq = pl.BlockSpec((None, T, None, Dp), lambda n, b, h: (b, 0, h, 0))
    den_spec = pl.BlockSpec((None, None, T), lambda n, b, h: (b, h, 0))
    out_specs = [block, block, block]
    out_shape = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (fq, fk, v)]
    if forget:
        out_specs.append(pl.BlockSpec((None, None, c), lambda n, b, h: (b, h, n)))
        out_shape.append(jax.ShapeDtypeStruct((B, H, T), F32))
    out = pl.pallas_call(
        partial(_bwd_kernel, c=c, n_blocks=T // c, eps=eps, forget=forget),
        grid=(T // c, B, H),
        in_specs=[seq, seq, seq, seq, seq, den_spec, *(_forget_specs(T) if forget else [])],
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=_compiler_params(Dp, backward=True),
        interpret=kernels.interpret(),
        name="lt_attention_parallel_backward",
    )(fq, fk, v, y, dy, den, *((b, seg) if forget else ()))
    if forget:
        return (*out[:3], jnp.swapaxes(out[3], 1, 2))
    return tuple(out)


blocked_attention = kernels.fused_linear_attention(
    _forward, _backward, "LT_attention_parallel kernel=pallas"
)
blocked_attention.__doc__ = """Normalised causal linear attention, flash-style, fused.

fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``, T a multiple of the block size c (a power of two
>= 16); any D (zero-padded to a power of two >= 16). Returns y ``[B, T, H, D]``; differentiable
(``custom_vjp`` with the blocked backward kernel). The interface of
``lt_attention_parallel.IMPLEMENTATIONS``."""


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def _forget_core(fq, fk, v, log_gate, seg, c: int, eps: float):
    b = kernels.block_cumsum(log_gate, tile(c, fq.shape[-1]))
    return _forward(fq, fk, v, c, eps, b, seg)[0]


def _forget_core_fwd(fq, fk, v, log_gate, seg, c, eps):
    b = kernels.block_cumsum(log_gate, tile(c, fq.shape[-1]))
    y, den = _forward(fq, fk, v, c, eps, b, seg)
    return y, (fq, fk, v, b, seg, y, den)


def _forget_core_bwd(c, eps, residuals, dy):
    fq, fk, v, b, seg, y, den = residuals
    dq, dk, dv, dL = _backward(fq, fk, v, y, dy.astype(y.dtype), den, c, eps, b, seg)
    return dq, dk, dv, kernels.log_gate_cotangent(dL), np.zeros(seg.shape, dtype=jax.dtypes.float0)


_forget_core.defvjp(_forget_core_fwd, _forget_core_bwd)


def blocked_forget_attention(fq, fk, v, log_gate, seg, c: int, eps: float) -> jax.Array:
    """:func:`blocked_attention` with document resets and decay: pair weights
    [j <= i, seg_i = seg_j] exp(L_i - L_j), the interface of
    ``attention.lt_attention_parallel.blocked_forget_attention`` (the oracle).

    fq, fk, v ``[B, T, H, D]``; log_gate float32 ``[B, T, H]`` log gamma per position (<= 0; 0 on
    padding), seg int32 ``[B, T]`` the document id of each position. Returns y ``[B, T, H, D]``,
    differentiable in fq, fk, v and log_gate (residuals O(T D): the inputs, y and den)."""
    what = "LT_attention_parallel kernel=pallas"
    D = v.shape[-1]
    kernels.check_fused_shape(fq.shape[1], max(D, fq.shape[-1]), c, what)
    Dp = kernels.padded_head_dim(max(D, fq.shape[-1]))
    fq, fk, v = (kernels.pad_head_dim(x, Dp) for x in (fq, fk, v.astype(fq.dtype)))
    y = _forget_core(fq, fk, v, log_gate.astype(F32), seg.astype(jnp.int32), c, float(eps))
    return y[..., :D]
