"""Weights on disk: state dicts read from and written to ``.pt``/``.pth``/``.bin``/``.ckpt``
(torch), ``.safetensors`` and ``.npz`` files, and values taken from numpy, JAX or torch.

torch and safetensors are optional: each is imported only for the file type that needs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from linear_gpt2.model.interop_layout import CheckpointError, StateDict


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
