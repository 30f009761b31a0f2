"""Sampling from a trained model, and timing it: KV cache (softmax) vs recurrent state (linear).

Generation is built on the model's decode path (:func:`linear_gpt2.model.decode_init`,
:func:`linear_gpt2.model.decode`), which runs each layer's
:func:`linear_gpt2.attention.decoder`: softmax and flash keep a KV cache ``[B, max_len, H, D]``
per layer, whose per-token cost grows with the cache; the linear family keeps the recurrent state
``(S [B, H, D, D], z [B, H, D])``, constant in the context (the post's section 4).

- :func:`generate`: prefill the prompt in one call, then one jitted step per new token
  (temperature, top-k, seed). Temperature 0 is greedy.
- :func:`greedy_by_recompute`: the reference, greedy decoding by running the full
  :func:`linear_gpt2.model.forward` again for every new token; the tests check :func:`generate`
  against it token for token.
- :func:`load`: parameters and config from a run directory or a checkpoint directory.
- :func:`bench_next_token`: milliseconds to sample the next token at each context length.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from linear_gpt2.attention import module as attention_module
from linear_gpt2.config import Config, ModelConfig, load_config_from_dict
from linear_gpt2.errors import UsageError
from linear_gpt2.model import Params, decode, decode_init, forward, init_params


class SamplingError(UsageError):
    """A sampling request that cannot be met (a ``ValueError``): numbers of tokens, prompt."""


def fit_prompt(ids: Sequence[int], new_tokens: int, block_size: int) -> tuple[list[int], int]:
    """``(ids the model sees, number of prompt tokens dropped)`` for a prompt continued by
    ``new_tokens`` within ``block_size`` positions: a prompt that does not fit loses its
    beginning (the model continues the end). Raises :class:`SamplingError` when ``new_tokens``
    is < 1 or leaves no room for one prompt token."""
    if new_tokens < 1:
        raise SamplingError(f"--tokens must be >= 1 (new tokens per sample), got {new_tokens}")
    room = block_size - new_tokens
    if room < 1:
        raise SamplingError(
            f"--tokens {new_tokens} leaves no room for the prompt: the model's block_size is "
            f"{block_size} positions (prompt + new tokens); use --tokens {block_size - 1} or fewer"
        )
    ids = list(ids)
    dropped = max(0, len(ids) - room)
    return ids[dropped:], dropped


def choose(
    logits: jax.Array,
    key: jax.Array,
    temperature: float | jax.Array = 1.0,
    top_k: int | None = None,
    vocab_limit: int | None = None,
) -> jax.Array:
    """Next tokens int32 ``[B]`` from float32 logits ``[B, V]``.

    ``temperature`` <= 0 takes the argmax (greedy); otherwise logits / temperature are sampled,
    restricted to the ``top_k`` largest when given. ``temperature`` may be traced (one compiled
    step serves every temperature); ``top_k`` and ``vocab_limit`` are static. ``vocab_limit``
    removes ids >= it (the vocabulary is padded to 50304 for speed; ids from 50257 have no text).
    """
    logits = logits.astype(jnp.float32)
    if vocab_limit is not None and vocab_limit < logits.shape[-1]:
        logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_limit, logits, -jnp.inf)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    t = jnp.asarray(temperature, jnp.float32)
    scaled = logits / jnp.where(t > 0, t, 1.0)
    if top_k is not None and top_k < logits.shape[-1]:
        kth = jax.lax.top_k(scaled, top_k)[0][..., -1:]
        scaled = jnp.where(scaled >= kth, scaled, -jnp.inf)
    sampled = jax.random.categorical(key, scaled, axis=-1).astype(jnp.int32)
    return jnp.where(t > 0, sampled, greedy)


@functools.partial(jax.jit, static_argnames=("config", "top_k", "vocab_limit"))
def _prefill(params, prompt, cache, key, *, config, temperature, top_k, vocab_limit):
    logits, cache = decode(params, prompt, cache, config)
    return choose(logits[:, -1], key, temperature, top_k, vocab_limit), cache


# The cache is donated: a KV cache is updated in place instead of copied at every token.
@functools.partial(
    jax.jit,
    static_argnames=("config", "top_k", "vocab_limit"),
    donate_argnames=("cache",),
)
def _step(params, token, cache, key, *, config, temperature, top_k, vocab_limit):
    logits, cache = decode(params, token[:, None], cache, config)
    return choose(logits[:, -1], key, temperature, top_k, vocab_limit), cache


def generate(
    params: Params,
    config: ModelConfig,
    prompt: jax.Array | np.ndarray | Sequence[Sequence[int]],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    top_k: int | None = None,
    seed: int = 0,
    max_len: int | None = None,
    vocab_limit: int | None = None,
) -> jax.Array:
    """``max_new_tokens`` tokens, int32 ``[B, max_new_tokens]``, continuing ``prompt`` int
    ``[B, T0]`` (T0 >= 1).

    The cache holds ``max_len`` tokens (default ``T0 + max_new_tokens``; a KV cache's per-token
    cost grows with it). Token i is drawn with ``fold_in(key(seed), i)``, so a seed reproduces
    a sample.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    if prompt.ndim != 2:
        raise SamplingError(f"prompt must be int [batch, tokens], got shape {prompt.shape}")
    B, T0 = prompt.shape
    if T0 < 1:
        raise SamplingError("the prompt needs at least one token")
    if max_new_tokens < 1:
        raise SamplingError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    need = T0 + max_new_tokens
    max_len = need if max_len is None else max_len
    if need > max_len or max_len > config.block_size:
        raise SamplingError(
            f"prompt of {T0} + {max_new_tokens} new tokens needs {need} positions; max_len="
            f"{max_len}, block_size={config.block_size}: shorten the prompt or the sample"
        )
    static = dict(config=config, top_k=top_k, vocab_limit=vocab_limit)
    static["temperature"] = jnp.float32(temperature)  # traced: no recompilation per value
    key = jax.random.key(seed)
    cache = decode_init(config, B, max_len)
    token, cache = _prefill(params, prompt, cache, jax.random.fold_in(key, 0), **static)
    out = [token]
    for i in range(1, max_new_tokens):
        token, cache = _step(params, token, cache, jax.random.fold_in(key, i), **static)
        out.append(token)
    return jnp.stack(out, axis=1)


