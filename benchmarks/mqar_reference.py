#!/usr/bin/env python
"""MQAR with a plain-JAX model written apart from the library: the check that found why our
softmax did not learn Zoology's cells (``benchmarks/results/mqar_cpu.md``, notes).

Two attention-only pre-LN layers, one head, learned positions, tied head, no biases, trained with
optax AdamW (clip 1.0, b2 0.95, weight decay 0.1 on everything, warmup 50 + cosine) on the
library's MQAR generator (``linear_gpt2.training.data.mqar.example``), batch 64. Prints the held-out
accuracy (first 512 test examples) every 250 updates and stops at 99%:

    python benchmarks/mqar_reference.py                    # (L, N) = (64, 4), vocab 8192, lr 3e-3
    python benchmarks/mqar_reference.py --L 256 --N 16 --steps 6000

Measured (2-core CPU), (64, 4): ``--steps 1500`` 0.775 at update 1000, 0.954 at 1500;
``scripts/train.py configs/mqar/base.yaml`` with ``model.bias: false`` 0.993 at 1750, with
GPT-2's biases 0.25 after 4000.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.training.data.mqar import example  # noqa: E402


def batch(start: int, n: int, split: str, L: int, N: int, V: int):
    pairs = [
        example(i, length=L, num_kv_pairs=N, vocab_size=V, split=split)
        for i in range(start, start + n)
    ]
    return np.stack([p[0] for p in pairs]), np.stack([p[1] for p in pairs])


def init(key, V: int, L: int, d: int, layers: int) -> dict:
    ks = iter(jax.random.split(key, 2 + 2 * layers))
    normal = lambda shape, std=0.02: std * jax.random.normal(next(ks), shape)  # noqa: E731
    p = {"wte": normal((V, d)), "wpe": normal((L, d)), "lnf": jnp.ones(d)}
    for i in range(layers):
        p[f"ln{i}"], p[f"qkv{i}"] = jnp.ones(d), normal((d, 3 * d))
        p[f"o{i}"] = normal((d, d), 0.02 / np.sqrt(2 * layers))
    return p


def layer_norm(x, g):
    x = x - x.mean(-1, keepdims=True)
    return g * x / jnp.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)


def loss_and_accuracy(p, x, y, layers: int, queries: int):
    """x, y int ``[B, L]`` (y -1 except at the ``queries`` query positions of each row) ->
    (mean loss, accuracy) over the queries."""
    B, L = x.shape
    h = p["wte"][x] + p["wpe"][None, :L]
    causal = jnp.tril(jnp.ones((L, L), bool))
    for i in range(layers):
        q, k, v = jnp.split(layer_norm(h, p[f"ln{i}"]) @ p[f"qkv{i}"], 3, -1)
        s = jnp.where(causal, q @ jnp.swapaxes(k, 1, 2) / np.sqrt(q.shape[-1]), -jnp.inf)
        h = h + jax.nn.softmax(s, -1) @ v @ p[f"o{i}"]
    # the 8192-way head only at the queries: at every position it would outweigh the model
    at = jnp.argsort(y < 0, axis=1, stable=True)[:, :queries]  # [B, queries]
    y = jnp.take_along_axis(y, at, 1)
    logits = layer_norm(jnp.take_along_axis(h, at[..., None], 1), p["lnf"]) @ p["wte"].T
    ll = jnp.take_along_axis(jax.nn.log_softmax(logits), y[..., None], -1)
    return -ll.mean(), (logits.argmax(-1) == y).mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--L", type=int, default=64)
    ap.add_argument("--N", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--steps", type=int, default=3000)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    B, layers = 64, 2
    p = init(jax.random.PRNGKey(a.seed), a.vocab, a.L, 64, layers)
    lr = optax.warmup_cosine_decay_schedule(0.0, a.lr, 50, a.steps, 1e-5)
    opt = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, b2=0.95, weight_decay=0.1))
    state = opt.init(p)
    grad = jax.value_and_grad(lambda p, x, y: loss_and_accuracy(p, x, y, layers, a.N), has_aux=True)

    @jax.jit
    def step(p, state, x, y):
        (loss, _), g = grad(p, x, y)
        updates, state = opt.update(g, state, p)
        return optax.apply_updates(p, updates), state, loss

    accuracy = jax.jit(lambda p, x, y: loss_and_accuracy(p, x, y, layers, a.N)[1])
    test = [batch(j * B, B, "validation", a.L, a.N, a.vocab) for j in range(8)]
    rng, t0 = np.random.default_rng(a.seed), time.time()
    for s in range(1, a.steps + 1):
        x, y = batch(int(rng.integers(0, 100_000 - B)), B, "train", a.L, a.N, a.vocab)
        p, state, loss = step(p, state, x, y)
        if s % 250 == 0:
            acc = float(np.mean([accuracy(p, *t) for t in test]))
            print(
                f"update {s}: loss {float(loss):.3f} held-out accuracy {acc:.3f} ({time.time() - t0:.0f} s)",
                flush=True,
            )
            if acc >= 0.99:
                break


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    main()
