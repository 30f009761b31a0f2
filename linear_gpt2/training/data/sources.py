"""Where documents come from: local C4 files or allenai/c4 on the hub, both through ``datasets``.

Both paths read with ``datasets.load_dataset(..., streaming=True)``: local files with the
``json`` builder, one file at a time (so every error names its file and a position within a file
is a resumable ``(file, row)``), the hub with ``load_dataset("allenai/c4", "en")`` split across
hosts by :func:`datasets.distributed.split_dataset_by_node`.

Bad input, decided per case (never silently wrong data):

======================================  =======================================================
missing ``data.path`` / no split files  error (:class:`DataNotFoundError`, says what to set)
empty source file (no documents)        skip, counted in ``stats["empty_files"]``, warning
truncated / corrupt gzip                error (:class:`DataError`, names the file and the last
                                        good line)
a line that is not JSON                 error (:class:`DataError`, names the file and line)
non-UTF-8 bytes                         error (:class:`DataError`, names the file and line)
record without ``text`` (or empty)      skip, counted in ``stats["no_text"]``, warning
``text`` that is not a string           error (:class:`DataError`, file and row)
hub unreachable / offline               error at once (no retries), says how to set data.path
======================================  =======================================================

Truncation, bad JSON and bad bytes are errors rather than skips because the JSON reader fails
on a whole block, so the documents around the bad line would be lost too, and a file damaged
that way should be re-downloaded rather than trained on. A record without text carries no data,
so skipping it loses nothing. Every error is one line (the command-line tools print it as
``error: ...`` and exit 1); the line number comes from re-reading the file up to the fault with
Python's own gzip and JSON readers, which happens only once a read has failed.
"""

from __future__ import annotations

import glob
import gzip
import json
import logging
import os
import socket
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from linear_gpt2.platform.errors import DataError, DataNotFoundError

log = logging.getLogger(__name__)

SPLITS = ("train", "validation")
__all__ = ["DataError", "DataNotFoundError", "c4_files", "check_hub", "iter_file", "iter_hub"]


def new_stats() -> dict[str, int]:
    """Counters of documents read and of skips (see the module docstring)."""
    return {"docs": 0, "no_text": 0, "empty_files": 0}


# --------------------------------------------------------------------------------------------
# Local C4 files


def c4_files(path: str | os.PathLike, split: str) -> list[Path]:
    """The local C4 files of ``split`` under ``path``, sorted by name.

    ``path`` is a directory holding ``c4-<split>.NNNNN-of-MMMMM.json.gz`` files (``.json`` works
    too), a glob (``/dir/c4-train.0000*.json.gz``: its matches for this split; for the other split
    the standard names in the glob's directory), or one file.
    """
    text = os.path.expanduser(str(path))
    pattern = f"c4-{split}.*.json*"
    if os.path.isdir(text):
        folder, files = Path(text), sorted(Path(text).glob(pattern))
    elif os.path.isfile(text):
        folder, files = Path(text).parent, [Path(text)]
    elif glob.has_magic(text):
        folder = Path(text).parent
        if not folder.is_dir():
            raise DataNotFoundError(_missing(text))
        matches = [Path(m) for m in sorted(glob.glob(text))]
        files = [m for m in matches if m.name.startswith(f"c4-{split}.")]
        if not files:
            # A glob written for the train files also finds the validation files beside them.
            files = sorted(folder.glob(pattern))
    else:
        raise DataNotFoundError(_missing(text))
    files = [f for f in files if not f.name.endswith(".tmp")]
    if not files:
        raise DataNotFoundError(
            f"no C4 {split!r} files ({pattern}) found for data.path={text!r} (looked in {folder}); "
            f"download them from allenai/c4 (en/c4-{split}.*.json.gz) into that directory"
        )
    return files


def _missing(path: str) -> str:
    return (
        f"data.path={path!r} does not exist; point it at a directory of C4 files, e.g. "
        f"data.path=/dir/with/c4-train.*.json.gz (files named c4-train.00000-of-01024.json.gz)"
    )


def _open_bytes(path: Path):
    return gzip.open(path, "rb") if path.suffix == ".gz" else open(path, "rb")


# What a damaged file raises while it is read: gzip (EOFError, BadGzipFile, zlib.error),
# bytes (UnicodeDecodeError), pyarrow's JSON reader (ArrowInvalid, a ValueError), I/O (OSError).
_READ_ERRORS = (EOFError, zlib.error, OSError, UnicodeDecodeError, ValueError, TypeError)


def diagnose(path: Path, error: BaseException | None = None) -> DataError:
    """A one-line :class:`DataError` saying what is wrong with ``path`` and where: re-reads the
    file with Python's gzip and json modules up to the first bad line (only called after a read
    failed, so the cost is paid once)."""
    line_no = 0
    try:
        with _open_bytes(path) as f:
            for line_no, raw in enumerate(f, start=1):  # noqa: B007 - line_no is used after
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    return DataError(
                        f"{path} line {line_no}: bytes that are not UTF-8 (byte {e.start} of the "
                        f"line, {raw[e.start : e.start + 4]!r}); the file is corrupt, re-download "
                        "it or remove that line"
                    )
                if not text.strip():
                    continue
                try:
                    json.loads(text)
                except json.JSONDecodeError as e:
                    return DataError(
                        f"{path} line {line_no}: not valid JSON ({e.msg} at column {e.colno}); "
                        "each line of a C4 file is one JSON record: re-download the file or fix "
                        "that line"
                    )
    except (EOFError, zlib.error, gzip.BadGzipFile) as e:
        return DataError(
            f"{path}: truncated or corrupt gzip file after line {line_no} "
            f"({str(e).splitlines()[0]}); re-download it"
        )
    except OSError as e:
        return DataError(f"{path}: cannot be read ({e.strerror or e}); check the file")
    detail = f" ({type(error).__name__}: {str(error).splitlines()[0]})" if error else ""
    return DataError(
        f"{path}: not readable as C4 JSON lines{detail}; re-download it or check its format"
    )


