"""Sampling from a model: KV cache (softmax) vs recurrent state (linear), on the decode path.

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

A trained model comes from ``linear_gpt2.training.trained.load``; the time per sampled token is
measured by ``studies.sample_time.sample_time``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from linear_gpt2.model.api import Params, decode, decode_init, forward
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import UsageError


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
def next_token(params, token, cache, key, *, config, temperature, top_k, vocab_limit):
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
        token, cache = next_token(params, token, cache, jax.random.fold_in(key, i), **static)
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
    0..t and the padding after t changes nothing. The buffer is lengthened to the next length
    the attention takes (its spec's ``context_problem``: LT_chunked needs whole chunks).
    """
    prompt = jnp.asarray(prompt, jnp.int32)
    B, T0 = prompt.shape
    n = T0 + max_new_tokens
    length = n
    problem, options = config.spec.context_problem, config.attention_options
    while problem is not None and problem(length, options) and length < config.block_size:
        length += 1
    if length > config.block_size:
        raise ValueError(f"{length} positions do not fit block_size={config.block_size}")
    buf = jnp.zeros((B, length), jnp.int32).at[:, :T0].set(prompt)
    run = jax.jit(lambda p, x: forward(p, x, config))
    for t in range(T0, n):
        logits = run(params, buf)[:, t - 1]
        buf = buf.at[:, t].set(choose(logits, jax.random.key(0), 0.0, None, vocab_limit))
    return buf[:, T0:n]