def greedy_by_recompute(
    params: Params,
    config: ModelConfig,
    prompt: jax.Array | np.ndarray | Sequence[Sequence[int]],
    max_new_tokens: int,
    vocab_limit: int | None = None,
) -> jax.Array:
    """Greedy continuation by full recomputation, int32 ``[B, max_new_tokens]``: every new
    token is the argmax of :func:`~linear_gpt2.model.forward` over the whole sequence so far.

    The sequence lives in a fixed buffer (the padded tail is not yet generated) so ``forward``
    compiles once: attention is causal, so the logits at position t depend only on tokens
    0..t and the padding after t changes nothing. The buffer is rounded up to a multiple of
    ``chunk_size`` for LT_chunked, whose training form needs whole chunks.
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    B, T0 = prompt.shape
    n = T0 + max_new_tokens
    length = n
    if "chunk_size" in attention_module(config.attention).OPTIONS:
        length = -(-n // config.chunk_size) * config.chunk_size
    if length > config.block_size:
        raise ValueError(f"{length} positions do not fit block_size={config.block_size}")
    buf = jnp.zeros((B, length), jnp.int32).at[:, :T0].set(prompt)
    run = jax.jit(lambda p, x: forward(p, x, config))
    for t in range(T0, n):
        logits = run(params, buf)[:, t - 1]
        buf = buf.at[:, t].set(choose(logits, jax.random.key(0), 0.0, None, vocab_limit))
    return buf[:, T0:n]


# --------------------------------------------------------------------------------------------
# Loading a trained model


def resolve_checkpoint(path: str | Path) -> tuple[Path, int | None]:
    """``(checkpoints directory, step or None for the latest)`` from a run directory
    (``RUN/checkpoints/<step>``), a checkpoints directory, or one step's directory."""
    from linear_gpt2.checkpoint import resolve_checkpoint as resolve

    return resolve(path)


