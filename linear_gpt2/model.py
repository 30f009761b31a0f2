"""GPT-2 in Flax (linen), numerically nanoGPT's ``model.py``.

Same structure and names as nanoGPT: ``wte``, ``wpe``, blocks ``h`` (``ln_1``, ``attn.c_attn``,
``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``), ``ln_f``, and a language-model head tied
to ``wte``. Pre-LN blocks, LayerNorm eps 1e-5 with optional bias, exact-erf GELU, dropout at
nanoGPT's four sites (embeddings, attention weights, after each residual projection), init
N(0, 0.02) with the residual projections at 0.02/sqrt(2 n_layer).

Two deliberate layout choices (see docs/design.md):

- The ``n_layer`` blocks are one ``nn.scan``: parameters under ``h`` are stacked with a leading
  ``[n_layer]`` axis, so compile time does not grow with depth (48 layers for 1.6B) and per-block
  rematerialisation is one flag. ``interop`` unstacks them into nanoGPT's ``h.{i}.`` keys.
- Dense kernels are ``[in, out]`` (Flax's, and Hugging Face's Conv1D layout).

Memory options for long contexts (``memory_plan.py`` picks them with ``auto``): a rematerialisation
policy per block (:func:`remat_policy`) and a loss fused with the head by chunks of tokens
(``loss_chunk``, :mod:`linear_gpt2.loss`). Neither changes the function or its gradients.

Mixed precision follows torch autocast: parameters, the residual stream, LayerNorm, softmax and the
loss are float32; the matmuls run in ``config.dtype``.

Options beyond GPT-2, all off by default (the synthetic-task models of Zoology and ReBased):
attention-only blocks (``mlp=False``, and with ``identity_state_mixer`` the ``x + ln_2(x)`` that
Zoology's blocks add in place of the MLP), a short causal convolution before each attention
(``short_conv``), and the head computed only at the labelled positions (``loss_positions``).
With ``diagnostics`` (:func:`diagnostics`) every attention layer also reports statistics of its
normaliser, state and output (:mod:`linear_gpt2.diagnostics`).
"""

from __future__ import annotations

import math
from typing import Any

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from linear_gpt2 import attention
from linear_gpt2 import diagnostics as diag
from linear_gpt2.config import ModelConfig
from linear_gpt2.loss import IGNORE_INDEX, cross_entropy, head_cross_entropy
from linear_gpt2.tokenizer import EOT

Params = dict[str, Any]

_init = nn.initializers.normal(stddev=0.02)


def _dense(cfg: ModelConfig, features: int, name: str, stddev: float = 0.02) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=cfg.bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(stddev=stddev),
        bias_init=nn.initializers.zeros,
        name=name,
    )


def _layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    # Two-pass variance, as torch computes it; statistics in float32 whatever the input dtype.
    return nn.LayerNorm(
        epsilon=1e-5,
        use_bias=cfg.bias,
        use_fast_variance=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        name=name,
    )


def retnet_gammas(n_head: int) -> np.ndarray:
    """RetNet's fixed per-head decays gamma_h = 1 - 2^(-5 - h), h = 0 .. H-1 (float64): memory
    lengths 1/(1 - gamma) from 32 tokens (head 0) doubling per head."""
    return 1.0 - 2.0 ** (-5.0 - np.arange(n_head, dtype=np.float64))


