"""Multi-query associative recall (MQAR), the synthetic task of Zoology (Arora et al. 2023,
"Zoology: Measuring and Improving Recall in Efficient Language Models"; HazyResearch/zoology,
``zoology/data/multiquery_ar.py``), generated here with the same distribution:

- vocabulary V (8192): keys are drawn from ``[1, V/2)`` and values from ``[V/2, V)``, N distinct
  of each per example (``data.mqar.num_kv_pairs``);
- the N pairs come first, ``k_1 v_1 k_2 v_2 ... k_N v_N`` (2N tokens);
- each key is queried once in the remaining ``L - 2N`` positions: the query region has
  ``(L - 2N) / 2`` even slots, and the N slots used are drawn without replacement with
  probability proportional to ``a g^(a - 1)`` for slot g = 1, 2, ... (``power_a`` = a = 0.01, a
  power law: mostly early slots, with a long tail);
- the label (the value) sits on the query token (the model predicts the value as the next
  token); every other target is -1 (ignored);
- the other positions hold 0, or, with ``random_non_queries`` (Zoology's default; its paper
  figures and ReBased use false), uniform random tokens of the whole vocabulary.

Example (V = 12, N = 2, L = 16, no random fill)::

    inputs:   2  8  4  7  0  0  4  0  0  0  0  0  2  0  0  0
    targets: -1 -1 -1 -1 -1 -1  7 -1 -1 -1 -1 -1  8 -1 -1 -1

Zoology draws its fixed training set (100,000 examples) and test set (3,000) with numpy's
global generator; here each example is a pure function of ``(seed, split, index)`` (its own
``numpy.random.Generator``), so a batch needs no stored data, any example can be regenerated, and
resuming is a position ``(epoch, batch)``. The slots are drawn by Gumbel top-N (the N largest of
``log p_g + Gumbel noise``, in decreasing order), which is exactly successive sampling without
replacement proportionally to p, order included, as ``numpy.random.choice(..., replace=False,
p=p)`` does: key i is queried in the i-th slot drawn. The training set is shuffled every
epoch (a permutation of the indices, as Zoology's data loader shuffles); the test set (the
``validation`` split) is read once, in order.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from linear_gpt2.platform.errors import DataError
from linear_gpt2.training.data.loader import _Source, permute

IGNORE = -1
_SPLIT_CODE = {"train": 0, "validation": 1}


def slot_probabilities(space: int, power_a: float) -> np.ndarray:
    """p_g proportional to ``a g^(a - 1)`` for the query slots g = 1 .. ``space`` (float64)."""
    g = np.arange(1, space + 1, dtype=np.float64)
    p = power_a * g ** (power_a - 1)
    return p / p.sum()


def example(
    index: int,
    *,
    length: int,
    num_kv_pairs: int,
    vocab_size: int = 8192,
    power_a: float = 0.01,
    random_non_queries: bool = False,
    seed: int = 0,
    split: str = "train",
) -> tuple[np.ndarray, np.ndarray]:
    """``(inputs, targets)``, int32 ``[length]`` each: example ``index`` of ``split``."""
    L, N, V = length, num_kv_pairs, vocab_size
    if L % 2 or 4 * N > L:
        raise ValueError(f"MQAR needs an even length L >= 4 N; got L={L}, N={N}")
    rng = np.random.default_rng([seed, _SPLIT_CODE[split], index])
    half = V // 2
    keys = rng.choice(half - 1, size=N, replace=False) + 1
    values = rng.choice(V - half, size=N, replace=False) + half
    space = (L - 2 * N) // 2
    scores = np.log(slot_probabilities(space, power_a)) + rng.gumbel(size=space)
    slots = np.argsort(-scores, kind="stable")[:N]  # in the order successive draws pick them
    stream = np.zeros(L + 1, np.int64)  # Zoology's example: L + 1 tokens, inputs are [:-1]
    stream[0 : 2 * N : 2], stream[1 : 2 * N : 2] = keys, values
    stream[2 * N + 2 * slots] = keys
    labels = np.full(L + 1, IGNORE, np.int64)
    labels[2 * N + 2 * slots + 1] = values
    inputs, targets = stream[:-1], labels[1:]
    if random_non_queries:
        fill = rng.integers(0, V, size=L)
        inputs = np.where(inputs == 0, fill, inputs)
    return inputs.astype(np.int32), targets.astype(np.int32)


class MQARSource(_Source):
    """Batches ``{"inputs", "targets"}`` int32 ``[B, L]`` of one split, for the loader."""

    kind = "mqar"

    def __init__(
        self, mqar, *, split: str, batch_size, context, seed, shuffle, epochs, rank, world
    ):
        self.cfg, self.split = mqar, split
        self.B, self.L = batch_size, context
        self.seed, self.shuffle, self.epochs = seed, shuffle, epochs
        self.rank, self.world = rank, world
        self.n = mqar.train_examples if split == "train" else mqar.test_examples
        self.batches_per_epoch = self.n // (self.B * self.world)
        if self.batches_per_epoch == 0:
            raise DataError(
                f"MQAR {split}: {self.n} examples are fewer than one batch of {self.B} for each "
                f"of {self.world} hosts; raise data.mqar.{'train' if split == 'train' else 'test'}"
                "_examples or lower the batch"
            )
        # the split is checked against vocabulary and length once, here, not in the thread
        example(0, **self._kwargs())

    def _kwargs(self) -> dict[str, Any]:
        c = self.cfg
        return dict(
            length=self.L,
            num_kv_pairs=c.num_kv_pairs,
            vocab_size=c.vocab_size,
            power_a=c.power_a,
            random_non_queries=c.random_non_queries,
            seed=self.seed,
            split=self.split,
        )

    def fingerprint(self) -> dict[str, Any]:
        c = self.cfg
        return {
            "mqar": [c.vocab_size, c.num_kv_pairs, self.n, c.power_a, c.random_non_queries],
        }

    def initial_state(self) -> dict[str, Any]:
        return {"epoch": 0, "batch": 0, **self.fingerprint()}

    def check_state(self, state: dict[str, Any]) -> None:
        for k, v in self.fingerprint().items():
            if state.get(k) != v:
                raise ValueError(
                    f"loader state was saved for another MQAR task: {k}={state.get(k)}, now {v} "
                    "(vocab_size, num_kv_pairs, examples, power_a, random_non_queries)"
                )

    def example_ids(self, epoch: int, batch: int) -> np.ndarray:
        """Indices of this host's batch ``batch`` of ``epoch``, int64 [B]."""
        start = (batch * self.world + self.rank) * self.B
        pos = np.arange(start, start + self.B, dtype=np.int64)
        return permute(pos, self.n, self.seed, epoch) if self.shuffle else pos

    def batches(self, state):
        epoch, batch = state["epoch"], state["batch"]
        fp, kwargs = self.fingerprint(), self._kwargs()
        while self.epochs is None or epoch < self.epochs:
            pairs = [example(int(i), **kwargs) for i in self.example_ids(epoch, batch)]
            out = {
                "inputs": np.stack([p[0] for p in pairs]),
                "targets": np.stack([p[1] for p in pairs]),
            }
            batch += 1
            if batch == self.batches_per_epoch:
                epoch, batch = epoch + 1, 0
            yield out, {"epoch": epoch, "batch": batch, **fp}
