"""Pre-tokenized token shards on disk: writing them (resumable, multiprocess) and reading them.

Layout of one split (``<tokenized_dir>/<split>/``)::

    c4-train.00000-of-01024.bin   uint16 tokens of one source file: doc EOT doc EOT ...
    ...
    index.json                    {"version", "tokenizer", "dtype", "split", "sources": [names],
                                   "shards": {source name: {"file", "n_tokens", "n_docs",
                                              "no_text", "empty_files"}}, "complete": bool}

One shard per source file makes resuming simple: a source whose shard is in the index (with a
``.bin`` of the recorded size) is done. Shards are written to ``<name>.bin.tmp`` and renamed, and
the index is rewritten atomically after each shard, so an interrupted run loses at most the
shards in progress.

Reading validates once, when :class:`TokenShards` opens a split: the index's dtype and tokenizer,
each shard's size (a whole number of tokens, the count the index records) and every token id
(below the tokenizer's vocabulary, one vectorised pass over the memory map). A shard that passed
is remembered in ``validated.json`` beside the index (size, mtime and largest id), so later opens
only ``stat`` the files; a shard rewritten since is scanned again. Where the split directory is
read-only, the record goes to the project cache (:func:`linear_gpt2.platform.env.cache_root`).
"""

from __future__ import annotations

import hashlib
import json
import logging
import multiprocessing
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from linear_gpt2.model.tokenizer import VOCAB_SIZE
from linear_gpt2.platform.env import cache_root
from linear_gpt2.training.data.packing import doc_tokens
from linear_gpt2.training.data.sources import DataError, DataNotFoundError, iter_file, new_stats

log = logging.getLogger(__name__)

INDEX = "index.json"
VALIDATED = "validated.json"
# Tokens per vectorised max() during validation: 32M uint16 = 64 MB at a time.
SCAN_CHUNK = 1 << 25
INDEX_VERSION = 1
DTYPE = np.uint16
# Documents tokenized before each write: bounds memory (a C4 file is ~150M tokens).
WRITE_EVERY_DOCS = 2048


def shard_name(source: Path) -> str:
    name = source.name
    for suffix in (".gz", ".json"):
        name = name.removesuffix(suffix)
    return name + ".bin"


def tokenize_file(source: str, out_dir: str) -> dict[str, Any]:
    """Tokenize one source file into ``out_dir/<name>.bin``; returns its index entry.

    Runs in worker processes, so it takes and returns plain values.
    """
    src, out = Path(source), Path(out_dir)
    final = out / shard_name(src)
    tmp = final.with_name(final.name + ".tmp")
    stats = new_stats()
    n_tokens, max_id = 0, -1
    with open(tmp, "wb") as f:
        pending: list[np.ndarray] = []
        for _, text in iter_file(src, stats=stats):
            pending.append(doc_tokens(text))
            max_id = max(max_id, int(pending[-1].max()))
            if len(pending) >= WRITE_EVERY_DOCS:
                n_tokens += _flush(pending, f)
        n_tokens += _flush(pending, f)
    os.replace(tmp, final)
    return {
        "source": src.name,
        "file": final.name,
        "n_tokens": n_tokens,
        "n_docs": stats["docs"],
        "no_text": stats["no_text"],
        "empty_files": stats["empty_files"],
        "max_id": max_id,
    }


def _flush(pending: list[np.ndarray], f) -> int:
    if not pending:
        return 0
    arr = np.concatenate(pending)
    arr.tofile(f)
    pending.clear()
    return len(arr)


def read_index(split_dir: str | os.PathLike) -> dict[str, Any] | None:
    path = Path(split_dir) / INDEX
    if not path.is_file():
        return None
    try:
        index = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(
            f"{path} is not valid JSON ({e}); delete it and re-run scripts/prepare_data.py"
        ) from e
    if not isinstance(index, dict) or not isinstance(index.get("shards", {}), dict):
        raise DataError(
            f"{path} is not a shard index (no 'shards' mapping); delete it and re-run "
            "scripts/prepare_data.py"
        )
    return index


def _write_index(split_dir: Path, index: dict[str, Any]) -> None:
    tmp = split_dir / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, split_dir / INDEX)


def _shard_ok(split_dir: Path, entry: dict[str, Any]) -> bool:
    try:
        path = split_dir / entry["file"]
        return (
            path.is_file() and path.stat().st_size == entry["n_tokens"] * np.dtype(DTYPE).itemsize
        )
    except (KeyError, TypeError):
        return False


