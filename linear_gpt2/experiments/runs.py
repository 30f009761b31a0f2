"""Training runs as records: a run directory's (or a wandb run's) config and per-step metrics,
and the tables of the learning study built from them (final loss against context and size).

A run's family (``softmax``, ``linear``) comes from its attention's spec; a run of a variant
whose package is not installed here is ``other``.

Runs compared side by side are told apart by what differs among them (:func:`run_labels`): a
run's :attr:`Run.variant` (attention and what it forgets), plus every setting that differs
between runs of that variant at one context and size (``chunk_size=64``, ``kernel=pallas``,
``context_parallel=2``, a variant's own ``attention.extra`` option, ``seed=1``), plus the run's
name where nothing else does: no table row or curve ever stands for two runs.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from linear_gpt2 import attention as attention_registry
from linear_gpt2.attention import schema as attention_schema
from linear_gpt2.experiments.axes import context_label
from linear_gpt2.model.api import count_params, param_shapes
from linear_gpt2.model.config import PRESETS, ArchConfig, ModelConfig
from linear_gpt2.platform.errors import DataError


@dataclasses.dataclass
class Run:
    """One training run: its name, resolved config as dotted keys, and its per-step records
    (the ``metrics.jsonl`` lines: ``step``, ``loss``, ``hours``, optional ``val_loss``)."""

    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    n_params: int | None = None
    # Where and with what each start of the run trained (``run_info.jsonl``: start step, device,
    # versions, commit, host, time); empty for runs older than that file.
    starts: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    @property
    def commits(self) -> list[str]:
        """The commits the run trained at, in order of its starts (unknown ones left out)."""
        return list(dict.fromkeys(s["git_commit"] for s in self.starts if s.get("git_commit")))

    @property
    def attention(self) -> str:
        return str(self.config.get("attention.name", "?"))

    @property
    def family(self) -> str:
        """The attention's family from its spec: ``softmax``, ``linear``, or ``other`` (a variant
        whose package is not installed here)."""
        return attention_registry.family(self.attention, default="other")

    @property
    def context(self) -> int:
        return int(self.config.get("data.context", 0))

    @property
    def variant(self) -> str:
        """The attention and what its options change, as the spec's options label them:
        ``flash``, ``LT_chunked``, ``LT_chunked+reset``, ``LT_chunked+gate`` (``+fixed`` for
        RetNet's decay; a non-default feature map is added as ``/elu1``), and ``+conv3`` for a
        short convolution."""
        prefix = "attention."
        options = {k[len(prefix) :]: v for k, v in self.config.items() if k.startswith(prefix)}
        name = attention_schema.label(self.attention, options)
        if self.config.get("model.short_conv"):
            name += f"+conv{self.config['model.short_conv']}"
        return name

    @property
    def is_baseline(self) -> bool:
        """Softmax attention without resets: what the post compares linear attention with."""
        return self.family == "softmax" and not self.config.get("attention.doc_reset")

    def final_val_loss(self) -> float | None:
        """The held-out loss of the last evaluation (the trainer evaluates at the last step)."""
        _, val = self.series("step", "val_loss")
        return float(val[-1]) if val.size else None

    @property
    def size(self) -> str:
        """``124M``-style label from the architecture: a preset's name, else the parameters of
        the model without its position embeddings and without a gate's projection (nanoGPT's
        count), so that one model swept over contexts and attentions is one size (the CPU
        grid's model has 3.43M parameters in all at context 128 and 3.55M at 2048, which the
        full count labelled 3M and 4M; without position embeddings it is 3.4M at both)."""
        dims = {k: self.config.get(f"model.{k}") for k in ("n_layer", "n_head", "n_embd")}
        for name, preset in PRESETS.items():
            if preset == dims:
                return name
        n = count_params_of(self.config, architecture_only=True)
        if not n:
            return "custom"
        return f"{n / 1e6:.1f}M" if n < 1e7 else f"{n / 1e6:.0f}M"

    def series(self, x: str = "step", y: str = "loss") -> tuple[np.ndarray, np.ndarray]:
        pts = [
            (r[x], r[y])
            for r in self.records
            if isinstance(r.get(x), (int, float)) and _finite(r.get(y)) and not r.get("skipped")
        ]
        if not pts:
            return np.zeros(0), np.zeros(0)
        a = np.asarray(pts, dtype=float)
        return a[:, 0], a[:, 1]

    def median_step_ms(self) -> float | None:
        """The median ``step_time_s`` of the logged steps in milliseconds, without the first
        step of each start (it compiles the program), unless nothing else is left."""
        steps, times = self.series("step", "step_time_s")
        if times.size == 0:
            return None
        starts = {int(s.get("start_step", 0)) + 1 for s in self.starts} or {int(steps[0])}
        warm = times[~np.isin(steps, list(starts))]
        return float(np.median(warm if warm.size else times)) * 1000

    def final_loss(self, frac: float = 0.02) -> float | None:
        """Mean training loss over the last ``frac`` of the logged steps (at least one): the
        post's "final loss", less noisy than the very last step."""
        _, loss = self.series("step", "loss")
        if loss.size == 0:
            return None
        n = max(1, int(round(loss.size * frac)))
        return float(loss[-n:].mean())


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key))
        else:
            out[key] = v
    return out


