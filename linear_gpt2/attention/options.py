"""A variant's options: one frozen dataclass per variant, declared in the variant's module.

Every field of the class is a config key ``attention.<field>``, with its type (the annotation),
default, help line and checks (:func:`option`), and whether it only selects the implementation,
so that a resumed run may change it (``implementation=True``: ``kernel``, ``chunk_size``)::

    @dataclasses.dataclass(frozen=True)
    class TemperedOptions(Options):
        temperature: float = option(1.0, "divides the scores", check=positive)

    SPEC = AttentionSpec(name="tempered_softmax", ..., options=TemperedOptions)

:class:`Options`, the base of every class, holds what the model's layer does around any
attention: ``doc_reset`` and ``decay`` (the layer passes resets and log-gates to a variant whose
spec takes them; ``layer=True``: the help lists them apart). The linear family extends it once
(``linear.LinearOptions``: ``feature_map``, ``kernel``, ``eps``) and its chunked variants once
more (``linear.ChunkedOptions``: ``chunk_size``). Constructing an instance coerces and checks
every field (an :class:`OptionError` names the field), then runs the class's :meth:`~Options.check`
across fields.

The config schema, checkpoint compatibility, the command line's help, the docs' option table
and the plots' labels read these declarations (``schema.py``); nothing else lists options.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import types
import typing
from collections.abc import Callable
from typing import Any

from linear_gpt2.platform.errors import ConfigError

# What the linear state forgets (attention.decay): none; fixed (RetNet's per-head gamma_h); gate
# (gamma_i = sigmoid(w_h . x_i + b_h), a learned projection per head).
DECAYS = ("none", "fixed", "gate")
_KEY = "linear_gpt2.option"


class OptionError(ConfigError):
    """A value an option cannot take: ``option`` names the field, ``problem`` says why."""

    def __init__(self, option: str, problem: str):
        super().__init__(f"{option}: {problem}")
        self.option, self.problem = option, problem


@dataclasses.dataclass(frozen=True)
class Declaration:
    """What :func:`option` records about a field (beside its type and default)."""

    help: str
    choices: tuple[Any, ...] | None = None
    check: Callable[[Any], str | None] | None = None
    implementation: bool = False
    label: str | None = None
    layer: bool = False


def option(
    default: Any,
    help: str,
    *,
    choices: tuple[Any, ...] | None = None,
    check: Callable[[Any], str | None] | None = None,
    implementation: bool = False,
    label: str | None = None,
    layer: bool = False,
) -> Any:
    """A field of an options class: its ``default`` and ``help`` (one line), the ``choices`` it
    takes, ``check(value) -> why it is bad, or None``, whether it only selects the
    implementation (``implementation``: a resumed run may change it), how a plot labels a
    non-default value (``label``, formatted with the value: ``"/{}"``, ``"+reset"``), and
    whether the model's layer reads it rather than the variant (``layer``)."""
    meta = Declaration(help, choices, check, implementation, label, layer)
    return dataclasses.field(default=default, metadata={_KEY: meta})


def positive(value: float) -> str | None:
    """A check: ``value > 0``."""
    return None if value > 0 else f"must be > 0, got {value}"


def nonnegative(value: float) -> str | None:
    """A check: ``value >= 0``."""
    return None if value >= 0 else f"must be >= 0, got {value}"


@dataclasses.dataclass(frozen=True)
class Options:
    """The options of a variant without any of its own; the base of every options class.

    ``doc_reset`` and ``decay`` are the layer's (the model reads them); a variant whose spec
    takes no resets (decay gates) refuses them at config load (:func:`parse`)."""

    # Restart at every document start (after each EOT of the packed rows): the linear state and
    # normaliser are zeroed there, softmax / flash do not attend across documents. Off: the
    # post's setting (packed documents see each other).
    doc_reset: bool = option(
        False, "restart attention at every document start", label="+reset", layer=True
    )
    # Decay of the linear state, S_i = gamma_i S_{i-1} + phi(k_i) v_i^T (DECAYS above).
    decay: str = option(
        "none",
        "what the state forgets (fixed: RetNet's gamma_h; gate: learned per position)",
        choices=DECAYS,
        label="+{}",
        layer=True,
    )

    def __post_init__(self) -> None:
        hints = _hints(type(self))
        for f in dataclasses.fields(self):
            value = coerce(getattr(self, f.name), hints[f.name], f.name)
            object.__setattr__(self, f.name, value)
            check_declared(f.name, value, declaration(f))
        self.check()

    def check(self) -> None:
        """Checks across fields; raise :class:`OptionError` naming the field. Override it."""

    def as_dict(self) -> dict[str, Any]:
        """Every field, as the config's ``attention`` section holds it (besides ``name``)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def replace(self, **changes: Any) -> Options:
        return dataclasses.replace(self, **changes)


def declaration(f: dataclasses.Field) -> Declaration:
    """A field's :class:`Declaration` (a field declared without :func:`option`: no help)."""
    return f.metadata.get(_KEY) or Declaration(help="")


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def declared(cls: type[Options]) -> dict[str, tuple[dataclasses.Field, Any, Declaration]]:
    """``{field: (Field, type, Declaration)}`` of an options class, in order."""
    hints = _hints(cls)
    return {f.name: (f, hints[f.name], declaration(f)) for f in dataclasses.fields(cls)}


def _members(hint: Any) -> tuple[Any, ...]:
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return typing.get_args(hint)
    return (hint,)


def type_name(hint: Any) -> str:
    """``float``, ``int or str``: a field's type as an error message says it."""
    names = [getattr(m, "__name__", str(m)) for m in _members(hint)]
    return " or ".join("null" if n == "NoneType" else n for n in names)


def coerce(value: Any, hint: Any, name: str) -> Any:
    """``value`` as the field's type: exactly that type, an int for a float, or a string that
    reads as the number (YAML reads ``1e-6`` as a string); else :class:`OptionError`."""
    members = _members(hint)
    for t in members:
        if t is type(None) and value is None:
            return None
        if t is bool and isinstance(value, bool):
            return value
        if t is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if t is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if t is str and isinstance(value, str):
            return value
        if isinstance(t, type) and t not in (bool, int, float, str) and isinstance(value, t):
            return value
    if isinstance(value, str):
        for t in members:
            if t in (int, float):
                try:
                    return t(value)
                except ValueError:
                    pass
    raise OptionError(name, f"wrong type: expected {type_name(hint)}, got {value!r}")


def check_declared(name: str, value: Any, d: Declaration) -> None:
    """Raise :class:`OptionError` unless ``value`` is one of the choices and passes the check."""
    if d.choices is not None and value not in d.choices:
        close = difflib.get_close_matches(str(value), [str(c) for c in d.choices], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        valid = ", ".join(str(c) for c in d.choices)
        raise OptionError(name, f"{value!r} is not valid{hint}; valid values: {valid}")
    problem = d.check(value) if d.check is not None else None
    if problem:
        raise OptionError(name, problem)
