"""Weights on disk: state dicts read from and written to ``.pt``/``.pth``/``.bin``/``.ckpt``
(torch), ``.safetensors`` and ``.npz`` files, and values taken from numpy, JAX or torch.

torch and safetensors are optional: each is imported only for the file type that needs it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from linear_gpt2.model.interop_layout import CheckpointError, StateDict, WeightsFileError
from linear_gpt2.platform.errors import LinearGPT2Error, PathNotFoundError, UsageError, require


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


_TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")


def _is_tensor(value: Any) -> bool:
    return isinstance(value, np.ndarray) or type(value).__module__.startswith("torch")


def _torch_to_numpy(value: Any) -> np.ndarray:
    t = value.detach().cpu()
    # numpy has no bfloat16: widen it; other dtypes keep theirs.
    if str(t.dtype) == "torch.bfloat16":
        t = t.float()
    return t.numpy()


_PARITY = "pip install -e '.[parity]'"


def _check_suffix(path: Path) -> str:
    suffix = path.suffix.lower()
    if suffix not in (*_TORCH_SUFFIXES, ".safetensors", ".npz"):
        raise UsageError(
            f"unknown checkpoint suffix {suffix!r} for {str(path)!r}; use one of "
            f"{', '.join(_TORCH_SUFFIXES)}, .safetensors, .npz"
        )
    return suffix


def _read(path: Path, what: str, reader: Callable[[], Any]) -> Any:
    """``reader()``, with a file it cannot read reported as :class:`WeightsFileError`."""
    try:
        return reader()
    except LinearGPT2Error:
        raise
    except Exception as e:  # noqa: BLE001 - torch, safetensors and numpy each raise their own
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        detail = f"{type(e).__name__}: {first[:200]}" if first else type(e).__name__
        raise WeightsFileError(
            f"{path} cannot be read as {what} ({detail}); the file is damaged, cut short or not "
            f"{what}: download or export it again"
        ) from e


def load_state_dict(path: str | Path) -> StateDict:
    """``{key: numpy array}`` from a ``.pt``/``.pth``/``.bin``/``.ckpt`` (``torch.load`` with
    ``weights_only=True``), ``.safetensors`` or ``.npz`` file.

    A nanoGPT training checkpoint (``ckpt.pt``: ``{"model": state_dict, "optimizer": ...,
    "model_args": ...}``) yields its ``"model"`` entry. Keys are returned as stored (the
    ``_orig_mod.`` prefix is stripped by :func:`from_nanogpt`/:func:`from_hf`). Dtypes are kept
    except bfloat16, which becomes float32. A missing file is a
    :class:`~linear_gpt2.platform.errors.PathNotFoundError` (a ``FileNotFoundError``), an unknown
    suffix a ``UsageError`` (a ``ValueError``), both raised before reading; a file that cannot be
    read is a :class:`WeightsFileError` naming it.
    """
    path = Path(path)
    if not path.is_file():
        raise PathNotFoundError(f"no checkpoint file at {str(path)!r}")
    suffix = _check_suffix(path)
    if suffix in _TORCH_SUFFIXES:
        torch = require("torch", _PARITY, f"reading {path.name}")
        obj = _read(
            path,
            "a torch file",
            lambda: torch.load(path, map_location="cpu", weights_only=True),
        )
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
        return _read(path, "a safetensors file", lambda: _load_safetensors(path))
    return _read(path, "an .npz file", lambda: _load_npz(path))


def _load_safetensors(path: Path) -> StateDict:
    # Optional formats: imported for the file type that needs them.
    from safetensors.numpy import load_file

    try:
        return dict(load_file(str(path)))
    except TypeError:  # bfloat16 has no numpy dtype: read through torch
        require("torch", _PARITY, f"reading the bfloat16 tensors of {path.name}")
        from safetensors.torch import load_file as load_torch

        return {k: _torch_to_numpy(v) for k, v in load_torch(str(path)).items()}


def _load_npz(path: Path) -> StateDict:
    with np.load(path, allow_pickle=False) as f:
        return {k: f[k] for k in f.files}


def save_state_dict(state_dict: Mapping[str, Any], path: str | Path) -> None:
    """Write ``{key: array}`` (numpy or torch values) as ``.pt``/``.pth``/``.bin``/``.ckpt``
    (``torch.save`` of a dict of tensors), ``.safetensors`` or ``.npz``, chosen by suffix."""
    path = Path(path)
    suffix = _check_suffix(path)
    arrays = {str(k): np.ascontiguousarray(to_numpy(v)) for k, v in state_dict.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    if suffix in _TORCH_SUFFIXES:
        # torch (the parity extra) is needed only to write .pt files.
        torch = require("torch", _PARITY, f"writing {path.name}")
        # Copies, not from_numpy views: tied keys (one array twice) stay separate tensors in the
        # file, which every loader reads.
        torch.save({k: torch.tensor(v) for k, v in arrays.items()}, path)
    elif suffix == ".safetensors":
        # Optional formats: imported for the file type that needs them.
        from safetensors.numpy import save_file

        save_file(arrays, str(path))
    else:
        np.savez(path, **arrays)
