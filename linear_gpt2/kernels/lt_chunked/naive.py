"""The oracle of every ``LT_chunked`` kernel: the pure-JAX chunked form (the XLA path).

Split the T positions into T/c chunks of c. With S_n the state after n chunks (S_0 = 0),

    P_n = sum_{j in chunk n} phi(k_j) v_j^T          S_n = P_0 + ... + P_{n-1}  (exclusive cumsum)
    p_n = sum_{j in chunk n} phi(k_j)                z_n = p_0 + ... + p_{n-1}
    y_i = (phi(q_i)^T S_n + sum_{j in chunk n, j <= i} (phi(q_i) . phi(k_j)) v_j)
          / (phi(q_i) . z_n + sum_{j in chunk n, j <= i} phi(q_i) . phi(k_j) + eps)

for i in chunk n. With forgetting (``forget.Forget``: decay gates gamma_i, document resets), per
chunk n with b_i the cumulative log gamma from the chunk's start to i (inclusive) and "kept"
meaning no document starts in the chunk up to i:

    y_i  = (kept_i e^{b_i} phi(q_i)^T S_n + sum_{j<=i, same doc} e^{b_i - b_j} (phi(q_i).phi(k_j)) v_j)
           / (kept_i e^{b_i} phi(q_i).z_n + sum_{j<=i, same doc} e^{b_i - b_j} phi(q_i).phi(k_j) + eps)
    S_{n+1} = kept_last e^{b_last} S_n + sum_{j in last doc} e^{b_last - b_j} phi(k_j) v_j^T

a first-order recurrence over chunks (``lax.associative_scan``). The exponents are sums over at
most c positions, all <= 0: exact in float32 at any sequence length.

:func:`chunked_linear_attention` returns the numerator, denominator and final state (what the
decoder's prefill and the diagnostics need); :func:`chunked_attention` adds the normaliser with
the kernels' interface, so tests compare the two directly (values, and gradients by autodiff).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from linear_gpt2.kernels import normalise
from linear_gpt2.kernels.forget import Forget, causal_mask, decayed_scan

F32 = jnp.float32


def chunked_linear_attention(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    c: int,
    state=None,
    forget: Forget | None = None,
):
    """Numerator ``[B, T, H, D]`` and denominator ``[B, T, H]`` (float32) by chunks of ``c``,
    continuing from ``state`` = ``(S [B, H, d', D], z [B, H, d'])`` float32 (zeros if None).

    fq = phi(q), fk = phi(k) ``[B, T, H, d']`` and v ``[B, T, H, D]`` with T a multiple of c; ``forget`` see
    ``Forget`` (a reset at position 0 drops ``state``). Returns ``((num, den), state)``
    with the state after all T positions (what the decoder's prefill continues from).
    """
    if forget is not None:
        return _chunked_forget(fq, fk, v, c, state, forget)
    B, T, H, Dk = fq.shape
    D = v.shape[-1]
    N = T // c
    if state is None:
        state = (jnp.zeros((B, H, Dk, D), F32), jnp.zeros((B, H, Dk), F32))
    S0, z0 = state
    fq, fk, v = (x.reshape(B, N, c, H, x.shape[-1]) for x in (fq, fk, v))

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
    A = jnp.where(causal_mask(c), A, 0.0)
    num = num + jnp.einsum("bnhij,bnjhd->bnihd", A.astype(v.dtype), v, preferred_element_type=F32)
    den = den + jnp.swapaxes(A.sum(-1), 2, 3)  # [B, N, H, c] -> [B, N, c, H]

    new_state = (S_incl[:, -1], z_incl[:, -1])
    return (num.reshape(B, T, H, D), den.reshape(B, T, H)), new_state


def chunk_decays(forget: Forget, B: int, T: int, H: int, c: int):
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
    mask = (causal_mask(c) & same)[:, :, None]  # [B, N, 1, c, c]
    bt = jnp.swapaxes(b, 2, 3)  # [B, N, H, c]
    intra = jnp.exp(jnp.where(mask, bt[..., :, None] - bt[..., None, :], -jnp.inf))
    into = jnp.where(kept[..., None], jnp.exp(b), 0.0)
    last_doc = seg == seg[..., -1:]  # [B, N, c]
    out = jnp.where(last_doc[..., None], jnp.exp(b[:, :, -1:] - b), 0.0)  # b_last - b_j <= 0
    carry = into[:, :, -1]
    return intra, into, out, carry


def _chunked_forget(fq, fk, v, c, state, forget: Forget):
    B, T, H, Dk = fq.shape
    D = v.shape[-1]
    N = T // c
    if state is None:
        state = (jnp.zeros((B, H, Dk, D), F32), jnp.zeros((B, H, Dk), F32))
    S0, z0 = state
    intra, into, out, carry = chunk_decays(forget, B, T, H, c)
    fq, fk, v = (x.reshape(B, N, c, H, x.shape[-1]) for x in (fq, fk, v))

    # Each chunk's own contribution to the state at its end, then the recurrence over chunks
    # S_after_n = carry_n S_after_{n-1} + P_n from S_after_{-1} = S0, in log depth.
    wk = (fk.astype(F32) * out[..., None]).astype(fk.dtype)
    P = jnp.einsum("bnchd,bnche->bnhde", wk, v, preferred_element_type=F32)
    p = (fk.astype(F32) * out[..., None]).sum(axis=2)  # [B, N, H, D]

    G, Q, q = decayed_scan(carry, P, p, axis=1)
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


def chunked_attention(
    fq: jax.Array,
    fk: jax.Array,
    v: jax.Array,
    c: int,
    eps: float,
    initial_state=None,
    return_final_state: bool = False,
):
    """``y = num / (den + eps)`` by chunks of ``c`` (T padded to a multiple of c, as the
    kernels do), in fq's dtype; with ``return_final_state`` also the state ``(S [B, H, D, D],
    z [B, H, D])`` float32 after the T positions."""
    T = fq.shape[1]
    pad = (-T) % c
    if pad:
        widths = ((0, 0), (0, pad), (0, 0), (0, 0))
        fq, fk, v = (jnp.pad(x, widths) for x in (fq, fk, v))
    (num, den), state = chunked_linear_attention(fq, fk, v, c, state=initial_state)
    y = normalise(num[:, :T], den[:, :T], eps, fq.dtype)
    return (y, state) if return_final_state else y
