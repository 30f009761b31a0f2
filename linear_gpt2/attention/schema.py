"""The config's ``attention`` section: a name, resolved to a spec, and that variant's options.

Everything outside the variant that needs its options asks here, and this module asks the
variant's options class (``options.py``): the config schema (:func:`parse`: each value coerced
and checked, a bad one a one-line :class:`ConfigError` naming ``attention.<option>``),
checkpoint compatibility (:func:`implementation_only`), the command line's help and the docs'
option table (:func:`describe`), the sequence lengths a variant takes
(:func:`validate_context`) and the plots' labels (:func:`label`).

A config may carry an option its variant does not declare when some built-in variant does (so
that a sweep can change ``attention.name`` and keep the rest: ``chunk_size`` under ``flash``):
such a value is checked against those declarations and then dropped.
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any

from linear_gpt2.attention import registry
from linear_gpt2.attention.options import (
    Declaration,
    OptionError,
    Options,
    check_declared,
    coerce,
    declared,
    type_name,
)
from linear_gpt2.platform.errors import ConfigError


def _builtin_classes() -> list[type[Options]]:
    return list(dict.fromkeys(registry.spec(n).options for n in registry.BUILTIN))


def _check_elsewhere(key: str, value: Any, prefix: str, spec) -> None:
    """An option ``spec`` does not declare: checked against the built-in variants that do
    (valid for one of them is enough), or an unknown-option error."""
    where = [declared(cls)[key] for cls in _builtin_classes() if key in declared(cls)]
    if not where:
        own = list(declared(spec.options))
        known = list(dict.fromkeys([*own, *(k for c in _builtin_classes() for k in declared(c))]))
        close = difflib.get_close_matches(key, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(
            f"{prefix}{key}: unknown attention option for {spec.name!r}{hint}; its options: "
            f"{', '.join(own)}; any variant's: {', '.join(known)}"
        )
    errors = []
    for _, hint, d in where:
        try:
            check_declared(key, coerce(value, hint, key), d)
            return
        except OptionError as e:
            errors.append(e)
    choices = [c for _, _, d in where for c in (d.choices or ())]
    if choices and all(d.choices for _, _, d in where):  # the union of every variant's values
        try:
            check_declared(key, value, Declaration("", tuple(dict.fromkeys(choices))))
        except OptionError as e:
            errors.insert(0, e)
    raise ConfigError(f"{prefix}{key}: {errors[0].problem}")


def parse(spec, values: Mapping[str, Any], prefix: str = "attention.") -> Options:
    """The options of ``spec`` (an ``AttentionSpec``) from config values ``{option: value}``:
    each coerced and checked by the variant's options class, then what the spec's function takes
    (document resets, decay gates). Options the variant does not declare are checked against the
    built-in variants that do and dropped. Raises :class:`ConfigError` naming ``prefix`` +
    option."""
    cls = spec.options
    own = declared(cls)
    for key, value in values.items():
        if key not in own:
            _check_elsewhere(key, value, prefix, spec)
    try:
        opts = cls(**{k: v for k, v in values.items() if k in own})
    except OptionError as e:
        raise ConfigError(f"{prefix}{e.option}: {e.problem}") from None
    except ValueError as e:  # a check that raised a plain ValueError: name the first option
        raise ConfigError(f"{prefix}{_first_option(e, cls)}: {e}") from None
    check_takes(spec, opts, prefix)
    return opts


def check_takes(spec, opts: Options, prefix: str = "attention.") -> None:
    """Raise :class:`ConfigError` if ``opts`` turn on resets or a decay that ``spec``'s function
    does not take."""
    if opts.decay != "none" and not spec.decay:
        takes = ", ".join(registry.names_where(lambda s: s.decay))
        raise ConfigError(
            f"{prefix}decay: decay={opts.decay!r} needs a state to decay, and {spec.name!r} "
            f"takes no decay gates. Use one of {takes}, or decay=none"
        )
    if opts.doc_reset and not spec.resets:
        takes = ", ".join(registry.names_where(lambda s: s.resets))
        raise ConfigError(
            f"{prefix}doc_reset: {spec.name!r} takes no document resets; use one of {takes}, "
            f"or doc_reset=false"
        )


def options_of(name: str, values: Mapping[str, Any], prefix: str = "attention.") -> Options:
    """:func:`parse` for attention ``name``, its unknown name a :class:`ConfigError` on
    ``prefix`` + ``name``."""
    return parse(spec_of(name, prefix), values, prefix)


def spec_of(name: str, prefix: str = "attention."):
    """The spec of ``name``; a name that does not resolve is a :class:`ConfigError` naming the
    key (``attention.name``)."""
    key = f"{prefix}name" if prefix == "attention." else "attention"
    try:
        return registry.spec(name)
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"{key}: {e}") from None


def implementation_only(name: str, option: str) -> bool:
    """Whether ``option`` of attention ``name`` only selects the implementation (a resumed run
    may change it); False for an option the variant does not declare or a name not found."""
    try:
        found = declared(registry.spec(name).options).get(option)
    except (ValueError, ImportError):
        return False
    return bool(found and found[2].implementation)


def validate_context(
    name: str,
    context: int,
    options: Options,
    prefix: str = "attention.",
    context_parallel: int = 1,
) -> None:
    """Raise :class:`ConfigError` if attention ``name`` with ``options`` cannot run sequences of
    ``context`` tokens (``AttentionSpec.context_problem``), or, with the sequence split into
    ``context_parallel`` slices (``train.context_parallel``), if it does not take context
    parallelism or a slice does not suit it."""
    spec = registry.spec(name)
    n = context_parallel
    if n > 1 and not spec.context_parallel:
        takes = ", ".join(registry.names_where(lambda s: s.context_parallel))
        raise ConfigError(
            f"train.context_parallel={n}: attention {name!r} does not split the sequence over "
            f"devices; those that do: {takes}; use one of them, or train.context_parallel=1"
        )
    if n > 1 and context % n:
        fits = _fitting_context(spec, options, context, n)
        advice = f"e.g. data.context={fits}" if fits else f"a multiple of {n}"
        raise ConfigError(
            f"train.context_parallel={n} does not divide data.context={context} into equal "
            f"slices; use a context that {n} divides and whose slices {name!r} takes ({advice}"
            + (", with model.block_size at least that)" if fits and fits > context else ")")
        )
    problem = _problem(spec, options, context, n)
    if problem:
        where = (
            f"data.context={context}"
            if n == 1
            else f"each device's slice (data.context={context} / train.context_parallel={n})"
        )
        raise ConfigError(f"{prefix}{_first_option(problem, spec.options)}: {where}: {problem}")


def _problem(spec, options: Options, context: int, n: int) -> str | None:
    """Why ``context`` tokens split into ``n`` slices do not suit the variant, or None."""
    tokens = context // n
    problem = None if spec.context_problem is None else spec.context_problem(tokens, options)
    if not problem and n > 1 and spec.slice_problem is not None:
        problem = spec.slice_problem(tokens, n, options)
    return problem


def _fitting_context(spec, options: Options, context: int, n: int) -> int | None:
    """The context nearest ``context`` that ``n`` slices split and the variant takes (the
    largest below, else the smallest above, within 64 times it), so advice is never refused."""
    below = range(context // n * n, 0, -n)
    above = range(context // n * n + n, 64 * max(context, n) + 1, n)
    for candidates in (below, above):
        for c in candidates:
            if not _problem(spec, options, c, n):
                return c
    return None


def _first_option(err: ValueError | str, cls: type[Options]) -> str:
    """The option a message complains about: the first of the class's fields it names."""
    text = str(err)
    for name in declared(cls):
        if name in text:
            return name
    return "name"


