"""The model's configuration: GPT-2's architecture and the attention, one frozen value.

:class:`ModelConfig` is what the model code sees: the architecture fields (:class:`ArchConfig`,
the YAML ``model`` section), the attention name (``attention``) and the variant's options (an
instance of its options class, ``AttentionSpec.options``; ``linear_gpt2.attention.options``), so
that a model is described by one hashable value (a static argument to ``jax.jit``). Runs build it
from their config (``training.config.Config.model_config``); code builds it directly or from a
preset.
"""

from __future__ import annotations

import dataclasses
import types
from dataclasses import dataclass, field, fields
from typing import Any

from linear_gpt2 import attention
from linear_gpt2.attention import schema
from linear_gpt2.attention.options import Options, declared
from linear_gpt2.kernels.choice import KERNELS as FUSED_KERNELS
from linear_gpt2.kernels.choice import LOSS_KERNELS
from linear_gpt2.platform.errors import check, check_choice

DTYPES = ("float32", "bfloat16")
# Rematerialisation of each block in the backward pass (model.remat): none; dots (keep the matmul
# outputs, recompute the rest); full (keep only each block's input); offload (full, with each
# block's input kept in host memory); auto (the fastest that fits the device; memory_plan.py).
REMAT = ("none", "dots", "full", "offload", "auto")
GPT2_VOCAB = 50257  # ids 0..50256 (50256 = <|endoftext|>), what the data pipeline emits
# Field metadata of a config value that a resumed run may change: it selects how the step is
# computed or run (a memory setting, a sharding, a micro-batch split) or bounds the run, not the
# function trained. An attention option says so in its own declaration (``option(...,
# implementation=True)``); checkpoints and sweeps ask ``Config.resume_may_change``.
RESUME_MAY_CHANGE = types.MappingProxyType({"resume_may_change": True})


