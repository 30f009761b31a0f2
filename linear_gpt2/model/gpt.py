"""GPT-2 in Flax (linen), numerically nanoGPT's ``model.py``: the modules.

Same structure and names as nanoGPT: ``wte``, ``wpe``, blocks ``h`` (``ln_1``, ``attn.c_attn``,
``attn.c_proj``, ``ln_2``, ``mlp.c_fc``, ``mlp.c_proj``), ``ln_f``, and a language-model head tied
to ``wte``. Pre-LN blocks, LayerNorm eps 1e-5 with optional bias, exact-erf GELU, dropout at
nanoGPT's four sites (embeddings, attention weights, after each residual projection), init
N(0, 0.02) with the residual projections at 0.02/sqrt(2 n_layer).

Two deliberate layout choices (see docs/design.md):

- The ``n_layer`` blocks are one ``nn.scan``: parameters under ``h`` are stacked with a leading
  ``[n_layer]`` axis, so compile time does not grow with depth (48 layers for 1.6B) and per-block
  rematerialisation is one flag. ``interop`` unstacks them into nanoGPT's ``h.{i}.`` keys. With
  ``scan_layers: false`` (and ``auto``'s choice for a GPU: :func:`scans_layers`) the training
  forward runs the blocks unrolled on the same stacked parameters (:meth:`GPT.unrolled_blocks`),
  so checkpoints and weights serve both settings.
- Dense kernels are ``[in, out]`` (Flax's, and Hugging Face's Conv1D layout).

Memory options for long contexts (``memory_plan.py`` picks them with ``auto``): a rematerialisation
policy per block (:func:`remat_policy`) and a loss fused with the head by chunks of tokens
(``loss_chunk``, :mod:`linear_gpt2.model.loss`). Neither changes the function or its gradients.

Mixed precision follows torch autocast: parameters, the residual stream, LayerNorm, softmax and the
loss are float32; the matmuls run in ``config.dtype``, the tied head's backward ones on the logits'
gradient rounded to it (:func:`linear_gpt2.model.loss.head_logits`). ``residual_dtype: bfloat16`` carries the
residual stream (and the block inputs remat keeps) in bfloat16 instead.

Options beyond GPT-2, all off by default (the synthetic-task models of Zoology and ReBased):
attention-only blocks (``mlp=False``, and with ``identity_state_mixer`` the ``x + ln_2(x)`` that
Zoology's blocks add in place of the MLP), a short causal convolution before each attention
(``short_conv``), and the head computed only at the labelled positions (``loss_positions``).
With ``diagnostics`` (:func:`diagnostics`) every attention layer also reports statistics of its
normaliser, state and output (:mod:`linear_gpt2.model.layer_stats`).
"""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from linear_gpt2 import kernels
from linear_gpt2.attention.context import over_batch
from linear_gpt2.kernels.choice import is_fused_head, is_pallas, resolve_loss
from linear_gpt2.model import layer_stats as diag
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.layers import (
    DenseParams,
    FusedLayerNorm,
    GateProjection,
    ShortConv,
    add_residual,
    dense,
    fused_bias,
    fused_layer_norm,
    fused_mlp,
    layer_norm,
    mlp,
    qk_norm,
    qkv_heads,
    retnet_gammas,
)
from linear_gpt2.model.loss import IGNORE_INDEX, cross_entropy, head_cross_entropy, head_logits
from linear_gpt2.model.loss import counted as counted_after
from linear_gpt2.model.tokenizer import EOT

_init = nn.initializers.normal(stddev=0.02)


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
        # q and k have cfg.qk_dim per head: D, or attention.feature_dim, the linear family's
        # projection to fewer dimensions before the feature map (Based's proj_q, proj_k).
        Dk = cfg.qk_dim
        if fused_bias(cfg) and Dk == D:  # the same parameters and function, the fused backward
            w, b = DenseParams(C, 3 * C, name="c_attn")()
            q, k, v = qkv_heads(cfg, x, w, b)
        else:
            qkv = dense(cfg, 2 * H * Dk + C, "c_attn")(x)
            q, k, v = jnp.split(qkv, [H * Dk, 2 * H * Dk], axis=-1)
            q, k, v = q.reshape(B, T, H, Dk), k.reshape(B, T, H, Dk), v.reshape(B, T, H, D)
        if cfg.qk_layer_norm:  # ReBased: gamma * LayerNorm(x) + beta on q and k, per head
            q, k = (qk_norm(name)(t).astype(t.dtype) for name, t in (("ln_q", q), ("ln_k", k)))
        forget: dict[str, Any] = {}
        if resets is not None:
            forget["resets"] = resets
        log_gate = self.log_gate(x)
        if log_gate is not None:
            forget["log_gate"] = log_gate
        if self.is_initializing():
            # Parameters do not depend on the attention (it has none): initialisation skips it,
            # so every variant gets the same parameters for the same seed and none has to
            # accept the one-token sequence init traces.
            y = v
        elif cache is None:
            fn = cfg.spec.build(cfg.attention_options)
            kwargs = dict(forget)
            if cfg.dropout > 0 and not self.deterministic and cfg.spec.dropout:
                kwargs.update(dropout_rate=cfg.dropout, dropout_rng=self.make_rng("dropout"))
            y = over_batch(fn, q, k, v, **kwargs)
            if self.is_mutable_collection(diag.COLLECTION):  # only in model.diagnostics
                stats = diag.layer_stats(cfg, q, k, v, y, resets, log_gate)
                for name, value in stats.items():
                    self.sow(diag.COLLECTION, name, value)
        else:
            dec = cfg.spec.decoder(cfg.attention_options)
            if T == 1:
                one = {
                    ("reset" if name == "resets" else name): a[:, 0] for name, a in forget.items()
                }
                y, cache = dec.step(cache, q[:, 0], k[:, 0], v[:, 0], **one)
                y = y[:, None]
            else:
                y, cache = dec.prefill(cache, q, k, v, **forget)
        y = dense(cfg, C, "c_proj", stddev=0.02 / math.sqrt(2 * cfg.n_layer))(y.reshape(B, T, C))
        return nn.Dropout(cfg.dropout)(y, deterministic=self.deterministic), cache


