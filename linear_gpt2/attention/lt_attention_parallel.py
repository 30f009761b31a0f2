"""``LT_attention_parallel``: the attention formulation without the T x T matrix (flash-style).

The post uses a Triton flash kernel here. With block size c (the ``chunk_size`` option), every
query block sums over the key blocks before it with running numerator and denominator, so the
[T, T] scores never exist: O(T^2 D) FLOPs, O(T c) extra memory per head. ``kernel=xla`` is the
blocked form in pure JAX with a hand-written backward
(``linear_gpt2.kernels.lt_attention_parallel.naive``, the oracle); the Pallas kernels
(``linear_gpt2.kernels.lt_attention_parallel``) are ``pallas_tiled`` (resident 128-row blocks,
longest first, one backward kernel with atomic dq), ``pallas_tiled_dq`` (its forward with
FlashAttention 2's two backward kernels), ``pallas_blocked`` (the first design) and ``pallas``,
which chooses by shape between ``pallas_tiled_dq`` and ``pallas_blocked`` with the roofline
model (the atomic backward measured slower: ``kernels.lt_attention_parallel.cost``); with
document resets and decay gates every form weighs each pair by exp(L_i - L_j) within a
document, from block-local log-gate sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.attention import autotune, feature_maps, linear
from linear_gpt2.attention.spec import AttentionSpec, quadratic_flops
from linear_gpt2.kernels import key_blocks
from linear_gpt2.kernels.lt_attention_parallel import NAMES
from linear_gpt2.kernels.lt_attention_parallel.naive import (
    blocked_forget_attention,
    blocked_linear_attention,
)

F32 = jnp.float32


def _pallas(kernel: str):
    """The (plain, with forgetting) implementations of a Pallas kernel name; Pallas is imported
    when the kernel is called: kernel=xla never imports it."""

    def plain(fq, fk, v, c: int, eps: float) -> jax.Array:
        from linear_gpt2.kernels.lt_attention_parallel import ops

        return ops.attention(fq, fk, v, c, eps, kernel)

    def forgetting(fq, fk, v, log_gate, seg, c: int, eps: float) -> jax.Array:
        from linear_gpt2.kernels.lt_attention_parallel import ops

        return ops.forget_attention(fq, fk, v, log_gate, seg, c, eps, kernel)

    return plain, forgetting


# kernel name -> (plain, with forgetting) implementations of the oracle's interfaces (``auto``
# is pallas on a GPU when the block size suits it, xla otherwise; see ``linear_gpt2.kernels``).
# The fused kernels need a power-of-two block size >= 16.
IMPLEMENTATIONS: dict[str, tuple[Callable[..., jax.Array], Callable[..., jax.Array]]] = {
    "xla": (blocked_linear_attention, blocked_forget_attention),
    **{name: _pallas(name) for name in NAMES},
}
KERNELS = ("auto", *IMPLEMENTATIONS)


@dataclasses.dataclass(frozen=True)
class LTAttentionParallelOptions(linear.ChunkedOptions):
    kernel: str = linear.kernel_option(KERNELS)


def _block_size(kernel: str, chunk_size: int, T: int) -> int:
    """The block size for length T: ``chunk_size``, capped at T for xla; for a fused kernel
    capped at the power of two >= T (at least 16), so that it stays a valid Triton block."""
    if kernel != "xla":
        return min(chunk_size, max(kernels.MIN_BLOCK, kernels.next_power_of_2(T)))
    return min(chunk_size, T)


def make(options: LTAttentionParallelOptions):
    """``fn(q, k, v) -> y``. ``options.chunk_size`` is the block size (any int >= 1 for xla, a
    power of two >= 16 for the Pallas kernels, where it caps their tiles), or ``"auto"``: chosen
    at trace time from the concrete shape by ``linear_gpt2.attention.autotune.best_chunk_size``."""
    feature_map, chunk_size = options.feature_map, options.chunk_size
    kernel, eps = options.kernel, options.eps
    phi = linear.check_feature_map(feature_map)

    def fn(q, k, v, *, resets=None, log_gate=None) -> jax.Array:
        """Causal linear attention, blocked. q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``; any T
        (padded to a multiple of the block size); optional ``resets`` / ``log_gate`` (see
        ``kernels.forget``)."""
        forget = linear.as_forget(log_gate, resets)
        # auto is resolved here, when traced: for the platform compiled for (a GPU target too).
        name = kernels.resolve_kernel(
            kernel,
            "LT_attention_parallel",
            problem=kernels.tiling_problem(chunk_size, v.shape[-1]),
        )
        plain, forgetting = IMPLEMENTATIONS[name]
        T = q.shape[1]
        block = chunk_size
        if block == "auto":
            block = autotune.best_chunk_size(
                "LT_attention_parallel", q.shape, q.dtype, name, feature_map=feature_map, eps=eps
            )
        c = _block_size(name, block, T)
        fq, fk = linear.features(q, k, phi)
        # Pad in feature space: phi(k) = 0 and v = 0 on padded keys, so they add nothing to any
        # real query's sums; the padded queries (den = 0, y = 0) are dropped.
        pad = (-T) % c
        if pad:
            widths = ((0, 0), (0, pad), (0, 0), (0, 0))
            fq, fk, v = (jnp.pad(x, widths) for x in (fq, fk, v))
        if forget is None:
            return plain(fq, fk, v.astype(q.dtype), c, float(eps))[:, :T]
        B, _, H, _ = q.shape
        gate = forget.log_gate if forget.log_gate is not None else jnp.zeros((B, T, H), F32)
        seg = (
            linear.segment_ids(forget.resets)
            if forget.resets is not None
            else jnp.zeros((B, T), jnp.int32)
        )
        # Padded positions: gamma = 1 (log 0) and the last document id; they come after every
        # real query (masked by causality) and carry no features.
        gate = jnp.pad(gate, ((0, 0), (0, pad), (0, 0)))
        seg = jnp.pad(seg, ((0, 0), (0, pad)), mode="edge")
        return forgetting(fq, fk, v.astype(q.dtype), gate, seg, c, float(eps))[:, :T]

    return fn


def _kernel_design(shape, dtype, options: LTAttentionParallelOptions) -> str:
    """What ``kernel`` runs at ``shape`` = (B, T, H, D) for the platform traced for: ``xla`` or
    the Pallas design (``kernel=pallas`` chooses by shape with the cost model)."""
    B, T, H, D = shape
    kernel, c = linear.pallas_block(options, NAMES, D, lambda k, c: _block_size(k, c, T))
    if c is None:
        return kernel
    from linear_gpt2.kernels.lt_attention_parallel import ops  # the model: no Pallas import

    Tp = -(-T // c) * c
    d = feature_maps.key_features(D, options)  # wider keys: blocks folded into the heads
    nk = 1 if kernels.padded_head_dim(d) == kernels.padded_head_dim(D) else key_blocks.plan(d, D)[1]
    return ops.design(kernel, B, Tp, H * nk, kernels.padded_head_dim(D), c, dtype)


SPEC = AttentionSpec(
    name="LT_attention_parallel",
    context_parallel=False,
    family="linear",
    make=make,
    flops=quadratic_flops,
    options=LTAttentionParallelOptions,
    make_decoder=linear.make_decoder,
    resets=True,
    decay=True,
    stats=linear.layer_stats,
    kernel_design=_kernel_design,
    description="the attention form blocked flash-style: running sums, no T x T matrix",
)
