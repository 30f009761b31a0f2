"""The training loader: batches from tokens, per-host parts, background prefetch, resumable state.

Three producers yield ``(batch, state)`` pairs, ``state`` being where the stream continues after
that batch; the :class:`Loader` runs one in a background thread (``prefetch.py``) and remembers
the state of the last batch it handed out, so ``state_dict()`` is exact however far the thread
has read ahead.

- :class:`TokenizedSource`: pre-tokenized shards. Window ``i`` is tokens ``[i*W, (i+1)*W)``,
  ``W = context + 1``. Each epoch visits the windows in a seeded pseudo-random order (a Feistel
  permutation: O(1) memory for any number of windows); batch ``k`` of host ``h`` takes positions
  ``[(k*P + h)*B, (k*P + h + 1)*B)`` of that order, so hosts are disjoint and together cover
  the epoch (the last ``< P*B`` windows of an epoch are dropped, different ones each epoch).
- :class:`StreamSource`: documents from local C4 files or the hub, tokenized on the fly and packed.
  Hosts read disjoint files (when their number divides evenly, else disjoint rows of each file).
- :class:`SyntheticSource`: uniform random tokens, a pure function of (seed, host, step).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from linear_gpt2.model.tokenizer import VOCAB_SIZE
from linear_gpt2.training.data.packing import Packer, doc_tokens, split_window
from linear_gpt2.training.data.prefetch import Prefetcher
from linear_gpt2.training.data.shards import TokenShards
from linear_gpt2.training.data.sources import DataError, iter_file, iter_hub, new_stats

log = logging.getLogger(__name__)

STATE_VERSION = 1
Batch = dict[str, np.ndarray]


# --------------------------------------------------------------------------------------------
# A seeded permutation of [0, n) that needs no O(n) table


def _mix(x: np.ndarray, key: np.uint64) -> np.ndarray:
    # splitmix64-style finalizer: a cheap, well-mixing round function.
    x = (x ^ key) * np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(29))


def permute(idx: np.ndarray, n: int, seed: int, epoch: int, rounds: int = 4) -> np.ndarray:
    """A bijection of ``[0, n)`` chosen by ``(seed, epoch)``, applied to ``idx`` (int64 [k]).

    A balanced Feistel network permutes ``[0, 4^h)`` with ``4^h >= n``; cycle-walking (applying it
    again while the result is ``>= n``) restricts it to ``[0, n)`` and stays a bijection.
    """
    if n <= 1:
        return np.zeros_like(idx, dtype=np.int64)
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = np.random.SeedSequence([seed, epoch, 0x5EED]).generate_state(rounds, dtype=np.uint64)
    x = np.asarray(idx, dtype=np.uint64).copy()
    todo = np.ones(len(x), dtype=bool)
    with np.errstate(over="ignore"):
        while todo.any():
            v = x[todo]
            left, right = v >> np.uint64(half), v & mask
            for k in keys:
                left, right = right, left ^ (_mix(right, k) & mask)
            v = (left << np.uint64(half)) | right
            x[todo] = v
            todo[todo] = v >= np.uint64(n)
    return x.astype(np.int64)


# --------------------------------------------------------------------------------------------
# Producers


class _Source:
    """A producer of ``(windows uint16 [B, T+1], state)``, or of ``({"inputs", "targets"}
    int32 [B, T], state)`` for tasks whose targets are not the next tokens (MQAR); ``state`` is a
    JSON-able dict."""

    kind = ""

    def initial_state(self) -> dict[str, Any]:
        raise NotImplementedError

    def batches(self, state: dict[str, Any]) -> Iterator[tuple[np.ndarray, dict[str, Any]]]:
        raise NotImplementedError

    def check_state(self, state: dict[str, Any]) -> None:
        """Raise if ``state`` was saved for other data (position fields are not compared)."""


class TokenizedSource(_Source):
    kind = "tokenized"

    def __init__(self, split_dir, *, batch_size, context, seed, shuffle, epochs, rank, world):
        self.shards = TokenShards(split_dir)
        self.B, self.W = batch_size, context + 1
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self.rank, self.world = rank, world
        self.n_windows = self.shards.n_tokens // self.W
        self.batches_per_epoch = self.n_windows // (self.B * self.world)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"{split_dir} holds {self.shards.n_tokens} tokens = {self.n_windows} windows of "
                f"{self.W}, fewer than one batch of {self.B} windows for each of {self.world} "
                "hosts; use more data, a shorter data.context or fewer tokens per update"
            )

    def initial_state(self) -> dict[str, Any]:
        return {"epoch": 0, "batch": 0, **self.shards.fingerprint()}

    def check_state(self, state: dict[str, Any]) -> None:
        for k, v in self.shards.fingerprint().items():
            if state.get(k) != v:
                raise ValueError(
                    f"loader state was saved for other data: {k}={state.get(k)}, now {v}"
                )

    def window_ids(self, epoch: int, batch: int) -> np.ndarray:
        """Global window indices of this host's batch ``batch`` of ``epoch``, int64 [B]."""
        start = (batch * self.world + self.rank) * self.B
        pos = np.arange(start, start + self.B, dtype=np.int64)
        return permute(pos, self.n_windows, self.seed, epoch) if self.shuffle else pos

    def batches(self, state):
        epoch, batch = state["epoch"], state["batch"]
        fp = self.shards.fingerprint()
        while self.epochs is None or epoch < self.epochs:
            ids = self.window_ids(epoch, batch)
            windows = np.stack([self.shards.read(int(i) * self.W, self.W) for i in ids])
            batch += 1
            if batch == self.batches_per_epoch:
                epoch, batch = epoch + 1, 0
            yield windows, {"epoch": epoch, "batch": batch, **fp}