@dataclass(frozen=True)
class ArchConfig:
    """GPT-2 architecture (the YAML ``model`` section). Defaults are GPT-2 124M trained from
    scratch (vocabulary padded to 50304, a multiple of 64, as nanoGPT does)."""

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    # Activation/matmul dtype; parameters, LayerNorm statistics, softmax and loss stay float32.
    dtype: str = "float32"
    # The residual stream's dtype (the blocks' carry, each residual add, the block input that
    # remat keeps or offloads): float32 as torch autocast keeps it (nanoGPT's numerics), or
    # bfloat16 (half its bytes; LayerNorm statistics and the loss stay float32).
    residual_dtype: str = "float32"
    # The blocks as one nn.scan (true: compile time flat in depth) or unrolled (false: no
    # stacking of per-layer activations and gradients, compile time grows with depth); auto:
    # unrolled when the program is traced for a GPU, scanned elsewhere (gpt.scans_layers, the
    # one reader). The parameters are stacked under h either way, so checkpoints and weights
    # serve both and a resumed run may switch it. residual_dtype changes the function trained
    # (its rounding), so a resume keeps it.
    scan_layers: bool | str = field(default="auto", metadata=RESUME_MAY_CHANGE)
    # Rematerialisation policy per block (REMAT above). true/false are accepted for full/none.
    remat: bool | str = field(default="auto", metadata=RESUME_MAY_CHANGE)
    # Tokens per chunk of the fused head + cross-entropy (loss.py), which never holds the whole
    # sequence's [T, vocab] float32 logits; 0 computes the logits at once (nanoGPT's way); auto
    # chunks only when the plain step does not fit the device (memory_plan.py).
    loss_chunk: int | str = field(default="auto", metadata=RESUME_MAY_CHANGE)
    # Blocks with the MLP (GPT-2). false: attention-only blocks (x + attn(ln_1(x))), the
    # 2-layer models of Zoology's and ReBased's MQAR experiments.
    mlp: bool = True
    # With mlp: false, also add ln_2(x) to the residual after each attention
    # (x = x + attn(ln_1(x)); x = x + ln_2(x)). This is what Zoology's TransformerBlock computes
    # with state_mixer=Identity, the attention-only models of its and ReBased's MQAR figures: the
    # block returns ln_2 of its stream and the next block (or ln_f) adds that to the residual.
    identity_state_mixer: bool = False
    # Kernel size of a depthwise causal convolution on each block's attention input (after
    # ln_1, before c_attn), the "short convolution" of Based/ReBased; 0 = none (GPT-2).
    short_conv: int = 0
    # Compute the head and the loss only at the first K labelled targets (!= -1) of each row
    # (sparse-label tasks such as MQAR, where an 8192-way head at every token would dominate);
    # rows with more than K labelled targets lose the rest. 0 = every position (GPT-2).
    loss_positions: int = 0
    # LayerNorm as fused Pallas kernels (kernels/layernorm/): one pass forward with the residual
    # add before ln_2, one pass backward with the residual's gradient, and the statistics kept;
    # the same function as Flax's nn.LayerNorm. auto: pallas when compiling for a GPU, xla (Flax's
    # LayerNorm, the program of before) elsewhere.
    layernorm_kernel: str = field(default="auto", metadata=RESUME_MAY_CHANGE)
    # The MLP's bias + GELU with a fused backward (kernels/bias_gelu/): the backward keeps only
    # the c_fc matmul's output (not GELU's intermediates) and writes dz and the bias gradient in
    # one pass; the same function. auto: pallas when compiling for a GPU, xla (Flax's Dense and
    # nn.gelu, the program of before) elsewhere.
    mlp_kernel: str = field(default="auto", metadata=RESUME_MAY_CHANGE)
    # The cross-entropy of each chunk of logits and its gradient in one Pallas kernel
    # (kernels/cross_entropy/), written over the logits: the head's matmuls stay XLA's, the
    # loss's reductions and elementwise passes become one kernel; with loss_chunk 0 the sequence
    # is one chunk. The same function. auto: pallas when compiling for a GPU, xla elsewhere.
    # pallas_fused (asked for by name only; auto never picks it): the head's matmuls and the
    # loss as one Pallas kernel pair (kernels/head_loss/) that never writes the [N, V] logits,
    # loss_chunk ignored; the logits computed twice, dx and dW summed by float32 atomics (not
    # bit-reproducible run to run). Every kernel, and the plain head, rounds the gradient of
    # the logits to model.dtype before the head's backward matmuls, as torch autocast does
    # (model/loss.py, "Precision").
    loss_kernel: str = field(default="auto", metadata=RESUME_MAY_CHANGE)
    # The bias adds of c_attn (with the split into heads) and of the MLP's c_proj (with the
    # residual add) with their gradients, sums over tokens, fused into the pass that writes the
    # cotangent (kernels/bias_add/). The same function. auto: pallas when compiling for a GPU,
    # xla elsewhere.
    bias_kernel: str = field(default="auto", metadata=RESUME_MAY_CHANGE)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            check(
                getattr(self, name) > 0,
                f"model.{name}",
                f"must be positive, got {getattr(self, name)}",
            )
        check(
            self.n_embd % self.n_head == 0,
            "model.n_embd",
            f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}; choose n_embd as a "
            f"multiple of n_head (e.g. {self.n_head * max(1, round(self.n_embd / self.n_head))})",
        )
        check(0.0 <= self.dropout < 1.0, "model.dropout", f"must be in [0, 1), got {self.dropout}")
        check_choice(self.dtype, "model.dtype", DTYPES)
        check_choice(self.residual_dtype, "model.residual_dtype", DTYPES)
        check(
            isinstance(self.scan_layers, bool) or self.scan_layers == "auto",
            "model.scan_layers",
            f"must be auto (unrolled on a GPU, scanned elsewhere), true (one nn.scan over the "
            f"blocks) or false (unrolled), got {self.scan_layers!r}",
        )
        if isinstance(self.remat, bool):  # the earlier boolean form
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        check_choice(self.remat, "model.remat", REMAT)
        if isinstance(self.loss_chunk, str):
            check(
                self.loss_chunk == "auto",
                "model.loss_chunk",
                f"must be an int >= 0 (tokens; 0 = no chunking) or 'auto', got {self.loss_chunk!r}",
            )
        else:
            check(
                not isinstance(self.loss_chunk, bool) and self.loss_chunk >= 0,
                "model.loss_chunk",
                f"must be an int >= 0 (tokens; 0 = no chunking) or 'auto', got {self.loss_chunk!r}",
            )
        check(
            self.short_conv >= 0,
            "model.short_conv",
            f"must be >= 0 (0: none), got {self.short_conv}",
        )
        check(
            not (self.identity_state_mixer and self.mlp),
            "model.identity_state_mixer",
            "replaces the MLP, so it needs model.mlp: false (set mlp: false or drop the option)",
        )
        check_choice(self.layernorm_kernel, "model.layernorm_kernel", FUSED_KERNELS)
        check_choice(self.mlp_kernel, "model.mlp_kernel", FUSED_KERNELS)
        check_choice(self.loss_kernel, "model.loss_kernel", LOSS_KERNELS)
        check_choice(self.bias_kernel, "model.bias_kernel", FUSED_KERNELS)
        check(
            self.loss_positions >= 0,
            "model.loss_positions",
            f"must be >= 0 (0: every position), got {self.loss_positions}",
        )

    @property
    def is_gpt2(self) -> bool:
        """The architecture nanoGPT and Hugging Face GPT-2 can represent (MLP, no convolution,
        q and k of the head dim without a normalisation of their own)."""
        options = getattr(self, "attention_options", None)
        extra = getattr(options, "feature_dim", 0) or getattr(self, "qk_layer_norm", False)
        return self.mlp and self.short_conv == 0 and not extra


