"""Weights in and out: nanoGPT and Hugging Face GPT-2 state dicts, and the files that hold them.

Our parameters (``linear_gpt2.model``) are a nested dict with the ``n_layer`` blocks stacked under
``params["h"]`` (leading ``[n_layer]`` axis) and Dense kernels ``[in, out]``. The two outside
layouts differ from ours and from each other only in naming and orientation:

==========================  ====================================  ===============================
ours                        nanoGPT (``torch.nn.Linear``)         Hugging Face (``Conv1D``)
==========================  ====================================  ===============================
``wte/embedding [V, C]``    ``transformer.wte.weight [V, C]``     same key, same shape
``wpe/embedding [T, C]``    ``transformer.wpe.weight [T, C]``     same key, same shape
``h/ln_1/scale [L, C]``     ``transformer.h.{i}.ln_1.weight [C]`` same key, same shape
``h/ln_1/bias [L, C]``      ``transformer.h.{i}.ln_1.bias [C]``   same key, same shape
``h/attn/c_attn/kernel``    ``...attn.c_attn.weight [3C, C]``     ``...c_attn.weight [C, 3C]``
``[L, C, 3C]``              (``[out, in]``)                       (``[in, out]``)
``h/.../bias [L, out]``     ``....bias [out]``                    same key, same shape
(tied to ``wte``)           ``lm_head.weight [V, C]``             same key, same shape
==========================  ====================================  ===============================

and likewise ``attn.c_proj`` (``[C, C]``), ``ln_2``, ``mlp.c_fc`` (``[C, 4C]`` ours), ``mlp.c_proj``
(``[4C, C]`` ours), ``transformer.ln_f``. With ``config.bias=False`` no Dense or LayerNorm has a
bias, in our tree or in nanoGPT's state dict.

Conversions are exact (float32, no arithmetic): ``to_x(from_x(sd)) == sd`` key for key, bit for
bit, for a float32 state dict of the full model (``GPT2LMHeadModel`` for Hugging Face).
Everything that cannot be loaded exactly is an error naming the key (:class:`CheckpointError` and
its subclasses, all ``ValueError``).

Tolerated on input, dropped: the ``_orig_mod.`` prefix that ``torch.compile`` adds (nanoGPT's
``train.py`` saves the compiled module's state dict), the causal-mask buffers ``attn.bias`` and
``attn.masked_bias`` (old nanoGPT without flash attention, old ``transformers``), and for Hugging
Face the bare ``GPT2Model`` layout without the ``transformer.`` prefix (the hub's ``gpt2``
checkpoints). ``lm_head.weight`` is optional on input, since the head is tied to ``wte`` (Hugging
Face's ``save_pretrained`` drops it); when present it must equal ``transformer.wte.weight``.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import UsageError

Params = dict[str, Any]
StateDict = dict[str, np.ndarray]
Format = Literal["nanogpt", "hf"]

# GPT-2's tokenizer has 50257 tokens; nanoGPT pads to 50304 for speed when training from scratch,
# so its checkpoints may have either.
GPT2_VOCAB_SIZE = 50257

_ORIG_MOD = "_orig_mod."
_WTE, _WPE, _LM_HEAD = "transformer.wte.weight", "transformer.wpe.weight", "lm_head.weight"
# Non-parameter buffers some checkpoints carry: the causal mask (nanoGPT's slow-attention path,
# transformers < 4.4x) and the masked-score constant (old transformers). Recomputed, never loaded.
_BUFFER = re.compile(r"^transformer\.h\.\d+\.attn\.(bias|masked_bias)$")
_LAYER = re.compile(r"^transformer\.h\.(\d+)\.")


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


def _check_representable(config: ModelConfig, direction: str) -> None:
    if not config.is_gpt2:
        raise UnrepresentableError(
            f"model.mlp={config.mlp}, model.short_conv={config.short_conv}: a nanoGPT / Hugging "
            "Face GPT-2 checkpoint has an MLP in every block and no convolution; use "
            "model.mlp=true and model.short_conv=0"
        )
    if config.decay == "none":
        return
    if direction == "import" and config.decay == "fixed":
        return  # the fixed decay has no parameters: GPT-2's weights are all the model needs
    what = (
        "has no c_gate weights for it; import with attention.decay=none or fixed and train the "
        "gate from its initialisation"
        if direction == "import"
        else "cannot represent it (its attention has no decay); export a model trained with "
        "attention.decay=none"
    )
    raise UnrepresentableError(
        f"attention.decay={config.decay!r}: a nanoGPT / Hugging Face GPT-2 checkpoint {what}"
    )


class VocabSizeMismatchError(ShapeMismatchError):
    """The checkpoint's vocabulary differs from ``config.vocab_size``; says which to set."""


