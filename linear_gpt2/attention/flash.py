"""``flash``: fused causal softmax attention (FlashAttention), nanoGPT's ``flash`` path.

Same function as ``softmax`` (scale 1/sqrt(D), softmax over keys 0..i), computed blockwise with an
online softmax so the T x T score matrix never exists: cost O(T^2 D) FLOPs, O(T) memory per head
(O(T D) for q, k, v and the output, O(T) for the row statistics the backward pass keeps).

Kernels (``make(kernel=...)``):

- ``cudnn``: cuDNN's fused attention through ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``. GPU only, and only for bfloat16/float16 inputs with a head dim that is
  a multiple of 8 and at most 128 (256 on Hopper and later). Float32 inputs are an error, not cast
  to bfloat16 behind the caller's back: an explicit kernel choice means that kernel at the
  precision asked for. Use ``model.dtype=bfloat16``, or ``kernel=auto``, which falls back to xla.
  On CPU it raises :class:`KernelUnavailableError`.
- ``xla``: ``jax.nn.dot_product_attention(..., implementation="xla")``, which materialises the
  scores (O(T^2) memory); any backend, any dtype.
- ``pallas``: JAX's Pallas FlashAttention-2 kernel, ``jax.experimental.pallas.ops.gpu.attention.mha``
  (Triton-lowered on GPU; layout ``[B, T, H, D]`` like ours; its own custom_vjp with Pallas backward
  kernels). On a non-GPU backend it runs in Pallas interpret mode (slow; for tests). The kernel
  needs T to be a multiple of its (power-of-two) block sizes, so T is zero-padded at the end to a
  multiple of the block and the output sliced back; causality makes this exact (padded keys come
  after every real query; padded queries are discarded and get a zero cotangent). On GPU, float32
  inputs go through TF32 tensor-core dots unless ``jax.default_matmul_precision("highest")`` is set;
  head dims are padded to a power of two inside the kernel (keep D >= 16 for Triton's dots).
  JAX marks this module deprecated in favour of ``tokamax.dot_product_attention``; it is still the
  Pallas reference kernel in jax 0.11.2.
- ``auto`` (default): ``cudnn`` on GPU (or compiling for one: ``linear_gpt2.platform.target``), falling back to ``xla`` (with a warning) when cuDNN rejects
  the dtype or shape at trace time (float32, head dim not a multiple of 8, ...); ``xla`` elsewhere.

Document resets (``resets`` bool ``[B, T]``, ``attention.doc_reset``): no query attends across a
document start. ``xla`` takes the mask; ``cudnn`` takes the documents as cuDNN's packed
sequences (segment offsets and lengths per row, JAX's lower-level
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``: ``jax.nn`` has no segment
ids), causal within each; ``pallas`` takes them as the kernel's segment ids.

Dropout: none (the spec's ``dropout`` is False). nanoGPT's flash path drops attention weights inside the
kernel (``F.scaled_dot_product_attention(dropout_p=...)``); ``jax.nn.dot_product_attention`` (xla
and cudnn) and the Pallas kernel have no dropout, so with ``dropout > 0`` the model applies
nanoGPT's other three dropout sites (embeddings, attention output projection, MLP) and not this one.

Context parallelism (the mesh's ``seq`` axis splits T): ring attention with a fused op per block
(:mod:`linear_gpt2.attention.flash_context`): ``auto`` and ``cudnn`` take cuDNN blocks on a GPU
(or a GPU compile target) for bfloat16/float16 without document resets, ``xla`` and ``auto``
elsewhere take XLA blocks ([T / N, T / N] scores per head and block, computed in tiles with an
online softmax when those would pass a few hundred MB); ``pallas`` is refused.
``attention.ring``: ``zigzag`` (default) balances the causal ring (each device holds chunks
r and 2N-1-r of 2N, so every device attends to the same amount at every step; T must split into
2N chunks), ``contiguous`` keeps the slices as the mesh splits them (device N-1 does N blocks
while device 0 does one, but nothing is moved to set the ring up).

Decoding (sampling) uses the KV cache of :func:`linear_gpt2.attention.softmax.make_decoder`:
one query row per step gains nothing from a fused kernel.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from linear_gpt2.attention import flash_context as _fc
from linear_gpt2.attention import softmax as _softmax
from linear_gpt2.attention.context import over_sequence, sequence_shards
from linear_gpt2.attention.spec import AttentionSpec, Decoder, quadratic_flops
from linear_gpt2.platform.device import compiling_for_gpu
from linear_gpt2.platform.errors import ConfigError, DeviceError

KERNELS = ("auto", "xla", "pallas", "cudnn")

# Pallas block sizes: JAX's defaults (BlockSizes.get_default(): 128 forward, 32 backward), capped
# for short sequences. Triton needs powers of two, and its dots at least 16 rows.
_PALLAS_BLOCK_FWD = 128
_PALLAS_BLOCK_BWD = 32
_PALLAS_MIN_BLOCK = 16


class KernelUnavailableError(DeviceError):
    """The requested attention kernel cannot run on this backend or for these inputs."""


def _on_gpu() -> bool:
    # The platform compiled for (a GPU compile target counts), not the default backend.
    return compiling_for_gpu()


def _scale(q: jax.Array) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def _xla(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    if resets is not None:
        return jax.nn.dot_product_attention(
            q, k, v, mask=_softmax.document_mask(resets), scale=_scale(q), implementation="xla"
        )
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=_scale(q), implementation="xla"
    )


def packed_segments(resets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cuDNN's packed-sequence description of the documents of each row: ``offsets`` int32
    ``[B, T + 1]`` (each document's first position, then -1) and ``lengths`` int32 ``[B, T]``
    (each document's length, then -1). ``resets`` bool ``[B, T]``; position 0 always starts one.
    At most T documents per row, so the static bound is T (the arrays are small)."""
    B, T = resets.shape
    starts = resets.at[:, 0].set(True)
    offsets = jax.vmap(lambda r: jnp.nonzero(r, size=T + 1, fill_value=-1)[0])(starts)
    n = starts.sum(axis=1, keepdims=True)  # documents per row
    col = jnp.arange(T)[None]
    nxt = jnp.where(col + 1 < n, offsets[:, 1 : T + 1], T)  # the next start, or T for the last
    lengths = jnp.where(col < n, nxt - offsets[:, :T], -1)
    return offsets.astype(jnp.int32), lengths.astype(jnp.int32)


