"""The oracle of the ``LT_attention_parallel`` kernel, and its XLA path: the blocked form in
pure JAX, with a hand-written backward.

With block size c (the ``chunk_size`` option) and T/c query blocks Q_n and key blocks K_m:

    for every query block n (in parallel):              # a kernel's grid axis; here a batch axis
        num_n, den_n = 0, 0
        for m = 0, 1, ...:                              # sequential, running sums
            A = (phi(Q_n) phi(K_m)^T) * causal mask     # [c, c] scores, never [T, T]
            num_n += A V_m;  den_n += A 1
        Y_n = num_n / (den_n + eps)

Unlike softmax flash attention there is no running maximum to rescale by: the scores are sums of
nonnegative products, so the running sums just add. All query blocks advance together, so step m
also computes the (masked, all-zero) blocks n < m: T^2 D FLOPs like the materialised
``LT_attention_parallel_no_flash``, rather than the causal T^2 D / 2 a kernel that skips them
does. Extra memory is O(T c) per head (one [c, c] block per query block) instead of O(T^2).

The backward pass is written by hand (``jax.custom_vjp``) in the same blocked form, keeping only
O(T D) residuals (phi(q), phi(k), v, y, the denominators); autodiff of the forward loop would
instead store every step's scores, O(T^2) again. With r_i = 1 / (den_i + eps) and dY the
output cotangent:

    dnum_i = r_i dY_i,   dA_ij = dnum_i . v_j - dnum_i . y_i     (j <= i)
    dV_j = sum_i A_ij dnum_i,   dphi(Q)_i = sum_j dA_ij phi(K)_j,   dphi(K)_j = sum_i dA_ij phi(Q)_i

computed per key block m: dphi(Q) accumulates over m, dV_m and dphi(K)_m are sums over the
query blocks. The gradient through phi itself is left to autodiff.

Forgetting (``kernels.forget``): each score is multiplied by w_ij = exp(L_i - L_j) within a
document, L the cumulative log gamma, the mask built per block pair from the block's positions
and segment ids. L itself is never formed: in float32 the difference of two nearby positions
is lost once |L| is large. With b the cumulative log gamma within each block and G_m block m's
total, for query block n and key block m < n, L_i - L_j = b_i + R_nm + (G_m - b_j),
R_nm = G_{m+1} + ... + G_{n-1}, and b_i - b_j on the diagonal: every term is <= 0, and R is
accumulated near to far (the scan runs over the key blocks downwards), never as a difference of
long sums. The backward pass then also returns dL: with s_ij = A_ij w_ij and
dS_ij = dnum_i . v_j - dnum_i . y_i, dL_i = sum_j dS_ij s_ij (as a query) - sum_k dS_ki s_ki (as
a key), and d(log gamma) its reverse cumulative sum. :func:`blocked_forget_attention` is the
oracle of the kernel's forgetting form (``blocked.blocked_forget_attention``).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from linear_gpt2 import kernels

F32 = jnp.float32


def _blocks(x: jax.Array, c: int) -> jax.Array:
    """``[B, T, ...]`` -> ``[B, T/c, c, ...]``."""
    return x.reshape(x.shape[0], x.shape[1] // c, c, *x.shape[2:])


def _key_blocks(x: jax.Array, c: int) -> jax.Array:
    """``[B, T, H, D]`` -> ``[T/c, B, c, H, D]``: key blocks on the leading axis, for scan."""
    return jnp.swapaxes(_blocks(x, c), 0, 1)


def _block_mask(N: int, m: jax.Array, c: int) -> jax.Array:
    """``[1, N, 1, c, c]`` bool: query position n c + i sees key position m c + j iff
    m c + j <= n c + i, i.e. all of block n > m, the lower triangle of n = m, nothing of n < m."""
    q_pos = jnp.arange(N * c).reshape(N, c)
    k_pos = m * c + jnp.arange(c)
    return (q_pos[:, :, None] >= k_pos[None, None, :])[None, :, None]


def _block_scores(Q: jax.Array, k_m: jax.Array, mask: jax.Array) -> jax.Array:
    """Masked scores ``[B, N, H, c, c]`` float32 of all query blocks Q ``[B, N, c, H, D]``
    against one key block k_m ``[B, c, H, D]``."""
    A = jnp.einsum("bnihd,bjhd->bnhij", Q, k_m, preferred_element_type=F32)
    return jnp.where(mask, A, 0.0)


def _forward(fq, fk, v, c: int, eps: float):
    """y ``[B, T, H, D]`` float32 and den ``[B, T, H]`` float32; T a multiple of c (fq, fk
    ``[B, T, H, d']``, v ``[B, T, H, D]``)."""
    B, T, H, D = v.shape
    N = T // c
    Q = _blocks(fq, c)

    def key_block(carry, x):
        num, den = carry
        k_m, v_m, m = x
        A = _block_scores(Q, k_m, _block_mask(N, m, c))
        num = num + jnp.einsum(
            "bnhij,bjhd->bnihd", A.astype(v.dtype), v_m, preferred_element_type=F32
        )
        den = den + A.sum(-1)
        return (num, den), None

    init = (jnp.zeros((B, N, c, H, D), F32), jnp.zeros((B, N, H, c), F32))
    xs = (_key_blocks(fk, c), _key_blocks(v, c), jnp.arange(N))
    (num, den), _ = lax.scan(key_block, init, xs)
    den = jnp.swapaxes(den, 2, 3).reshape(B, T, H)
    y = num.reshape(B, T, H, D) * _reciprocal(den, eps)[..., None]
    return y, den


def _reciprocal(den: jax.Array, eps: float) -> jax.Array:
    # 0 where 1 / (den + eps) is 1/0: only padded queries (no keys, so num = 0 too) with eps = 0,
    # which would otherwise put NaN into the gradients of the real positions.
    return kernels.reciprocal(den, eps)


def _cotangent_blocks(fq, dy, y, den, c: int, eps: float):
    """The backward's per-block operands: phi(Q) ``[B, N, c, H, D]``, dnum = dY / (den + eps)
    ``[B, N, c, H, D]`` and delta = dnum . y ``[B, N, H, c]`` (as flash's rowsum(dO * O))."""
    dnum = dy.astype(F32) * _reciprocal(den, eps)[..., None]
    delta = jnp.einsum("bthd,bthd->bth", dnum, y)
    return _blocks(fq, c), _blocks(dnum, c), jnp.swapaxes(_blocks(delta, c), 2, 3)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def blocked_linear_attention(fq, fk, v, c: int, eps: float):
    """Normalised causal linear attention from features, by blocks of c without the T x T matrix.

    fq = phi(q), fk = phi(k) ``[B, T, H, d']``, v ``[B, T, H, D]`` with T a multiple of c -> y
    ``[B, T, H, D]`` in v's dtype. (The interface a fused kernel implements.)"""
    y, _ = _forward(fq, fk, v, c, eps)
    return y.astype(v.dtype)


def _fwd(fq, fk, v, c, eps):
    y, den = _forward(fq, fk, v, c, eps)
    return y.astype(v.dtype), (fq, fk, v, y, den)


def _bwd(c, eps, residuals, dy):
    fq, fk, v, y, den = residuals
    B, T, H, _ = fq.shape
    Q, dNum, Delta = _cotangent_blocks(fq, dy, y, den, c, eps)

    N = T // c

    def key_block(dQ, x):
        k_m, v_m, m = x
        mask = _block_mask(N, m, c)
        A = _block_scores(Q, k_m, mask)
        dA = jnp.einsum("bnihd,bjhd->bnhij", dNum, v_m, preferred_element_type=F32)
        dA = jnp.where(mask, dA - Delta[..., None], 0.0)
        dQ = dQ + jnp.einsum("bnhij,bjhd->bnihd", dA, k_m, preferred_element_type=F32)
        dv_m = jnp.einsum("bnhij,bnihd->bjhd", A, dNum, preferred_element_type=F32)
        dk_m = jnp.einsum("bnhij,bnihd->bjhd", dA, Q, preferred_element_type=F32)
        return dQ, (dk_m, dv_m)

    xs = (_key_blocks(fk, c), _key_blocks(v, c), jnp.arange(N))
    dQ, (dK, dV) = lax.scan(key_block, jnp.zeros(Q.shape, F32), xs)

    def unblock(x):  # [N, B, c, H, D] -> [B, T, H, D]
        return jnp.swapaxes(x, 0, 1).reshape(B, T, H, x.shape[-1])

    return (
        dQ.reshape(fq.shape).astype(fq.dtype),
        unblock(dK).astype(fk.dtype),
        unblock(dV).astype(v.dtype),
    )


blocked_linear_attention.defvjp(_fwd, _bwd)


# --------------------------------------------------------------------------------------------
# With forgetting: decays exp(L_i - L_j) and document masks per block pair


def _block_gates(log_gate: jax.Array, c: int) -> tuple[jax.Array, jax.Array]:
    """Block-local cumulative log-gates b ``[B, N, H, c]`` (b_i = sum of log gamma from the
    block's first position to i) and the block totals G ``[B, N, H]`` (b at the block's end)."""
    b = jnp.swapaxes(_blocks(kernels.block_cumsum(log_gate, c), c), 2, 3)
    return b, b[..., -1]


def _forget_blocks(b, G, R, seg, m, c):
    """For key block m against every query block n: mask ``[B, N, 1, c, c]`` (causal, same
    document) and weights ``[B, N, H, c, c]`` exp(L_i - L_j) (0 where masked), with the exponent
    taken from block-local sums (module docstring): b_i - b_j when n = m, else
    b_i + R_n + (G_m - b_j), R ``[B, N, H]`` the totals of the blocks strictly between."""
    bk = lax.dynamic_index_in_dim(b, m, axis=1, keepdims=False)  # [B, H, c]
    Gm = lax.dynamic_index_in_dim(G, m, axis=1, keepdims=False)  # [B, H]
    sq = _blocks(seg, c)  # [B, N, c]
    sk = lax.dynamic_slice_in_dim(seg, m * c, c, axis=1)  # [B, c]
    mask = _block_mask(b.shape[1], m, c)  # [1, N, 1, c, c]
    mask = mask & (sq[:, :, None, :, None] == sk[:, None, None, None, :])
    diag = (jnp.arange(b.shape[1]) == m)[None, :, None, None]  # [1, N, 1, 1]
    # The key's share of the exponent per query block: -b_j on the diagonal block, else
    # R_n + e_j with e_j = G_m - b_j formed first (both block-local, so it is exact where it
    # matters: e_j = 0 for the block's last key however large G_m is).
    e = Gm[..., None] - bk  # [B, H, c]
    key = jnp.where(diag, -bk[:, None], R[..., None] + e[:, None])
    diff = b[..., :, None] + key[..., None, :]  # [B, N, H, c, c]
    return mask, jnp.exp(jnp.where(mask, diff, -jnp.inf))


def _between(R, G, m):
    """R after key block m (the scan runs m downwards): block m's total joins the sum of every
    later query block, added near to far so that R never is a difference of long sums."""
    later = (jnp.arange(R.shape[1]) > m)[None, :, None]
    return R + jnp.where(later, lax.dynamic_index_in_dim(G, m, axis=1, keepdims=True), 0.0)


def _forward_forget(fq, fk, v, log_gate, seg, c: int, eps: float):
    B, T, H, D = v.shape
    N = T // c
    Q = _blocks(fq, c)
    b, G = _block_gates(log_gate, c)

    def key_block(carry, x):
        num, den, R = carry
        k_m, v_m, m = x
        _, W = _forget_blocks(b, G, R, seg, m, c)
        S = jnp.einsum("bnihd,bjhd->bnhij", Q, k_m, preferred_element_type=F32) * W
        num = num + jnp.einsum(
            "bnhij,bjhd->bnihd", S.astype(v.dtype), v_m, preferred_element_type=F32
        )
        return (num, den + S.sum(-1), _between(R, G, m)), None

    init = (
        jnp.zeros((B, N, c, H, D), F32),
        jnp.zeros((B, N, H, c), F32),
        jnp.zeros((B, N, H), F32),
    )
    xs = (_key_blocks(fk, c), _key_blocks(v, c), jnp.arange(N))
    (num, den, _), _ = lax.scan(key_block, init, xs, reverse=True)
    den = jnp.swapaxes(den, 2, 3).reshape(B, T, H)
    y = num.reshape(B, T, H, D) * _reciprocal(den, eps)[..., None]
    return y, den


@partial(jax.custom_vjp, nondiff_argnums=(5, 6))
def blocked_forget_attention(fq, fk, v, log_gate, seg, c: int, eps: float):
    """:func:`blocked_linear_attention` with the pair weights exp(L_i - L_j), L the cumulative
    log-gate, and document masks (``seg`` int32 [B, T]); ``log_gate`` float32 [B, T, H] is
    log gamma per position (<= 0; 0 on padding). Differentiable in fq, fk, v and log_gate."""
    return _forward_forget(fq, fk, v, log_gate, seg, c, eps)[0].astype(v.dtype)


def _fwd_forget(fq, fk, v, log_gate, seg, c, eps):
    y, den = _forward_forget(fq, fk, v, log_gate, seg, c, eps)
    return y.astype(v.dtype), (fq, fk, v, log_gate, seg, y, den)


def _bwd_forget(c, eps, residuals, dy):
    fq, fk, v, log_gate, seg, y, den = residuals
    B, T, H, _ = fq.shape
    N = T // c
    Q, dNum, Delta = _cotangent_blocks(fq, dy, y, den, c, eps)
    b, G = _block_gates(log_gate, c)

    def key_block(carry, x):
        dQ, dLq, R = carry
        k_m, v_m, m = x
        mask, W = _forget_blocks(b, G, R, seg, m, c)
        P = jnp.einsum("bnihd,bjhd->bnhij", Q, k_m, preferred_element_type=F32)
        S = P * W
        dS = jnp.einsum("bnihd,bjhd->bnhij", dNum, v_m, preferred_element_type=F32)
        dS = jnp.where(mask, dS - Delta[..., None], 0.0)
        dP = dS * W
        dQ = dQ + jnp.einsum("bnhij,bjhd->bnihd", dP, k_m, preferred_element_type=F32)
        dv_m = jnp.einsum("bnhij,bnihd->bjhd", S, dNum, preferred_element_type=F32)
        dk_m = jnp.einsum("bnhij,bnihd->bjhd", dP, Q, preferred_element_type=F32)
        dSS = dS * S
        dLq = dLq + dSS.sum(-1)  # [B, N, H, c]: as queries
        dLk_m = -jnp.einsum("bnhij->bjh", dSS)  # [B, c, H]: as keys
        return (dQ, dLq, _between(R, G, m)), (dk_m, dv_m, dLk_m)

    xs = (_key_blocks(fk, c), _key_blocks(v, c), jnp.arange(N))
    init = (jnp.zeros(Q.shape, F32), jnp.zeros((B, N, H, c), F32), jnp.zeros((B, N, H), F32))
    (dQ, dLq, _), (dK, dV, dLk) = lax.scan(key_block, init, xs, reverse=True)

    def unblock(x):  # [N, B, c, ...] -> [B, T, ...]
        return jnp.swapaxes(x, 0, 1).reshape(B, T, *x.shape[3:])

    dL = jnp.swapaxes(dLq, 2, 3).reshape(B, T, H) + unblock(dLk)
    dseg = np.zeros(seg.shape, dtype=jax.dtypes.float0)
    return (
        dQ.reshape(fq.shape).astype(fq.dtype),
        unblock(dK).astype(fk.dtype),
        unblock(dV).astype(v.dtype),
        kernels.log_gate_cotangent(dL),
        dseg,
    )


blocked_forget_attention.defvjp(_fwd_forget, _bwd_forget)
