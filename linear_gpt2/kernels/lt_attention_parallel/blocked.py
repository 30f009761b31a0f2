"""``LT_attention_parallel`` as a flash-style Pallas kernel (Triton-lowered on GPU, interpret mode
elsewhere): tiles of c queries x c keys, running numerator and denominator, no T x T in memory.
Here c is the kernel's block, ``tile(c, D)``: the block size asked for, at most 64 rows (32 at
D = 128), so that the [c, c] and [c, D] tiles compile without spills on the H100.

Same function as :func:`linear_gpt2.attention.lt_attention_parallel.blocked_linear_attention`
(the oracle). Forward, grid (T/c, B, H), one program per query block n:

    num, den = 0, 0                                      float32 [c, D], [c]
    for m = 0 .. n:                                      blocks m > n are all masked: skipped
        A = phi(Q_n) phi(K_m)^T, causal-masked when m = n   [c, c]
        num += A V_m;  den += A 1
    Y_n = num / (den + eps);  store Y_n and den (T floats per head, for the backward pass)

Unlike softmax there is no running maximum: scores are sums of nonnegative products and simply
add. Skipping the blocks above the diagonal halves the oracle's T^2 D work: the kernel does
about 2 T^2 D FLOPs per head forward (A and A V, causal half), 5 T^2 D backward.

Backward (``custom_vjp``), grid (T/c, B, H) as JAX's Pallas flash attention does: program j
computes key block j's dphi(K), dV (loop over query blocks i >= j) and query block j's dphi(Q)
(loop over key blocks m <= j). With g = dY / (den + eps) and delta_i = g_i . y_i, recomputed per
tile from dY, Y and den (elementwise, cheap next to the dots):

    A = mask(phi(Q_i) phi(K_j)^T),   dA = mask(g_i V_j^T - delta_i 1^T)
    dV_j += A^T g_i,   dphi(K)_j += dA^T phi(Q_i),   dphi(Q)_i += dA phi(K_j)

Memory: O(T D) per head (inputs, outputs, den); the [c, c] tiles live in registers.

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
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2 import kernels

F32 = jnp.float32


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=F32)


def _mask(qi, kj, c: int) -> jax.Array:
    """``[c, c]`` bool: query position qi c + a sees key position kj c + b iff b + kj c <= ..."""
    row = jnp.arange(c)
    return (qi * c + row)[:, None] >= (kj * c + row)[None, :]


def _fwd_kernel(fq_ref, fk_ref, v_ref, y_ref, den_ref, *, c: int, eps: float):
    """Query block n = program_id(0): fq/y refs ``[c, Dp]``, fk/v refs ``[T, Dp]``, den ``[c]``."""
    n = pl.program_id(0)
    Dp = fq_ref.shape[-1]
    fq = fq_ref[...]

    def key_block(m, carry):
        num, den = carry
        rows = pl.ds(m * c, c)
        fk, v = fk_ref[rows, :], v_ref[rows, :]
        A = jnp.where(_mask(n, m, c), _dot(fq, fk.T), 0.0)
        return num + _dot(A.astype(v.dtype), v), den + jnp.sum(A, axis=1)

    init = (jnp.zeros((c, Dp), F32), jnp.zeros((c,), F32))
    num, den = lax.fori_loop(0, n + 1, key_block, init)
    y_ref[...] = (num * kernels.reciprocal(den, eps)[:, None]).astype(y_ref.dtype)
    den_ref[...] = den


def _cotangents(dy_ref, y_ref, den_ref, rows, eps: float):
    """g = dY / (den + eps) ``[c, Dp]`` and delta = rowsum(g * Y) ``[c]``, float32."""
    r = kernels.reciprocal(den_ref[rows], eps)
    g = dy_ref[rows, :].astype(F32) * r[:, None]
    return g, jnp.sum(g * y_ref[rows, :].astype(F32), axis=1)


def _bwd_kernel(
    fq_ref, fk_ref, v_ref, y_ref, dy_ref, den_ref, dq_ref, dk_ref, dv_ref, *, c, n_blocks, eps
):
    """Block j = program_id(0): inputs ``[T, Dp]`` (den ``[T]``), outputs ``[c, Dp]``."""
    j = pl.program_id(0)
    Dp = fq_ref.shape[-1]
    own = pl.ds(j * c, c)

    # dphi(K)_j, dV_j: query blocks i >= j (earlier ones do not see key block j).
    fk_j, v_j = fk_ref[own, :], v_ref[own, :]
    dt = fk_j.dtype

    def query_block(i, carry):
        dk, dv = carry
        rows = pl.ds(i * c, c)
        fq = fq_ref[rows, :]
        g, delta = _cotangents(dy_ref, y_ref, den_ref, rows, eps)
        mask = _mask(i, j, c)
        A = jnp.where(mask, _dot(fq, fk_j.T), 0.0)
        dA = jnp.where(mask, _dot(g.astype(dt), v_j.T) - delta[:, None], 0.0)
        return dk + _dot(dA.astype(dt).T, fq), dv + _dot(A.astype(dt).T, g.astype(dt))

    zeros = jnp.zeros((c, Dp), F32)
    dk, dv = lax.fori_loop(j, n_blocks, query_block, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)

    # dphi(Q)_j: key blocks m <= j.
    g_j, delta_j = _cotangents(dy_ref, y_ref, den_ref, own, eps)

    def key_block(m, dq):
        rows = pl.ds(m * c, c)
        fk, v = fk_ref[rows, :], v_ref[rows, :]
        dA = jnp.where(_mask(j, m, c), _dot(g_j.astype(dt), v.T) - delta_j[:, None], 0.0)
        return dq + _dot(dA.astype(dt), fk)

    dq = lax.fori_loop(0, j + 1, key_block, zeros)
    dq_ref[...] = dq.astype(dq_ref.dtype)


def _compiler_params(Dp: int, backward: bool = False):
    from jax.experimental.pallas import triton as plgpu

    warps = 8 if backward else kernels.num_warps(Dp)
    return plgpu.CompilerParams(num_warps=warps, num_stages=2)


def tile(c: int, Dp: int) -> int:
    """The kernel's block of rows: the block size c, at most 64 rows (32 at D = 128), the tiles
    of the ``LT_chunked`` kernels (``lt_chunked.plan.tile``); with 128-row blocks the backward
    spills (D = 64) or needs more shared memory than the H100 has (D = 128). A larger block size
    only changes how far T is padded."""
    from linear_gpt2.kernels.lt_chunked import plan

    return plan.tile(c, Dp)


def _forward(fq, fk, v, c: int, eps: float):
    B, T, H, Dp = fq.shape
    c = tile(c, Dp)
    block = pl.BlockSpec((None, c, None, Dp), lambda n, b, h: (b, n, h, 0))
    seq = pl.BlockSpec((None, T, None, Dp), lambda n, b, h: (b, 0, h, 0))
    den = pl.BlockSpec((None, None, c), lambda n, b, h: (b, h, n))
    return pl.pallas_call(
        partial(_fwd_kernel, c=c, eps=eps),
        grid=(T // c, B, H),
        in_specs=[block, seq, seq],
        out_specs=[block, den],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, Dp), v.dtype),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        compiler_params=_compiler_params(Dp),
        interpret=kernels.interpret(),
        name="lt_attention_parallel_forward",
    )(fq, fk, v)


def _backward(fq, fk, v, y, dy, den, c: int, eps: float):
    B, T, H, Dp = fq.shape
    c = tile(c, Dp)
    block = pl.BlockSpec((None, c, None, Dp), lambda n, b, h: (b, n, h, 0))
    seq = pl.BlockSpec((None, T, None, Dp), lambda n, b, h: (b, 0, h, 0))
    den_spec = pl.BlockSpec((None, None, T), lambda n, b, h: (b, h, 0))
    return pl.pallas_call(
        partial(_bwd_kernel, c=c, n_blocks=T // c, eps=eps),
        grid=(T // c, B, H),
        in_specs=[seq, seq, seq, seq, seq, den_spec],
        out_specs=[block, block, block],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (fq, fk, v)],
        compiler_params=_compiler_params(Dp, backward=True),
        interpret=kernels.interpret(),
        name="lt_attention_parallel_backward",
    )(fq, fk, v, y, dy, den)


blocked_attention = kernels.fused_linear_attention(
    _forward, _backward, "LT_attention_parallel kernel=pallas"
)
blocked_attention.__doc__ = """Normalised causal linear attention, flash-style, fused.

fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``, T a multiple of the block size c (a power of two
>= 16); any D (zero-padded to a power of two >= 16). Returns y ``[B, T, H, D]``; differentiable
(``custom_vjp`` with the blocked backward kernel). The interface of
``lt_attention_parallel.IMPLEMENTATIONS``."""
