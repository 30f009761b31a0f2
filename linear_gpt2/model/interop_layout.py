"""GPT-2's state-dict layouts beside ours: key names, shapes and orientations per model config,
the key spellings tolerated on input, and the errors of a state dict that does not fit.

Our parameters keep the ``n_layer`` blocks stacked under ``params["h"]`` (leading ``[n_layer]``
axis) with Dense kernels ``[in, out]``; nanoGPT's ``torch.nn.Linear`` weights are ``[out, in]``,
Hugging Face's ``Conv1D`` weights ``[in, out]`` (the table in ``interop.py``). Every error of a
state dict is a :class:`CheckpointError` (a ``ValueError``) that names the key(s); a weights file
that cannot be read at all is a :class:`WeightsFileError` (the package's ``CheckpointError``, a
run error) that names the file.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any, Literal

import numpy as np

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform import errors
from linear_gpt2.platform.errors import UsageError

Params = dict[str, Any]
StateDict = dict[str, np.ndarray]
Format = Literal["nanogpt", "hf"]

# GPT-2's tokenizer has 50257 tokens; nanoGPT pads to 50304 for speed when training from scratch,
# so its checkpoints may have either.
GPT2_VOCAB_SIZE = 50257

ORIG_MOD = "_orig_mod."
WTE, WPE, LM_HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"
# Non-parameter buffers some checkpoints carry: the causal mask (nanoGPT's slow-attention path,
# transformers < 4.4x) and the masked-score constant (old transformers). Recomputed, never loaded.
BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")
LAYER = re.compile(r"^transformer\.h\.(\d+)\.")


# --------------------------------------------------------------------------------------------
# Errors


class CheckpointError(UsageError):
    """A state dict that does not fit the model config (base class of the specific errors)."""


class MissingKeysError(CheckpointError):
    """Keys the config needs that the state dict lacks. ``.keys``: the missing keys."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys


class UnexpectedKeysError(CheckpointError):
    """Keys in the state dict that the config has no parameter for. ``.keys``: those keys."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys


class ShapeMismatchError(CheckpointError):
    """A key whose array has another shape than the config implies. ``.keys``: those keys."""

    def __init__(self, message: str, keys: list[str]):
        super().__init__(message)
        self.keys = keys


class UnrepresentableError(CheckpointError):
    """A model that GPT-2 (nanoGPT, Hugging Face) cannot represent: a decaying linear state,
    blocks without the MLP or with a short convolution."""


class VocabSizeMismatchError(ShapeMismatchError):
    """The checkpoint's vocabulary differs from ``config.vocab_size``; says which to set."""


class TiedWeightsError(CheckpointError):
    """``lm_head.weight`` differs from ``transformer.wte.weight``: our head is tied to ``wte``."""


# --------------------------------------------------------------------------------------------
# The layout table


# One row per tensor of a block: (suffix after ``transformer.h.{i}.``, our path under
# ``params["h"]``, kind). Kind "kernel" is a Dense kernel (ours ``[in, out]``), "bias" a Dense
# bias, "scale"/"shift" a LayerNorm weight/bias. Rows in nanoGPT's state_dict order.
BLOCK_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
    ("ln_1.weight", ("ln_1", "scale"), "scale"),
    ("ln_1.bias", ("ln_1", "bias"), "shift"),
    ("attn.c_attn.weight", ("attn", "c_attn", "kernel"), "kernel"),
    ("attn.c_attn.bias", ("attn", "c_attn", "bias"), "bias"),
    ("attn.c_proj.weight", ("attn", "c_proj", "kernel"), "kernel"),
    ("attn.c_proj.bias", ("attn", "c_proj", "bias"), "bias"),
    ("ln_2.weight", ("ln_2", "scale"), "scale"),
    ("ln_2.bias", ("ln_2", "bias"), "shift"),
    ("mlp.c_fc.weight", ("mlp", "c_fc", "kernel"), "kernel"),
    ("mlp.c_fc.bias", ("mlp", "c_fc", "bias"), "bias"),
    ("mlp.c_proj.weight", ("mlp", "c_proj", "kernel"), "kernel"),
    ("mlp.c_proj.bias", ("mlp", "c_proj", "bias"), "bias"),
)


def block_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """Our per-layer shapes (without the ``[n_layer]`` axis), kernels ``[in, out]``."""
    C = config.n_embd
    shapes = {
        ("ln_1", "scale"): (C,),
        ("ln_1", "bias"): (C,),
        ("attn", "c_attn", "kernel"): (C, 3 * C),
        ("attn", "c_attn", "bias"): (3 * C,),
        ("attn", "c_proj", "kernel"): (C, C),
        ("attn", "c_proj", "bias"): (C,),
        ("ln_2", "scale"): (C,),
        ("ln_2", "bias"): (C,),
        ("mlp", "c_fc", "kernel"): (C, 4 * C),
        ("mlp", "c_fc", "bias"): (4 * C,),
        ("mlp", "c_proj", "kernel"): (4 * C, C),
        ("mlp", "c_proj", "bias"): (C,),
    }
    return shapes