def _is_empty(path: Path) -> bool:
    """True when the file holds no bytes but whitespace (after decompression)."""
    try:
        with _open_bytes(path) as f:
            while chunk := f.read(1 << 16):
                if chunk.strip():
                    return False
        return True
    except (EOFError, zlib.error, OSError) as e:
        raise diagnose(path, e) from e


def _is_empty_fast(path: Path) -> bool:
    # Reading a whole file twice would double the I/O; a file is "empty" only if it is tiny.
    if path.stat().st_size > 4096:
        return False
    return _is_empty(path)


def iter_file(
    path: Path, start_row: int = 0, stats: dict[str, int] | None = None
) -> Iterator[tuple[int, str]]:
    """``(row, text)`` for each document of one local C4 file, from ``start_row`` on.

    ``row`` counts every record of the file (skipped ones too), so ``(file, row)`` is a stable
    position to resume from.
    """
    # Hugging Face datasets is heavy: imported only to read C4 files or the hub.
    from datasets import load_dataset

    stats = new_stats() if stats is None else stats
    if not path.is_file():
        raise DataNotFoundError(f"{path} does not exist (was it moved or deleted during the run?)")
    if _is_empty_fast(path):
        log.warning("%s holds no documents; skipping it", path)
        stats["empty_files"] += 1
        return
    row = start_row
    try:
        ds = load_dataset("json", data_files=[str(path)], split="train", streaming=True)
        if start_row:
            ds = ds.skip(start_row)
        for record in ds:
            text = record.get("text")
            if text is None or text == "":
                log.warning("%s row %d has no 'text'; skipping it", path, row)
                stats["no_text"] += 1
            elif not isinstance(text, str):
                raise DataError(
                    f"{path} row {row}: 'text' is {type(text).__name__}, expected a string "
                    "(is this a C4 file?)"
                )
            else:
                stats["docs"] += 1
                yield row, text
            row += 1
    except DataError:
        raise
    except StopIteration as e:  # the json builder's schema inference on a file with no records
        log.warning("%s holds no documents; skipping it", path)
        stats["empty_files"] += 1
        del e
    except _READ_ERRORS as e:
        # Truncated gzip, bad bytes, a line that is not JSON (pyarrow's ArrowInvalid is a
        # ValueError "JSON parse error ... in row N" of a block): find the line and say it.
        raise diagnose(path, e) from e


# --------------------------------------------------------------------------------------------
# The hub


def _truthy(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _hub_error(why: str, hf_dataset: str) -> DataError:
    return DataError(
        f"cannot stream {hf_dataset} from the Hugging Face hub: {why}. Download the C4 files and "
        f"point the config at them: data.path=/dir/with/c4-train.*.json.gz (or pre-tokenize them "
        f"with scripts/prepare_data.py and set data.tokenized_dir), or use data.source=sample"
    )


def check_hub(hf_dataset: str, timeout: float = 3.0) -> None:
    """Fail at once when the hub cannot be reached, instead of hanging in ``datasets``' retries."""
    for var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        if _truthy(var):
            raise _hub_error(f"{var} is set (offline mode)", hf_dataset)
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlparse(endpoint)
    port = url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((url.hostname or "huggingface.co", port), timeout=timeout).close()
    except OSError as e:
        raise _hub_error(f"{endpoint} is unreachable ({e})", hf_dataset) from e


def iter_hub(
    hf_dataset: str,
    hf_config: str,
    split: str,
    *,
    process_index: int,
    process_count: int,
    start_row: int = 0,
    shuffle_seed: int | None = None,
    shuffle_buffer: int = 10_000,
    stats: dict[str, int] | None = None,
) -> Iterator[tuple[int, str]]:
    """``(row, text)`` from the hub, this host's part only; ``row`` counts this host's records.

    The stream is shuffled (shard order and a buffer of ``shuffle_buffer`` documents) when
    ``shuffle_seed`` is given; the same seed gives the same order, so skipping ``start_row``
    records resumes exactly.
    """
    # Hugging Face datasets is heavy: imported only to read C4 files or the hub.
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node

    stats = new_stats() if stats is None else stats
    check_hub(hf_dataset)
    try:
        ds: Any = load_dataset(hf_dataset, hf_config, split=split, streaming=True)
    except Exception as e:  # connection errors surface as many types; all mean the same here
        raise _hub_error(f"{type(e).__name__}: {e}", hf_dataset) from e
    if shuffle_seed is not None:
        ds = ds.shuffle(seed=shuffle_seed, buffer_size=shuffle_buffer)
    # Shards are split between hosts when their number divides evenly, else every host reads
    # all and keeps every process_count-th record; both give disjoint parts that cover the data.
    ds = split_dataset_by_node(ds, rank=process_index, world_size=process_count)
    if start_row:
        ds = ds.skip(start_row)
    for row, record in enumerate(ds, start=start_row):
        text = record.get("text")
        if not isinstance(text, str) or not text:
            log.warning("%s %s row %d has no 'text'; skipping it", hf_dataset, split, row)
            stats["no_text"] += 1
            continue
        stats["docs"] += 1
        yield row, text