@dataclass(frozen=True, init=False)
class ModelConfig(ArchConfig):
    """Everything the model needs, hashable: architecture, attention name, its options.

    Build it directly, with the attention's options as keywords beside the architecture's
    (``ModelConfig(n_layer=2, n_head=2, n_embd=64, attention="LT_chunked", chunk_size=16)``),
    from a preset (``ModelConfig.preset("124M")``) or from a run config
    (``Config.model_config``). Options read as attributes too (``cfg.chunk_size``); an option
    only another built-in variant declares is checked and dropped, as in configs.
    """

    attention: str = "softmax"
    # The variant's options: an instance of its spec's options class (frozen, so hashable).
    attention_options: Options = field(default_factory=Options)

    def __init__(
        self, attention: str = "softmax", attention_options: Options | None = None, **values: Any
    ) -> None:
        arch_names = {f.name for f in fields(ArchConfig)}
        arch = {k: values.pop(k) for k in list(values) if k in arch_names}
        ArchConfig.__init__(self, **arch)  # sets and checks the architecture's fields
        spec = schema.spec_of(attention, prefix="")
        if attention_options is not None:
            if not isinstance(attention_options, Options):
                raise TypeError(
                    f"attention_options must be an Options instance, got {attention_options!r}"
                )
            # Another variant's options (a replace of the name): the fields both declare carry.
            own = declared(spec.options)
            kept = {k: v for k, v in attention_options.as_dict().items() if k in own}
            values = {**kept, **values}
        object.__setattr__(self, "attention", attention)
        object.__setattr__(self, "attention_options", schema.parse(spec, values, prefix=""))

    def __getattr__(self, name: str) -> Any:
        # Only called when normal lookup fails: the attention's options, read flat.
        options = self.__dict__.get("attention_options")
        if name.startswith("__") or options is None or name not in declared(type(options)):
            where = f" (attention {self.__dict__.get('attention')!r} has no option {name!r})"
            raise AttributeError(f"ModelConfig has no attribute {name!r}{where}")
        return getattr(options, name)

    @property
    def spec(self) -> attention.AttentionSpec:
        """The attention variant's spec (``linear_gpt2.attention.spec``)."""
        return attention.spec(self.attention)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def qk_dim(self) -> int:
        """The dimension of q and k per head: ``feature_dim`` when set (the linear family's
        projection, Based's 16), else the head dim."""
        return getattr(self.attention_options, "feature_dim", 0) or self.head_dim

    @property
    def qk_layer_norm(self) -> bool:
        """Whether the attention layer normalises q and k with a learned affine before the
        feature map (ReBased's gamma * LayerNorm(x) + beta: ``feature_map: rebased``)."""
        feature_map = getattr(self.attention_options, "feature_map", None)
        return feature_map is not None and attention.feature_maps.get(feature_map).layer_norm

    def replace(self, **changes: Any) -> ModelConfig:
        """A copy with ``changes``: architecture fields, ``attention``, or attention options."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> ModelConfig:
        """A GPT-2 size by name (``124M``, ``355M``, ``774M``, ``1.6B`` or the Hugging Face names
        ``gpt2``, ``gpt2-medium``, ``gpt2-large``, ``gpt2-xl``), with field overrides."""
        return cls(**{**preset_values(name), **overrides})


# nanoGPT's from_pretrained table; head dim is 64 in all four.
PRESETS: dict[str, dict[str, int]] = {
    "124M": dict(n_layer=12, n_head=12, n_embd=768),
    "355M": dict(n_layer=24, n_head=16, n_embd=1024),
    "774M": dict(n_layer=36, n_head=20, n_embd=1280),
    "1.6B": dict(n_layer=48, n_head=25, n_embd=1600),
}
PRESET_ALIASES = {"gpt2": "124M", "gpt2-medium": "355M", "gpt2-large": "774M", "gpt2-xl": "1.6B"}


def preset_values(name: str) -> dict[str, int]:
    canonical = PRESET_ALIASES.get(name, name)
    if canonical not in PRESETS:
        check_choice(name, "model.preset", [*PRESETS, *PRESET_ALIASES])
    return dict(PRESETS[canonical])