def label(name: str, values: Mapping[str, Any]) -> str:
    """A run's label in plots: ``name`` and each option whose value differs from its default
    and declares a label, the variant's own options first, then the layer's:
    ``LT_chunked/elu1+reset+gate``. ``values`` ``{option: value}``; a name not found here (a
    package not installed) gets the labels every variant's options share (``Options``)."""
    try:
        fields = declared(registry.spec(name).options)
    except (ValueError, ImportError):
        fields = declared(Options)
    ordered = sorted(fields.items(), key=lambda kv: kv[1][2].layer)  # stable: own ones first
    out = name
    for key, (f, _, d) in ordered:
        value = values.get(key, f.default)
        if d.label is not None and value is not None and value != f.default:
            out += d.label.format(value)
    return out


def describe(name: str) -> list[dict[str, Any]]:
    """The options of attention ``name`` in declaration order, each ``{option, type, default,
    choices, help, implementation, layer}``: what the command line's help and the docs' option
    table print."""
    return [
        {"option": key, "type": type_name(hint), "default": f.default, "choices": d.choices,
         "help": d.help, "implementation": d.implementation, "layer": d.layer}
        for key, (f, hint, d) in declared(registry.spec(name).options).items()
    ]  # fmt: skip


def help_text(names: list[str] | None = None) -> str:
    """The options of attention ``names`` (default: the built-in and registered ones) as the
    command line's help prints them: the layer's options once, then each variant's own, each
    ``attention.<option> = default`` with its values and help (``*``: a resumed run may change
    it)."""
    names = registry.names() if names is None else names

    def line(row: dict[str, Any]) -> str:
        values = " | ".join(map(str, row["choices"])) if row["choices"] else row["type"]
        mark = " *" if row["implementation"] else ""
        return f"    {row['option']} = {row['default']}{mark}  ({values}): {row['help']}"

    layer = [r for r in describe("softmax") if r["layer"]]
    lines = [
        "Attention options, attention.<option>=value (* a resumed run may change it):",
        "  every variant (the model's layer; a variant takes them if its spec does):",
        *(line(r) for r in layer),
    ]
    for name in names:
        own = [r for r in describe(name) if not r["layer"]]
        lines.append(f"  {name}:" + ("" if own else " none of its own"))
        lines += [line(r) for r in own]
    return "\n".join(lines)
