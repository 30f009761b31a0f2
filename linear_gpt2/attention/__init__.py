"""Attention registry: every self-attention algorithm, selectable by name.

Each variant is one module in this package that defines

- ``OPTIONS``: the option names it reads (a subset of ``ALL_OPTIONS``);
- ``make(**options) -> fn`` where ``fn(q, k, v) -> y`` maps ``[B, T, H, D]`` inputs (causal
  self-attention) to a ``[B, T, H, D]`` output.

- optionally ``make_decoder(**options) -> Decoder`` for incremental decoding (sampling).

Adding a variant is one new module plus one line in ``_VARIANTS``. Modules are imported lazily so
that picking ``softmax`` never imports Pallas or Triton.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any, NamedTuple

from linear_gpt2.errors import UsageError

AttentionFn = Callable[..., Any]


class Decoder(NamedTuple):
    """Incremental (token-by-token) attention, the basis of sampling.

    - ``init(batch, n_head, head_dim, max_len, dtype) -> state``: an empty state (a pytree): the
      KV cache for softmax attention, the recurrent state ``(S [B, H, D, D], z [B, H, D])`` in
      float32 for the linear family.
    - ``step(state, q, k, v) -> (y, state)``: one new token, q, k, v and y ``[B, H, D]``.
    - ``prefill(state, q, k, v) -> (y, state)``: a block of T new tokens after those already in
      the state, q, k, v and y ``[B, T, H, D]``.

    Contract (tested): T steps from ``init`` equal the full-sequence ``fn``; a prefill of the first
    part then of the rest equals one prefill of the whole.
    """

    init: Callable[..., Any]
    step: Callable[..., Any]
    prefill: Callable[..., Any]


# name -> module in this package. The names are the post's.
_VARIANTS: dict[str, str] = {
    "softmax": "softmax",
    "flash": "flash",
    "LT_attention": "lt_attention",
    "LT_attention_parallel_no_flash": "lt_attention_parallel_no_flash",
    "LT_attention_parallel": "lt_attention_parallel",
    "LT_state": "lt_state",
    "LT_state_parallel": "lt_state_parallel",
    "LT_chunked": "lt_chunked",
}

# Every option any variant may read; ModelConfig carries all of them, so ``get`` accepts all and
# passes each variant only the ones it declares.
ALL_OPTIONS = ("feature_map", "chunk_size", "kernel", "scan", "eps", "doc_reset", "decay")


class UnknownAttentionError(UsageError):
    """An attention name or kernel that is not registered (a ``ValueError``)."""


def names() -> list[str]:
    """The registered attention names, in registry order."""
    return list(_VARIANTS)


def _suggest(name: str, valid: list[str]) -> str:
    close = difflib.get_close_matches(name, valid, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def module(name: str) -> ModuleType:
    """The module that implements attention ``name``."""
    if name not in _VARIANTS:
        valid = names()
        raise UnknownAttentionError(
            f"unknown attention {name!r}{_suggest(name, valid)}; valid names: {', '.join(valid)}"
        )
    return importlib.import_module(f"{__name__}.{_VARIANTS[name]}")


def options_of(name: str) -> tuple[str, ...]:
    """The option names that attention ``name`` reads."""
    return tuple(module(name).OPTIONS)


def supports_dropout(name: str) -> bool:
    """Whether attention ``name`` can drop attention weights (nanoGPT's ``attn_dropout``)."""
    return bool(getattr(module(name), "SUPPORTS_DROPOUT", False))


def decoder(name: str, **options: Any) -> Decoder:
    """The incremental decoder of attention ``name`` (see :class:`Decoder`)."""
    mod = module(name)
    if not hasattr(mod, "make_decoder"):
        raise NotImplementedError(f"attention {name!r} has no incremental decoder")
    return mod.make_decoder(**_used_options(mod, options))


def _used_options(mod: ModuleType, options: dict[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(options) - set(ALL_OPTIONS))
    if unknown:
        raise TypeError(
            f"unknown attention option(s) {unknown}; valid options: {', '.join(ALL_OPTIONS)}"
        )
    return {k: v for k, v in options.items() if k in mod.OPTIONS and v is not None}


def get(name: str, **options: Any) -> AttentionFn:
    """``fn(q, k, v) -> y`` for attention ``name``; q, k, v and y are ``[B, T, H, D]``.

    Options not read by this variant are ignored (configs carry every option); options that no
    variant knows are an error.
    """
    mod = module(name)
    return mod.make(**_used_options(mod, options))
