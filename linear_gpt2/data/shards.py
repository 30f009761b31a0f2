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
"""

from __future__ import annotations

import json
import multiprocessing
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from linear_gpt2.data.packing import doc_tokens
from linear_gpt2.data.sources import DataError, iter_file, new_stats

INDEX = "index.json"
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
    n_tokens = 0
    with open(tmp, "wb") as f:
        pending: list[np.ndarray] = []
        for _, text in iter_file(src, stats=stats):
            pending.append(doc_tokens(text))
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
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise DataError(f"{path} is not valid JSON ({e}); delete it and re-run prepare_data") from e


def _write_index(split_dir: Path, index: dict[str, Any]) -> None:
    tmp = split_dir / (INDEX + ".tmp")
    tmp.write_text(json.dumps(index, indent=1) + "\n")
    os.replace(tmp, split_dir / INDEX)


def _shard_ok(split_dir: Path, entry: dict[str, Any]) -> bool:
    path = split_dir / entry["file"]
    return path.is_file() and path.stat().st_size == entry["n_tokens"] * np.dtype(DTYPE).itemsize


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


def _tokenize_star(args: tuple[str, str]) -> dict[str, Any]:
    return tokenize_file(*args)


class TokenShards:
    """A split's shards as one memory-mapped token stream, read by global token offset.

    ``n_tokens`` is the total; :meth:`read` ``(start, n)`` returns uint16 [n] across shard
    boundaries. Shards are ordered as the source files (the index's ``sources``).
    """

    def __init__(self, split_dir: str | os.PathLike):
        self.dir = Path(split_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(
                f"no pre-tokenized data at {self.dir}; create it with scripts/prepare_data.py "
                "(or unset data.tokenized_dir to stream)"
            )
        index = read_index(self.dir)
        if index is None:
            raise DataError(f"{self.dir} has no {INDEX}; run scripts/prepare_data.py for it")
        if not index.get("complete"):
            raise DataError(
                f"{self.dir} is incompletely tokenized ({len(index['shards'])} of "
                f"{len(index['sources'])} shards); re-run scripts/prepare_data.py to finish it"
            )
        self.index = index
        self._maps: list[np.ndarray] = []
        sizes = []
        for name in index["sources"]:
            entry = index["shards"][name]
            path = self.dir / entry["file"]
            if not _shard_ok(self.dir, entry):
                have = path.stat().st_size if path.is_file() else "missing"
                raise DataError(
                    f"{path}: size {have} bytes does not match the index's {entry['n_tokens']} "
                    "tokens; the shard is corrupt, delete it and re-run scripts/prepare_data.py"
                )
            if entry["n_tokens"] == 0:
                continue  # an empty source file: nothing to map (np.memmap rejects empty files)
            self._maps.append(np.memmap(path, dtype=DTYPE, mode="r"))
            sizes.append(entry["n_tokens"])
        self.starts = np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)])
        self.n_tokens = int(self.starts[-1])
        if self.n_tokens == 0:
            raise DataError(f"{self.dir}: all shards are empty (0 tokens)")

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
