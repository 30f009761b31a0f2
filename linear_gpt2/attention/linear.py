"""Shared pieces of the linear-attention family: feature maps, normalisation, options, decoder.

Every linear variant computes the same function of raw ``q, k`` ``[B, T, H, Dk]`` and ``v``
``[B, T, H, D]``: for each position i (causal),

    y_i = (sum_{j<=i} (phi(q_i) . phi(k_j)) v_j) / (sum_{j<=i} phi(q_i) . phi(k_j) + eps)

with phi one of :data:`FEATURE_MAPS` (``feature_maps.py``): elementwise (d' = Dk) or expanding
(Based's Taylor map, the symmetric power, ReBased's kernel: d' = dim(Dk) > Dk). Dk is the head
dim, or ``attention.feature_dim`` when the layer projects q and k to fewer dimensions (Based's
16). The states are ``S [d', D]``, ``z [d']`` per head. There is no 1/sqrt(D) scaling for the
elementwise maps (the post has none: the normaliser already removes the scale of the scores).
``eps`` (default 1e-6) is added to the denominator only, after the sum and before the division; it keeps ``relu``, whose
features can all be zero, finite (then y_i = 0) and is negligible otherwise, since the
denominator is a sum of at least one positive product.

Mixed precision (the same rule in every variant):

- phi is applied in float32 whatever the input dtype;
- matmul operands (phi(q), phi(k), v, and the intra-block score matrices) are in the input
  dtype, so bfloat16 inputs use bfloat16 matmuls, but every sum accumulates in float32
  (``preferred_element_type=jnp.float32``): the states S ``[D, D]`` and z ``[D]``, the running
  numerators and denominators, and the normaliser;
- the division is done in float32 and the output is cast back to the input dtype.

The variants differ only in the order of the sums (see ``docs/attention.md``).

Forgetting (``kernels.forget.Forget``; the ``attention.doc_reset`` and ``attention.decay``
options): every variant also takes, per call, ``log_gate`` float32 ``[B, T, H]`` (the state
decays by gamma_i, z too) and ``resets`` bool ``[B, T]`` (the state is dropped where a document
starts). Every exponent is A_i - A_j <= 0 (masked before ``exp``), so nothing overflows; weights
underflow to 0 where the decay is complete. The chunked form computes A within each chunk (and
carries the chunk's total decay on the state), which keeps float32 exact at any length; the
materialising forms use the sequence's cumulative sum.

The family's options are declared once here: :class:`LinearOptions` (``feature_map``,
``feature_dim``, ``kernel``, ``eps``, on top of the layer's ``doc_reset`` and ``decay``), which every linear
variant's options class extends, and :class:`ChunkedOptions` (``chunk_size``, and the rule that
a fused kernel needs a block size it can tile) for the variants that work in chunks or blocks.

The statistics diagnostics report for a linear layer (:func:`layer_stats`) and the recurrent
decoder (:func:`make_decoder`) are shared by every linear variant: they compute the same function.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.attention import feature_maps
from linear_gpt2.attention.context import SEQ, over_sequence, sequence_shards
from linear_gpt2.attention.feature_maps import FeatureMap
from linear_gpt2.attention.options import OptionError, Options, nonnegative, option
from linear_gpt2.attention.spec import AttentionSpec, Decoder
from linear_gpt2.kernels import normalise
from linear_gpt2.kernels.context import entering_state, entering_weights, slice_state
from linear_gpt2.kernels.forget import Forget, as_forget, causal_mask, segment_ids
from linear_gpt2.kernels.lt_chunked import FUSED
from linear_gpt2.kernels.lt_chunked import NAMES as PALLAS_CHUNKED
from linear_gpt2.kernels.lt_chunked.naive import chunked_linear_attention

__all__ = ["Forget", "as_forget", "causal_mask", "normalise", "segment_ids"]

F32 = jnp.float32


# phi by name (``feature_maps.py``): the elementwise maps (features >= 0) and the expanding ones
# (Based's Taylor map, the symmetric power, ReBased's kernel), whose d' = dim(d) features make
# phi(q) . phi(k) a polynomial of q . k.
FEATURE_MAPS = feature_maps.FEATURE_MAPS


def check_feature_map(name: str | FeatureMap) -> FeatureMap:
    return feature_maps.get(name)


# --------------------------------------------------------------------------------------------
# The family's options


def kernel_option(names: tuple[str, ...]) -> Any:
    """The ``kernel`` field of a linear variant whose implementations are ``names``."""
    return option(
        "auto",
        "the implementation (auto: the fused kernel on a GPU, xla elsewhere)",
        choices=names,
        implementation=True,
    )


@dataclasses.dataclass(frozen=True)
class LinearOptions(Options):
    """What every linear variant reads: the feature map, the implementation and eps."""

    # The feature map phi applied to q and k (FEATURE_MAPS): elementwise or expanding.
    feature_map: str = option(
        "softplus", "the feature map phi on q and k", choices=tuple(FEATURE_MAPS), label="/{}"
    )
    # The dimension of q and k per head the layer projects them to before phi (Based's 16;
    # 0: the head dim). It changes c_attn's shape, so a resumed run may not change it.
    feature_dim: int = option(
        0,
        "q and k per head projected to this many dimensions before phi (0: the head dim)",
        check=nonnegative,
        label="({})",
    )
    kernel: str = kernel_option(("auto", "xla"))
    # Added to the normaliser sum_j phi(q_i).phi(k_j) before dividing.
    eps: float = option(1e-6, "added to the normaliser before dividing", check=nonnegative)

    def check(self) -> None:
        super().check()
        problem = feature_maps.dim_problem(self.feature_map, self.feature_dim)
        if problem:
            raise OptionError("feature_dim", problem)


def _chunk_value(value: int | str) -> str | None:
    if value == "auto" or (isinstance(value, int) and value >= 1):
        return None
    return f"must be an int >= 1 or 'auto', got {value!r}"


@dataclasses.dataclass(frozen=True)
class ChunkedOptions(LinearOptions):
    """A linear variant that works in chunks (blocks) of ``chunk_size`` positions."""

    # An int, or "auto": measured per shape and device at trace time, cached (autotune.py).
    chunk_size: int | str = option(
        64,
        "positions per chunk (block); auto: measured per shape when traced",
        check=_chunk_value,
        implementation=True,
    )

    def check(self) -> None:
        super().check()
        # A fused kernel tiles the chunk: its size must be a block size the kernels take.
        if self.kernel not in ("auto", "xla") and self.chunk_size != "auto":
            problem = kernels.block_size_problem(self.chunk_size)
            if problem:
                raise OptionError(
                    "chunk_size",
                    f"kernel={self.kernel}: chunk_size={self.chunk_size} {problem}; use e.g. 64, "
                    f"or kernel=xla for any size",
                )


def features(
    q: jax.Array, k: jax.Array, feature_map: str | Callable[[jax.Array], jax.Array]
) -> tuple[jax.Array, jax.Array]:
    """phi(q), phi(k) ``[..., d']`` of q, k ``[..., d]`` (:func:`feature`)."""
    return feature(q, feature_map), feature(k, feature_map)


def feature(x: jax.Array, feature_map: str | Callable[[jax.Array], jax.Array]) -> jax.Array:
    """phi(x) ``[..., d']`` of x ``[..., d]``: computed in float32, returned in x's dtype (the
    matmul operand dtype)."""
    phi = check_feature_map(feature_map) if isinstance(feature_map, str) else feature_map

    def apply(x):
        return phi(x.astype(F32)).astype(x.dtype)

    if kernels.on_gpu():
        # Keep x (its own dtype) for the backward, not autodiff's float32 copy of it (issue 37:
        # half the bytes the layer scan stacks); phi' is recomputed from it, exactly as
        # autodiff would compute it.
        return jax.checkpoint(apply)(x)
    return apply(x)


def attention_fn(
    variant: str,
    algorithm: Callable[..., tuple[jax.Array, jax.Array]],
    options: LinearOptions,
) -> Callable[..., jax.Array]:
    """``fn(q, k, v, *, resets=None, log_gate=None) -> y`` (q, k, v, y ``[B, T, H, D]``) for a
    pure-JAX variant: phi on q and k (``options.feature_map``), the variant's ``algorithm(phi(q),
    phi(k), v, forget) -> (num [B, T, H, D], den [B, T, H])`` (``forget`` a :class:`Forget` or
    None), then ``num / (den + options.eps)``.

    Under context parallelism (the sequence split over the mesh's ``seq`` axis) each device runs
    ``algorithm`` on its slice from a zero state and adds what the earlier slices leave: the
    entering state ``(S_in, z_in)`` (``kernels/context.py``) weighted at position i by its decay
    so far, ``w_i phi(q_i) S_in`` to the numerator and ``w_i phi(q_i) . z_in`` to the
    denominator. Every such form takes it at the cost of one gather of [D, D] states."""
    phi, eps = check_feature_map(options.feature_map), options.eps

    def attend(q, k, v, resets=None, log_gate=None, context_parallel: bool = False) -> jax.Array:
        fq, fk = features(q, k, phi)
        num, den = algorithm(fq, fk, v, as_forget(log_gate, resets))
        if context_parallel:
            S_in, z_in = entering_state(*slice_state(fk, v, log_gate, resets), SEQ)
            w = entering_weights(log_gate, resets, fq.shape[:3])
            num = num + w[..., None] * jnp.einsum(
                "bthd,bhde->bthe", fq, S_in.astype(fq.dtype), preferred_element_type=F32
            )
            den = den + w * jnp.einsum("bthd,bhd->bth", fq.astype(F32), z_in)
        return normalise(num, den, eps, q.dtype)

    def fn(q, k, v, *, resets=None, log_gate=None) -> jax.Array:
        if sequence_shards() > 1:
            local = partial(attend, context_parallel=True)
            return over_sequence(local, q, k, v, resets, log_gate)
        return attend(q, k, v, resets, log_gate)

    fn.__doc__ = (
        f"Causal linear attention ({variant}). q, k, v ``[B, T, H, D]`` -> same; optional "
        "``resets`` bool [B, T] and ``log_gate`` float32 [B, T, H] (see ``Forget``)."
    )
    return fn


def pallas_block(
    options: ChunkedOptions, names: Any, D: int, block: Callable[[str, int], int] | None = None
) -> tuple[str, int | None]:
    """The kernel ``options`` name for the platform traced for (``auto``: ``pallas`` on a GPU,
    ``xla`` elsewhere) and the block size its Pallas design would run (``block(kernel,
    chunk_size)``, default the chunk size), or None where no Pallas design applies: another
    kernel, ``chunk_size=auto``, or a block or head dim the kernels refuse."""
    kernel, c = options.kernel, options.chunk_size
    if kernel == "auto":
        kernel = "pallas" if kernels.on_gpu() else "xla"
    if kernel not in names or c == "auto":
        return kernel, None
    c = int(c) if block is None else block(kernel, int(c))
    if kernels.block_size_problem(c) or kernels.head_dim_problem(D):
        return kernel, None  # the kernel would refuse this shape (recorded as an error)
    return kernel, c


def spec(name: str, make: Callable[..., Any], flops: Callable[..., float], **fields: Any):
    """The :class:`AttentionSpec` of a linear variant of this package: the linear family, the
    shared recurrent decoder and statistics, resets and decay gates taken. ``fields`` override
    or add (``options``, ``kernel_design``, ...); ``options`` defaults to
    :class:`LinearOptions`."""
    fields.setdefault("options", LinearOptions)
    return AttentionSpec(
        name=name, family="linear", make=make, flops=flops, make_decoder=make_decoder,
        resets=True, decay=True, stats=layer_stats, **{"context_parallel": True, **fields},
    )  # fmt: skip


def gammas(forget: Forget, shape: tuple[int, int, int]) -> jax.Array:
    """float32 ``[B, T, H]``: the per-position factor of the recurrence, gamma_i, and 0 where a
    document starts (the state before it is dropped)."""
    g = jnp.ones(shape, F32) if forget.log_gate is None else jnp.exp(forget.log_gate)
    if forget.resets is not None:
        g = jnp.where(forget.resets[..., None], 0.0, g)
    return g


def pair_weights(forget: Forget, T: int, H: int) -> jax.Array:
    """float32 ``[B, H, T, T]`` (B may be 1): weight of key j for query i, exp(A_i - A_j) for
    j <= i in the same document, 0 elsewhere (the causal mask included)."""
    mask = causal_mask(T)[None, None]
    if forget.resets is not None:
        seg = segment_ids(forget.resets)
        mask = mask & (seg[:, None, :, None] == seg[:, None, None, :])
    if forget.log_gate is None:
        return jnp.broadcast_to(mask, (mask.shape[0], H, T, T)).astype(F32)
    A = jnp.swapaxes(jnp.cumsum(forget.log_gate, axis=1), 1, 2)  # [B, H, T]
    return jnp.exp(jnp.where(mask, A[..., :, None] - A[..., None, :], -jnp.inf))


# --------------------------------------------------------------------------------------------
# Recurrent decoder, shared by all linear variants (they compute the same function).


def state_step(state, fq: jax.Array, fk: jax.Array, v: jax.Array, gamma: jax.Array | None = None):
    """One token of the recurrence. state ``(S [B, H, d', D], z [B, H, d'])`` float32; fq =
    phi(q), fk = phi(k) ``[B, H, d']``, v ``[B, H, D]``; ``gamma`` float32 ``[B, H]`` scales the
    carry (None: 1).
    Returns ``((num [B, H, D], den [B, H]), state)`` in float32.

    The state is updated before it is read: position i attends to itself.
    """
    S, z = state
    if gamma is not None:
        S, z = gamma[..., None, None] * S, gamma[..., None] * z
    S = S + jnp.einsum("bhd,bhe->bhde", fk, v, preferred_element_type=F32)
    z = z + fk.astype(F32)
    num = jnp.einsum("bhd,bhde->bhe", fq, S, preferred_element_type=F32)
    den = jnp.einsum("bhd,bhd->bh", fq, z, preferred_element_type=F32)
    return (num, den), (S, z)


def _prefill_kernel(kernel: str, c: int) -> str | None:
    """The Pallas ``LT_chunked`` kernel a prefill uses, or None for the XLA chunked form: the
    kernel named (one of ``kernels.lt_chunked.NAMES``), or ``pallas`` for ``auto`` when
    compiling for a GPU, provided c is a valid block size."""
    name = kernel if kernel in PALLAS_CHUNKED else ("pallas" if kernel == "auto" else None)
    if name is None or (kernel == "auto" and not kernels.on_gpu()):
        return None
    return name if kernels.block_size_problem(c) is None else None


# The prefill's chunk for a variant without a chunk size of its own (or chunk_size=auto): it only
# affects speed, and decoding is mostly single steps.
PREFILL_CHUNK = 64


def make_decoder(options: LinearOptions) -> Decoder:
    """The linear transformer as an RNN (the post's section 4): a state of constant size.

    - ``init(batch, n_head, head_dim, max_len, dtype)`` -> ``(S [B, H, d', D], z [B, H, d'])``,
      zeros in float32 whatever ``dtype`` (the activation dtype): S = sum_j phi(k_j) v_j^T and
      z = sum_j phi(k_j) are sums over the whole context, so they accumulate in float32. D is
      ``head_dim`` (the values'), d' the feature map's dimension of the keys' Dk
      (``options.feature_dim``, or ``head_dim`` when it is 0): 153 for ``taylor2`` at Dk = 16.
      ``max_len`` is accepted for the protocol and unused: the state does not grow.
    - ``step(state, q, k, v, *, log_gate=None, reset=None)``, q, k, v ``[B, H, D]``, log_gate
      ``[B, H]``, reset bool ``[B]``: the recurrence S = gamma S + phi(k) v^T, z = gamma z +
      phi(k) (gamma = 0 where a document starts), y = phi(q) S / (phi(q) . z + eps); O(D^2).
    - ``prefill(state, q, k, v, *, log_gate=None, resets=None)``, q, k, v ``[B, T, H, D]``: the
      chunked form (``LT_chunked``) started from ``state``, with chunks of ``chunk_size``; T need
      not be a multiple of it (:data:`PREFILL_CHUNK` for a variant without one). With
      ``kernel`` a Pallas ``LT_chunked`` kernel (or ``auto`` compiling for a GPU) and a
      power-of-two chunk size >= 16, the Pallas kernels run it (from the state, returning the
      final state; with resets or gates the chunk-parallel ones, the single pass taking none);
      otherwise the XLA form.
    """
    phi, eps, kernel = check_feature_map(options.feature_map), options.eps, options.kernel
    feature_dim = options.feature_dim
    chunk_size = getattr(options, "chunk_size", PREFILL_CHUNK)
    if chunk_size == "auto":
        chunk_size = PREFILL_CHUNK

    def init(batch: int, n_head: int, head_dim: int, max_len: int | None = None, dtype=None):
        del max_len, dtype
        dk = phi.dim(feature_dim or head_dim)
        S = jnp.zeros((batch, n_head, dk, head_dim), F32)
        z = jnp.zeros((batch, n_head, dk), F32)
        return S, z

    def step(state, q, k, v, *, log_gate=None, reset=None):
        fq, fk = features(q, k, phi)
        gamma = None
        forget = as_forget(
            None if log_gate is None else log_gate[:, None],
            None if reset is None else reset[:, None],
        )
        if forget is not None:
            gamma = gammas(forget, (q.shape[0], 1, q.shape[1]))[:, 0]
        (num, den), state = state_step(state, fq, fk, v, gamma)
        return normalise(num, den, eps, q.dtype), state

    def prefill(state, q, k, v, *, log_gate=None, resets=None):
        T = q.shape[1]
        fq, fk = features(q, k, phi)
        fused = _prefill_kernel(kernel, chunk_size)
        forgets = log_gate is not None or resets is not None
        if fused is not None and not (forgets and fused == FUSED):
            # The Pallas kernels are imported when they run: the XLA path never imports Pallas.
            from linear_gpt2.kernels.lt_chunked import ops

            y, state = ops.chunked_attention(
                fq, fk, v.astype(q.dtype), chunk_size, eps, initial_state=state,
                return_final_state=True, kernel=fused, log_gate=log_gate, resets=resets,
            )  # fmt: skip
            return y.astype(q.dtype), state
        c = min(chunk_size, T)
        # Pad to a multiple of c in feature space: a padded key has phi(k) = 0 and v = 0, so it
        # adds nothing to the state or to any real query's sums; padded queries are dropped.
        # Padded positions neither decay (log gamma = 0) nor start a document, so the state
        # after the last real position is the state returned.
        pad = (-T) % c
        if pad:
            widths = ((0, 0), (0, pad), (0, 0), (0, 0))
            fq, fk, v = (jnp.pad(x, widths) for x in (fq, fk, v))
            if log_gate is not None:
                log_gate = jnp.pad(log_gate, ((0, 0), (0, pad), (0, 0)))
            if resets is not None:
                resets = jnp.pad(resets, ((0, 0), (0, pad)))
        forget = as_forget(log_gate, resets)
        (num, den), state = chunked_linear_attention(fq, fk, v, c, state=state, forget=forget)
        return normalise(num[:, :T], den[:, :T], eps, q.dtype), state

    return Decoder(init=init, step=step, prefill=prefill, kind="recurrent state")


# --------------------------------------------------------------------------------------------
# Diagnostics of a linear layer (``log.diagnostics``), shared by every linear variant


def _divisor(T: int, limit: int = 64) -> int:
    return max(d for d in range(1, min(T, limit) + 1) if T % d == 0)


def layer_stats(q, k, v, y, resets=None, log_gate=None, options: LinearOptions | None = None):
    """float32 scalars of one layer (q, k, v, y ``[B, T, H, D]`` as the attention got and gave
    them): ``den_min``, ``den_mean``, the normaliser phi(q_i) . z_i before ``eps`` (min and mean
    over rows, positions and heads; near 0 it blows the output and its gradient up), and
    ``state_norm``, the Frobenius norm of the state at the end of the row (of its last document
    with resets), mean over rows and heads. Recomputed with the chunked form, which every linear
    variant equals, so it holds for kernels that never materialise either."""
    del y
    fq, fk = features(q, k, (options or LinearOptions()).feature_map)
    forget = as_forget(log_gate, resets)
    (_, den), (S, _) = chunked_linear_attention(fq, fk, v, _divisor(q.shape[1]), forget=forget)
    return {
        "den_min": den.min(),
        "den_mean": den.mean(),
        "state_norm": jnp.sqrt(jnp.sum(jnp.square(S), axis=(-2, -1))).mean(),
    }