class TiedWeightsError(CheckpointError):
    """``lm_head.weight`` differs from ``transformer.wte.weight``: our head is tied to ``wte``."""


# --------------------------------------------------------------------------------------------
# The layout table


# One row per tensor of a block: (suffix after ``transformer.h.{i}.``, our path under
# ``params["h"]``, kind). Kind "kernel" is a Dense kernel (ours ``[in, out]``), "bias" a Dense
# bias, "scale"/"shift" a LayerNorm weight/bias. Rows in nanoGPT's state_dict order.
_BLOCK_ROWS: tuple[tuple[str, tuple[str, ...], str], ...] = (
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


def _block_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
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


def _has(config: ModelConfig, kind: str) -> bool:
    return config.bias or kind not in ("bias", "shift")


def expected_params_shapes(config: ModelConfig) -> dict[tuple[str, ...], tuple[int, ...]]:
    """``{path: shape}`` of our parameter tree for ``config`` (stacked blocks under ``h``)."""
    out: dict[tuple[str, ...], tuple[int, ...]] = {
        ("wte", "embedding"): (config.vocab_size, config.n_embd),
        ("wpe", "embedding"): (config.block_size, config.n_embd),
    }
    block = _block_shapes(config)
    for _, path, kind in _BLOCK_ROWS:
        if _has(config, kind):
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
    _check_format(format)
    C = config.n_embd
    out = {_WTE: (config.vocab_size, C), _WPE: (config.block_size, C)}
    block = _block_shapes(config)
    for i in range(config.n_layer):
        for suffix, path, kind in _BLOCK_ROWS:
            if _has(config, kind):
                shape = block[path]
                out[f"transformer.h.{i}.{suffix}"] = (
                    shape[::-1] if _transposed(kind, format) else shape
                )
    out["transformer.ln_f.weight"] = (C,)
    if config.bias:
        out["transformer.ln_f.bias"] = (C,)
    out[_LM_HEAD] = (config.vocab_size, C)
    return out


def _transposed(kind: str, format: Format) -> bool:
    # torch.nn.Linear stores [out, in]; Conv1D (Hugging Face) and Flax Dense store [in, out].
    return kind == "kernel" and format == "nanogpt"


def _check_format(format: str) -> None:
    if format not in ("nanogpt", "hf"):
        raise ValueError(f"format must be 'nanogpt' or 'hf', got {format!r}")


# --------------------------------------------------------------------------------------------
# Value conversion


def to_numpy(value: Any) -> np.ndarray:
    """A numpy array from a numpy/JAX array or a torch tensor (torch is not imported here).

    torch tensors go through ``.detach().cpu().float()``: bfloat16/float16 become float32, as our
    parameters are float32 and numpy has no bfloat16.
    """
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch"):
        t = value.detach().cpu()
        return (t.float() if t.is_floating_point() else t).numpy()
    return np.asarray(value)


def _normalize(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """Strip ``_orig_mod.`` prefixes and drop the causal-mask buffers; values untouched."""
    out: dict[str, Any] = {}
    for key, value in state_dict.items():
        key = str(key)
        while key.startswith(_ORIG_MOD):
            key = key[len(_ORIG_MOD) :]
        if _BUFFER.match(key):
            continue
        if key in out:
            raise CheckpointError(f"{key}: present both with and without the {_ORIG_MOD!r} prefix")
        out[key] = value
    return out


def _add_transformer_prefix(state_dict: dict[str, Any]) -> dict[str, Any]:
    """Hugging Face's bare ``GPT2Model`` layout (``wte.weight``, ``h.0...``) to the LM layout."""
    if any(k.startswith("transformer.") for k in state_dict):
        return state_dict
    if not any(k in ("wte.weight", "wpe.weight") or k.startswith("h.") for k in state_dict):
        return state_dict
    out = {(k if k == _LM_HEAD else f"transformer.{k}"): v for k, v in state_dict.items()}
    return {k: v for k, v in out.items() if not _BUFFER.match(k)}


# --------------------------------------------------------------------------------------------
# Validation


def _fmt_shape(shape: Iterable[int]) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def _orientation(format: Format) -> str:
    return "[out, in] (torch.nn.Linear)" if format == "nanogpt" else "[in, out] (Conv1D)"


def _layers_in(keys: Iterable[str]) -> int:
    idx = [int(m.group(1)) for k in keys if (m := _LAYER.match(k))]
    return max(idx) + 1 if idx else 0


def _list(keys: list[str], limit: int = 30) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f", ... ({len(keys) - limit} more)" if len(keys) > limit else "")


def _has_bias_keys(keys: Iterable[str]) -> bool:
    return any(k.endswith(".bias") for k in keys)


def _validate(state_dict: dict[str, Any], config: ModelConfig, format: Format) -> None:
    """Raise a :class:`CheckpointError` naming the key(s) unless ``state_dict`` fits ``config``."""
    name = "nanoGPT" if format == "nanogpt" else "Hugging Face"
    expected = expected_state_dict_shapes(config, format)
    shapes = {k: tuple(int(s) for s in np.shape(v)) for k, v in state_dict.items()}

    # The vocabulary first: the commonest mismatch (GPT-2's 50257 vs nanoGPT's padded 50304).
    if _WTE in shapes and len(shapes[_WTE]) == 2 and shapes[_WTE][0] != config.vocab_size:
        found = shapes[_WTE][0]
        raise VocabSizeMismatchError(
            f"{_WTE}: the checkpoint has vocab_size {found} (found shape {_fmt_shape(shapes[_WTE])}, "
            f"expected {_fmt_shape(expected[_WTE])}) but config.vocab_size is {config.vocab_size}; "
            f"set vocab_size={found} (model.vocab_size={found}) to load it"
            + (
                " (50257 is GPT-2's tokenizer; nanoGPT pads it to 50304 only when training from "
                "scratch)"
                if found == GPT2_VOCAB_SIZE
                else ""
            ),
            [_WTE],
        )
    if _WPE in shapes and len(shapes[_WPE]) == 2 and shapes[_WPE][0] != config.block_size:
        found = shapes[_WPE][0]
        raise ShapeMismatchError(
            f"{_WPE}: the checkpoint has block_size {found} (found shape {_fmt_shape(shapes[_WPE])}, "
            f"expected {_fmt_shape(expected[_WPE])}) but config.block_size is {config.block_size}; "
            f"set block_size={found} (model.block_size={found}) to load it",
            [_WPE],
        )

    present = set(shapes)
    optional = {_LM_HEAD}  # tied to wte, so a checkpoint may leave it out
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
            f"{len(missing)} key(s) missing from the {name} state dict: {_list(missing)}{hint}"
            + (f"; unexpected keys present: {_list(unexpected)}" if unexpected else "")
            + (f"; similar keys: {near_s}" if near_s else "")
            + f". Expected for this config: {_describe_expected(config)}",
            missing,
        )
    if unexpected:
        raise UnexpectedKeysError(
            f"{len(unexpected)} unexpected key(s) in the {name} state dict, which the config "
            f"({config.n_layer} layers, bias={config.bias}) has no parameter for: "
            f"{_list(unexpected)}{hint}",
            unexpected,
        )

    bad = [k for k in shapes if shapes[k] != expected[k]]
    if bad:
        lines = [
            f"{k}: expected shape {_fmt_shape(expected[k])}, found {_fmt_shape(shapes[k])}"
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


def _describe_expected(config: ModelConfig) -> str:
    """The expected key set, compactly: the per-block suffixes once, with the layer range."""
    block = [suffix for suffix, _, kind in _BLOCK_ROWS if _has(config, kind)]
    layers = "0" if config.n_layer == 1 else f"0..{config.n_layer - 1}"
    ln_f = "transformer.ln_f.weight" + (", transformer.ln_f.bias" if config.bias else "")
    return (
        f"{_WTE}, {_WPE}, transformer.h.{{{layers}}}.{{{', '.join(block)}}}, {ln_f}, "
        f"{_LM_HEAD} (optional: tied to {_WTE})"
    )


# --------------------------------------------------------------------------------------------
# State dict -> params


def _from_state_dict(state_dict: Mapping[str, Any], config: ModelConfig, format: Format) -> Params:
    _check_representable(config, "import")
    sd = _normalize(state_dict)
    if format == "hf":
        sd = _add_transformer_prefix(sd)
    _validate(sd, config, format)
    arr = {k: np.asarray(to_numpy(v), dtype=np.float32) for k, v in sd.items()}
    if _LM_HEAD in arr and not np.array_equal(arr[_LM_HEAD], arr[_WTE]):
        diff = float(np.max(np.abs(arr[_LM_HEAD] - arr[_WTE])))
        raise TiedWeightsError(
            f"{_LM_HEAD} differs from {_WTE} (max abs difference {diff:.3g}); this model ties the "
            f"output head to the token embedding, so an untied checkpoint cannot be loaded exactly"
        )

    params: Params = {
        "wte": {"embedding": jnp.array(arr[_WTE])},
        "wpe": {"embedding": jnp.array(arr[_WPE])},
        "h": {},
    }
    for suffix, path, kind in _BLOCK_ROWS:
        if not _has(config, kind):
            continue
        layers = [arr[f"transformer.h.{i}.{suffix}"] for i in range(config.n_layer)]
        if _transposed(kind, format):
            layers = [w.T for w in layers]  # [out, in] -> [in, out]
        node = params["h"]
        for p in path[:-1]:
            node = node.setdefault(p, {})
        node[path[-1]] = jnp.asarray(np.stack(layers))  # [n_layer, ...], a fresh copy
    params["ln_f"] = {"scale": jnp.array(arr["transformer.ln_f.weight"])}
    if config.bias:
        params["ln_f"]["bias"] = jnp.array(arr["transformer.ln_f.bias"])
    return params


def from_nanogpt(state_dict: Mapping[str, Any], config: ModelConfig) -> Params:
    """Our params from a nanoGPT ``GPT.state_dict()`` (Linear weights ``[out, in]``).

    Values may be numpy arrays or torch tensors. ``_orig_mod.`` prefixes and ``attn.bias`` mask
    buffers are accepted and ignored; ``lm_head.weight`` is optional and must equal
    ``transformer.wte.weight``. Raises a :class:`CheckpointError` naming the key on a missing,
    unexpected or misshapen key or a vocabulary that differs from ``config.vocab_size``.
    """
    return _from_state_dict(state_dict, config, "nanogpt")


def from_hf(state_dict: Mapping[str, Any], config: ModelConfig) -> Params:
    """Our params from a Hugging Face ``GPT2LMHeadModel`` (or ``GPT2Model``) state dict.

    Conv1D weights are ``[in, out]``, as ours. ``attn.bias``/``attn.masked_bias`` buffers are
    ignored; ``lm_head.weight`` is optional and must equal ``transformer.wte.weight``. The model
    must use ``activation_function="gelu"`` (exact erf, as nanoGPT's ``nn.GELU()``) to compute
    exactly this model's function; OpenAI's GPT-2 checkpoints use ``gelu_new`` (the tanh
    approximation, at most ~4.7e-4 from the erf form per activation), which nanoGPT also ignores
    when it loads them. Errors as :func:`from_nanogpt`.
    """
    return _from_state_dict(state_dict, config, "hf")


# --------------------------------------------------------------------------------------------
# Params -> state dict


def _validate_params(params: Params, config: ModelConfig) -> dict[tuple[str, ...], np.ndarray]:
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
            f"params lack {_list(names)} for config (n_layer={config.n_layer}, "
            f"bias={config.bias}); expected {_list(['.'.join(p) for p in expected])}",
            names,
        )
    if extra:
        names = [".".join(p) for p in extra]
        raise UnexpectedKeysError(
            f"params have {_list(names)}, which config (bias={config.bias}) has no place for",
            names,
        )
    bad = [p for p in expected if tuple(np.shape(flat[p])) != expected[p]]
    if bad:
        lines = [
            f"{'.'.join(p)}: expected shape {_fmt_shape(expected[p])}, found "
            f"{_fmt_shape(np.shape(flat[p]))}"
            for p in bad
        ]
        raise ShapeMismatchError(
            "params do not match the config: " + "; ".join(lines), [".".join(p) for p in bad]
        )
    return {p: np.asarray(to_numpy(flat[p])) for p in expected}