def has_tensor(config: ModelConfig, kind: str) -> bool:
    """Whether ``config``'s model has tensors of ``kind`` (biases and shifts only with ``bias``)."""
    return config.bias or kind not in ("bias", "shift")


def expected_params_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{path: shape}`` of our parameter tree for ``config`` (stacked blocks under ``h``)."""
    out: dict[tuple[str, ...], tuple[int, ...]] = {
        ("wte", "embedding"): (config.vocab_size, config.n_embd),
        ("wpe", "embedding"): (config.block_size, config.n_embd),
    }
    block = block_shapes(config)
    for _, path, kind in BLOCK_ROWS:
        if has_tensor(config, kind):
            out[("h", *path)] = (config.n_layer, *block[path])
    out[("ln_f", "scale")] = (config.n_embd,)
    if config.bias:
        out[("ln_f", "bias")] = (config.n_embd,)
    return out


def expected_state_dict_shapes(config: ModelConfig, format: Format) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of the full state dict in ``format`` for ``config``, in torch's order.

    nanoGPT's Linear weights are ``[out, in]``; Hugging Face's Conv1D weights are ``[in, out]``.
    ``lm_head.weight`` (tied to ``transformer.wte.weight``) is included, as in both state dicts.
    """
    check_format(format)
    C = config.n_embd
    out = {WTE: (config.vocab_size, C), WPE: (config.block_size, C)}
    block = block_shapes(config)
    for i in range(config.n_layer):
        for suffix, path, kind in BLOCK_ROWS:
            if has_tensor(config, kind):
                shape = block[path]
                out[f"transformer.h.{i}.{suffix}"] = (
                    shape[::-1] if transposed(kind, format) else shape
                )
    out["transformer.ln_f.weight"] = (C,)
    if config.bias:
        out["transformer.ln_f.bias"] = (C,)
    out[LM_HEAD] = (config.vocab_size, C)
    return out


def transposed(kind: str, format: Format) -> bool:
    # torch.nn.Linear stores [out, in]; Conv1D (Hugging Face) and Flax Dense store [in, out].
    return kind == "kernel" and format == "nanogpt"


class WeightsFileError(errors.CheckpointError):
    """A weights file that cannot be read: truncated, corrupt, or not the format its suffix
    says. The message names the file and what the reader said (exit 1 from a command)."""


def check_format(format: str, allowed: tuple[str, ...] = ("nanogpt", "hf")) -> None:
    """Raise :class:`~linear_gpt2.platform.errors.UsageError` (a ``ValueError``) naming the
    valid values unless ``format`` is one of ``allowed``."""
    if format not in allowed:
        valid = ", ".join(repr(a) for a in allowed)
        raise UsageError(f"format must be one of {valid}, got {format!r}")


# --------------------------------------------------------------------------------------------
# Keys as found in the wild


def normalize(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Strip ``_orig_mod.`` prefixes and drop the causal-mask buffers; values untouched."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        key = str(key)
        while key.startswith(ORIG_MOD):
            key = key[len(ORIG_MOD) :]
        if BUFFER.match(key):
            continue
        if key in out:
            raise CheckpointError(f"{key}: present both with and without the {ORIG_MOD!r} prefix")
        out[key] = value
    return out


def add_transformer_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's bare ``GPT2Model`` layout (``wte.weight``, ``h.0...``) to the LM layout."""
    if any(k.startswith("transformer.") for k in state_dict):
        return state_dict
    if not any(k in ("wte.weight", "wpe.weight") or k.startswith("h.") for k in state_dict):
        return state_dict
    out = {(k if k == LM_HEAD else f"transformer.{k}"): v for k, v in state_dict.items()}
    return {k: v for k, v in out.items() if not BUFFER.match(k)}


def detect_format(state_dict: Mapping[str, Any], config: ModelConfig) -> Format:
    """``"nanogpt"`` or ``"hf"``, from the orientation of the first ``c_attn.weight``.

    nanoGPT's is ``[3C, C]`` (``[out, in]``), Hugging Face's ``[C, 3C]``; a bare ``GPT2Model``
    layout (no ``transformer.`` prefix) is Hugging Face's.
    """
    sd = normalize(state_dict)
    if add_transformer_prefix(sd) is not sd:
        return "hf"
    C = config.n_embd
    key = "transformer.h.0.attn.c_attn.weight"
    if key not in sd:
        raise MissingKeysError(
            f"cannot tell nanoGPT from Hugging Face: {key} is missing; keys found: "
            f"{short_list(list(sd), 10)}",
            [key],
        )
    shape = tuple(np.shape(sd[key]))
    if shape == (3 * C, C):
        return "nanogpt"
    if shape == (C, 3 * C):
        return "hf"
    raise ShapeMismatchError(
        f"{key}: found shape {fmt_shape(shape)}, expected [{3 * C}, {C}] (nanoGPT) or "
        f"[{C}, {3 * C}] (Hugging Face) for n_embd={C}; check model.n_embd",
        [key],
    )


# --------------------------------------------------------------------------------------------
# Message parts


def fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def short_list(keys: list[str], limit: int = 30) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")
