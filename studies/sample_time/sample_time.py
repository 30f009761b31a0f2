"""Time to sample the next token: KV cache (softmax) against recurrent state (linear), per context
(``scripts/bench_sample.py``; the post's section 4)."""

from __future__ import annotations

import csv
import json
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

from linear_gpt2.experiments.axes import loglog_slope
from linear_gpt2.model.api import Params, decode, decode_init, init_params
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.sampling import next_token
from linear_gpt2.platform.memory import is_oom
from studies import common as reports


def decoder_label(config: ModelConfig) -> str:
    """``KV cache (softmax)`` or ``recurrent state (LT_chunked)``: what the decoder keeps (the
    decoder's ``kind``)."""
    kind = config.spec.decoder(config.attention_options).kind
    return f"{kind} ({config.attention})"


def _prepared_step(params, config: ModelConfig, context: int, prefill: bool, block: int):
    """A cache sized for ``context`` tokens holding ``context - reserve`` of them (when
    ``prefill``), and the jitted greedy step, compiled. Returns ``(step, cache, token)``."""
    cache = decode_init(config, 1, context)
    token = jnp.zeros((1,), jnp.int32)
    if prefill:
        fill = context // 2  # half full: room remains for the timed steps
        tokens = jax.random.randint(jax.random.key(1), (1, fill), 0, config.vocab_size)
        run = jax.jit(lambda p, x, c: decode(p, x, c, config))
        for start in range(0, fill, block):
            logits, cache = run(params, tokens[:, start : start + block], cache)
        token = jnp.argmax(logits[:, -1], -1).astype(jnp.int32)
    static = dict(config=config, temperature=jnp.float32(0.0), top_k=None, vocab_limit=None)
    key = jax.random.key(0)
    token, cache = next_token(params, token, cache, key, **static)  # compile
    jax.block_until_ready(cache)
    return (lambda t, c: next_token(params, t, c, key, **static)), cache, token


def bench_next_token(
    params_by_attention: dict[str, Params] | None,
    configs: Sequence[ModelConfig],
    contexts: Sequence[int],
    *,
    steps: int = 5,
    rounds: int = 3,
    prefill: bool = False,
    prefill_block: int = 512,
) -> list[dict[str, Any]]:
    """Seconds to decode one token (batch 1, greedy) with a cache sized for each context.

    For every config (one per attention) and context the cache is built for ``context`` tokens
    (``block_size`` must be >= the largest context). With ``prefill`` it first holds
    ``context / 2`` real tokens; without, it starts empty, which times the same work here:
    the KV cache decoder attends over its whole ``max_len`` buffer (masked) at every step, so its
    cost depends on the context it is sized for, not on how full it is, and the recurrent state
    has constant size. Timing is interleaved: ``rounds`` passes over every (config, context),
    ``steps`` tokens each, so a machine's load drifts over all settings alike; the row's
    ``median_ms`` is over all ``rounds * steps`` tokens.

    Rows: ``decoder``, ``attention``, ``context``, ``median_ms``, ``times_ms``.
    """
    prepared, failed = {}, []
    for cfg in configs:
        params = (params_by_attention or {}).get(cfg.attention) or init_params(cfg, 0)
        for ctx in sorted(contexts):
            # A KV cache written past max_len yields NaN inside jit rather than an error.
            if (ctx // 2 if prefill else 0) + 1 + rounds * steps > ctx:
                raise ValueError(f"context {ctx} too short for {rounds * steps} timed steps")
            try:
                prepared[(cfg, ctx)] = list(
                    _prepared_step(params, cfg, ctx, prefill, prefill_block)
                )
            except Exception as e:
                if not is_oom(e):
                    raise
                # Out of memory (a large KV cache): the limit; longer contexts need more.
                failed.append(
                    dict(
                        decoder=decoder_label(cfg),
                        attention=cfg.attention,
                        context=ctx,
                        status="oom",
                        median_ms=None,
                        times_ms=[],
                    )
                )
                break
    times: dict[tuple[ModelConfig, int], list[float]] = {k: [] for k in prepared}
    for _ in range(rounds):
        for k, entry in prepared.items():
            step, cache, token = entry
            for _ in range(steps):
                t0 = time.perf_counter()
                token, cache = step(token, cache)
                jax.block_until_ready(token)
                times[k].append(time.perf_counter() - t0)
            entry[1], entry[2] = cache, token
    rows = []
    for (cfg, ctx), ts in times.items():
        rows.append(
            dict(
                decoder=decoder_label(cfg),
                attention=cfg.attention,
                context=ctx,
                status="ok",
                median_ms=statistics.median(ts) * 1e3,
                times_ms=[t * 1e3 for t in ts],
            )
        )
    return rows + failed


def write_sample_results(
    rows: Sequence[dict[str, Any]], out_dir: str | Path, stem: str, meta: dict[str, Any]
) -> list[Path]:
    """``stem.json`` (meta, rows with raw times, fitted slopes), ``stem.csv`` and ``stem.md``
    (a table: context x decoder, milliseconds per token; ``studies.sample_time.report``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    slopes = {}
    for d in decoders:
        pts = [(r["context"], r["median_ms"]) for r in rows if r["decoder"] == d and r["median_ms"]]
        slopes[d] = loglog_slope(*zip(*pts)) if len(pts) >= 2 else None
    paths = [out / f"{stem}.json", out / f"{stem}.csv", out / f"{stem}.md"]
    meta = {"how": "measured", **meta}
    paths[0].write_text(json.dumps({"meta": meta, "rows": list(rows), "slopes": slopes}, indent=1))
    with paths[1].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["decoder", "attention", "context", "status", "median_ms", "times_ms"])
        for r in rows:
            times = ";".join(f"{t:.4f}" for t in r["times_ms"])
            w.writerow(
                [r["decoder"], r["attention"], r["context"], r["status"], r["median_ms"], times]
            )
    reports.page(paths[2], reports.block("sample_time.page", paths[0].name))
    return paths
