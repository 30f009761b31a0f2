"""A checkpoint's files on disk: which step directories are final, the file list recorded for
each, and the checks that tell a damaged step from an intact one.

Orbax writes a step into ``<step>.orbax-checkpoint-tmp`` and renames it to ``<step>`` only when
every file is written, so a process killed while saving leaves a temporary directory that is
never a candidate for resuming (only directories named by a bare number are, :func:`step_dirs`).
Once a step is final, the checkpointer records the size of every file of it in
``linear_gpt2_files.json`` inside the step (:func:`write_manifest`). :func:`check_files` checks a
step against that list (a truncated or removed file, or a removed or truncated list, is damage;
a step from before the list, or whose list was never written, gets orbax's own markers checked
and is then restored under watch, :func:`is_unreadable`), plus its JSON metadata. What is done
with a damaged step (moved to ``checkpoints/damaged/<step>-<reason>``) is ``checkpoint.py``'s.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

MANIFEST = "linear_gpt2_files.json"  # {"step": N, "files": {relative path: size in bytes}}
DAMAGED = "damaged"
# orbax's markers of a finalized step (besides the rename from <step>.orbax-checkpoint-tmp).
_REQUIRED = ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA", "state/manifest.ocdbt")
# What an unreadable (rather than incompatible) checkpoint raises while orbax restores it.
_DAMAGE_WORDS = (
    "NOT_FOUND",
    "DATA_LOSS",
    "OUT_OF_RANGE",
    "Error reading",
    "Error opening",
    "error while reading",
    "Unexpected end",
    "checksum",
    "not found",
    "Expecting",
)


def step_dirs(directory: str | Path) -> list[int]:
    """The finalized step numbers in ``directory`` (subdirectories named by a bare number),
    ascending. Orbax's temporary directories (``<step>.orbax-checkpoint-tmp...``) are not steps."""
    d = Path(directory)
    if not d.is_dir():
        return []
    return sorted(int(p.name) for p in d.iterdir() if p.name.isdigit() and p.is_dir())


def _file_sizes(root: Path) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST:
                out[rel] = path.stat().st_size
    return out


def write_manifest(step_dir: Path) -> None:
    """Record the size of every file of a finalized step (atomically)."""
    record = {"step": int(step_dir.name), "files": _file_sizes(step_dir)}
    tmp = step_dir / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(record, indent=0, sort_keys=True) + "\n")
    os.replace(tmp, step_dir / MANIFEST)


def read_json(path: Path) -> Any:
    return json.loads(path.read_text())


def check_files(step_dir: Path) -> tuple[str | None, bool]:
    """``(reason it is damaged or None, verified)`` for one step directory. ``verified`` is true
    when the step's file list exists and every file has its recorded size."""
    manifest = step_dir / MANIFEST
    if manifest.exists():
        try:
            files = read_json(manifest)["files"]
            assert isinstance(files, dict)
        except (OSError, ValueError, KeyError, TypeError, AssertionError):
            return f"unreadable {MANIFEST}", False
        for rel, size in sorted(files.items()):
            path = step_dir / rel
            if not path.is_file():
                return f"missing {rel}", False
            have = path.stat().st_size
            if have != size:
                return f"truncated {rel} ({have} of {size} bytes)", False
        verified = True
    else:
        verified = False
        for rel in _REQUIRED:
            path = step_dir / rel
            if not path.is_file():
                return f"missing {rel}", False
            if path.stat().st_size == 0:
                return f"truncated {rel} (0 bytes)", False
    for rel in ("_CHECKPOINT_METADATA", "meta/metadata", "state/_METADATA"):
        try:
            read_json(step_dir / rel)
        except (OSError, ValueError):
            return f"unreadable {rel}", False
    return None, verified


def short_error(e: BaseException, limit: int = 240) -> str:
    """``Type: first line`` of an exception, without TensorStore's multi-kilobyte spec dumps."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    text = text.split(" See full TensorStore details")[0].split(" [tensorstore_spec=")[0]
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def slug(reason: str) -> str:
    """A damage reason as part of a directory name (``truncated state/x (3 of 9 bytes)`` ->
    ``truncated-state-x``)."""
    words = re.sub(r"\(.*?\)", "", reason).strip()
    return re.sub(r"[^A-Za-z0-9._-]+", "-", words).strip("-")[:80] or "damaged"


def is_unreadable(e: BaseException) -> bool:
    """Whether an error raised while orbax restores a step says that its files cannot be read
    (damage), rather than that they hold something else (another program's state)."""
    return isinstance(e, (OSError, EOFError, json.JSONDecodeError)) or any(
        w in str(e) for w in _DAMAGE_WORDS
    )