def prepare_split(
    sources: Sequence[str | os.PathLike],
    split_dir: str | os.PathLike,
    split: str,
    num_proc: int = 1,
    on_shard: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Tokenize ``sources`` (local C4 files) into shards in ``split_dir``; returns the index.

    Finished shards (in the index, ``.bin`` of the right size) are skipped, so re-running after an
    interruption continues where it stopped. ``on_shard(entry)`` is called in this process as
    each shard finishes (skipped ones included, with ``entry["skipped"] = True``), for progress.
    """
    out = Path(split_dir)
    out.mkdir(parents=True, exist_ok=True)
    srcs = [Path(s) for s in sources]
    names = [s.name for s in srcs]
    if len(set(names)) != len(names):
        raise DataError(f"source file names must be unique, got duplicates in {names}")
    index = read_index(out) or {}
    if index and index.get("sources") != names:
        raise DataError(
            f"{out / INDEX} was written for other source files ({len(index.get('sources', []))} "
            f"files); use another tokenized_dir or delete {out}"
        )
    index = {
        "version": INDEX_VERSION,
        "tokenizer": "gpt2",
        "dtype": "uint16",
        "split": split,
        "sources": names,
        "shards": index.get("shards", {}),
        "complete": False,
    }
    done = {n for n, e in index["shards"].items() if _shard_ok(out, e)}
    index["shards"] = {n: e for n, e in index["shards"].items() if n in done}
    todo = [s for s in srcs if s.name not in done]
    for s in srcs:
        if s.name in done and on_shard is not None:
            on_shard({**index["shards"][s.name], "skipped": True})

    def record(entry: dict[str, Any]) -> None:
        index["shards"][entry["source"]] = entry
        _write_index(out, index)
        if on_shard is not None:
            on_shard(entry)

    if num_proc <= 1 or len(todo) <= 1:
        for s in todo:
            record(tokenize_file(str(s), str(out)))
    else:
        # spawn, not fork: forking a process that runs JAX's threads can deadlock.
        ctx = multiprocessing.get_context("spawn")
        with ctx.Pool(min(num_proc, len(todo))) as pool:
            jobs = [(str(s), str(out)) for s in todo]
            for entry in pool.imap_unordered(_tokenize_star, jobs):
                record(entry)
            pool.close()  # let workers exit on their own (terminate() leaks semaphores)
            pool.join()
    index["complete"] = True
    _write_index(out, index)
    return index


def _bad_id_message(path: Path, token: int, position: int | None, vocab_size: int) -> str:
    where = f" at token {position}" if position is not None else ""
    return (
        f"{path}: token id {token}{where} is outside the vocabulary (ids must be < {vocab_size}); "
        "the shard is corrupt or was written with another tokenizer: delete it and re-run "
        "scripts/prepare_data.py"
    )


def _validated_fallback(split_dir: Path) -> Path:
    digest = hashlib.sha1(str(split_dir.resolve()).encode()).hexdigest()[:16]
    return cache_root() / "linear_gpt2" / "shard_checks" / f"{digest}.json"


def _load_validated(split_dir: Path) -> tuple[Path, dict[str, Any]]:
    """Where this split's validation record lives (beside the index when writable, else in the
    project cache) and what it holds."""
    path = split_dir / VALIDATED
    if not os.access(split_dir, os.W_OK):
        path = _validated_fallback(split_dir)
    try:
        record = json.loads(path.read_text()) if path.is_file() else {}
    except (OSError, ValueError):
        record = {}  # unreadable: validate again and rewrite it
    return path, record if isinstance(record, dict) else {}


def _save_validated(path: Path, record: dict[str, Any]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1) + "\n")
        os.replace(tmp, path)
    except OSError as e:  # the check passed; only its record is lost, so the next open rescans
        log.warning("could not record the shard validation in %s (%s)", path, e)


def _tokenize_star(args: tuple[str, str]) -> dict[str, Any]:
    return tokenize_file(*args)


class TokenShards:
    """A split's shards as one memory-mapped token stream, read by global token offset.

    ``n_tokens`` is the total; :meth:`read` ``(start, n)`` returns uint16 [n] across shard
    boundaries. Shards are ordered as the source files (the index's ``sources``). Opening
    validates the split (module docstring) and raises :class:`DataError` naming the shard and the
    fix; ``vocab_size`` is the bound for token ids (GPT-2's 50257), ``validate=False`` skips the id
    scan (sizes are always checked).
    """

    def __init__(
        self, split_dir: str | os.PathLike, *, vocab_size: int = VOCAB_SIZE, validate: bool = True
    ):
        self.dir = Path(split_dir)
        if not self.dir.is_dir():
            raise DataNotFoundError(
                f"no pre-tokenized data at {self.dir}; create it with scripts/prepare_data.py "
                "(or unset data.tokenized_dir to stream)"
            )
        index = read_index(self.dir)
        if index is None:
            raise DataError(f"{self.dir} has no {INDEX}; run scripts/prepare_data.py for it")
        if not index.get("complete"):
            raise DataError(
                f"{self.dir} is incompletely tokenized ({len(index.get('shards', {}))} of "
                f"{len(index.get('sources', []))} shards); re-run scripts/prepare_data.py to finish it"
            )
        where = self.dir / INDEX
        if index.get("dtype", "uint16") != np.dtype(DTYPE).name:
            raise DataError(
                f"{where}: dtype {index.get('dtype')!r}, but shards are read as "
                f"{np.dtype(DTYPE).name}; re-run scripts/prepare_data.py with this version"
            )
        if index.get("tokenizer", "gpt2") != "gpt2":
            raise DataError(
                f"{where}: tokenizer {index.get('tokenizer')!r}, but training uses GPT-2's; "
                "re-tokenize with scripts/prepare_data.py"
            )
        missing = [n for n in index.get("sources", []) if n not in index["shards"]]
        if missing or not isinstance(index.get("sources"), list):
            raise DataError(
                f"{where} lists sources without shards ({missing[:3]}); delete {self.dir} and "
                "re-run scripts/prepare_data.py"
            )
        self.index = index
        self.vocab_size = vocab_size
        self._maps: list[np.ndarray] = []
        self.validation_s = 0.0  # time spent scanning token ids at this open (0 when cached)
        self.scanned_tokens = 0
        sizes = []
        entries = []
        for name in index["sources"]:
            entry = index["shards"][name]
            path = self.dir / str(entry.get("file"))
            if not _shard_ok(self.dir, entry):
                have = f"{path.stat().st_size} bytes" if path.is_file() else "missing"
                raise DataError(
                    f"{path}: {have}, but the index records {entry.get('n_tokens')} tokens of "
                    f"{np.dtype(DTYPE).itemsize} bytes; the shard is corrupt or truncated: delete "
                    "it and re-run scripts/prepare_data.py (finished shards are kept)"
                )
            recorded = entry.get("max_id")
            if isinstance(recorded, int) and recorded >= vocab_size:
                raise DataError(_bad_id_message(path, recorded, None, vocab_size))
            if entry["n_tokens"] == 0:
                continue  # an empty source file: nothing to map (np.memmap rejects empty files)
            self._maps.append(np.memmap(path, dtype=DTYPE, mode="r"))
            sizes.append(entry["n_tokens"])
            entries.append(path)
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.n_tokens = int(self.starts[-1])
        if self.n_tokens == 0:
            raise DataError(
                f"{self.dir}: all shards are empty (0 tokens); check the source files and re-run "
                "scripts/prepare_data.py"
            )
        if validate and vocab_size <= np.iinfo(DTYPE).max:
            self._validate_ids(entries)

    def _validate_ids(self, paths: list[Path]) -> None:
        """Every id < ``vocab_size``: a vectorised max per shard, skipped for shards recorded as
        checked with the same size and mtime."""
        record_path, record = _load_validated(self.dir)
        changed = False
        t0 = time.perf_counter()
        for path, m in zip(paths, self._maps):
            st = path.stat()
            stamp = {"size": st.st_size, "mtime_ns": st.st_mtime_ns}
            seen = record.get(path.name)
            if (
                isinstance(seen, dict)
                and all(seen.get(k) == v for k, v in stamp.items())
                and isinstance(seen.get("max_id"), int)
                and seen["max_id"] < self.vocab_size
            ):
                continue  # checked before, unchanged since
            max_id = -1
            for lo in range(0, len(m), SCAN_CHUNK):
                chunk = m[lo : lo + SCAN_CHUNK]
                top = int(chunk.max())
                if top >= self.vocab_size:
                    at = lo + int(np.argmax(chunk >= self.vocab_size))
                    raise DataError(_bad_id_message(path, int(chunk[at - lo]), at, self.vocab_size))
                max_id = max(max_id, top)
            self.scanned_tokens += len(m)
            record[path.name] = {**stamp, "max_id": max_id}
            changed = True
        self.validation_s = time.perf_counter() - t0
        if changed:
            _save_validated(record_path, record)

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens ``[start, start + n)`` of the concatenated stream, uint16 [n]."""
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        local = start - int(self.starts[i])
        m = self._maps[i]
        if local + n <= len(m):
            return m[local : local + n]
        parts, left = [], n
        while left > 0:
            take = min(left, len(self._maps[i]) - local)
            parts.append(self._maps[i][local : local + take])
            left -= take
            i, local = i + 1, 0
        return np.concatenate(parts)

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this data in a loader state: token count and shard names."""
        return {"n_tokens": self.n_tokens, "n_shards": len(self.index["sources"])}
