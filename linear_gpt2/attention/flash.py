"""``flash``: fused causal softmax attention (FlashAttention), nanoGPT's ``flash`` path.

Same function as ``softmax`` (scale 1/sqrt(D), softmax over keys 0..i), computed blockwise with an
online softmax so the T x T score matrix never exists: cost O(T^2 D) FLOPs, O(T) memory per head
(O(T D) for q, k, v and the output, O(T) for the row statistics the backward pass keeps).

Kernels (``attention.kernel``; the kernels themselves are in ``linear_gpt2/kernels/flash/``):

- ``cudnn``: cuDNN's fused attention through ``jax.nn.dot_product_attention(...,
  implementation="cudnn")``. GPU only, and only for bfloat16/float16 inputs with a head dim that is
  a multiple of 8 and at most 128 (256 on Hopper and later). Float32 inputs are an error, not cast
  to bfloat16 behind the caller's back: an explicit kernel choice means that kernel at the
  precision asked for. Use ``model.dtype=bfloat16``, or ``kernel=auto``, which falls back to xla.
  On CPU it raises ``linear_gpt2.kernels.KernelUnavailableError``.
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
- ``auto`` (default): ``cudnn`` on GPU (or compiling for one: ``linear_gpt2.platform.target``),
  falling back to ``xla`` (with a warning) when cuDNN rejects the dtype or shape at trace time
  (float32, head dim not a multiple of 8, ...); ``xla`` elsewhere.

Document resets (``resets`` bool ``[B, T]``, ``attention.doc_reset``): no query attends across a
document start. ``xla`` takes the mask; ``cudnn`` takes the documents as cuDNN's packed
sequences (segment offsets and lengths per row, JAX's lower-level
``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention``: ``jax.nn`` has no segment
ids), causal within each; ``pallas`` takes them as the kernel's segment ids.

Dropout: none (the spec's ``dropout`` is False). nanoGPT's flash path drops attention weights
inside the kernel (``F.scaled_dot_product_attention(dropout_p=...)``); ``jax.nn.dot_product_attention`` (xla
and cudnn) and the Pallas kernel have no dropout, so with ``dropout > 0`` the model applies
nanoGPT's other three dropout sites (embeddings, attention output projection, MLP) and not this one.

Context parallelism (the mesh's ``seq`` axis splits T): ring attention with a fused op per block
(``linear_gpt2.kernels.flash.ring``): ``auto`` and ``cudnn`` take cuDNN blocks on a GPU
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

import dataclasses

import jax

from linear_gpt2.attention import softmax as _softmax
from linear_gpt2.attention.context import over_sequence, sequence_shards
from linear_gpt2.attention.options import Options, option
from linear_gpt2.attention.spec import AttentionSpec, Decoder, quadratic_flops
from linear_gpt2.kernels.flash import KERNELS
from linear_gpt2.kernels.flash import ops as _ops
from linear_gpt2.kernels.flash import ring as _ring
from linear_gpt2.platform.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class FlashOptions(Options):
    kernel: str = option(
        "auto",
        "the implementation (auto: cudnn on a GPU, xla elsewhere; pallas: JAX's Pallas kernel)",
        choices=KERNELS,
        implementation=True,
    )
    # The ring's layout under context parallelism (train.context_parallel > 1).
    ring: str = option(
        "zigzag",
        "the ring's layout under context parallelism (zigzag: balanced)",
        choices=_ring.RINGS,
        implementation=True,
    )


def _slice_problem(S: int, n: int, options: FlashOptions) -> str | None:
    if options.ring == "zigzag" and S % 2:
        return (
            f"ring=zigzag cuts the sequence into {2 * n} chunks, and slices of {S} tokens do not "
            f"halve; use a context that {2 * n} divides, or ring=contiguous"
        )
    return None


def make(options: FlashOptions):
    """``fn(q, k, v) -> y``: fused causal softmax attention, q, k, v, y ``[B, T, H, D]``, y in
    q's dtype (the module docstring)."""
    kernel, ring = options.kernel, options.ring

    def flash_attention(q, k, v, *, resets=None) -> jax.Array:
        """q, k, v ``[B, T, H, D]`` -> y; ``resets`` bool ``[B, T]``: documents start there."""
        n = sequence_shards()
        if n > 1:
            problem = _slice_problem(q.shape[1] // n, n, options)
            if problem:
                raise ConfigError(f"attention.ring: {problem}")
            block = _ops.context_block(kernel, q, resets, n)
            return over_sequence(_ring.ring_local(block, n, ring), q, k, v, resets)
        return _ops.attention(kernel, q, k, v, resets)

    return flash_attention


def make_decoder(options: FlashOptions) -> Decoder:
    """The KV-cache decoder of :mod:`softmax` (the options unused: every step is a short query
    block against the cache, which plain XLA handles; ``ring`` is the training's layout over
    devices)."""
    return _softmax.make_decoder(options)


SPEC = AttentionSpec(
    name="flash",
    family="softmax",
    make=make,
    flops=quadratic_flops,
    options=FlashOptions,
    slice_problem=_slice_problem,
    make_decoder=make_decoder,
    resets=True,
    context_parallel=True,
    description="fused softmax: cuDNN on GPU, XLA, or JAX's Pallas flash kernel",
)