def count_params_of(config: dict[str, Any], architecture_only: bool = False) -> int | None:
    """Parameters of the model a flat config describes, by shapes only: all of them (embeddings
    and a gate's projection included), or with ``architecture_only`` those of the plain model
    without position embeddings (what stays fixed across a context and attention sweep)."""
    fields = {f.name for f in dataclasses.fields(ArchConfig)}
    values = {k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("model.")}
    values = {k: v for k, v in values.items() if k in fields}
    if not architecture_only and config.get("attention.decay") not in (None, "none"):
        values["decay"] = config["attention.decay"]  # the gate's projection
        values["attention"] = config.get("attention.name")
    key = tuple(sorted(values.items()))
    return _count_params(key, architecture_only)


@functools.lru_cache(maxsize=64)
def _count_params(key: tuple[tuple[str, Any], ...], non_embedding: bool = False) -> int | None:
    try:
        return count_params(param_shapes(ModelConfig(**dict(key))), non_embedding=non_embedding)
    except Exception:
        return None


def load_run(run_dir: str | Path) -> Run:
    """A local run directory: ``config.yaml`` (the resolved config) and ``metrics.jsonl``.

    A log that holds a step twice (two trainers wrote it at once, before run directories were
    locked) is refused with :class:`~linear_gpt2.platform.errors.DataError`: its curve would be
    drawn twice over itself."""
    d = Path(run_dir)
    config = flatten(yaml.safe_load((d / "config.yaml").read_text()) or {})
    metrics = d / "metrics.jsonl"
    records = _jsonl(metrics)  # a line cut by a preemption is skipped
    _refuse_duplicate_steps(records, metrics)
    name = str(config.get("log.name") or d.name)
    return Run(name, config, records, count_params_of(config), _jsonl(d / "run_info.jsonl"))