def _cudnn_packed(q, k, v, resets):
    # cuDNN attention's internals (packed documents): only when the kernel runs.
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    offsets, lengths = packed_segments(resets)
    return cudnn.dot_product_attention(
        q, k, v, q_seqlen=lengths, kv_seqlen=lengths, q_offsets=offsets, kv_offsets=offsets,
        scale=_scale(q), mask_type=cudnn.MaskType.CAUSAL,
    )  # fmt: skip


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    if not _on_gpu():
        raise KernelUnavailableError(
            f"flash attention kernel='cudnn' needs a CUDA GPU (or a GPU compile target, "
            f"linear_gpt2.platform.target), but this program is for {jax.default_backend()!r}; use "
            f"kernel=xla or kernel=pallas (interpret mode on CPU), or kernel=auto"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise KernelUnavailableError(
            f"flash attention kernel='cudnn' needs bfloat16 or float16 inputs, got {q.dtype}; "
            f"set model.dtype=bfloat16, or use kernel=auto (falls back to xla) or kernel=xla|pallas"
        )
    T = q.shape[1]
    if T % 2:
        # cuDNN's training kernels need an even sequence length; a zero key/value after the last
        # token is masked for every real query by causality, and the padded query is sliced off.
        pad = ((0, 0), (0, 1), (0, 0), (0, 0))
        q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
        if resets is not None:
            resets = jnp.pad(resets, ((0, 0), (0, 1)), constant_values=True)
    if resets is not None:
        y = _cudnn_packed(q, k, v, resets)
    else:
        y = jax.nn.dot_product_attention(
            q, k, v, is_causal=True, scale=_scale(q), implementation="cudnn"
        )
    return y[:, :T]


def _auto(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    if not _on_gpu():
        return _xla(q, k, v, resets)
    try:
        # cuDNN's support checks (dtype, head dim, cuDNN present) run in Python when the call is
        # traced, so a rejection surfaces here, also under jit and grad.
        return _cudnn(q, k, v, resets)
    except (KernelUnavailableError, NotImplementedError, ValueError, RuntimeError) as e:
        warnings.warn(
            f"flash attention: cuDNN cannot run q {q.shape} {q.dtype} ({e}); using kernel=xla "
            f"(O(T^2) memory)",
            stacklevel=2,
        )
        return _xla(q, k, v, resets)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pallas_block_sizes(T: int) -> tuple[int, int]:
    """``(forward block, backward block)`` used by the Pallas kernel for sequence length T.

    The forward block is 128, or for short sequences the power of two >= T (at least 16); the
    backward block is 32 or the forward block if smaller. Both divide the padded length
    ``ceil(T / forward) * forward``.
    """
    fwd = min(_PALLAS_BLOCK_FWD, max(_PALLAS_MIN_BLOCK, _next_power_of_2(T)))
    return fwd, min(_PALLAS_BLOCK_BWD, fwd)


def _pallas(q: jax.Array, k: jax.Array, v: jax.Array, resets=None) -> jax.Array:
    # Imported here: picking another kernel never imports Pallas, and the module's import-time
    # DeprecationWarning (pointing to tokamax) is noise for us.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    T = q.shape[1]
    fwd, bwd = pallas_block_sizes(T)
    T_pad = -(-T // fwd) * fwd
    segment_ids = None if resets is None else jnp.cumsum(resets.astype(jnp.int32), axis=1)
    if T_pad != T:
        # Zero keys/values after the last real token are masked for every real query by
        # causality; the padded query rows are sliced off below.
        pad = ((0, 0), (0, T_pad - T), (0, 0), (0, 0))
        q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
        if segment_ids is not None:
            segment_ids = jnp.pad(segment_ids, ((0, 0), (0, T_pad - T)), mode="edge")
    blocks = pallas_attention.BlockSizes(
        block_q=fwd,
        block_k=fwd,
        block_q_dkv=bwd,
        block_kv_dkv=bwd,
        block_q_dq=bwd,
        block_kv_dq=bwd,
    )
    y = pallas_attention.mha(
        q,
        k,
        v,
        segment_ids,
        sm_scale=_scale(q),  # mha's default is 1.0
        causal=True,
        block_sizes=blocks,
        interpret=not _on_gpu(),
    )
    return y[:, :T]


_IMPLS: dict[str, Callable[[jax.Array, jax.Array, jax.Array], jax.Array]] = {
    "auto": _auto,
    "xla": _xla,
    "pallas": _pallas,
    "cudnn": _cudnn,
}


def _check_kernel(kernel: str) -> None:
    if kernel not in _IMPLS:
        hint = " (the pallas kernel is Triton-lowered on GPU)" if kernel == "triton" else ""
        raise ValueError(
            f"flash attention has no kernel {kernel!r}{hint}; valid kernels: {', '.join(KERNELS)}"
        )


def _check(options) -> None:
    _fc.check_ring(options.get("ring", "zigzag"))


def _slice_problem(S: int, n: int, options) -> str | None:
    if options.get("ring", "zigzag") == "zigzag" and S % 2:
        return (
            f"ring=zigzag cuts the sequence into {2 * n} chunks, and slices of {S} tokens do not "
            f"halve; use a context that {2 * n} divides, or ring=contiguous"
        )
    return None


def make(kernel: str = "auto", ring: str = "zigzag"):
    """``fn(q, k, v) -> y``: fused causal softmax attention, q, k, v, y ``[B, T, H, D]``, y in
    q's dtype. See the module docstring for the kernels and ``ring``."""
    _check_kernel(kernel)
    _check({"ring": ring})
    impl = _IMPLS[kernel]

    def flash_attention(q, k, v, *, resets=None) -> jax.Array:
        """q, k, v ``[B, T, H, D]`` -> y; ``resets`` bool ``[B, T]``: documents start there."""
        n = sequence_shards()
        if n > 1:
            problem = _slice_problem(q.shape[1] // n, n, {"ring": ring})
            if problem:
                raise ConfigError(f"attention.ring: {problem}")
            block = _context_block(kernel, q, resets, n)
            return over_sequence(_fc.ring_local(block, n, ring), q, k, v, resets)
        return impl(q, k, v, resets).astype(q.dtype)

    return flash_attention


# Above this many bytes of one block's float32 scores (all heads and rows), the ring's XLA blocks
# are computed in tiles (flash_context.tiled_block): at 124M's 12 heads, slices from 4k tokens.
_WHOLE_BLOCK_BYTES = 256 * 2**20


def _xla_block(q: jax.Array, n: int) -> _fc.Block:
    S = q.shape[1] // n
    whole = q.shape[0] * q.shape[2] * S * S * 4
    return _fc.XLA if whole <= _WHOLE_BLOCK_BYTES else _fc.XLA_TILED


def _context_block(kernel: str, q: jax.Array, resets, n: int) -> _fc.Block:
    """The per-block op of the ring (:mod:`flash_context`) for ``kernel`` and ``q`` ``[B, T, H,
    D]`` split into ``n`` slices: cuDNN on a GPU (or a GPU compile target) for bfloat16/float16
    without document resets, XLA otherwise (in tiles where a block's scores would be large). An
    explicit kernel that cannot run is an error; ``auto`` on a GPU warns when it falls back."""
    if kernel == "pallas":
        raise NotImplementedError(
            "flash kernel=pallas does not run under context parallelism (its segment ids are "
            "one array for queries and keys, which cannot mask a block of one slice's queries "
            "against another slice's keys); use kernel=cudnn, kernel=auto or kernel=xla"
        )
    if kernel == "xla" or (kernel == "auto" and not _on_gpu()):
        return _xla_block(q, n)
    problem = None
    if not _on_gpu():
        problem = f"needs a CUDA GPU (or a GPU compile target); this is {jax.default_backend()!r}"
    elif q.dtype not in (jnp.bfloat16, jnp.float16):
        problem = f"needs bfloat16 or float16 inputs, got {q.dtype}"
    elif q.shape[-1] % 8 or q.shape[-1] > 256:
        problem = f"needs a head dim that is a multiple of 8 and at most 256, got {q.shape[-1]}"
    elif resets is not None:
        problem = "takes no document resets under context parallelism yet"
    if problem is None:
        return _fc.CUDNN
    if kernel == "cudnn":
        raise KernelUnavailableError(
            f"flash kernel=cudnn under context parallelism {problem}; use kernel=xla or "
            "kernel=auto (falls back to XLA blocks)"
        )
    block = _xla_block(q, n)
    how = "in tiles, flash-style loops in XLA" if block is _fc.XLA_TILED else "whole"
    warnings.warn(
        f"flash under context parallelism: cuDNN {problem}; ring attention with XLA blocks "
        f"({how}; slower than cuDNN's)",
        stacklevel=3,
    )
    return block


def make_decoder(kernel: str = "auto", ring: str = "zigzag") -> Decoder:
    """The KV-cache decoder of :mod:`softmax` (``kernel`` is checked, then unused: every step
    is a short query block against the cache, which plain XLA handles; ``ring`` is the
    training's layout over devices)."""
    del ring
    _check_kernel(kernel)
    return _softmax.make_decoder()


SPEC = AttentionSpec(
    name="flash",
    family="softmax",
    make=make,
    flops=quadratic_flops,
    options=("kernel",),
    extra_options={"ring": "zigzag"},
    kernels=KERNELS,
    check=_check,
    slice_problem=_slice_problem,
    make_decoder=make_decoder,
    resets=True,
    context_parallel=True,
    description="fused softmax: cuDNN on GPU, XLA, or JAX's Pallas flash kernel",
)
