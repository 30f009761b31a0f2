"""The model as functions of plain parameter dicts: initialise, run, decode, count.

``init_params(config, seed) -> params`` and ``forward(params, tokens, config) -> logits`` are
linen's ``init`` / ``apply`` of :class:`~linear_gpt2.model.gpt.GPT`; the parameters are a plain
nested dict that optax, orbax, ``jax.sharding`` and the weight converters take as they are.
"""

from __future__ import annotations

from typing import Any

import flax
import jax
import jax.numpy as jnp

from linear_gpt2.model import layer_stats as diag
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.gpt import GPT

Params = dict[str, Any]


def init_config(config: ModelConfig) -> ModelConfig:
    """The config initialisation traces: no rematerialisation, the plain head (neither changes
    the parameters). The attention is not called at all while initialising (it has no
    parameters; ``decay: gate`` adds its projection, which is)."""
    return config.replace(remat="none", loss_chunk=0)


def init_params(config: ModelConfig, seed: int = 0) -> Params:
    """Fresh float32 parameters (nanoGPT's init) as a plain nested dict, the same for every
    attention variant with the same seed (initialisation does not run the attention)."""
    model = GPT(init_config(config))
    tokens = jnp.zeros((1, 1), dtype=jnp.int32)
    variables = jax.jit(model.init)(jax.random.key(seed), tokens)
    return flax.core.unfreeze(variables["params"])


def param_shapes(config: ModelConfig) -> Params:
    """Parameter shapes and dtypes without allocating them (``jax.ShapeDtypeStruct`` leaves)."""
    model = GPT(init_config(config))
    tokens = jax.ShapeDtypeStruct((1, 1), jnp.int32)
    return jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]


def forward(
    params: Params,
    tokens: jax.Array,
    config: ModelConfig,
    *,
    train: bool = False,
    rng: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Logits, float32 ``[B, T, vocab_size]``, for int tokens ``[B, T]``.

    Deterministic (no dropout) unless ``train`` is true, in which case ``rng`` seeds dropout.
    ``segment_ids`` (int ``[B, T]``): documents, for ``doc_reset`` (see :class:`GPT`).
    """
    deterministic = not train or config.dropout == 0.0
    rngs = {} if deterministic else {"dropout": rng if rng is not None else jax.random.key(0)}
    return GPT(config, deterministic).apply(
        {"params": params}, jnp.asarray(tokens, jnp.int32), segment_ids=segment_ids, rngs=rngs
    )


def decode_init(config: ModelConfig, batch: int, max_len: int | None = None) -> dict[str, Any]:
    """An empty decoding cache for ``batch`` sequences of up to ``max_len`` tokens (default
    ``block_size``): ``{"pos": int32 [], "layers": decoder states stacked on [n_layer]}``.

    The KV cache of softmax attention grows with ``max_len``; the linear family's recurrent
    state ``(S [B, H, D, D], z [B, H, D])`` does not."""
    max_len = config.block_size if max_len is None else max_len
    if config.short_conv:
        raise NotImplementedError(
            "model.short_conv has no incremental decoder; sample from a model without it"
        )
    if max_len > config.block_size:
        raise ValueError(
            f"max_len={max_len} exceeds block_size={config.block_size}: positions beyond it have "
            "no position embedding"
        )
    dec = config.spec.decoder(config.attention_options)
    one = dec.init(batch, config.n_head, config.head_dim, max_len, jnp.dtype(config.dtype))
    layers = jax.tree.map(lambda a: jnp.broadcast_to(a, (config.n_layer, *a.shape)), one)
    cache = {"pos": jnp.zeros((), jnp.int32), "layers": layers}
    if config.doc_reset:  # whether the next token starts a document (the last one was EOT)
        cache["reset_next"] = jnp.zeros((batch,), bool)
    return cache


def decode(
    params: Params, tokens: jax.Array, cache: dict[str, Any], config: ModelConfig
) -> tuple[jax.Array, dict[str, Any]]:
    """Logits float32 ``[B, T_new, vocab_size]`` for int tokens ``[B, T_new]`` that continue the
    sequence in ``cache``, and the updated cache. ``T_new > 1`` is a prefill; ``T_new == 1`` one
    step (O(D^2) per layer for the linear family, O(max_len D) for a KV cache). The caller keeps
    ``pos + T_new <= max_len`` (checked here when ``pos`` is concrete)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    try:
        pos = int(cache["pos"])
    except (TypeError, jax.errors.ConcretizationTypeError):
        pos = None  # traced under jit: the decoders guard the cache bounds
    if pos is not None and pos + tokens.shape[1] > config.block_size:
        raise ValueError(
            f"cannot decode past block_size={config.block_size}: cache holds {pos} tokens and "
            f"{tokens.shape[1]} more were given"
        )
    return GPT(config).apply({"params": params}, tokens, cache)


def loss_fn(
    params: Params,
    tokens: jax.Array,
    targets: jax.Array,
    config: ModelConfig,
    *,
    train: bool = False,
    rng: jax.Array | None = None,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
    """Scalar float32 loss of next-token prediction; ``targets`` -1 are ignored.

    With ``config.loss_chunk`` > 0 the head and the loss are fused by chunks of tokens
    (``loss.head_cross_entropy``): same value and gradients, without the ``[B, T, vocab]``
    logits."""
    deterministic = not train or config.dropout == 0.0
    rngs = {} if deterministic else {"dropout": rng if rng is not None else jax.random.key(0)}
    return GPT(config, deterministic).apply(
        {"params": params},
        jnp.asarray(tokens, jnp.int32),
        targets=jnp.asarray(targets, jnp.int32),
        segment_ids=segment_ids,
        rngs=rngs,
    )


def correct(
    params: Params,
    tokens: jax.Array,
    targets: jax.Array,
    config: ModelConfig,
    *,
    segment_ids: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """``(hits, counted)``: how many targets != -1 are the argmax of their logits, and how many
    there are (no dropout). Held-out accuracy is ``sum(hits) / sum(counted)``."""
    return GPT(config).apply(
        {"params": params},
        jnp.asarray(tokens, jnp.int32),
        targets=jnp.asarray(targets, jnp.int32),
        segment_ids=segment_ids,
        output="correct",
    )


def diagnostics(
    params: Params,
    tokens: jax.Array,
    config: ModelConfig,
    *,
    segment_ids: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """Per-layer attention statistics of a forward pass (no dropout), ``{name: float32
    [n_layer]}`` with the names of :data:`linear_gpt2.model.layer_stats.LAYER_STATS` that apply (see
    :func:`linear_gpt2.model.layer_stats.layer_stats`). Only this function makes the statistics'
    collection mutable, so no other program (the training step) computes them."""
    _, state = GPT(config).apply(
        {"params": params},
        jnp.asarray(tokens, jnp.int32),
        segment_ids=segment_ids,
        mutable=[diag.COLLECTION],
    )
    sown = state.get(diag.COLLECTION, {}).get("h", {}).get("attn", {})
    # sow keeps a tuple per name; nn.scan stacks each entry over the layers.
    return {name: jnp.asarray(values[0]) for name, values in sown.items()}


def count_params(params: Params, non_embedding: bool = True) -> int:
    """Number of parameters, as nanoGPT's ``get_num_params``: by default without the position
    embeddings (the token embedding counts, since it is also the output head)."""
    n = sum(int(p.size) for p in jax.tree.leaves(params))
    if non_embedding:
        n -= int(params["wpe"]["embedding"].size)
    return n
