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

This module converts; the layout table and the errors are in ``interop_layout.py``, the checks
that a state dict or a param tree fits a config in ``interop_checks.py``, and reading and
writing weight files in ``interop_files.py``. Their public names are importable from here.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import jax.numpy as jnp
import numpy as np

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.interop_checks import validate_params, validate_state_dict
from linear_gpt2.model.interop_files import load_state_dict, save_state_dict, to_numpy
from linear_gpt2.model.interop_layout import (
    BLOCK_ROWS,
    GPT2_VOCAB_SIZE,
    LM_HEAD,
    WPE,
    WTE,
    CheckpointError,
    Format,
    MissingKeysError,
    Params,
    ShapeMismatchError,
    StateDict,
    TiedWeightsError,
    UnexpectedKeysError,
    UnrepresentableError,
    VocabSizeMismatchError,
    WeightsFileError,
    add_transformer_prefix,
    check_format,
    detect_format,
    expected_params_shapes,
    expected_state_dict_shapes,
    has_tensor,
    normalize,
    transposed,
)

__all__ = [
    "GPT2_VOCAB_SIZE",
    "CheckpointError",
    "Format",
    "MissingKeysError",
    "Params",
    "ShapeMismatchError",
    "StateDict",
    "TiedWeightsError",
    "UnexpectedKeysError",
    "UnrepresentableError",
    "VocabSizeMismatchError",
    "WeightsFileError",
    "detect_format",
    "expected_params_shapes",
    "expected_state_dict_shapes",
    "from_hf",
    "from_nanogpt",
    "load_params",
    "load_state_dict",
    "save_state_dict",
    "to_hf",
    "to_nanogpt",
    "to_numpy",
]


def _check_representable(config: ModelConfig, direction: str) -> None:
    """Raise :class:`UnrepresentableError` unless a GPT-2 checkpoint can hold ``config``'s model
    (``direction``: ``"import"`` or ``"export"``)."""
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


def _from_state_dict(state_dict: Mapping[str, Any], config: ModelConfig, format: Format) -> Params:
    _check_representable(config, "import")
    sd = normalize(state_dict)
    if format == "hf":
        sd = add_transformer_prefix(sd)
    validate_state_dict(sd, config, format)
    arr = {k: np.asarray(to_numpy(v), dtype=np.float32) for k, v in sd.items()}
    if LM_HEAD in arr and not np.array_equal(arr[LM_HEAD], arr[WTE]):
        diff = float(np.max(np.abs(arr[LM_HEAD] - arr[WTE])))
        raise TiedWeightsError(
            f"{LM_HEAD} differs from {WTE} (max abs difference {diff:.3g}); this model ties the "
            f"output head to the token embedding, so an untied checkpoint cannot be loaded exactly"
        )

    params: Params = {
        "wte": {"embedding": jnp.array(arr[WTE])},
        "wpe": {"embedding": jnp.array(arr[WPE])},
        "h": {},
    }
    for suffix, path, kind in BLOCK_ROWS:
        if not has_tensor(config, kind):
            continue
        layers = [arr[f"transformer.h.{i}.{suffix}"] for i in range(config.n_layer)]
        if transposed(kind, format):
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


def _to_state_dict(params: Params, config: ModelConfig, format: Format) -> StateDict:
    _check_representable(config, "export")
    flat = validate_params(params, config)

    def f32(a: np.ndarray) -> np.ndarray:
        # A fresh, writable, C-contiguous float32 copy (torch.from_numpy and safetensors need
        # contiguous, writable arrays; JAX's host views are read-only).
        return np.array(a, dtype=np.float32, order="C", copy=True)

    wte = f32(flat[("wte", "embedding")])
    out: StateDict = {WTE: wte, WPE: f32(flat[("wpe", "embedding")])}
    for i in range(config.n_layer):
        for suffix, path, kind in BLOCK_ROWS:
            if not has_tensor(config, kind):
                continue
            a = flat[("h", *path)][i]
            out[f"transformer.h.{i}.{suffix}"] = f32(a.T if transposed(kind, format) else a)
    out["transformer.ln_f.weight"] = f32(flat[("ln_f", "scale")])
    if config.bias:
        out["transformer.ln_f.bias"] = f32(flat[("ln_f", "bias")])
    # The tied head: the same array object as wte (torch's state_dict also holds one tensor twice).
    out[LM_HEAD] = wte
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


def load_params(
    path: str | Path, config: ModelConfig, format: Literal["nanogpt", "hf", "auto"] = "auto"
) -> Params:
    """Our params from a checkpoint file (see :func:`load_state_dict`) in nanoGPT's or Hugging
    Face's layout; ``"auto"`` tells them apart by the orientation of ``c_attn.weight``. A
    ``format`` that is none of these is refused before the file is read."""
    check_format(format, ("nanogpt", "hf", "auto"))
    sd = load_state_dict(path)
    fmt = detect_format(sd, config) if format == "auto" else format
    return _from_state_dict(sd, config, fmt)
