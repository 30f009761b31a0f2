"""The ``attention`` section of a config: the variant's name and its options, and their checks.

The shared options (:class:`AttentionOptions`) are one schema for every variant, so that a sweep
can change the attention and keep the rest of its config; each variant reads the ones its spec
lists (``AttentionSpec.options``). Options of a variant's own (``AttentionSpec.extra_options``)
are set like the shared ones, ``attention.<name>=value``, and are kept in ``extra``.

:func:`validate` is the one check of a name with its options, for the YAML section and for the
model's flat config alike: every failure names the key and what would be valid.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Mapping
from typing import Any

from linear_gpt2.attention import registry
from linear_gpt2.attention.linear import FEATURE_MAPS
from linear_gpt2.platform.errors import ConfigError, check, check_choice

SCANS = ("cumsum", "associative")
# What the linear state forgets (attention.decay): none; fixed (RetNet's per-head gamma_h); gate
# (gamma_i = sigmoid(w_h . x_i + b_h), a learned projection per head).
DECAYS = ("none", "fixed", "gate")


@dataclasses.dataclass(frozen=True)
class AttentionOptions:
    """Options shared by the attention variants; each variant reads only those its spec lists."""

    # Feature map phi applied to q and k by the linear variants (attention/feature_maps.py):
    # elementwise (softplus, elu1, relu, exp) or expanding (taylor2, power2, rebased).
    feature_map: str = "softplus"
    # Dimension of q and k per head for the linear variants: the layer projects them to it
    # (Based's 16 before its Taylor map); 0 = the head dim.
    feature_dim: int = 0
    # Chunk size c of LT_chunked (and block size of the blocked LT_attention_parallel): an int,
    # or "auto" (measured per shape and device at trace time, cached; attention/autotune.py).
    chunk_size: int | str = 64
    # Implementation: xla (pure JAX), or one of the variant's fused kernels (its spec's
    # ``kernels``); auto: the fused kernel when compiling for a GPU, xla elsewhere.
    kernel: str = "auto"
    # LT_state_parallel's prefix sum: jnp.cumsum or lax.associative_scan.
    scan: str = "cumsum"
    # Added to the linear-attention normaliser sum_j phi(q_i).phi(k_j) before dividing.
    eps: float = 1e-6
    # Restart at every document start (after each EOT of the packed rows): the linear state and
    # normaliser are zeroed there, softmax / flash do not attend across documents. Off: the
    # post's setting (packed documents see each other).
    doc_reset: bool = False
    # Decay of the linear state, S_i = gamma_i S_{i-1} + phi(k_i) v_i^T (DECAYS above).
    decay: str = "none"


SHARED = tuple(f.name for f in dataclasses.fields(AttentionOptions))


def _check_chunk_size(value: Any, key: str) -> None:
    # OmegaConf types the field int | str: YAML/CLI "64" arrives as int 64, "auto" as a string.
    ok = value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1)
    check(ok, key, f"must be an int >= 1 or 'auto', got {value!r}")


def _check_feature_dim(value: Any, spec, name: str, prefix: str) -> None:
    key = f"{prefix}feature_dim"
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= 0
    check(ok, key, f"must be an int >= 0 (0: the head dim), got {value!r}")
    check(
        value == 0 or "feature_dim" in spec.options,
        key,
        f"{name!r} projects no features (it reads no feature map); use one of "
        f"{', '.join(registry.names_where(lambda s: 'feature_dim' in s.options))}, "
        "or feature_dim=0",
    )


def validate(
    name: str,
    options: Mapping[str, Any],
    extra: Mapping[str, Any] | None = None,
    prefix: str = "attention.",
) -> None:
    """Check attention ``name`` with the shared ``options`` (all of :data:`SHARED`) and its own
    ``extra`` options; raise :class:`ConfigError` naming the key (``prefix`` + option)."""
    extra = dict(extra or {})
    name_key = f"{prefix}name" if prefix == "attention." else "attention"
    try:
        spec = registry.spec(name)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{name_key}: {e}") from None
    check_choice(options["feature_map"], f"{prefix}feature_map", list(FEATURE_MAPS))
    _check_feature_dim(options["feature_dim"], spec, name, prefix)
    check_choice(options["scan"], f"{prefix}scan", SCANS)
    _check_chunk_size(options["chunk_size"], f"{prefix}chunk_size")
    check(options["eps"] >= 0.0, f"{prefix}eps", f"must be >= 0, got {options['eps']}")
    check_choice(options["decay"], f"{prefix}decay", DECAYS)
    if "kernel" in spec.options:
        check_choice(options["kernel"], f"{prefix}kernel", spec.kernels)
    else:  # not read here, but a sweep may carry it to a variant that does: catch typos now
        check_choice(options["kernel"], f"{prefix}kernel", registry.all_kernels())
    takes = registry.names_where(lambda s: s.decay)
    check(
        options["decay"] == "none" or spec.decay,
        f"{prefix}decay",
        f"decay={options['decay']!r} needs a state to decay, and {name!r} takes no decay gates. "
        f"Use one of {', '.join(takes)}, or decay=none",
    )
    check(
        not options["doc_reset"] or spec.resets,
        f"{prefix}doc_reset",
        f"{name!r} takes no document resets; use one of "
        f"{', '.join(registry.names_where(lambda s: s.resets))}, or doc_reset=false",
    )
    unknown = sorted(set(extra) - set(spec.extra_options))
    if unknown:
        own = ", ".join(spec.extra_options) or "none"
        close = difflib.get_close_matches(unknown[0], [*SHARED, *spec.extra_options], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{prefix}{unknown[0]}: unknown attention option for {name!r}{hint}; its own "
            f"options: {own}; shared options: {', '.join(SHARED)}"
        )
    if spec.check is not None:
        try:
            spec.check(kwargs_for(spec, {**options, **extra}))
        except ValueError as e:
            raise ConfigError(f"{prefix}{_first_option(e, spec)}: {e}") from None


def validate_context(
    name: str,
    context: int,
    options: Mapping[str, Any],
    prefix: str = "attention.",
    context_parallel: int = 1,
) -> None:
    """Raise :class:`ConfigError` if attention ``name`` with ``options`` (shared and own) cannot
    run sequences of ``context`` tokens (``AttentionSpec.context_problem``), or, with the
    sequence split into ``context_parallel`` slices (``train.context_parallel``), if it does not
    take context parallelism or a slice does not suit it."""
    spec = registry.spec(name)
    n = context_parallel
    if n > 1 and not spec.context_parallel:
        takes = ", ".join(registry.names_where(lambda s: s.context_parallel))
        raise ConfigError(
            f"train.context_parallel={n}: attention {name!r} does not split the sequence over "
            f"devices; those that do: {takes}; use one of them, or train.context_parallel=1"
        )
    if n > 1 and context % n:
        raise ConfigError(
            f"train.context_parallel={n} does not divide data.context={context} into equal "
            f"slices; use a context that {n} divides (e.g. {context // n * n or n})"
        )
    tokens, kwargs = context // n, kwargs_for(spec, options)
    problem = None if spec.context_problem is None else spec.context_problem(tokens, kwargs)
    if not problem and n > 1 and spec.slice_problem is not None:
        problem = spec.slice_problem(tokens, n, kwargs)
    if problem:
        where = (
            f"data.context={context}"
            if n == 1
            else f"each device's slice (data.context={context} / train.context_parallel={n})"
        )
        raise ConfigError(f"{prefix}{_first_option(problem, spec)}: {where}: {problem}")


def _first_option(err: ValueError | str, spec) -> str:
    """The option a spec's check complains about: the first of its options its message names."""
    text = str(err)
    for option in spec.all_options:
        if option in text:
            return option
    return "name"


def kwargs_for(spec, options: Mapping[str, Any]) -> dict[str, Any]:
    """What ``spec.make`` receives from ``options`` (shared and own mixed): the shared options
    it reads (configs carry all of them; None values dropped) and its own; an option no one
    knows is a ``TypeError``."""
    unknown = sorted(set(options) - set(SHARED) - set(spec.extra_options))
    if unknown:
        raise TypeError(
            f"unknown attention option(s) {unknown} for {spec.name!r}; shared options: "
            f"{', '.join(SHARED)}; its own: {', '.join(spec.extra_options) or 'none'}"
        )
    out = {k: v for k, v in options.items() if k in spec.options and v is not None}
    return {**out, **{k: v for k, v in options.items() if k in spec.extra_options}}