class MLP(nn.Module):
    config: ModelConfig
    deterministic: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, residual: jax.Array | None = None) -> jax.Array:
        """x ``[B, T, C]`` -> the MLP's output ``[B, T, C]``; with ``residual`` (the fused
        kernels' path, no dropout) ``residual`` + the output, c_proj's bias added by the op
        whose backward sums its gradient in the same pass."""
        cfg = self.config
        C, stddev = cfg.n_embd, 0.02 / math.sqrt(2 * cfg.n_layer)
        if fused_mlp(cfg):  # the same parameters and function, the fused activation
            fc = DenseParams(C, 4 * C, name="c_fc")()
            proj = DenseParams(4 * C, C, stddev, name="c_proj")()
            if residual is not None:
                return add_residual(residual, mlp(cfg, x, fc, proj, add_bias=False), proj[1])
            h = mlp(cfg, x, fc, proj)
        else:
            h = dense(cfg, 4 * C, "c_fc")(x)
            h = nn.gelu(h, approximate=False)  # nanoGPT's nn.GELU() is the exact erf form
            h = dense(cfg, C, "c_proj", stddev=stddev)(h)
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
        if cfg.mlp and fused_layer_norm(cfg):
            # The fused kernels: ln_1 passes x through (so its backward adds the residual's
            # gradient), ln_2 adds the attention's output to the residual stream.
            x, y = FusedLayerNorm(cfg, name="ln_1")(x)
            h, cache = CausalSelfAttention(cfg, self.deterministic, name="attn")(y, cache, resets)
            x, y = FusedLayerNorm(cfg, name="ln_2")(x, h)
            mlp_block = MLP(cfg, self.deterministic, name="mlp")
            if fused_mlp(cfg) and fused_bias(cfg) and cfg.dropout == 0:
                return mlp_block(y, residual=x), cache
            return x + mlp_block(y), cache
        h, cache = CausalSelfAttention(cfg, self.deterministic, name="attn")(
            layer_norm(cfg, "ln_1")(x), cache, resets
        )
        x = x + _as(h, x)
        if cfg.mlp:
            x = x + _as(MLP(cfg, self.deterministic, name="mlp")(layer_norm(cfg, "ln_2")(x)), x)
        elif cfg.identity_state_mixer:
            x = x + _as(layer_norm(cfg, "ln_2")(x), x)
        return x, cache


def _as(h: jax.Array, x: jax.Array) -> jax.Array:
    """``h`` in the residual stream's dtype (``model.residual_dtype``). A float32 stream takes a
    bfloat16 branch as type promotion did (the same program); a bfloat16 stream stays bfloat16."""
    return h if h.dtype == x.dtype else h.astype(x.dtype)


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


def loss_kernel_of(cfg: ModelConfig) -> str:
    """The implementation of ``model.loss_kernel`` in the program being traced (``auto``:
    ``pallas`` for a GPU target, ``xla`` elsewhere; ``pallas_fused`` by name only)."""
    return resolve_loss(cfg.loss_kernel, "model.loss_kernel")


# The choices logger the scan's pick is noted on (a child of ``kernels.CHOICES``), once.
SCAN_CHOICE_LOGGER = f"{kernels.CHOICES}.scan_layers"
_SCAN_NOTED: set[str] = set()
# The remat policies under which auto keeps the scan (see scans_layers).
WHOLE_BLOCK_REMAT = ("full", "offload")


