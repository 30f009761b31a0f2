"""Where ``attention.name`` finds its :class:`~linear_gpt2.attention.spec.AttentionSpec`.

A name is, in this order:

1. one of the post's variants, a module of this package (:data:`BUILTIN`);
2. a name registered by an installed package under the entry-point group
   ``linear_gpt2.attention`` (``[project.entry-points."linear_gpt2.attention"] cosine =
   "my_lab.attn.cosine"``, pointing at a module that defines ``SPEC`` or at a spec itself,
   ``"my_lab.attn:COSINE"``);
3. an importable module path, ``my_lab.attn.cosine`` (its ``SPEC``) or ``my_lab.attn:COSINE``.

Modules are imported when first asked for, so choosing ``softmax`` never imports Pallas, Triton or
a researcher's package.
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.metadata
import importlib.util
from collections.abc import Callable
from types import ModuleType

from linear_gpt2.attention.spec import AttentionSpec
from linear_gpt2.platform.errors import UsageError

ENTRY_POINTS = "linear_gpt2.attention"

# name -> module in this package. The names are the post's.
BUILTIN: dict[str, str] = {
    "softmax": "softmax",
    "flash": "flash",
    "LT_attention": "lt_attention",
    "LT_attention_parallel_no_flash": "lt_attention_parallel_no_flash",
    "LT_attention_parallel": "lt_attention_parallel",
    "LT_state": "lt_state",
    "LT_state_parallel": "lt_state_parallel",
    "LT_chunked": "lt_chunked",
}


class UnknownAttentionError(UsageError):
    """An attention name that is neither registered nor an importable spec (a ``ValueError``)."""


def names() -> list[str]:
    """The built-in attention names, in the post's order, then those installed packages
    register."""
    return [*BUILTIN, *sorted(n for n in _entry_points() if n not in BUILTIN)]


def names_where(predicate: Callable[[AttentionSpec], bool]) -> list[str]:
    """The built-in names whose spec satisfies ``predicate`` (for error messages)."""
    return [n for n in BUILTIN if predicate(spec(n))]


def _entry_points() -> dict[str, importlib.metadata.EntryPoint]:
    return {ep.name: ep for ep in importlib.metadata.entry_points(group=ENTRY_POINTS)}


@functools.cache
def spec(name: str) -> AttentionSpec:
    """The spec of attention ``name`` (see the module docstring)."""
    if name in BUILTIN:
        return _spec_of(importlib.import_module(f"linear_gpt2.attention.{BUILTIN[name]}"), name)
    eps = _entry_points()
    if name in eps:
        try:
            return _spec_of(eps[name].load(), name)
        except AttributeError:
            return _spec_of(None, f"{name} ({eps[name].value})")
    if "." in name or ":" in name:
        module_path, _, attr = name.partition(":")
        try:
            module = importlib.import_module(module_path)
        except ImportError as e:
            missing = getattr(e, "name", None)
            if missing and module_path.startswith(missing):
                raise UnknownAttentionError(
                    f"attention {name!r}: no module {missing!r} on the Python path; install the "
                    f"package that holds it or add its directory to PYTHONPATH"
                ) from None
            raise
        return _spec_of(getattr(module, attr, None) if attr else module, name)
    valid = names()
    close = closest(name, valid)
    hint = f" (did you mean {close!r}?)" if close else ""
    if _top_level_module(name):
        raise UnknownAttentionError(
            f"attention {name!r}: not a registered name; a module of your own is named by its "
            f"path with its package (my_lab.attn, defining SPEC), or as {name}:SPEC for a "
            f"top-level module; registered names: {', '.join(valid)}"
        )
    raise UnknownAttentionError(
        f"unknown attention {name!r}{hint}; valid names: {', '.join(valid)}, or the module path "
        f"of a variant of your own, with its package (e.g. my_lab.attn, defining SPEC)"
    )


def _top_level_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # not a module name at all
        return False


def closest(name: str, valid: list[str]) -> str | None:
    """The valid name ``name`` most likely meant: one it is made of (``flash_attention`` ->
    ``flash``: the longest valid name that is a ``_``-separated part or prefix of it, case
    aside), else the closest spelling."""
    lower = name.lower()
    parts = set(lower.replace("-", "_").split("_"))
    within = [v for v in valid if v.lower() in parts or lower.startswith(v.lower())]
    if within:
        return max(within, key=len)
    close = difflib.get_close_matches(lower, [v.lower() for v in valid], n=1)
    return next((v for v in valid if close and v.lower() == close[0]), None)


def _spec_of(obj: object, name: str) -> AttentionSpec:
    """``obj`` itself if it is a spec, or a module's ``SPEC``; else a one-line error."""
    found = getattr(obj, "SPEC", None) if isinstance(obj, ModuleType) else obj
    if not isinstance(found, AttentionSpec):
        where = f"module {obj.__name__}" if isinstance(obj, ModuleType) else "it"
        raise UnknownAttentionError(
            f"attention {name!r}: {where} defines no SPEC = AttentionSpec(...) (see "
            f"linear_gpt2.attention.spec)"
        )
    return found


def family(name: str, default: str | None = None) -> str | None:
    """The family of attention ``name`` (``softmax`` or ``linear``); ``default`` when the name
    cannot be resolved here (a run of a variant whose package is not installed)."""
    try:
        return spec(name).family
    except (UnknownAttentionError, ImportError):
        return default