class StreamSource(_Source):
    """Documents read and tokenized on the fly: local C4 files (``files``) or the hub."""

    kind = "stream"

    def __init__(
        self,
        *,
        files: list[Path] | None,
        hub: tuple[str, str, str] | None,
        batch_size,
        context,
        seed,
        shuffle,
        epochs,
        rank,
        world,
        shuffle_buffer=10_000,
    ):
        self.files, self.hub = files, hub
        self.B, self.W = batch_size, context + 1
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self.rank, self.world = rank, world
        self.shuffle_buffer = shuffle_buffer
        self.stats = new_stats()
        # Whole files per host when they divide evenly (no wasted reads), else rows of each file.
        self.by_files = files is not None and len(files) % world == 0

    def initial_state(self) -> dict[str, Any]:
        return {"epoch": 0, "file": 0, "row": 0, "offset": 0, "process_index": self.rank}

    def check_state(self, state: dict[str, Any]) -> None:
        if state.get("process_index") != self.rank:
            raise ValueError(
                f"stream loader state belongs to host {state.get('process_index')}, this is host "
                f"{self.rank}: each host must restore its own state"
            )

    def _epoch_files(self, epoch: int) -> list[Path]:
        assert self.files is not None
        order = list(range(len(self.files)))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch]).permutation(len(order)).tolist()
        files = [self.files[i] for i in order]
        return files[self.rank :: self.world] if self.by_files else files

    def _docs(self, state) -> Iterator[tuple[tuple[int, int, int], np.ndarray, int]]:
        """``((epoch, file, row), tokens, offset)`` from ``state`` on; offset only on the first."""
        epoch, f0, r0, offset = state["epoch"], state["file"], state["row"], state["offset"]
        while self.epochs is None or epoch < self.epochs:
            if self.files is None:
                name, config, split = self.hub  # type: ignore[misc]
                seed = self.seed + epoch if self.shuffle else None
                it = iter_hub(
                    name, config, split, process_index=self.rank, process_count=self.world,
                    start_row=r0, shuffle_seed=seed, shuffle_buffer=self.shuffle_buffer,
                    stats=self.stats,
                )  # fmt: skip
                for row, text in it:
                    yield (epoch, 0, row), doc_tokens(text), offset
                    offset = 0
            else:
                files = self._epoch_files(epoch)
                for fi in range(f0, len(files)):
                    for row, text in iter_file(files[fi], r0 if fi == f0 else 0, self.stats):
                        if not self.by_files and row % self.world != self.rank:
                            continue
                        yield (epoch, fi, row), doc_tokens(text), offset
                        offset = 0
            epoch, f0, r0 = epoch + 1, 0, 0

    def batches(self, state):
        packer = Packer(self.W, self.B)
        last = (state["epoch"], state["file"], state["row"] - 1)
        for pos, tokens, offset in self._docs(state):
            packer.add(pos, tokens, offset)
            last = pos
            while packer.ready():
                windows = packer.take()
                point = packer.resume_point
                if point is None:  # continue after the last document read
                    (epoch, fi, row), off = (last[0], last[1], last[2] + 1), 0
                else:
                    (epoch, fi, row), off = point
                yield windows, {
                    "epoch": epoch, "file": fi, "row": row, "offset": off,
                    "process_index": self.rank,
                }  # fmt: skip