def scans_layers(cfg: ModelConfig) -> bool:
    """Whether the training forward runs the blocks as one ``nn.scan`` in the program being
    traced (``model.scan_layers``; ``auto``: unrolled for a GPU target, the kernels' rule
    (:func:`linear_gpt2.kernels.on_gpu`: the target's devices, not the process's backend), so
    the CPU program is the scanned one, byte for byte). Every reader of the option asks this,
    never the value's truth (``"auto"`` is a true string). A GPU measured the unrolled step
    faster at every point it timed (``benchmarks/results/glue_ab_h200_measured.md``); its
    cost, compile time growing with depth, is ``benchmarks/results/scan_compile_h100_compiled.md``.
    With whole blocks rematerialised (``remat`` ``full`` / ``offload``) ``auto`` scans: no GPU
    timed those unrolled, and unrolled they compiled to far more memory than scanned (the same
    file's plan section)."""
    value = cfg.scan_layers
    if isinstance(value, bool):
        return value
    if value != "auto":
        raise ValueError(f"model.scan_layers={value!r} is not one of auto, true, false")
    if not kernels.on_gpu() or cfg.remat in WHOLE_BLOCK_REMAT:
        return True
    if "model.scan_layers" not in _SCAN_NOTED:
        _SCAN_NOTED.add("model.scan_layers")
        kernels.note_choice(
            "model.scan_layers=auto: unrolled (the program is for a GPU)", SCAN_CHOICE_LOGGER
        )
    return False


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
        if cfg.residual_dtype != "float32":
            x = x.astype(cfg.residual_dtype)
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
        # The scan always initialises (it creates the stacked parameters), decodes (its caches
        # are stacked per layer) and runs the diagnostics pass (statistics stacked per layer).
        unrolled = cache is None and not self.is_initializing() and not scans_layers(cfg)
        if not unrolled or self.is_mutable_collection(diag.COLLECTION):
            x, layer_caches = blocks(x, None if cache is None else cache["layers"], resets)
        else:
            x = self.unrolled_blocks(x, resets, policy)

        if fused_layer_norm(cfg):
            x = FusedLayerNorm(cfg, residual_out=False, name="ln_f")(x)
        else:
            x = layer_norm(cfg, "ln_f")(x)
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
            # The count after the logits, as the loss's (loss.counted: issue 38).
            return hits.sum(), counted_after(counted, logits).astype(jnp.int32)
        loss_kernel = loss_kernel_of(cfg)
        fused = is_pallas(loss_kernel) or is_fused_head(loss_kernel)
        if targets is not None and (loss_chunk_tokens(cfg) > 0 or fused):
            # With a Pallas loss kernel and no chunking the whole sequence is one chunk
            # (pallas_fused has no chunks).
            chunk = loss_chunk_tokens(cfg) or math.prod(targets.shape)
            return head_cross_entropy(
                x, wte.embedding, targets, chunk=chunk, dtype=cfg.dtype, kernel=loss_kernel
            )
        # Tied head: logits = x @ wte^T in the compute dtype, float32 for the loss; the backward
        # rounds the logits' gradient to the compute dtype first (loss.head_logits).
        logits = head_logits(x, wte.embedding, cfg.dtype)
        if targets is not None:
            return cross_entropy(logits, targets)
        if cache is None:
            return logits
        new = {"pos": cache["pos"] + T, "layers": layer_caches}
        if "reset_next" in cache:
            new["reset_next"] = tokens[:, -1] == EOT
        return logits, new

    def unrolled_blocks(self, x: jax.Array, resets: jax.Array | None, policy) -> jax.Array:
        """``model.scan_layers: false``: the blocks one after another on the stacked parameters
        of ``h`` (what the scan initialised), each layer's taken by ``lax.split`` (whose
        gradient is one concatenation, not a sum of padded copies). The function is the scan's;
        with dropout, layer i's masks come from the step's dropout key folded with i (the same
        distribution as the scan's split keys, not the same draws)."""
        cfg = self.config
        leaves, tree = jax.tree.flatten(self.variables["params"]["h"])
        split = [jax.lax.split(a, (1,) * cfg.n_layer) for a in leaves]
        key = None
        if cfg.dropout > 0 and not self.deterministic:
            key = self.make_rng("dropout")
        block = Block(cfg, self.deterministic, parent=None)

        def run(params, x, resets, key):
            rngs = {} if key is None else {"dropout": key}
            return block.apply({"params": params}, x, None, resets, rngs=rngs)[0]

        if policy is not None:
            run = jax.checkpoint(run, policy=policy)
        for i in range(cfg.n_layer):
            params = tree.unflatten([parts[i][0] for parts in split])
            x = run(params, x, resets, None if key is None else jax.random.fold_in(key, i))
        return x


def labelled_positions(x: jax.Array, targets: jax.Array, k: int) -> tuple[jax.Array, jax.Array]:
    """The hidden states ``[B, k, C]`` and targets ``[B, k]`` at the first ``k`` positions of
    each row whose target is counted (!= -1), in order; rows with fewer are padded with ignored
    targets. What ``loss_positions`` computes the head on."""
    counted = targets != IGNORE_INDEX
    idx = jax.vmap(lambda row: jnp.nonzero(row, size=k, fill_value=0)[0])(counted)  # [B, k]
    real = jnp.arange(k)[None, :] < counted.sum(axis=1, keepdims=True)
    picked = jnp.where(real, jnp.take_along_axis(targets, idx, axis=1), IGNORE_INDEX)
    return jnp.take_along_axis(x, idx[..., None], axis=1), picked