def _to_state_dict(params: Params, config: ModelConfig, format: Format) -> StateDict:
    _check_representable(config, "export")
    flat = _validate_params(params, config)

    def f32(a: np.ndarray) -> np.ndarray:
        # A fresh, writable, C-contiguous float32 copy (torch.from_numpy and safetensors need
        # contiguous, writable arrays; JAX's host views are read-only).
        return np.array(a, dtype=np.float32, order="C", copy=True)

    wte = f32(flat[("wte", "embedding")])
    out: StateDict = {_WTE: wte, _WPE: f32(flat[("wpe", "embedding")])}
    for i in range(config.n_layer):
        for suffix, path, kind in _BLOCK_ROWS:
            if not _has(config, kind):
                continue
            a = flat[("h", *path)][i]
            out[f"transformer.h.{i}.{suffix}"] = f32(a.T if _transposed(kind, format) else a)
    out["transformer.ln_f.weight"] = f32(flat[("ln_f", "scale")])
    if config.bias:
        out["transformer.ln_f.bias"] = f32(flat[("ln_f", "bias")])
    # The tied head: the same array object as wte (torch's state_dict also holds one tensor twice).
    out[_LM_HEAD] = wte
    return out


def to_nanogpt(params: Params, config: ModelConfig) -> StateDict:
    """nanoGPT ``GPT.state_dict()`` from our params: float32 numpy, Linear weights ``[out, in]``.

    Includes ``lm_head.weight`` (the same array as ``transformer.wte.weight``), as nanoGPT's
    state dict does, so ``GPT.load_state_dict(..., strict=True)`` accepts it (after
    ``torch.from_numpy`` of each value).
    """
    return _to_state_dict(params, config, "nanogpt")