def _jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSONL file (none if it does not exist; a line cut short is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


def _refuse_duplicate_steps(records: list[dict[str, Any]], path: Path) -> None:
    seen: dict[int, int] = {}
    for i, r in enumerate(records):
        step = r.get("step") if isinstance(r, dict) else None
        if not isinstance(step, int):
            continue
        if step in seen:
            raise DataError(
                f"{path} holds step {step} twice (records {seen[step] + 1} and {i + 1}): two "
                "trainers wrote this run at once; resume the run once with scripts/train.py "
                "(it keeps the newest record of each step) or remove the older lines"
            )
        seen[step] = i


def _newest_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The last record of each step, in step order (a wandb run resumed after a preemption
    logs the steps it replays a second time)."""
    by_step: dict[Any, dict[str, Any]] = {}
    for r in records:
        by_step[r.get("step")] = r
    steps = sorted(s for s in by_step if isinstance(s, (int, float)))
    return [by_step[s] for s in steps]


def find_runs(roots: Iterable[str | Path]) -> list[Run]:
    """Every run directory (holding ``config.yaml`` and ``metrics.jsonl``) at or under
    ``roots``, sorted by (family, context, name)."""
    dirs: list[Path] = []
    for root in roots:
        root = Path(root)
        if (root / "metrics.jsonl").exists():
            dirs.append(root)
        else:
            dirs.extend(p.parent for p in sorted(root.rglob("metrics.jsonl")))
    runs = [load_run(d) for d in dict.fromkeys(dirs) if (d / "config.yaml").exists()]
    return sorted(runs, key=lambda r: (r.size, r.family, r.context, r.name))


def load_wandb_runs(project: str, group: str | None = None, entity: str | None = None) -> list[Run]:
    """Runs of a wandb project (optionally one ``log.wandb_group``) through the public API; needs
    network and a wandb login. The trainer logs the config as dotted keys and ``step`` as the
    x-axis, so the records look like ``metrics.jsonl``'s; steps a resumed run logged again are
    kept once (the newest), as the trainer keeps them in ``metrics.jsonl``."""
    # wandb: only to read runs from a project.
    import wandb

    api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    filters = {"group": group} if group else None
    runs = []
    for wr in api.runs(path, filters=filters):
        config = {k: v for k, v in dict(wr.config).items() if not k.startswith("_")}
        records = _newest_per_step(list(wr.scan_history(keys=["step", "loss", "hours"])))
        runs.append(Run(wr.name, config, records, count_params_of(config)))
    return runs


def ema(y: np.ndarray, alpha: float) -> np.ndarray:
    """Exponential moving average (``alpha`` = weight of history, 0 = no smoothing), debiased
    at the start like TensorBoard's smoothing."""
    if alpha <= 0 or y.size == 0:
        return y
    out, acc, w = np.empty_like(y), 0.0, 0.0
    for i, v in enumerate(y):
        acc, w = alpha * acc + (1 - alpha) * v, alpha * w + (1 - alpha)
        out[i] = acc / w
    return out


# Settings that never tell runs apart: where a run was written, logged and checkpointed, and
# where its data was read from.
_NOT_SETTINGS = ("log.", "checkpoint.", "data.path", "data.tokenized_dir", "data.num_proc",
                 "data.prefetch", "data.hf_")  # fmt: skip
# What a run's variant, size and context already say.
_SHOWN = ("attention.name", "attention.feature_map", "attention.doc_reset", "attention.decay",
          "model.short_conv", "model.n_layer", "model.n_head", "model.n_embd", "model.preset",
          "data.context")  # fmt: skip


def _setting(key: str) -> bool:
    return not key.startswith(_NOT_SETTINGS) and key not in _SHOWN


def _short(keys: Sequence[str]) -> dict[str, str]:
    """Each key's last part (``chunk_size``), the full key where two would read the same."""
    last = [k.rsplit(".", 1)[-1] for k in keys]
    return {k: (s if last.count(s) == 1 else k) for k, s in zip(keys, last)}


def run_labels(runs: Sequence[Run]) -> list[str]:
    """A label per run (aligned with ``runs``) that tells it from every other run of the same
    size and context: its :attr:`Run.variant`, then ``key=value`` for each setting that differs
    between runs of that variant at one context (the same keys for the variant at every
    context, so a row of a table reads across), ``seed`` last; then ``[name]`` for runs that
    still read the same."""
    keys: dict[tuple[str, str], set[str]] = {}
    groups: dict[tuple[str, str, int], list[Run]] = {}
    for r in runs:
        groups.setdefault((r.size, r.variant, r.context), []).append(r)
    for (size, variant, _), group in groups.items():
        found = keys.setdefault((size, variant), set())
        for k in {k for r in group for k in r.config if _setting(k)}:
            if len({repr(r.config.get(k)) for r in group}) > 1:
                found.add(k)
    labels = []
    for r in runs:
        ks = sorted(keys[(r.size, r.variant)], key=lambda k: (k == "seed", k))
        short = _short(ks)
        parts = [f"{short[k]}={r.config.get(k)}" for k in ks]
        labels.append(" ".join([r.variant, ", ".join(parts)]) if parts else r.variant)
    seen: dict[tuple[str, int, str], int] = {}
    for r, label in zip(runs, labels):
        key = (r.size, r.context, label)
        seen[key] = seen.get(key, 0) + 1
    for i, (r, label) in enumerate(zip(runs, labels)):
        if seen[(r.size, r.context, label)] > 1:
            labels[i] = f"{label} [{r.name}]"
    # Runs with the same name as well (two sweeps' run directories): their order.
    count: dict[tuple[str, int, str], int] = {}
    for i, r in enumerate(runs):
        key = (r.size, r.context, labels[i])
        count[key] = count.get(key, 0) + 1
        if count[key] > 1:
            labels[i] = f"{labels[i]} #{count[key]}"
    return labels


def context_table(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The learning study by context: one row per run (sorted by size, label, context) with
    its ``label`` (:func:`run_labels`), final held-out loss (``val``, the last evaluation),
    final training loss (``train``), ``loss`` (``val``, or ``train`` for runs without
    evaluations, ``held_out`` saying which) and ``gap``: ``loss`` minus that of the softmax
    baseline (:attr:`Run.is_baseline`, e.g. ``flash``) of the same size and context (the one of
    the same seed where there are several; None without one); also the run's ``seed``,
    ``train_s`` (its step times summed), ``step_ms`` (its median step,
    :meth:`Run.median_step_ms`) and ``spikes`` (the trainer's last spike count)."""
    rows = []
    for r, label in zip(runs, run_labels(runs)):
        steps, _ = r.series("step", "loss")
        _, times = r.series("step", "step_time_s")
        _, spikes = r.series("step", "diag/spikes")
        step_ms = r.median_step_ms()
        rows.append(
            dict(
                name=r.name,
                size=r.size,
                variant=r.variant,
                label=label,
                context=r.context,
                seed=r.config.get("seed"),
                steps=int(steps[-1]) if steps.size else 0,
                val=r.final_val_loss(),
                train=r.final_loss(),
                train_s=round(float(times.sum()), 1) if times.size else None,
                step_ms=round(step_ms, 2) if step_ms is not None else None,
                spikes=int(spikes[-1]) if spikes.size else None,
                baseline=r.is_baseline,
            )
        )
    for x in rows:
        x["held_out"] = x["val"] is not None
        x["loss"] = x["val"] if x["held_out"] else x["train"]
    bases: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for x in rows:
        if x["baseline"]:
            bases.setdefault((x["size"], x["context"]), []).append(x)
    for x in rows:
        refs = bases.get((x["size"], x["context"]), [])
        same_seed = [b for b in refs if b["seed"] == x["seed"]]
        ref = (same_seed or refs or [None])[0]
        ok = ref is not None and x["loss"] is not None and ref["loss"] is not None
        x["gap"] = x["loss"] - ref["loss"] if ok else None
    # The baselines first, then the other labels in the order the runs came.
    labels = [x["label"] for x in rows if x["baseline"]] + [x["label"] for x in rows]
    order = {v: i for i, v in enumerate(dict.fromkeys(labels))}
    return sorted(rows, key=lambda x: (x["size"], order[x["label"]], x["context"]))


def context_table_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`context_table` as a Markdown table per size: final loss per run label (rows) and
    context (columns), held-out (training loss, marked ``*``, for runs never evaluated), with
    the gap to the softmax baseline in parentheses and the median step time after it."""
    out = []
    for size in dict.fromkeys(x["size"] for x in rows):
        mine = [x for x in rows if x["size"] == size]
        contexts = sorted({x["context"] for x in mine})
        by = {(x["label"], x["context"]): x for x in mine}
        out += [
            f"| {size} | " + " | ".join(context_label(c) for c in contexts) + " |",
            "|---" * (len(contexts) + 1) + "|",
        ]
        for v in dict.fromkeys(x["label"] for x in mine):
            cells = []
            for c in contexts:
                x = by.get((v, c))
                if x is None or x["loss"] is None:
                    cells.append("")
                    continue
                mark = "" if x["held_out"] else "*"
                gap = "" if x["baseline"] or x["gap"] is None else f" ({x['gap']:+.3f})"
                ms = f", {_ms(x['step_ms'])}/step" if x.get("step_ms") is not None else ""
                cells.append(f"{x['loss']:.3f}{mark}{gap}{ms}")
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def _ms(ms: float) -> str:
    return f"{ms:.3g} ms" if ms < 100 else f"{ms:.0f} ms"


def final_loss_table(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per run: name, label (:func:`run_labels`), size, params, context, attention,
    family, steps, hours, final loss and median step time (``step_ms``)."""
    rows = []
    for r, label in zip(runs, run_labels(runs)):
        steps, _ = r.series("step", "loss")
        hours, _ = r.series("hours", "loss")
        rows.append(
            dict(
                name=r.name,
                label=label,
                size=r.size,
                n_params=r.n_params,
                context=r.context,
                attention=r.attention,
                family=r.family,
                steps=int(steps[-1]) if steps.size else 0,
                hours=float(hours[-1]) if hours.size else None,
                final_loss=r.final_loss(),
                step_ms=r.median_step_ms(),
            )
        )
    return rows