def load(path: str | Path) -> tuple[Params, ModelConfig, Config, int]:
    """``(params, model config, run config, step)`` from a run or checkpoint directory (the
    trainer's orbax layout). Parameters come back float32 on the default device.

    Without an explicit step the newest intact checkpoint is used: damaged ones are skipped with
    a warning (and left where they are; the trainer moves them aside when the run resumes)."""
    from linear_gpt2.checkpoint import Checkpointer, short_error
    from linear_gpt2.config import CheckpointConfig
    from linear_gpt2.errors import CheckpointError
    from linear_gpt2.optim import optimizer
    from linear_gpt2.train_step import init_state

    directory, step = resolve_checkpoint(path)
    ckpt = Checkpointer(directory, CheckpointConfig())
    if not ckpt.steps():
        raise CheckpointError(
            f"{directory} holds no checkpoint (no step directories); give a run directory "
            "whose training saved at least one (checkpoint.every, or at the end of the run)"
        )
    try:
        step = ckpt.select(None, move_damaged=False, step=step)
        if step is None:  # pragma: no cover - select raises when every step is damaged
            raise CheckpointError(f"{directory} holds no intact checkpoint")
        cfg = load_config_from_dict(ckpt.read_meta(step)["config"])
        model_cfg = cfg.model_config
        tx = optimizer(cfg.train)
        sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        abstract = {
            "train": jax.eval_shape(lambda: init_state(init_params(model_cfg, 0), tx)),
            "rng": jax.eval_shape(lambda: jax.random.key_data(jax.random.key(0))),
        }
        abstract = jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), abstract
        )
        try:
            restored = ckpt.restore_state(step, abstract)
        except Exception as e:
            raise CheckpointError(
                f"checkpoint {directory / str(step)} could not be read ({short_error(e)}); give "
                f"an older step directory ({directory}/<step>)"
            ) from e
    finally:
        ckpt.close()
    return restored["train"].params, model_cfg, cfg, int(step)


# --------------------------------------------------------------------------------------------
# Timing the next token


def decoder_label(attention: str) -> str:
    """``KV cache (softmax)`` or ``recurrent state (LT_chunked)``: what the decoder keeps."""
    kind = "KV cache" if attention in ("softmax", "flash") else "recurrent state"
    return f"{kind} ({attention})"


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
    token, cache = _step(params, token, cache, key, **static)  # compile
    jax.block_until_ready(cache)
    return (lambda t, c: _step(params, t, c, key, **static)), cache, token


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
    from linear_gpt2.memory import is_oom

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
                        decoder=decoder_label(cfg.attention),
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
                decoder=decoder_label(cfg.attention),
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
    (a table: context x decoder, milliseconds per token)."""
    import csv
    import json

    from linear_gpt2.plots import context_label, loglog_slope

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    slopes = {}
    for d in decoders:
        pts = [(r["context"], r["median_ms"]) for r in rows if r["decoder"] == d and r["median_ms"]]
        slopes[d] = loglog_slope(*zip(*pts)) if len(pts) >= 2 else None
    paths = [out / f"{stem}.json", out / f"{stem}.csv", out / f"{stem}.md"]
    paths[0].write_text(json.dumps({"meta": meta, "rows": list(rows), "slopes": slopes}, indent=1))
    with paths[1].open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["decoder", "attention", "context", "status", "median_ms", "times_ms"])
        for r in rows:
            times = ";".join(f"{t:.4f}" for t in r["times_ms"])
            w.writerow(
                [r["decoder"], r["attention"], r["context"], r["status"], r["median_ms"], times]
            )
    by = {(r["decoder"], r["context"]): r for r in rows}
    lines = [
        f"# Time to sample the next token (ms), {meta.get('title', '')}".rstrip(", "),
        "",
        "| context | " + " | ".join(decoders) + " |",
        "|---" * (len(decoders) + 1) + "|",
    ]
    for ctx in sorted({r["context"] for r in rows}):
        cells = []
        for d in decoders:
            r = by.get((d, ctx))
            cells.append(
                "" if r is None else "OOM" if r["status"] != "ok" else f"{r['median_ms']:.3g}"
            )
        lines.append(f"| {context_label(ctx)} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Fitted log-log slopes (time ~ context^slope): "
        + ", ".join(f"{d}: {s:.2f}" if s is not None else f"{d}: n/a" for d, s in slopes.items()),
    ]
    env = meta.get("environment", {})
    lines += [
        "",
        f"Device {env.get('device_kind')}, jax {env.get('jax_version')}, "
        f"commit {env.get('git_commit')}.",
    ]
    paths[2].write_text("\n".join(lines) + "\n")
    return paths
