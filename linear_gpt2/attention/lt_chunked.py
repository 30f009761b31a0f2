"""``LT_chunked``: states at chunk boundaries, attention inside chunks (the post's section 3).

Split the T positions into T/c chunks of c. With S_n the state after n chunks (S_0 = 0),

    P_n = sum_{j in chunk n} phi(k_j) v_j^T          S_n = P_0 + ... + P_{n-1}  (exclusive cumsum)
    p_n = sum_{j in chunk n} phi(k_j)                z_n = p_0 + ... + p_{n-1}
    y_i = (phi(q_i)^T S_n + sum_{j in chunk n, j <= i} (phi(q_i) . phi(k_j)) v_j)
          / (phi(q_i) . z_n + sum_{j in chunk n, j <= i} phi(q_i) . phi(k_j) + eps)

for i in chunk n: the state carries everything before the chunk, causal attention covers the
chunk itself. O(T D^2 + T c D) FLOPs; memory O(T/c D^2 + T c) per head (T/c states, and c x c
scores per chunk). c = 1 is the state recurrence, c = T plain attention; in between it is linear
in T with matmul-shaped work. c must divide T.

Forgetting (``linear.Forget``: decay gates gamma_i, document resets), per chunk n with b_i the
cumulative log gamma from the chunk's start to i (inclusive) and "kept" meaning no document
starts in the chunk up to i:

    y_i  = (kept_i e^{b_i} phi(q_i)^T S_n + sum_{j<=i, same doc} e^{b_i - b_j} (phi(q_i).phi(k_j)) v_j)
           / (kept_i e^{b_i} phi(q_i).z_n + sum_{j<=i, same doc} e^{b_i - b_j} phi(q_i).phi(k_j) + eps)
    S_{n+1} = kept_last e^{b_last} S_n + sum_{j in last doc} e^{b_last - b_j} phi(k_j) v_j^T

a first-order recurrence over chunks (``lax.associative_scan``). The intra-chunk scores carry
the decay products between positions; the state entering a chunk is scaled by the chunk's
cumulative decay. The exponents are sums over at most c positions, all <= 0: exact in float32
at any sequence length (a sequence-long cumulative sum would not be: at 64k positions of
gamma = 1e-3 it reaches -4.5e5, where float32's spacing is 0.03).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2.attention import linear

OPTIONS: tuple[str, ...] = ("feature_map", "chunk_size", "kernel", "eps")

F32 = jnp.float32


def chunked_linear_attention(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    c: int,
    state=None,
    forget: linear.Forget | None = None,
):
    """Numerator ``[B, T, H, D]`` and denominator ``[B, T, H]`` (float32) by chunks of ``c``,
    continuing from ``state`` = ``(S [B, H, D, D], z [B, H, D])`` float32 (zeros if None).

    fq = phi(q), fk = phi(k), v: ``[B, T, H, D]`` with T a multiple of c; ``forget`` see
    ``linear.Forget`` (a reset at position 0 drops ``state``). Returns ``((num, den), state)``
    with the state after all T positions (what the decoder's prefill continues from).
    """
    if forget is not None:
        return _chunked_forget(fq, fk, v, c, state, forget)
    B, T, H, D = fq.shape
    N = T // c
    if state is None:
        state = (jnp.zeros((B, H, D, D), F32), jnp.zeros((B, H, D), F32))
    S0, z0 = state
    fq, fk, v = (x.reshape(B, N, c, H, D) for x in (fq, fk, v))

    # State increments of each chunk, then the state before each chunk (exclusive prefix sum).
    P = jnp.einsum("bnchd,bnche->bnhde", fk, v, preferred_element_type=F32)
    p = fk.astype(F32).sum(axis=2)  # [B, N, H, D]
    S_incl = S0[:, None] + jnp.cumsum(P, axis=1)
    z_incl = z0[:, None] + jnp.cumsum(p, axis=1)
    S = jnp.concatenate([S0[:, None], S_incl[:, :-1]], axis=1)  # [B, N, H, D, D]
    z = jnp.concatenate([z0[:, None], z_incl[:, :-1]], axis=1)  # [B, N, H, D]

    # Contribution of everything before the chunk, through its initial state.
    num = jnp.einsum("bnihd,bnhde->bnihe", fq, S, preferred_element_type=F32)
    den = jnp.einsum("bnihd,bnhd->bnih", fq, z, preferred_element_type=F32)

    # Contribution of the chunk itself: causal attention on c x c scores.
    A = jnp.einsum("bnihd,bnjhd->bnhij", fq, fk, preferred_element_type=F32)
    A = jnp.where(linear.causal_mask(c), A, 0.0)
    num = num + jnp.einsum("bnhij,bnjhd->bnihd", A.astype(v.dtype), v, preferred_element_type=F32)
    den = den + jnp.swapaxes(A.sum(-1), 2, 3)  # [B, N, H, c] -> [B, N, c, H]

    new_state = (S_incl[:, -1], z_incl[:, -1])
    return (num.reshape(B, T, H, D), den.reshape(B, T, H)), new_state


def chunk_decays(forget: linear.Forget, B: int, T: int, H: int, c: int):
    """The per-chunk factors of the forgetting form (module docstring), float32:

    - ``intra`` ``[B, N, H, c, c]``: e^{b_i - b_j} for j <= i in the same document, else 0;
    - ``into`` ``[B, N, c, H]``: kept_i e^{b_i}, the weight of the state entering the chunk;
    - ``out`` ``[B, N, c, H]``: e^{b_last - b_j} for j in the chunk's last document, else 0;
    - ``carry`` ``[B, N, H]``: kept_last e^{b_last}, the factor of the state across the chunk.
    """
    N = T // c
    a = jnp.zeros((B, T, H), F32) if forget.log_gate is None else forget.log_gate.astype(F32)
    b = jnp.cumsum(a.reshape(B, N, c, H), axis=2)  # [B, N, c, H], from the chunk's start
    r = jnp.zeros((B, T), bool) if forget.resets is None else forget.resets
    seg = jnp.cumsum(r.reshape(B, N, c).astype(jnp.int32), axis=2)  # documents begun so far
    kept = seg == 0  # [B, N, c]: still in the document the chunk started in
    same = seg[..., :, None] == seg[..., None, :]  # [B, N, c, c]
    mask = (linear.causal_mask(c) & same)[:, :, None]  # [B, N, 1, c, c]
    bt = jnp.swapaxes(b, 2, 3)  # [B, N, H, c]
    intra = jnp.exp(jnp.where(mask, bt[..., :, None] - bt[..., None, :], -jnp.inf))
    into = jnp.where(kept[..., None], jnp.exp(b), 0.0)
    last_doc = seg == seg[..., -1:]  # [B, N, c]
    out = jnp.where(last_doc[..., None], jnp.exp(b[:, :, -1:] - b), 0.0)  # b_last - b_j <= 0
    carry = into[:, :, -1]
    return intra, into, out, carry


def _chunked_forget(fq, fk, v, c, state, forget: linear.Forget):
    B, T, H, D = fq.shape
    N = T // c
    if state is None:
        state = (jnp.zeros((B, H, D, D), F32), jnp.zeros((B, H, D), F32))
    S0, z0 = state
    intra, into, out, carry = chunk_decays(forget, B, T, H, c)
    fq, fk, v = (x.reshape(B, N, c, H, D) for x in (fq, fk, v))

    # Each chunk's own contribution to the state at its end, then the recurrence over chunks
    # S_after_n = carry_n S_after_{n-1} + P_n from S_after_{-1} = S0, in log depth.
    wk = (fk.astype(F32) * out[..., None]).astype(fk.dtype)
    P = jnp.einsum("bnchd,bnche->bnhde", wk, v, preferred_element_type=F32)
    p = (fk.astype(F32) * out[..., None]).sum(axis=2)  # [B, N, H, D]

    def combine(x, y):
        (gx, Px, px), (gy, Py, py) = x, y
        return gx * gy, gy[..., None, None] * Px + Py, gy[..., None] * px + py

    G, Q, q = jax.lax.associative_scan(combine, (carry, P, p), axis=1)
    S_after = G[..., None, None] * S0[:, None] + Q  # [B, N, H, D, D]
    z_after = G[..., None] * z0[:, None] + q
    S = jnp.concatenate([S0[:, None], S_after[:, :-1]], axis=1)  # state entering each chunk
    z = jnp.concatenate([z0[:, None], z_after[:, :-1]], axis=1)

    # Through the entering state, weighted by kept_i e^{b_i}.
    num = jnp.einsum("bnihd,bnhde->bnihe", fq, S, preferred_element_type=F32) * into[..., None]
    den = jnp.einsum("bnihd,bnhd->bnih", fq, z, preferred_element_type=F32) * into
    # Inside the chunk: scores times the decay between positions, within documents.
    A = jnp.einsum("bnihd,bnjhd->bnhij", fq, fk, preferred_element_type=F32) * intra
    num = num + jnp.einsum("bnhij,bnjhd->bnihd", A.astype(v.dtype), v, preferred_element_type=F32)
    den = den + jnp.swapaxes(A.sum(-1), 2, 3)
    return (num.reshape(B, T, H, D), den.reshape(B, T, H)), (S_after[:, -1], z_after[:, -1])


def check_chunk_size(T: int, c: int) -> None:
    if c < 1 or T % c != 0:
        divisor = max(d for d in range(1, max(1, min(T, c)) + 1) if T % d == 0)
        raise ValueError(
            f"LT_chunked: chunk_size={c} does not divide the sequence length T={T}; choose a "
            f"divisor of {T}, e.g. chunk_size={divisor}"
        )


# Implementations selected by ``kernel=``: ``xla`` is ``chunked_linear_attention`` above (the
# oracle of the fused kernels); the Pallas kernels (Triton-lowered on GPU, interpret mode
# elsewhere) live in ``linear_gpt2.kernels.lt_chunked``: ``pallas_chunk`` (chunk-parallel),
# ``pallas_fused_chunk`` (single pass), and ``pallas``, which chooses between the two by shape;
# ``triton`` (jax-triton, GPU only) is the single pass written in Triton; ``auto`` is pallas on
# a GPU, xla elsewhere.
KERNELS = ("auto", "xla", "pallas", "pallas_chunk", "pallas_fused_chunk", "triton")
PALLAS = ("pallas", "pallas_chunk", "pallas_fused_chunk")


def _fused(kernel: str):
    """``(fq, fk, v, c, eps) -> y`` of a fused kernel, imported only when picked."""
    if kernel in PALLAS:
        from linear_gpt2.kernels import lt_chunked as lt_chunked_kernels

        def fn(fq, fk, v, c, eps):
            return lt_chunked_kernels.chunked_attention(fq, fk, v, c, eps, kernel=kernel)

        return fn
    from linear_gpt2.kernels.lt_chunked import triton_fused

    triton_fused.check_available()
    return triton_fused.chunked_attention


def make(
    feature_map: str = "softplus",
    chunk_size: int | str = 64,
    kernel: str = "auto",
    eps: float = 1e-6,
):
    """``fn(q, k, v) -> y``. ``chunk_size``: an int dividing T (a power of two >= 16 for the
    fused kernels), or ``"auto"``: chosen when ``fn`` is traced, from the concrete shape, by
    ``linear_gpt2.attention.autotune.best_chunk_size`` (measured once per shape and device, then
    cached on disk)."""
    from linear_gpt2 import kernels

    phi = linear.check_feature_map(feature_map)
    kernels.check_chunk_option(chunk_size, "LT_chunked")
    linear.check_kernel(kernel, "LT_chunked", KERNELS)
    if kernel not in ("auto", "xla"):
        _fused(kernel)  # an unavailable kernel (triton on CPU) fails here, at make()
        if chunk_size != "auto":
            kernels.check_block_size(chunk_size, f"LT_chunked kernel={kernel}: chunk_size")

    def fn(q, k, v, *, resets=None, log_gate=None) -> jax.Array:
        """Causal linear attention by chunks. q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``;
        the chunk size must divide T; optional ``resets`` / ``log_gate`` (``linear.Forget``)."""
        forget = linear.as_forget(log_gate, resets)
        # auto is resolved here, when traced: for the platform compiled for (a GPU target too).
        impl = kernels.resolve_kernel(kernel, "LT_chunked", KERNELS, chunk_size, q.shape[-1])
        if forget is not None and impl not in ("xla", "pallas", "pallas_chunk"):
            impl = kernels.forget_fallback(kernel, impl, "LT_chunked")
        c = chunk_size
        if c == "auto":
            from linear_gpt2.attention import autotune

            c = autotune.best_chunk_size(
                "LT_chunked", q.shape, q.dtype, impl, feature_map=feature_map, eps=eps
            )
        check_chunk_size(q.shape[1], c)
        fq, fk = linear.features(q, k, phi)
        if impl != "xla" and forget is not None:  # the chunk-parallel kernels forget
            from linear_gpt2.kernels import lt_chunked as lt_chunked_kernels

            y = lt_chunked_kernels.chunked_attention(
                fq, fk, v.astype(q.dtype), c, eps, kernel=impl, log_gate=forget.log_gate,
                resets=forget.resets,
            )  # fmt: skip
            return y.astype(q.dtype)
        if impl != "xla":
            return _fused(impl)(fq, fk, v.astype(q.dtype), c, eps).astype(q.dtype)
        (num, den), _ = chunked_linear_attention(fq, fk, v, c, forget=forget)
        return linear.normalise(num, den, eps, q.dtype)

    return fn


make_decoder = linear.make_decoder
