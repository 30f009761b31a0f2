"""Self-attention, pluggable by name.

Each variant is one module that exports ``SPEC``, an :class:`AttentionSpec` (``spec.py``): its
name, family, options class (``options.py``), FLOPs, decoder and what it takes. The post's variants are the
modules of this package (``registry.BUILTIN``); a variant of your own is a module anywhere on the
Python path, named in the config by its module path (``attention.name=my_lab.attn.cosine``) or
registered by its package under the entry-point group ``linear_gpt2.attention``.

    fn = attention.get("LT_chunked", chunk_size=64)   # fn(q, k, v) -> y, all [B, T, H, D]
    attention.spec("LT_chunked").family                # "linear"
    attention.decoder("softmax").init(...)             # incremental decoding (sampling)
"""

from __future__ import annotations

from typing import Any

from linear_gpt2.attention import feature_maps
from linear_gpt2.attention.options import OptionError, Options, option
from linear_gpt2.attention.registry import UnknownAttentionError, family, names, spec
from linear_gpt2.attention.schema import options_of, validate_context
from linear_gpt2.attention.spec import AttentionFn, AttentionSpec, Decoder

__all__ = [
    "AttentionFn",
    "AttentionSpec",
    "Decoder",
    "OptionError",
    "Options",
    "UnknownAttentionError",
    "decoder",
    "family",
    "feature_maps",
    "get",
    "names",
    "option",
    "options_of",
    "spec",
    "validate_context",
]


def get(name: str, **options: Any) -> AttentionFn:
    """``fn(q, k, v) -> y`` for attention ``name``; q, k, v and y are ``[B, T, H, D]``.

    ``options`` are fields of the variant's options class (defaults for the rest); an option
    only another built-in variant declares is checked and ignored, as in configs."""
    return spec(name).build(options_of(name, options, prefix=""))


def decoder(name: str, **options: Any) -> Decoder:
    """The incremental decoder of attention ``name`` (see :class:`Decoder`)."""
    return spec(name).decoder(options_of(name, options, prefix=""))
