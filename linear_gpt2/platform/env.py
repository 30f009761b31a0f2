"""Where the libraries we use write their caches, configs and logs: not under ``$HOME``.

wandb (debug logs, artifact cache, settings), Hugging Face ``datasets``/``huggingface_hub``
(lock files, dataset cache), matplotlib (font cache), Triton and the CUDA JIT all default to
``~/.cache``, ``~/.config`` or ``~/.triton``, and PyTorch's compiler (the interop checks'
``torch``) to ``$TMPDIR/torchinductor_<user>``. :func:`configure` points each of them at the project's
cache directory instead, once, before those libraries are imported; every entry point calls it
(through :func:`linear_gpt2.platform.cli.run`). A variable the user has set is never changed.

The cache directory is ``$LINEAR_GPT2_CACHE`` if set, else ``<repository>/.cache`` for a source
checkout (what ``make`` uses too), else ``./.cache``. Run-specific output (the wandb run, plots,
checkpoints) goes to the run directory as before (``wandb.init(dir=RUN_DIR)``).

Credentials stay where they are: wandb reads its API key from ``~/.netrc`` (read, never written),
an existing wandb settings directory (``~/.config/wandb``) is kept, and an existing Hugging Face
token file is passed on through ``HF_TOKEN_PATH``.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def cache_root() -> Path:
    """The directory that holds every tool cache (see the module docstring)."""
    explicit = os.environ.get("LINEAR_GPT2_CACHE")
    if explicit:
        return Path(explicit).expanduser().absolute()
    if (REPO / "pyproject.toml").is_file() and os.access(REPO, os.W_OK):
        return REPO / ".cache"
    return Path.cwd() / ".cache"


def defaults(root: Path | None = None) -> dict[str, str]:
    """The variables :func:`configure` sets when unset, with the values it would use."""
    root = cache_root() if root is None else root
    out = {
        "XDG_CACHE_HOME": root,
        "MPLCONFIGDIR": root / "matplotlib",
        "HF_HOME": root / "huggingface",
        "WANDB_DIR": root / "wandb",
        "WANDB_CACHE_DIR": root / "wandb" / "cache",
        "WANDB_DATA_DIR": root / "wandb" / "data",
        "WANDB_CONFIG_DIR": root / "wandb" / "config",
        "TRITON_CACHE_DIR": root / "triton",
        "TORCHINDUCTOR_CACHE_DIR": root / "torchinductor",
        "CUDA_CACHE_PATH": root / "nv",
    }
    home = Path(os.path.expanduser("~"))
    xdg_config = Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")
    if (xdg_config / "wandb" / "settings").is_file():
        del out["WANDB_CONFIG_DIR"]  # the user's own wandb settings (host, entity) stay in use
    return {k: str(v) for k, v in out.items()}


def configure(root: str | os.PathLike | None = None) -> dict[str, str]:
    """Set the cache variables that are not set yet; returns those it set.

    Call it before importing wandb, datasets or matplotlib (they read some of these at import).
    """
    home = Path(os.path.expanduser("~"))
    old_hf_token = Path(os.environ.get("XDG_CACHE_HOME") or home / ".cache") / "huggingface"
    changed = {}
    for var, value in defaults(None if root is None else Path(root)).items():
        if not os.environ.get(var):
            os.environ[var] = value
            changed[var] = value
    if "HF_HOME" in changed and not (os.environ.get("HF_TOKEN") or os.environ.get("HF_TOKEN_PATH")):
        token = old_hf_token / "token"
        if token.is_file():  # `huggingface-cli login` wrote it; keep using it (read only)
            os.environ["HF_TOKEN_PATH"] = changed["HF_TOKEN_PATH"] = str(token)
    return changed
