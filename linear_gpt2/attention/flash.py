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
- ``auto`` (default): ``cudnn`` on GPU, falling back to ``xla`` (with a warning) when cuDNN rejects
  the dtype or shape at trace time (float32, head dim not a multiple of 8, ...); ``xla`` elsewhere.

Dropout: ``SUPPORTS_DROPOUT = False``. nanoGPT's flash path drops attention weights inside the
kernel (``F.scaled_dot_product_attention(dropout_p=...)``); ``jax.nn.dot_product_attention`` (xla
and cudnn) and the Pallas kernel have no dropout, so with ``dropout > 0`` the model applies
nanoGPT's other three dropout sites (embeddings, attention output projection, MLP) and not this one.

Decoding (sampling) uses the KV cache of :func:`linear_gpt2.attention.softmax.make_decoder`:
one query row per step gains nothing from a fused kernel.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable

import jax
import jax.numpy as jnp

from linear_gpt2.attention import Decoder
from linear_gpt2.attention import softmax as _softmax
from linear_gpt2.errors import DeviceError

OPTIONS: tuple[str, ...] = ("kernel",)
SUPPORTS_DROPOUT = False

KERNELS = ("auto", "xla", "pallas", "cudnn")

# Pallas block sizes: JAX's defaults (BlockSizes.get_default(): 128 forward, 32 backward), capped
# for short sequences. Triton needs powers of two, and its dots at least 16 rows.
_PALLAS_BLOCK_FWD = 128
_PALLAS_BLOCK_BWD = 32
_PALLAS_MIN_BLOCK = 16


class KernelUnavailableError(DeviceError):
    """The requested attention kernel cannot run on this backend or for these inputs."""


def _on_gpu() -> bool:
    return jax.default_backend() == "gpu"


def _scale(q: jax.Array) -> float:
    return 1.0 / math.sqrt(q.shape[-1])


def _xla(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=_scale(q), implementation="xla"
    )


def _cudnn(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    if not _on_gpu():
        raise KernelUnavailableError(
            f"flash attention kernel='cudnn' needs a CUDA GPU, but the JAX backend is "
            f"{jax.default_backend()!r}; use kernel=xla or kernel=pallas (interpret mode on CPU), "
            f"or kernel=auto"
        )
    if q.dtype not in (jnp.bfloat16, jnp.float16):
        raise KernelUnavailableError(
            f"flash attention kernel='cudnn' needs bfloat16 or float16 inputs, got {q.dtype}; "
            f"set model.dtype=bfloat16, or use kernel=auto (falls back to xla) or kernel=xla|pallas"
        )
    return jax.nn.dot_product_attention(
        q, k, v, is_causal=True, scale=_scale(q), implementation="cudnn"
    )


def _auto(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    if not _on_gpu():
        return _xla(q, k, v)
    try:
        # cuDNN's support checks (dtype, head dim, cuDNN present) run in Python when the call is
        # traced, so a rejection surfaces here, also under jit and grad.
        return _cudnn(q, k, v)
    except (KernelUnavailableError, NotImplementedError, ValueError, RuntimeError) as e:
        warnings.warn(
            f"flash attention: cuDNN cannot run q {q.shape} {q.dtype} ({e}); using kernel=xla "
            f"(O(T^2) memory)",
            stacklevel=2,
        )
        return _xla(q, k, v)


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


def _pallas(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
    # Imported here: picking another kernel never imports Pallas, and the module's import-time
    # DeprecationWarning (pointing to tokamax) is noise for us.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    T = q.shape[1]
    fwd, bwd = pallas_block_sizes(T)
    T_pad = -(-T // fwd) * fwd
    if T_pad != T:
        # Zero keys/values after the last real token are masked for every real query by
        # causality; the padded query rows are sliced off below.
        pad = ((0, 0), (0, T_pad - T), (0, 0), (0, 0))
        q, k, v = (jnp.pad(t, pad) for t in (q, k, v))
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
        None,  # segment_ids
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


def make(kernel: str = "auto"):
    """``fn(q, k, v) -> y``: fused causal softmax attention, q, k, v, y ``[B, T, H, D]``, y in
    q's dtype. See the module docstring for the kernels."""
    _check_kernel(kernel)
    impl = _IMPLS[kernel]

    def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return impl(q, k, v).astype(q.dtype)

    return flash_attention


def make_decoder(kernel: str = "auto") -> Decoder:
    """The KV-cache decoder of :mod:`softmax` (``kernel`` is checked, then unused: every step
    is a short query block against the cache, which plain XLA handles)."""
    _check_kernel(kernel)
    return _softmax.make_decoder()