def _split(a: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """a = hi + lo (to about 16 bits) with hi, lo in ``dtype`` (lo = 0 when dtype is a's)."""
    hi = a.astype(dtype)
    return hi, (a - hi.astype(a.dtype)).astype(dtype)


def _dot32(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def gate_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x ``[B, T, C]`` (any float dtype) times w ``[C, H]`` float32 -> float32 ``[B, T, H]``, with
    w split into two halves of x's dtype (:func:`_split`). Forward and backward keep x and dx in
    x's dtype: no [B, T, C] float32 array (the backward's float32 cotangent is split likewise)."""
    hi, lo = _split(w, x.dtype)
    return _dot32(x, hi, "btc,ch->bth") + _dot32(x, lo, "btc,ch->bth")


def _gate_fwd(x, w):
    return gate_logits(x, w), (x, w)


def _gate_bwd(res, g):
    x, w = res
    g_hi, g_lo = _split(g.astype(jnp.float32), x.dtype)
    hi, lo = _split(w, x.dtype)
    dx = _dot32(g_hi, hi, "bth,ch->btc") + _dot32(g_lo, hi, "bth,ch->btc")
    dx = dx + _dot32(g_hi, lo, "bth,ch->btc")
    dw = _dot32(x, g_hi, "btc,bth->ch") + _dot32(x, g_lo, "btc,bth->ch")
    return dx.astype(x.dtype), dw


gate_logits.defvjp(_gate_fwd, _gate_bwd)


class GateProjection(nn.Module):
    """``x [B, T, C] -> x W + b`` float32 ``[B, T, H]``, W ``[C, H]`` and b float32 (params
    ``kernel``, ``bias``: a ``Dense``'s). x stays in its dtype (the model passes the compute
    dtype, as ``c_attn`` reads it): a bfloat16 x is neither copied to float32 nor kept as float32
    for the backward ([B, T, C] float32 per layer cost the 124M step 14% more memory at 1M
    tokens, compiled for the H100); W (and the backward's cotangent) is split into two bfloat16
    halves, so x W keeps about 16 bits of W's precision, accumulated in float32. With a float32
    x: exact."""

    features: int
    bias_value: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        f32 = jnp.float32
        w = self.param("kernel", nn.initializers.zeros, (x.shape[-1], self.features), f32)
        b = self.param("bias", lambda *_: self.bias_value, (self.features,), f32)
        return gate_logits(x, w) + b


def _conv_init(kernel: int):
    # torch's Conv1d default (kaiming uniform, a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    # fan_in = kernel for a depthwise convolution; Zoology's and ReBased's short convolutions.
    bound = 1.0 / math.sqrt(kernel)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound
    )


class ShortConv(nn.Module):
    """Depthwise causal convolution over time, ``y_t = b + sum_{i < k} w_i * x_{t-i}`` per channel
    (``model.short_conv`` = k), in float32. With ``resets`` (bool ``[B, T]``, document starts) a
    position sees no input from before its document's start."""

    kernel: int

    @nn.compact
    def __call__(self, x: jax.Array, resets: jax.Array | None = None) -> jax.Array:
        B, T, C = x.shape
        w = self.param("kernel", _conv_init(self.kernel), (self.kernel, C))
        b = self.param("bias", _conv_init(self.kernel), (C,))
        x = x.astype(jnp.float32)
        seg = None if resets is None else jnp.cumsum(resets.astype(jnp.int32), axis=1)
        y = b + w[0] * x
        for i in range(1, min(self.kernel, T)):
            shifted = jnp.pad(x, ((0, 0), (i, 0), (0, 0)))[:, :T]  # x_{t-i}, zeros before 0
            if seg is not None:
                same = jnp.pad(seg, ((0, 0), (i, 0)), constant_values=-1)[:, :T] == seg
                shifted = jnp.where(same[..., None], shifted, 0.0)
            y = y + w[i] * shifted
        return y


class CausalSelfAttention(nn.Module):
    config: ModelConfig
    deterministic: bool = True

    def log_gate(self, x: jax.Array) -> jax.Array | None:
        """log gamma float32 ``[B, T, H]`` of ``attention.decay`` for the block input x ``[B, T,
        C]``, or None (``decay: none``).

        - ``fixed``: RetNet's per-head constants (:func:`retnet_gammas`), no parameters.
        - ``gate``: gamma_i = sigmoid(w_h . x_i + b_h), a projection ``c_gate`` [C, H] in
          float32 (the gate's precision near 1 matters more than its 2 C H FLOPs per token),
          initialised with w = 0 and b = logit(RetNet's gamma_h): the model starts as the
          fixed-decay one (gammas from 0.97 to 1 - 2^-(4+H)) and learns to depend on the input.
        """
        cfg = self.config
        B, T, _ = x.shape
        if cfg.decay == "none":
            return None
        gammas = retnet_gammas(cfg.n_head)
        if cfg.decay == "fixed":
            logs = jnp.asarray(np.log(gammas), jnp.float32)
            return jnp.broadcast_to(logs, (B, T, cfg.n_head))
        logits = np.log(gammas) - np.log1p(-gammas)
        gate = GateProjection(cfg.n_head, jnp.asarray(logits, jnp.float32), name="c_gate")
        # x in the compute dtype, as c_attn reads it (the same cast): the gate keeps no float32
        # copy of the layer norm's output for its backward.
        return jax.nn.log_sigmoid(gate(x.astype(jnp.dtype(cfg.dtype))))

    @nn.compact
    def __call__(
        self, x: jax.Array, cache: Any = None, resets: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """x: ``[B, T, C]`` -> ``([B, T, C], cache)``; ``resets`` bool ``[B, T]`` where
        documents start (``attention.doc_reset``), else None.

        With ``cache`` (this layer's decoder state, see ``attention.Decoder``) the T tokens are
        new positions after those already in the cache: a prefill, or one step when T == 1."""
        cfg = self.config
        B, T, C = x.shape
        H, D = cfg.n_head, cfg.head_dim
        if cfg.short_conv:
            if cache is not None:
                raise NotImplementedError(
                    "model.short_conv has no incremental decoder; sample from a model without it"
                )
            x = ShortConv(cfg.short_conv, name="conv")(x, resets)
        qkv = _dense(cfg, 3 * C, "c_attn")(x)
        q, k, v = (t.reshape(B, T, H, D) for t in jnp.split(qkv, 3, axis=-1))
        forget: dict[str, Any] = {}
        if resets is not None:
            forget["resets"] = resets
        log_gate = self.log_gate(x)
        if log_gate is not None:
            forget["log_gate"] = log_gate
        if cache is None:
            fn = attention.get(cfg.attention, **cfg.attention_options())
            kwargs = dict(forget)
            if (
                cfg.dropout > 0
                and not self.deterministic
                and attention.supports_dropout(cfg.attention)
            ):
                kwargs.update(dropout_rate=cfg.dropout, dropout_rng=self.make_rng("dropout"))
            y = fn(q, k, v, **kwargs)
            if self.is_mutable_collection(diag.COLLECTION):  # only in model.diagnostics
                stats = diag.layer_stats(cfg, q, k, v, y, resets, log_gate)
                for name, value in stats.items():
                    self.sow(diag.COLLECTION, name, value)
        else:
            dec = attention.decoder(cfg.attention, **cfg.attention_options())
            if T == 1:
                one = {
                    ("reset" if name == "resets" else name): a[:, 0] for name, a in forget.items()
                }
                y, cache = dec.step(cache, q[:, 0], k[:, 0], v[:, 0], **one)
                y = y[:, None]
            else:
                y, cache = dec.prefill(cache, q, k, v, **forget)
        y = _dense(cfg, C, "c_proj", stddev=0.02 / math.sqrt(2 * cfg.n_layer))(y.reshape(B, T, C))
        return nn.Dropout(cfg.dropout)(y, deterministic=self.deterministic), cache


class MLP(nn.Module):
    config: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        cfg = self.config
        h = _dense(cfg, 4 * cfg.n_embd, "c_fc")(x)
        h = nn.gelu(h, approximate=False)  # nanoGPT's nn.GELU() is the exact erf form
        h = _dense(cfg, cfg.n_embd, "c_proj", stddev=0.02 / math.sqrt(2 * cfg.n_layer))(h)
        return nn.Dropout(cfg.dropout)(h, deterministic=self.deterministic)


class Block(nn.Module):
    config: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(
        self, x: jax.Array, cache: Any = None, resets: jax.Array | None = None
    ) -> tuple[jax.Array, Any]:
        """x: ``[B, T, C]`` float32 residual stream; ``cache`` this layer's decoder state or None;
        ``resets`` bool ``[B, T]`` (document starts) or None, the same for every layer.
        Returns ``(x, cache)``: the carry and the per-layer output of ``nn.scan``."""
        cfg = self.config
        # The one tensor the "full" and "offload" policies keep per block (see REMAT_POLICIES).
        x = checkpoint_name(x, BLOCK_INPUT)
        h, cache = CausalSelfAttention(cfg, self.deterministic, name="attn")(
            _layer_norm(cfg, "ln_1")(x), cache, resets
        )
        x = x + h
        if cfg.mlp:
            x = x + MLP(cfg, self.deterministic, name="mlp")(_layer_norm(cfg, "ln_2")(x))
        elif cfg.identity_state_mixer:
            x = x + _layer_norm(cfg, "ln_2")(x)
        return x, cache


BLOCK_INPUT = "block_input"


def document_starts(
    tokens: jax.Array, segment_ids: jax.Array | None = None, first: jax.Array | None = None
) -> jax.Array:
    """bool ``[B, T]``: where a document starts. From ``segment_ids`` (int ``[B, T]``) where the
    index changes; otherwise after every EOT token. Position 0 starts one only if ``first``
    (bool ``[B]``, decoding: the token before was EOT) says so."""
    if segment_ids is not None:
        starts = segment_ids[:, 1:] != segment_ids[:, :-1]
    else:
        starts = tokens[:, :-1] == EOT
    head = jnp.zeros((tokens.shape[0], 1), bool) if first is None else first[:, None]
    return jnp.concatenate([head, starts], axis=1)


def remat_policy(name: str):
    """The ``jax.checkpoint`` policy of ``model.remat`` = ``name``, or None for no remat.

    - ``none`` (and ``auto`` when nothing resolved it, see ``memory_plan``): every activation
      the backward pass needs is kept, as autodiff does by default.
    - ``dots``: keep the outputs of the matmuls without batch dimensions (projections and MLP);
      recompute LayerNorm, GELU, phi and attention in the backward pass.
    - ``full``: keep only each block's input (``[B, T, C]`` float32 per layer); recompute the
      whole block (+1 forward pass of the blocks).
    - ``offload``: as ``full``, with the block inputs moved to pinned host memory in the forward
      pass and fetched back for the backward pass: device memory no longer grows with depth.
    """
    policies = jax.checkpoint_policies
    return {
        "none": None,
        "auto": None,
        "dots": policies.dots_with_no_batch_dims_saveable,
        "full": policies.nothing_saveable,
        "offload": policies.save_and_offload_only_these_names(
            names_which_can_be_saved=[],
            names_which_can_be_offloaded=[BLOCK_INPUT],
            offload_src="device",
            offload_dst="pinned_host",
        ),
    }[name]


def loss_chunk_tokens(cfg: ModelConfig) -> int:
    """Tokens per chunk of the fused head + loss, 0 for the plain logits (``auto`` unresolved)."""
    return 0 if cfg.loss_chunk == "auto" else int(cfg.loss_chunk)


class GPT(nn.Module):
    config: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(
        self,
        tokens: jax.Array,
        cache: dict[str, Any] | None = None,
        targets: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        output: str = "loss",
    ):
        """tokens: int ``[B, T]`` -> logits float32 ``[B, T, vocab_size]``.

        With ``cache`` (from ``decode_init``) the tokens continue the cached sequence and the
        call returns ``(logits, cache)``. With ``targets`` (int ``[B, T]``, -1 ignored) it
        returns the mean cross-entropy instead of the logits, by chunks of tokens when
        ``loss_chunk`` is set (the ``[B, T, vocab]`` logits are then never materialised).
        ``segment_ids`` (int ``[B, T]``, the loader's document index of each token) say where
        documents start when ``doc_reset`` is on; without them a document starts after each
        EOT token (the packing's separator). ``output="correct"`` (with ``targets``) returns
        ``(hits, counted)`` instead of the loss: how many counted targets are the argmax of their
        logits, and how many targets were counted. With ``loss_positions`` the head runs only at
        the first ``loss_positions`` labelled targets of each row."""
        cfg = self.config
        T = tokens.shape[1]
        if cache is None and T > cfg.block_size:
            raise ValueError(
                f"cannot forward a sequence of length {T}: block_size is only {cfg.block_size}; "
                f"use a shorter context or a model with block_size >= {T}"
            )
        wte = nn.Embed(
            cfg.vocab_size, cfg.n_embd, embedding_init=_init, param_dtype=jnp.float32, name="wte"
        )
        wpe = nn.Embed(
            cfg.block_size, cfg.n_embd, embedding_init=_init, param_dtype=jnp.float32, name="wpe"
        )
        start = 0 if cache is None else cache["pos"]
        x = wte(tokens) + wpe(start + jnp.arange(T))[None]
        x = nn.Dropout(cfg.dropout)(x, deterministic=self.deterministic)

        block = Block
        policy = remat_policy(cfg.remat)
        if policy is not None:
            block = nn.remat(Block, prevent_cse=False, policy=policy)
        blocks = nn.scan(
            block,
            variable_axes={"params": 0, diag.COLLECTION: 0},
            split_rngs={"params": True, "dropout": True},
            in_axes=(0, nn.broadcast),
            length=cfg.n_layer,
            metadata_params={nn.PARTITION_NAME: "layers"},
        )(cfg, self.deterministic, name="h")
        resets = None
        if cfg.doc_reset:
            first = None if cache is None else cache["reset_next"]
            resets = document_starts(tokens, segment_ids, first)
        x, layer_caches = blocks(x, None if cache is None else cache["layers"], resets)

        x = _layer_norm(cfg, "ln_f")(x)
        if targets is not None and cfg.loss_positions > 0:
            x, targets = labelled_positions(x, targets, cfg.loss_positions)
        if targets is not None and output == "correct":
            logits = jnp.einsum(
                "btc,vc->btv",
                x.astype(cfg.dtype),
                wte.embedding.astype(cfg.dtype),
                preferred_element_type=jnp.float32,
            )
            counted = targets != IGNORE_INDEX
            hits = (jnp.argmax(logits, axis=-1) == targets) & counted
            return hits.sum(), counted.sum()
        if targets is not None and loss_chunk_tokens(cfg) > 0:
            return head_cross_entropy(
                x, wte.embedding, targets, chunk=loss_chunk_tokens(cfg), dtype=cfg.dtype
            )
        # Tied head: logits = x @ wte^T, in the compute dtype, then float32 for the loss.
        logits = jnp.einsum(
            "btc,vc->btv",
            x.astype(cfg.dtype),
            wte.embedding.astype(cfg.dtype),
            preferred_element_type=jnp.float32,
        )
        logits = logits.astype(jnp.float32)
        if targets is not None:
            return cross_entropy(logits, targets)
        if cache is None:
            return logits
        new = {"pos": cache["pos"] + T, "layers": layer_caches}
        if "reset_next" in cache:
            new["reset_next"] = tokens[:, -1] == EOT
        return logits, new


def labelled_positions(x: jax.Array, targets: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The hidden states ``[B, k, C]`` and targets ``[B, k]`` at the first ``k`` positions of
    each row whose target is counted (!= -1), in order; rows with fewer are padded with ignored
    targets. What ``loss_positions`` computes the head on."""
    counted = targets != IGNORE_INDEX
    idx = jax.vmap(lambda row: jnp.nonzero(row, size=k, fill_value=0)[0])(counted)  # [B, k]
    real = jnp.arange(k)[None, :] < counted.sum(axis=1, keepdims=True)
    picked = jnp.where(real, jnp.take_along_axis(targets, idx, axis=1), IGNORE_INDEX)
    return jnp.take_along_axis(x, idx[..., None], axis=1), picked


def init_config(config: ModelConfig) -> ModelConfig:
    """The config initialisation traces: softmax (or, with a decay, the recurrent LT_state,
    since decays need a linear attention) on one token. The parameters are the same for every
    attention of the family; only ``decay: gate`` adds its projection."""
    name = "softmax" if config.decay == "none" else "LT_state"
    return config.replace(attention=name, remat="none", loss_chunk=0)


def init_params(config: ModelConfig, seed: int = 0) -> Params:
    """Fresh float32 parameters (nanoGPT's init) as a plain nested dict.

    Parameters do not depend on the attention algorithm, so initialisation traces softmax on one
    token: every variant gets the same parameters for the same seed, and variants with shape
    constraints (LT_chunked's chunk size) need not accept a length-1 sequence."""
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
    dec = attention.decoder(config.attention, **config.attention_options())
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
    [n_layer]}`` with the names of :data:`linear_gpt2.diagnostics.LAYER_STATS` that apply (see
    :func:`linear_gpt2.diagnostics.layer_stats`). Only this function makes the statistics'
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
