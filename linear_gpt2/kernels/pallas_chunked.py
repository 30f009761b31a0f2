"""``LT_chunked`` as Pallas kernels (Triton-lowered on GPU, interpret mode elsewhere).

Same function as :func:`linear_gpt2.attention.lt_chunked.chunked_linear_attention` followed by
the normaliser, the oracle the tests compare against. For chunk n of c positions (rows of the
[c, D] tiles), with S_n [D, D] and z_n [D] the sums over all earlier chunks:

    A   = mask(phi(Q_n) phi(K_n)^T)                        [c, c] causal inside the chunk
    num = phi(Q_n) S_n + A V_n,   den = phi(Q_n) z_n + A 1,   Y_n = num / (den + eps)
    S_{n+1} = S_n + phi(K_n)^T V_n,   z_{n+1} = z_n + phi(K_n)^T 1

Design: one program per (batch, head), a sequential ``fori_loop`` over the T/c chunks carrying
S and z in float32 registers; the normaliser is computed in the same loop iteration (nothing of
num or den goes to HBM but den itself, T floats, kept for the backward pass).

Why single-pass rather than two passes (chunk states to HBM, then outputs in parallel over
chunks)? Per chunk and head, with s bytes per element (2 in bfloat16):

- FLOPs (either design): 2c^2 D (scores) + 2c^2 D (A V) + 2c D^2 (phi(Q) S) + 2c D^2 (state
  update) = 4c^2 D + 4c D^2; 2.1 MFLOP at c = D = 64.
- Bytes, single pass: read phi(Q), phi(K), V (3 c D s), write Y (c D s) and den (4c):
  33 KiB at c = D = 64 in bfloat16, 64 FLOP/byte.
- Bytes, two passes: the same plus the states written, prefix-summed (read + write) and read
  back, about 4 D^2 * 4 bytes = 64 KiB more: three times the traffic, and T/c D^2 floats of
  memory per head.

The single pass moves the least data and holds O(D^2) state per program; its cost is
parallelism: only B H programs, each walking T/c chunks in order (at B = 1, H = 12 an H100 has
132 SMs). The GPU benchmark (benchmarks/bench_kernels.py) decides whether that matters; a split
of the value dimension across programs (each carrying S[:, block]) is the next step if it does.

Backward (``custom_vjp``): the residuals are phi(Q), phi(K), V, Y and den, O(T D) per head. No
state is stored: one kernel per (batch, head) recomputes them. With r = 1 / (den + eps),
g = r dY (cotangent of num) and delta_i = g_i . y_i (minus the cotangent of den_i):

    dA = mask(g V_n^T - delta 1^T)                                   [c, c]
    dphi(Q)_n = g S_n^T - delta z_n^T + dA phi(K_n)                  loop 1, forward over chunks,
                                                                     recomputing S_n, z_n
    dV_n = A^T g + phi(K_n) dS_n,  dphi(K)_n = dA^T phi(Q_n) + V_n dS_n^T + 1 dz_n^T
                                                                     loop 2, reverse over chunks,
    dS_{n-1} = dS_n + phi(Q_n)^T g,  dz_{n-1} = dz_n - phi(Q_n)^T delta      carrying dS, dz

where dS_n, dz_n are the cotangents of the state after chunk n (sums over the later chunks'
queries). FLOPs per chunk: loop 1 4c^2 D + 4c D^2, loop 2 8c^2 D + 6c D^2 (3x the forward's
scores, 2.5x its state work); bytes: each loop reads phi(Q), phi(K), V, Y, dY, den (5 c D s + 4c)
and they write dphi(Q), dphi(K), dV (3 c D s).

Precision: matmul operands phi(Q), phi(K), V and A in the input dtype, as in the oracle; the
state S and every cotangent (g, dA, dS) are float32 operands (TF32 on GPU unless
``jax.default_matmul_precision("highest")``), all accumulation float32.

GPU constraints (Triton lowering; unverified here, the CPU tests run in interpret mode): c and
the padded head dim are powers of two >= 16 (``kernels.check_block_size``, ``padded_head_dim``);
every tile loaded is [c, Dp] or [c]; no matrix-vector dots (the z terms are elementwise products
and row sums).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from linear_gpt2 import kernels

F32 = jnp.float32


def _causal(c: int) -> jax.Array:
    row = jnp.arange(c)
    return row[:, None] >= row[None, :]


def _dot(a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.dot(a, b, preferred_element_type=F32)


def _fwd_kernel(fq_ref, fk_ref, v_ref, y_ref, den_ref, *, c: int, n_chunks: int, eps: float):
    """One (batch, head): fq/fk/v/y refs ``[T, Dp]``, den ref ``[T]``."""
    Dp = fq_ref.shape[-1]
    causal = _causal(c)

    def chunk(n, carry):
        S, z = carry
        rows = pl.ds(n * c, c)
        fq, fk, v = fq_ref[rows, :], fk_ref[rows, :], v_ref[rows, :]
        A = jnp.where(causal, _dot(fq, fk.T), 0.0)
        num = _dot(fq.astype(F32), S) + _dot(A.astype(v.dtype), v)
        den = jnp.sum(fq.astype(F32) * z[None, :], axis=1) + jnp.sum(A, axis=1)
        y_ref[rows, :] = (num * kernels.reciprocal(den, eps)[:, None]).astype(y_ref.dtype)
        den_ref[rows] = den
        # The state after this chunk (exclusive for the chunk itself, used from the next one).
        S = S + _dot(fk.T, v)
        z = z + jnp.sum(fk.astype(F32), axis=0)
        return S, z

    init = (jnp.zeros((Dp, Dp), F32), jnp.zeros((Dp,), F32))
    lax.fori_loop(0, n_chunks, chunk, init)


def _cotangents(dy_ref, y_ref, den_ref, rows, eps: float):
    """g = dY / (den + eps) ``[c, Dp]`` and delta = rowsum(g * Y) ``[c]``, float32."""
    r = kernels.reciprocal(den_ref[rows], eps)
    g = dy_ref[rows, :].astype(F32) * r[:, None]
    delta = jnp.sum(g * y_ref[rows, :].astype(F32), axis=1)
    return g, delta


def _bwd_kernel(
    fq_ref, fk_ref, v_ref, y_ref, dy_ref, den_ref, dq_ref, dk_ref, dv_ref, *, c, n_chunks, eps
):
    """One (batch, head): inputs ``[T, Dp]`` (den ``[T]``), outputs dphi(Q), dphi(K), dV."""
    Dp = fq_ref.shape[-1]
    causal = _causal(c)

    # Loop 1, forward over chunks: dphi(Q) needs the state before each chunk; recompute it.
    def dq_chunk(n, carry):
        S, z = carry
        rows = pl.ds(n * c, c)
        fk, v = fk_ref[rows, :], v_ref[rows, :]
        g, delta = _cotangents(dy_ref, y_ref, den_ref, rows, eps)
        fk32, v32 = fk.astype(F32), v.astype(F32)
        dA = jnp.where(causal, _dot(g, v32.T) - delta[:, None], 0.0)
        dq = _dot(g, S.T) - delta[:, None] * z[None, :] + _dot(dA, fk32)
        dq_ref[rows, :] = dq.astype(dq_ref.dtype)
        return S + _dot(fk.T, v), z + jnp.sum(fk32, axis=0)

    zeros = (jnp.zeros((Dp, Dp), F32), jnp.zeros((Dp,), F32))
    lax.fori_loop(0, n_chunks, dq_chunk, zeros)

    # Loop 2, reverse over chunks, carrying the cotangent of the state after the current chunk.
    def dkv_chunk(i, carry):
        dS, dz = carry
        rows = pl.ds((n_chunks - 1 - i) * c, c)
        fq, fk, v = fq_ref[rows, :], fk_ref[rows, :], v_ref[rows, :]
        g, delta = _cotangents(dy_ref, y_ref, den_ref, rows, eps)
        fq32, fk32, v32 = fq.astype(F32), fk.astype(F32), v.astype(F32)
        A = jnp.where(causal, _dot(fq, fk.T), 0.0)
        dA = jnp.where(causal, _dot(g, v32.T) - delta[:, None], 0.0)
        dv = _dot(A.T, g) + _dot(fk32, dS)
        dk = _dot(dA.T, fq32) + _dot(v32, dS.T) + dz[None, :]
        dv_ref[rows, :] = dv.astype(dv_ref.dtype)
        dk_ref[rows, :] = dk.astype(dk_ref.dtype)
        return dS + _dot(fq32.T, g), dz - jnp.sum(fq32 * delta[:, None], axis=0)

    lax.fori_loop(0, n_chunks, dkv_chunk, zeros)


def _specs(B: int, T: int, H: int, Dp: int):
    # Grid (B, H); each program sees its head's whole sequence and walks it chunk by chunk.
    seq = pl.BlockSpec((None, T, None, Dp), lambda b, h: (b, 0, h, 0))
    den = pl.BlockSpec((None, None, T), lambda b, h: (b, h, 0))
    return seq, den


def _compiler_params(Dp: int):
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=kernels.num_warps(Dp), num_stages=2)


def _forward(fq, fk, v, c: int, eps: float):
    B, T, H, Dp = fq.shape
    seq, den = _specs(B, T, H, Dp)
    return pl.pallas_call(
        partial(_fwd_kernel, c=c, n_chunks=T // c, eps=eps),
        grid=(B, H),
        in_specs=[seq, seq, seq],
        out_specs=[seq, den],
        out_shape=[
            jax.ShapeDtypeStruct((B, T, H, Dp), v.dtype),
            jax.ShapeDtypeStruct((B, H, T), F32),
        ],
        compiler_params=_compiler_params(Dp),
        interpret=kernels.interpret(),
        name="lt_chunked_forward",
    )(fq, fk, v)


def _backward(fq, fk, v, y, dy, den, c: int, eps: float):
    B, T, H, Dp = fq.shape
    seq, den_spec = _specs(B, T, H, Dp)
    return pl.pallas_call(
        partial(_bwd_kernel, c=c, n_chunks=T // c, eps=eps),
        grid=(B, H),
        in_specs=[seq, seq, seq, seq, seq, den_spec],
        out_specs=[seq, seq, seq],
        out_shape=[jax.ShapeDtypeStruct(x.shape, x.dtype) for x in (fq, fk, v)],
        compiler_params=_compiler_params(Dp),
        interpret=kernels.interpret(),
        name="lt_chunked_backward",
    )(fq, fk, v, y, dy, den)


chunked_attention = kernels.fused_linear_attention(_forward, _backward, "LT_chunked kernel=pallas")
chunked_attention.__doc__ = """Normalised causal linear attention by chunks of ``c``, fused.

fq = phi(q), fk = phi(k), v: ``[B, T, H, D]`` (same dtype), T a multiple of c, c a power of two
>= 16; any D (zero-padded to a power of two >= 16 around the kernel). Returns y ``[B, T, H, D]``;
differentiable (``custom_vjp``, recomputing backward)."""
