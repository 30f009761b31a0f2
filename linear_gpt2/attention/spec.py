"""What an attention variant is: one :class:`AttentionSpec`, exported as ``SPEC`` by its module.

Everything outside ``linear_gpt2/attention/`` learns about a variant from its spec alone: config
validation (its options class, whether it takes document resets and decay gates), the FLOPs behind MFU, the decoder sampling runs on, the statistics diagnostics report,
the family plots and reports group it by, and the kernel design benchmarks record. A variant of
your own is a module anywhere on ``sys.path`` that defines ``SPEC``; ``attention.name`` names it
by module path (``my_lab.attn.cosine``), see ``linear_gpt2.attention.registry``.

The function a spec makes, ``fn(q, k, v, *, resets=None, log_gate=None) -> y``, is causal
self-attention on ``[B, T, H, D]`` inputs and output, with

- ``resets`` bool ``[B, T]`` (True where a document starts; only passed when ``resets`` is True
  and ``attention.doc_reset`` is on): nothing is attended across a document start;
- ``log_gate`` float32 ``[B, T, H]`` (log gamma_i <= 0; only passed when ``decay`` is True and
  ``attention.decay`` is set): the state decays by gamma_i at position i;
- ``dropout_rate``, ``dropout_rng`` (only when ``dropout`` is True and the model trains with
  dropout): attention-weight dropout, nanoGPT's ``attn_dropout``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from linear_gpt2.attention import feature_maps
from linear_gpt2.attention.options import Options, declared

AttentionFn = Callable[..., jax.Array]
FAMILIES = ("softmax", "linear")


class Decoder(NamedTuple):
    """Incremental (token-by-token) attention, the basis of sampling.

    - ``init(batch, n_head, head_dim, max_len, dtype) -> state``: an empty state (a pytree): the
      KV cache for softmax attention, the recurrent state ``(S [B, H, D, D], z [B, H, D])`` in
      float32 for the linear family.
    - ``step(state, q, k, v, *, reset=None, log_gate=None) -> (y, state)``: one new token, q, k,
      v and y ``[B, H, D]`` (``reset`` bool ``[B]``, ``log_gate`` ``[B, H]``).
    - ``prefill(state, q, k, v, *, resets=None, log_gate=None) -> (y, state)``: a block of T new
      tokens after those already in the state, q, k, v and y ``[B, T, H, D]``.
    - ``kind``: what the state is, for reports (``KV cache``, ``recurrent state``,
      ``recompute``).

    Contract (tested): T steps from ``init`` equal the full-sequence ``fn``; a prefill of the first
    part then of the rest equals one prefill of the whole.
    """

    init: Callable[..., Any]
    step: Callable[..., Any]
    prefill: Callable[..., Any]
    kind: str = "KV cache"


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """One attention variant, as the rest of the library sees it.

    - ``name``: what configs call it (the post's name for the built-in ones).
    - ``family``: ``softmax`` (a softmax over the keys) or ``linear`` (a state of phi(k) v^T).
    - ``make(options) -> fn``: the attention function (module docstring), from an instance of
      its options class.
    - ``flops(T, H, D, options) -> float``: forward matmul FLOPs per token of one layer, all heads
      (MFU counts 3x this for forward + backward, as nanoGPT).
    - ``options``: its options class, a frozen dataclass extending
      :class:`~linear_gpt2.attention.options.Options` (types, defaults, checks, which fields only
      select the implementation); a config sets each field as ``attention.<field>=value``.
      ``make`` and the callbacks below receive an instance.
    - ``make_decoder(options) -> Decoder`` for sampling, or None: then :func:`recompute_decoder`
      (every step runs ``fn`` over the cached sequence; correct for any causal ``fn``, O(T) per
      token).
    - ``resets``, ``decay``, ``dropout``: whether ``fn`` takes document resets, decay gates and
      attention-weight dropout.
    - ``context_problem(T, options)``: why a sequence length does not suit, or None;
      ``slice_problem(S, N, options)``: with the sequence split over N devices, S tokens each,
      why that split does not suit (beyond ``context_problem(S, ...)``), or None.
    - ``stats(q, k, v, y, resets, log_gate, options) -> {name: scalar}``: extra diagnostics of one
      layer (``log.diagnostics``), or None.
    - ``kernel_design(shape, dtype, options) -> str``: the implementation ``kernel`` resolves to
      at ``shape`` ``[B, T, H, D]`` (what benchmarks record), or None.
    - ``sweep_chunk_size``: the step-time benchmark times every candidate ``chunk_size`` and
      keeps the fastest (the post picked ``LT_chunked``'s per setting).
    - ``context_parallel``: ``fn`` takes the sequence split over the mesh's ``seq`` axis
      (``train.context_parallel``; ``attention/context.py``).
    - ``description``: one line for listings.
    """

    name: str
    family: str
    make: Callable[[Any], AttentionFn]
    flops: Callable[[int, int, int, Any], float]
    options: type[Options] = Options
    make_decoder: Callable[..., Decoder] | None = None
    resets: bool = False
    decay: bool = False
    dropout: bool = False
    context_problem: Callable[[int, Any], str | None] | None = None
    slice_problem: Callable[[int, int, Any], str | None] | None = None
    stats: Callable[..., dict[str, jax.Array]] | None = None
    kernel_design: Callable[..., str] | None = None
    sweep_chunk_size: bool = False
    context_parallel: bool = False
    description: str = ""

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(
                f"attention spec {self.name!r}: family {self.family!r} is not one of "
                f"{', '.join(FAMILIES)}"
            )
        if not callable(self.make) or not callable(self.flops):
            raise ValueError(f"attention spec {self.name!r}: make and flops must be callables")
        if not (isinstance(self.options, type) and issubclass(self.options, Options)):
            raise ValueError(
                f"attention spec {self.name!r}: options must be a dataclass extending "
                f"linear_gpt2.attention.options.Options, got {self.options!r}"
            )

    @property
    def kernels(self) -> tuple[str, ...]:
        """The values ``attention.kernel`` takes (the choices of its options' ``kernel`` field);
        empty for a variant without one."""
        found = declared(self.options).get("kernel")
        return tuple(found[2].choices or ()) if found else ()

    def build(self, options: Options) -> AttentionFn:
        """``make`` with ``options`` (an instance of :attr:`options`)."""
        return self.make(options)

    def decoder(self, options: Options | None = None) -> Decoder:
        """The incremental decoder, from the variant's own ``make_decoder`` or by recomputation."""
        options = self.options() if options is None else options
        if self.make_decoder is not None:
            return self.make_decoder(options)
        return recompute_decoder(self.build(options), self)


# --------------------------------------------------------------------------------------------
# FLOP counts of the common shapes of attention (forward matmuls per token, all heads)


def quadratic_flops(T: int, H: int, D: int, options: Any) -> float:
    """Scores q.k against all T keys and the weighted sum of T values: 2 T d' + 2 T D per head,
    d' the features of q and k (D, or an expanding feature map's; not halved for causality, as
    nanoGPT and llm.c count)."""
    return H * 2 * T * (feature_maps.key_features(D, options) + D)


def state_flops(T: int, H: int, D: int, options: Any) -> float:
    """The outer product k v^T into a [d', D] state and the read q S: 4 d' D per head."""
    del T
    return H * 4 * feature_maps.key_features(D, options) * D


# --------------------------------------------------------------------------------------------
# The decoder of a variant without its own: recompute over the cached sequence


def recompute_decoder(fn: AttentionFn, spec: AttentionSpec) -> Decoder:
    """Sampling for any causal ``fn``: the state caches q, k, v (and resets, log-gates) of every
    position so far, ``[B, max_len, ...]``, and each call runs ``fn`` over the whole buffer and
    reads the new rows. Causality makes the unused tail harmless: row i sees keys j <= i only.
    O(max_len) work per token, against O(1) for a recurrent state: correct, not fast."""

    def init(batch: int, n_head: int, head_dim: int, max_len: int, dtype=jnp.float32):
        shape = (batch, max_len, n_head, head_dim)
        return {
            "q": jnp.zeros(shape, dtype),
            "k": jnp.zeros(shape, dtype),
            "v": jnp.zeros(shape, dtype),
            "resets": jnp.zeros((batch, max_len), bool),
            "log_gate": jnp.zeros((batch, max_len, n_head), jnp.float32),
            "pos": jnp.zeros((), jnp.int32),
        }

    def prefill(state, q, k, v, *, resets=None, log_gate=None):
        T, max_len = q.shape[1], state["q"].shape[1]
        if T > max_len:
            raise ValueError(f"cannot decode a block of {T} tokens with max_len={max_len}")
        pos = state["pos"]
        new = dict(state)
        for key, x in (("q", q), ("k", k), ("v", v)):
            new[key] = lax.dynamic_update_slice(
                state[key], x.astype(state[key].dtype), (0, pos, 0, 0)
            )
        kwargs: dict[str, Any] = {}
        if resets is not None and spec.resets:
            new["resets"] = lax.dynamic_update_slice(state["resets"], resets, (0, pos))
            kwargs["resets"] = new["resets"]
        if log_gate is not None and spec.decay:
            new["log_gate"] = lax.dynamic_update_slice(
                state["log_gate"], log_gate.astype(jnp.float32), (0, pos, 0)
            )
            kwargs["log_gate"] = new["log_gate"]
        y_all = fn(new["q"], new["k"], new["v"], **kwargs)
        y = lax.dynamic_slice_in_dim(y_all, pos, T, axis=1)
        new["pos"] = pos + T
        # A write past the end is clamped by dynamic_update_slice: NaN instead of a wrong answer.
        y = jnp.where(pos + T <= max_len, y, jnp.nan)
        return y.astype(q.dtype), new

    def step(state, q, k, v, *, reset=None, log_gate=None):
        y, state = prefill(
            state,
            q[:, None],
            k[:, None],
            v[:, None],
            resets=None if reset is None else reset[:, None],
            log_gate=None if log_gate is None else log_gate[:, None],
        )
        return y[:, 0], state

    return Decoder(init=init, step=step, prefill=prefill, kind="recompute")
