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

Forgetting (decay gates, document resets) scales the state entering a chunk by the chunk's
cumulative decay and the intra-chunk scores by the decay between positions, with exponents that
are sums over at most c positions: exact in float32 at any length. The XLA form is the kernels'
oracle, ``linear_gpt2.kernels.lt_chunked.naive`` (where the formulas are); the Pallas kernels
are ``...lt_chunked.ops``.
"""

from __future__ import annotations

import dataclasses
from functools import partial

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.attention import autotune, feature_maps, linear
from linear_gpt2.attention.context import SEQ, over_sequence, sequence_shards
from linear_gpt2.kernels import key_blocks
from linear_gpt2.kernels.context import entering_state, slice_state
from linear_gpt2.kernels.lt_chunked import FUSED, NAMES
from linear_gpt2.kernels.lt_chunked.naive import chunked_linear_attention

F32 = jnp.float32


def chunks_problem(T: int, c: int | str) -> str | None:
    """Why chunks of ``c`` do not tile ``T`` tokens, or None (``auto`` picks a divisor)."""
    if c == "auto" or T % c == 0:
        return None
    divisor = max(d for d in range(1, min(T, c) + 1) if T % d == 0)
    return (
        f"chunk_size={c} does not divide T={T}; choose a divisor of {T}, e.g. chunk_size={divisor}"
    )


# Implementations selected by ``kernel=``: ``xla`` is the oracle, ``kernels.lt_chunked.naive``;
# the Pallas kernels (Triton-lowered on GPU, interpret mode elsewhere) are ``NAMES``:
# ``pallas_chunk`` (chunk-parallel), ``pallas_fused_chunk`` (single pass), and ``pallas``, which
# chooses between the two by shape; ``triton`` (jax-triton, GPU only) is the single pass written
# in Triton; ``auto`` is pallas on a GPU, xla elsewhere.
KERNELS = ("auto", "xla", *NAMES, "triton")


@dataclasses.dataclass(frozen=True)
class LTChunkedOptions(linear.ChunkedOptions):
    kernel: str = linear.kernel_option(KERNELS)


def _check_available(kernel: str) -> None:
    """Fail at ``make()`` for a kernel this platform cannot run (triton without jax-triton).
    Pallas and Triton are imported only when a kernel is picked: kernel=xla never imports them."""
    if kernel == "triton":
        from linear_gpt2.kernels.lt_chunked import triton_fused

        triton_fused.check_available()


def make(options: LTChunkedOptions):
    """``fn(q, k, v) -> y``. ``options.chunk_size``: an int dividing T (a power of two >= 16 for
    the fused kernels), or ``"auto"``: chosen when ``fn`` is traced, from the concrete shape, by
    ``linear_gpt2.attention.autotune.best_chunk_size`` (measured once per shape and device, then
    cached on disk)."""
    feature_map, chunk_size = options.feature_map, options.chunk_size
    kernel, eps = options.kernel, options.eps
    phi = linear.check_feature_map(feature_map)
    _check_available(kernel)

    def fn(q, k, v, *, resets=None, log_gate=None) -> jax.Array:
        """Causal linear attention by chunks. q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``;
        the chunk size must divide T (each device's slice of it under context parallelism);
        optional ``resets`` / ``log_gate``."""
        if sequence_shards() > 1:
            return over_sequence(partial(attend, context_parallel=True), q, k, v, resets, log_gate)
        return attend(q, k, v, resets, log_gate)

    def attend(q, k, v, resets, log_gate, context_parallel: bool = False) -> jax.Array:
        """The positions in hand (the whole sequence, or this device's slice of it starting from
        the state the earlier slices leave, ``kernels/context.py``)."""
        forget = linear.as_forget(log_gate, resets)
        # auto is resolved here, when traced: for the platform compiled for (a GPU target too).
        impl = kernels.resolve_kernel(
            kernel, "LT_chunked", problem=kernels.tiling_problem(chunk_size, v.shape[-1])
        )
        if impl == "triton" and context_parallel:
            raise NotImplementedError(
                "LT_chunked kernel=triton takes no initial state, so not context parallelism; "
                "use kernel=pallas or kernel=auto"
            )
        if forget is not None and impl in (FUSED, "triton"):  # the single passes do not forget
            impl = kernels.forget_fallback(kernel, impl, "LT_chunked")
        c = chunk_size
        if c == "auto":
            c = autotune.best_chunk_size(
                "LT_chunked", q.shape, q.dtype, impl, feature_map=feature_map, eps=eps
            )
        problem = chunks_problem(q.shape[1], c)
        if problem:
            raise ValueError(f"LT_chunked: {problem}")
        # An elementwise map goes into the Pallas op with the raw q, k: phi in XLA fused with
        # the producer of q, k (the features are the op's residuals, not q and k), phi' in the
        # gradient kernels (``kernels/lt_chunked/ops.py``).
        raw_map = phi if impl in NAMES and phi.slope is not None else None
        fq, fk = (q, k) if raw_map else linear.features(q, k, phi)
        state = None
        if context_parallel:
            keys = linear.feature(k, phi) if raw_map else fk
            state = entering_state(*slice_state(keys, v, log_gate, resets), SEQ)
        if impl == "xla":
            (num, den), _ = chunked_linear_attention(fq, fk, v, c, state=state, forget=forget)
            return linear.normalise(num, den, eps, q.dtype)
        v = v.astype(q.dtype)
        if impl == "triton":  # jax-triton's single pass: no state, no forgetting (checked above)
            from linear_gpt2.kernels.lt_chunked import triton_fused

            return triton_fused.chunked_attention(fq, fk, v, c, eps).astype(q.dtype)
        from linear_gpt2.kernels.lt_chunked import ops  # Pallas: only when picked

        y = ops.chunked_attention(
            fq, fk, v, c, eps, kernel=impl, initial_state=state,
            log_gate=None if forget is None else forget.log_gate,
            resets=None if forget is None else forget.resets, feature_map=raw_map,
        )  # fmt: skip
        return y.astype(q.dtype)

    return fn


def _flops(T: int, H: int, D: int, options: LTChunkedOptions) -> float:
    """Attention inside the chunk (2 c d' + 2 c D) and the state read and update (4 d' D) per
    head, d' the features of q and k (D for the elementwise maps); an ``auto`` chunk size is
    counted at 64, its usual choice."""
    chunk = options.chunk_size
    c = min(64 if chunk == "auto" else chunk, T)
    d = feature_maps.key_features(D, options)
    return H * (2 * c * (d + D) + 4 * d * D)


def _kernel_design(shape, dtype, options: LTChunkedOptions) -> str:
    """What ``kernel`` runs at ``shape`` = (B, T, H, D) for the platform traced for: ``xla``,
    ``triton``, or the Pallas design (``kernel=pallas`` chooses by shape with the cost model)."""
    kernel, c = linear.pallas_block(options, NAMES, shape[3])
    if c is None:
        return kernel
    from linear_gpt2.kernels.lt_chunked import ops  # Pallas: only when a Pallas kernel is named

    B, T, H, D = shape
    Tp = -(-T // c) * c
    nk = key_blocks.plan(feature_maps.key_features(D, options), D)[1]
    return ops.choose(kernel, B, Tp, H, kernels.padded_head_dim(D), c, dtype, nk=nk)


SPEC = linear.spec(
    "LT_chunked",
    make,
    _flops,
    options=LTChunkedOptions,
    context_problem=lambda T, options: chunks_problem(T, options.chunk_size),
    kernel_design=_kernel_design,
    sweep_chunk_size=True,
    context_parallel=True,
    description="states at chunk boundaries, attention inside chunks",
)
