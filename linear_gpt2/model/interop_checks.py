"""Whether a state dict (nanoGPT's or Hugging Face's) or one of our parameter trees fits a model
config; each misfit raises the :class:`~linear_gpt2.model.interop_layout.CheckpointError` that
names the keys and the setting that would make it fit (``vocab_size``, ``n_layer``, ``bias``,
or the other layout when the weights are transposed).
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.interop_files import to_numpy
from linear_gpt2.model.interop_layout import (
    BLOCK_ROWS,
    GPT2_VOCAB_SIZE,
    LAYER,
    LM_HEAD,
    WPE,
    WTE,
    Format,
    MissingKeysError,
    Params,
    ShapeMismatchError,
    UnexpectedKeysError,
    VocabSizeMismatchError,
    expected_params_shapes,
    expected_state_dict_shapes,
    fmt_shape,
    has_tensor,
    short_list,
)


def _orientation(format: Format) -> str:
    return "[out, in] (torch.nn.Linear)" if format == "nanogpt" else "[in, out] (Conv1D)"


def _layers_in(keys: Iterable[str]) -> int:
    idx = [int(m.group(1)) for k in keys if (m := LAYER.match(k))]
    return max(idx) + 1 if idx else 0


def _has_bias_keys(keys: Iterable[str]) -> bool:
    return any(k.endswith(".bias") for k in keys)


def validate_state_dict(state_dict: dict[str, Any], config: ModelConfig, format: Format) -> None:
    """Raise a :class:`CheckpointError` naming the key(s) unless ``state_dict`` fits ``config``."""
    name = "nanoGPT" if format == "nanogpt" else "Hugging Face"
    expected = expected_state_dict_shapes(config, format)
    shapes = {k: tuple(int(s) for s in np.shape(v)) for k, v in state_dict.items()}

    # The vocabulary first: the commonest mismatch (GPT-2's 50257 vs nanoGPT's padded 50304).
    if WTE in shapes and len(shapes[WTE]) == 2 and shapes[WTE][0] != config.vocab_size:
        found = shapes[WTE][0]
        raise VocabSizeMismatchError(
            f"{WTE}: the checkpoint has vocab_size {found} (found shape {fmt_shape(shapes[WTE])}, "
            f"expected {fmt_shape(expected[WTE])}) but config.vocab_size is {config.vocab_size}; "
            f"set vocab_size={found} (model.vocab_size={found}) to load it"
            + (
                " (50257 is GPT-2's tokenizer; nanoGPT pads it to 50304 only when training from "
                "scratch)"
                if found == GPT2_VOCAB_SIZE
                else ""
            ),
            [WTE],
        )
    if WPE in shapes and len(shapes[WPE]) == 2 and shapes[WPE][0] != config.block_size:
        found = shapes[WPE][0]
        raise ShapeMismatchError(
            f"{WPE}: the checkpoint has block_size {found} (found shape {fmt_shape(shapes[WPE])}, "
            f"expected {fmt_shape(expected[WPE])}) but config.block_size is {config.block_size}; "
            f"set block_size={found} (model.block_size={found}) to load it",
            [WPE],
        )

    present = set(shapes)
    optional = {LM_HEAD}  # tied to wte, so a checkpoint may leave it out
    missing = [k for k in expected if k not in present and k not in optional]
    unexpected = [k for k in shapes if k not in expected]
    hints = []
    n_found = _layers_in(present)
    if n_found and n_found != config.n_layer:
        hints.append(f"the checkpoint has {n_found} layers: set n_layer={n_found}")
    if config.bias and missing and not _has_bias_keys(present):
        hints.append("the checkpoint has no biases: set bias=False")
    if not config.bias and _has_bias_keys(unexpected):
        hints.append("the checkpoint has biases: set bias=True")
    hint = f" ({'; '.join(hints)})" if hints else ""
    if missing:
        # Near-misses (typos, other prefixes) for the first few only: difflib is quadratic.
        near = {k: difflib.get_close_matches(k, unexpected, n=1, cutoff=0.8) for k in missing[:8]}
        near_s = "; ".join(f"{k} ~ {v[0]}?" for k, v in near.items() if v)
        raise MissingKeysError(
            f"{len(missing)} key(s) missing from the {name} state dict: {short_list(missing)}{hint}"
            + (f"; unexpected keys present: {short_list(unexpected)}" if unexpected else "")
            + (f"; similar keys: {near_s}" if near_s else "")
            + f". Expected for this config: {describe_expected(config)}",
            missing,
        )
    if unexpected:
        raise UnexpectedKeysError(
            f"{len(unexpected)} unexpected key(s) in the {name} state dict, which the config "
            f"({config.n_layer} layers, bias={config.bias}) has no parameter for: "
            f"{short_list(unexpected)}{hint}",
            unexpected,
        )

    bad = [k for k in shapes if shapes[k] != expected[k]]
    if bad:
        lines = [
            f"{k}: expected shape {fmt_shape(expected[k])}, found {fmt_shape(shapes[k])}"
            for k in bad
        ]
        transposed = [k for k in bad if len(shapes[k]) == 2 and shapes[k] == expected[k][::-1]]
        note = ""
        if transposed:
            other = "from_hf" if format == "nanogpt" else "from_nanogpt"
            note = (
                f" ({len(transposed)} of them transposed: {name} weights are "
                f"{_orientation(format)}; if this is the other layout, use {other})"
            )
        raise ShapeMismatchError(
            f"shape mismatch in the {name} state dict for config n_layer={config.n_layer}, "
            f"n_head={config.n_head}, n_embd={config.n_embd}, vocab_size={config.vocab_size}, "
            f"block_size={config.block_size}: {'; '.join(lines[:12])}"
            + (f"; ... ({len(lines) - 12} more)" if len(lines) > 12 else "")
            + note,
            bad,
        )


def describe_expected(config: ModelConfig) -> str:
    """The expected key set, compactly: the per-block suffixes once, with the layer range."""
    block = [suffix for suffix, _, kind in BLOCK_ROWS if has_tensor(config, kind)]
    layers = "0" if config.n_layer == 1 else f"0..{config.n_layer - 1}"
    ln_f = "transformer.ln_f.weight" + (", transformer.ln_f.bias" if config.bias else "")
    return (
        f"{WTE}, {WPE}, transformer.h.{{{layers}}}.{{{', '.join(block)}}}, {ln_f}, "
        f"{LM_HEAD} (optional: tied to {WTE})"
    )


def validate_params(params: Params, config: ModelConfig) -> dict[tuple[str, ...], np.ndarray]:
    """Flatten ``params`` to ``{path: array}`` and check it against ``config``."""
    flat: dict[tuple[str, ...], Any] = {}

    def walk(prefix: tuple[str, ...], node: Any) -> None:
        if isinstance(node, Mapping):
            for k, v in node.items():
                walk((*prefix, str(k)), v)
        else:
            flat[prefix] = node

    walk((), params)
    expected = expected_params_shapes(config)
    missing = [p for p in expected if p not in flat]
    extra = [p for p in flat if p not in expected]
    if missing:
        names = [".".join(p) for p in missing]
        raise MissingKeysError(
            f"params lack {short_list(names)} for config (n_layer={config.n_layer}, "
            f"bias={config.bias}); expected {short_list(['.'.join(p) for p in expected])}",
            names,
        )
    if extra:
        names = [".".join(p) for p in extra]
        raise UnexpectedKeysError(
            f"params have {short_list(names)}, which config (bias={config.bias}) has no place for",
            names,
        )
    bad = [p for p in expected if tuple(np.shape(flat[p])) != expected[p]]
    if bad:
        lines = [
            f"{'.'.join(p)}: expected shape {fmt_shape(expected[p])}, found "
            f"{fmt_shape(np.shape(flat[p]))}"
            for p in bad
        ]
        raise ShapeMismatchError(
            "params do not match the config: " + "; ".join(lines), [".".join(p) for p in bad]
        )
    return {p: np.asarray(to_numpy(flat[p])) for p in expected}