def to_hf(params: Params, config: ModelConfig) -> StateDict:
    """Hugging Face ``GPT2LMHeadModel`` state dict from our params: float32 numpy, Conv1D
    weights ``[in, out]``, ``lm_head.weight`` included (tied to ``transformer.wte.weight``).

    With ``config.bias=False`` there are no bias keys; GPT-2 in ``transformers`` always has
    biases, so load it with zeros for them (the function it computes is then the same).
    """
    return _to_state_dict(params, config, "hf")


# --------------------------------------------------------------------------------------------
# Files


_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray) or type(value).__module__.startswith("torch")


def _torch_to_numpy(value: Any) -> np.ndarray:
    t = value.detach().cpu()
    # numpy has no bfloat16: widen it; other dtypes keep theirs.
    if str(t.dtype) == "torch.bfloat16":
        t = t.float()
    return t.numpy()


def load_state_dict(path: str | Path) -> StateDict:
    """``{key: numpy array}`` from a ``.pt``/``.pth``/``.bin``/``.ckpt`` (``torch.load`` with
    ``weights_only=True``), ``.safetensors`` or ``.npz`` file.

    A nanoGPT training checkpoint (``ckpt.pt``: ``{"model": state_dict, "optimizer": ...,
    "model_args": ...}``) yields its ``"model"`` entry. Keys are returned as stored (the
    ``_orig_mod.`` prefix is stripped by :func:`from_nanogpt`/:func:`from_hf`). Dtypes are kept
    except bfloat16, which becomes float32.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint file at {str(path)!r}")
    suffix = path.suffix.lower()
    if suffix in _TORCH_SUFFIXES:
        import torch  # optional dependency, only for torch files

        obj = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(obj, Mapping) and isinstance(obj.get("model"), Mapping):
            obj = obj["model"]  # nanoGPT's ckpt.pt
        if not isinstance(obj, Mapping) or not all(_is_tensor(v) for v in obj.values()):
            what = list(obj)[:10] if isinstance(obj, Mapping) else type(obj).__name__
            raise CheckpointError(
                f"{str(path)!r} does not hold a state dict (a mapping of names to tensors) nor "
                f"nanoGPT's checkpoint layout with one under 'model'; found {what}"
            )
        return {
            str(k): _torch_to_numpy(v) if not isinstance(v, np.ndarray) else v
            for k, v in obj.items()
        }
    if suffix == ".safetensors":
        try:
            # Optional formats: imported for the file type that needs them.
            from safetensors.numpy import load_file

            return dict(load_file(str(path)))
        except (TypeError, ValueError):  # bfloat16 has no numpy dtype: read through torch
            from safetensors.torch import load_file as load_torch

            return {k: _torch_to_numpy(v) for k, v in load_torch(str(path)).items()}
    if suffix == ".npz":
        with np.load(path, allow_pickle=False) as f:
            return {k: f[k] for k in f.files}
    raise ValueError(
        f"unknown checkpoint suffix {suffix!r} for {str(path)!r}; use one of "
        f"{', '.join(_TORCH_SUFFIXES)}, .safetensors, .npz"
    )


def save_state_dict(state_dict: Mapping[str, Any], path: str | Path) -> None:
    """Write ``{key: array}`` (numpy or torch values) as ``.pt``/``.pth``/``.bin``/``.ckpt``
    (``torch.save`` of a dict of tensors), ``.safetensors`` or ``.npz``, chosen by suffix."""
    path = Path(path)
    suffix = path.suffix.lower()
    arrays = {str(k): np.ascontiguousarray(to_numpy(v)) for k, v in state_dict.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in _TORCH_SUFFIXES:
        # torch (the parity extra) is needed only to write .pt files.
        import torch

        # Copies, not from_numpy views: tied keys (one array twice) stay separate tensors in the
        # file, which every loader reads.
        torch.save({k: torch.tensor(v) for k, v in arrays.items()}, path)
    elif suffix == ".safetensors":
        # Optional formats: imported for the file type that needs them.
        from safetensors.numpy import save_file

        save_file(arrays, str(path))
    elif suffix == ".npz":
        np.savez(path, **arrays)
    else:
        raise ValueError(
            f"unknown checkpoint suffix {suffix!r} for {str(path)!r}; use one of "
            f"{', '.join(_TORCH_SUFFIXES)}, .safetensors, .npz"
        )


def detect_format(state_dict: Mapping[str, Any], config: ModelConfig) -> Format:
    """``"nanogpt"`` or ``"hf"``, from the orientation of the first ``c_attn.weight``.

    nanoGPT's is ``[3C, C]`` (``[out, in]``), Hugging Face's ``[C, 3C]``; a bare ``GPT2Model``
    layout (no ``transformer.`` prefix) is Hugging Face's.
    """
    sd = _normalize(state_dict)
    if _add_transformer_prefix(sd) is not sd:
        return "hf"
    C = config.n_embd
    key = "transformer.h.0.attn.c_attn.weight"
    if key not in sd:
        raise MissingKeysError(
            f"cannot tell nanoGPT from Hugging Face: {key} is missing; keys found: "
            f"{_list(list(sd), 10)}",
            [key],
        )
    shape = tuple(np.shape(sd[key]))
    if shape == (3 * C, C):
        return "nanogpt"
    if shape == (C, 3 * C):
        return "hf"
    raise ShapeMismatchError(
        f"{key}: found shape {_fmt_shape(shape)}, expected [{3 * C}, {C}] (nanoGPT) or "
        f"[{C}, {3 * C}] (Hugging Face) for n_embd={C}; check model.n_embd",
        [key],
    )


def load_params(
    path: str | Path, config: ModelConfig, format: Literal["nanogpt", "hf", "auto"] = "auto"
) -> Params:
    """Our params from a checkpoint file (see :func:`load_state_dict`) in nanoGPT's or Hugging
    Face's layout; ``"auto"`` tells them apart by the orientation of ``c_attn.weight``."""
    sd = load_state_dict(path)
    fmt = detect_format(sd, config) if format == "auto" else format
    _check_format(fmt)
    return _from_state_dict(sd, config, fmt)