class SyntheticSource(_Source):
    kind = "synthetic"

    def __init__(self, *, batch_size, context, seed, rank, stream=0):
        # ``stream`` tells the train (0) and validation (1) streams apart; both are endless.
        self.B, self.W, self.seed, self.rank, self.stream = (
            batch_size,
            context + 1,
            seed,
            rank,
            stream,
        )

    def initial_state(self):
        return {"step": 0}

    def batches(self, state):
        step = state["step"]
        while True:
            rng = np.random.default_rng([self.seed, self.stream, self.rank, step])
            windows = rng.integers(0, VOCAB_SIZE, size=(self.B, self.W), dtype=np.uint16)
            step += 1
            yield windows, {"step": step}


# --------------------------------------------------------------------------------------------
# The loader


class Loader:
    """Iterator of batches ``{"inputs": int32 [B, T], "targets": int32 [B, T]}`` (numpy), and
    ``"segments"`` (int32 [B, T], document ids) when made with ``segments=True``.

    ``B`` is this host's batch size, ``T`` the context. ``state_dict()`` is a JSON-able dict; a new
    loader given it by ``load_state_dict`` continues with exactly the next batch, provided the
    number of hosts (``process_count``), batch size, context, seed and data are the same.
    """

    def __init__(
        self, source: _Source, meta: dict[str, Any], prefetch: int = 2, segments: bool = False
    ):
        self.source, self.meta, self.prefetch = source, meta, prefetch
        # Also yield "segments" (int32 [B, T] document ids, packing.document_ids): derived from
        # the same windows, so accumulation, sharding and resume carry them like the tokens.
        self.segments = segments
        self._state = source.initial_state()
        self._it: Prefetcher | Iterator[Any] | None = None

    @property
    def stats(self) -> dict[str, int]:
        """Skip counters of a streaming source (see ``sources``); empty for other sources."""
        return dict(getattr(self.source, "stats", {}))

    def __iter__(self) -> Loader:
        return self

    def __next__(self) -> Batch:
        if self._it is None:
            start = dict(self._state)
            make = lambda: self.source.batches(start)
            self._it = Prefetcher(make, self.prefetch) if self.prefetch > 0 else make()
        windows, state = next(self._it)
        self._state = state
        if isinstance(windows, dict):  # a task source (MQAR): inputs and targets as they are
            batch = dict(windows)
            if self.segments:  # one example per row: one document
                batch["segments"] = np.zeros_like(batch["inputs"])
            return batch
        return split_window(windows, self.segments)

    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "kind": self.source.kind, **self.meta, **self._state}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved_p, now_p = state.get("process_count"), self.meta["process_count"]
        if saved_p != now_p:
            raise ValueError(
                f"loader state was saved with process_count={saved_p} hosts but this run has "
                f"process_count={now_p}; resuming the data order needs the same number of hosts"
            )
        if state.get("kind") != self.source.kind:
            raise ValueError(
                f"loader state is for a {state.get('kind')!r} source, not {self.source.kind!r}"
            )
        for key in ("split", "batch_size", "context", "seed", "shuffle"):
            if state.get(key) != self.meta[key]:
                raise ValueError(
                    f"loader state was saved with {key}={state.get(key)!r}, this loader has "
                    f"{key}={self.meta[key]!r}; the data order would differ"
                )
        self.source.check_state(state)
        self.close()
        position = set(self.source.initial_state())
        self._state = {k: v for k, v in state.items() if k in position}

    def close(self) -> None:
        """Stop the prefetch thread (if any); the loader may be iterated again afterwards."""
        if isinstance(self._it, Prefetcher):
            self._it.close()
        elif self._it is not None:
            getattr(self._it, "close", lambda: None)()
        self._it = None

    def __enter__(self) -> Loader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def to_global(batch: Batch, mesh: jax.sharding.Mesh, axis: str = "data") -> dict[str, jax.Array]:
    """Assemble each host's local batch into global arrays sharded along ``axis`` of ``mesh``.

    Host ``h`` passes its ``[B, T]`` arrays; the result is ``[B * process_count, T]``, row-sharded
    over the mesh's ``axis`` devices (each host's rows on its own devices).
    """
    sharding = NamedSharding(mesh, PartitionSpec(axis))
    return {k: jax.make_array_from_process_local_data(sharding, v) for k, v in batch.items()}
