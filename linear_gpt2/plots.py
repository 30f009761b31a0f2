"""The post's figures from our result files: step time and sampling time against context
(log-log, fitted slopes in the legend), and the learning study's loss curves.

Inputs are plain records so the functions serve the scripts, the notebooks and the tests alike:

- step time: the ``results`` of a :mod:`linear_gpt2.bench` JSON file (dicts with ``attention``,
  ``size``, ``context``, ``status``, ``median_ms``, ``chunk_size``);
- sampling time: the rows of a :mod:`linear_gpt2.sampling` benchmark (``decoder``, ``context``,
  ``median_ms``);
- learning: :class:`Run` objects, read from run directories (``metrics.jsonl`` +
  ``config.yaml``, see :func:`load_run`) or from a wandb project (:func:`load_wandb_runs`).

Matplotlib runs headless (Agg); each function writes one PNG and returns its path.
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

SOFTMAX_FAMILY = ("softmax", "flash")


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (creating its folder) and free it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    _plt().close(fig)
    return out


def _mark(ax, x: float, y: float, tag: str, color) -> None:
    """An x marker with a small label (an OOM or failed setting) at ``(x, y)``."""
    ax.plot([x], [y], "x", ms=9, mew=2, color=color)
    ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)


def loglog_slope(x: Sequence[float], y: Sequence[float]) -> float | None:
    """Least-squares slope of log y on log x (y ~ x^slope); None for fewer than two points."""
    pts = [(a, b) for a, b in zip(x, y) if a and b and a > 0 and b > 0]
    if len(pts) < 2:
        return None
    return float(np.polyfit(np.log([p[0] for p in pts]), np.log([p[1] for p in pts]), 1)[0])


def context_label(t: int) -> str:
    """1024 -> ``1k``, 65536 -> ``64k``, 1048576 -> ``1M``; the post's axis labels."""
    if t >= 2**20 and t % 2**20 == 0:
        return f"{t // 2**20}M"
    if t >= 1024 and t % 1024 == 0:
        return f"{t // 1024}k"
    return str(t)


def _context_axis(ax, contexts: Iterable[int]) -> None:
    ticks = sorted(set(contexts))
    ax.set_xscale("log", base=2)
    if ax.has_data() and any(len(line.get_ydata()) for line in ax.get_lines()):
        ax.set_yscale("log")  # not when nothing was measured (every setting out of memory)
    if ticks:
        ax.set_xticks(ticks)
        ax.set_xticklabels([context_label(t) for t in ticks], rotation=0)
        ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    ax.grid(alpha=0.3, which="both")


def plot_step_times(
    results: Sequence[dict[str, Any]],
    size: str,
    path: str | Path,
    title: str | None = None,
) -> Path:
    """Milliseconds per training step against context for one model ``size``: one line per
    attention with its fitted log-log slope in the legend (the post's figure 2); an ``x`` marks
    the context that ran out of memory, drawn at the line's last measured time."""
    plt = _plt()
    rows = [r for r in results if r["size"] == size]
    names = list(dict.fromkeys(r["attention"] for r in rows))
    fig, ax = plt.subplots(figsize=(7.5, 5))
    for name in names:
        ok = sorted(
            (r["context"], r["median_ms"])
            for r in rows
            if r["attention"] == name and r["status"] == "ok"
        )
        bad = [r for r in rows if r["attention"] == name and r["status"] != "ok"]
        slope = loglog_slope(*zip(*ok)) if len(ok) >= 2 else None
        label = name + (f" (slope {slope:.2f})" if slope is not None else "")
        if ok:
            (line,) = ax.plot(*zip(*ok), "o-", ms=4, label=label)
            color = line.get_color()
        else:
            color = None
        for r in bad:
            y = ok[-1][1] if ok else None
            if y is None:
                continue
            tag = "OOM" if r["status"] == "oom" else "error"
            _mark(ax, r["context"], y, tag, color)
        if not ok and bad:
            ax.plot([], [], "x", label=f"{name} (OOM at {context_label(bad[0]['context'])})")
    _context_axis(ax, [r["context"] for r in rows])
    ax.set_ylabel("ms per training step (fwd + bwd + AdamW)")
    ax.set_title(title or f"GPT-2 {size}: time per training step, batch 1")
    ax.legend(fontsize=8)
    return _save(fig, path)


def plot_memory_frontier(
    points: Sequence[dict[str, Any]],
    path: str | Path,
    budget_gib: float,
    post_frontier: dict[str, dict[str, int]] | None = None,
    title: str | None = None,
) -> Path:
    """Memory per device of the training step against context, compiled for a target: one panel
    per model size, one line per attention (the cheapest memory setting that fits at each
    context), an ``x`` where not even the most frugal setting fits, the budget as a horizontal
    line, and the post's largest context as a triangle on the budget line."""
    plt = _plt()
    sizes = list(dict.fromkeys(p["size"] for p in points))
    fig, axes = plt.subplots(1, len(sizes), figsize=(5.2 * len(sizes), 4.6), squeeze=False)
    for ax, size in zip(axes[0], sizes):
        rows = [p for p in points if p["size"] == size]
        for name in dict.fromkeys(p["attention"] for p in rows):
            mine = sorted(
                (p["context"], p["memory_bytes"] / 2**30)
                for p in rows
                if p["attention"] == name and p["status"] == "fits"
            )
            over = [p for p in rows if p["attention"] == name and p["status"] == "too_big"]
            (line,) = ax.plot(*zip(*mine), "o-", ms=3, label=name) if mine else ax.plot([], [])
            for p in over:
                if p["memory_bytes"]:
                    _mark(ax, p["context"], p["memory_bytes"] / 2**30, "", line.get_color())
            post = (post_frontier or {}).get(size, {}).get(name)
            if post:
                ax.plot([post], [budget_gib], "v", ms=8, color=line.get_color(), alpha=0.7)
        ax.axhline(budget_gib, color="k", lw=1, ls="--")
        ax.text(1024, budget_gib * 1.08, f"budget {budget_gib:g} GiB", fontsize=7)
        _context_axis(ax, [p["context"] for p in rows])
        ax.set_ylabel("GiB per device (compiled step)")
        ax.set_title(f"GPT-2 {size}")
        ax.legend(fontsize=7)
    fig.suptitle(
        title or "Training-step memory vs context (x: does not fit; triangle: the post's limit)",
        fontsize=10,
    )
    return _save(fig, path)


def plot_sample_times(
    rows: Sequence[dict[str, Any]], path: str | Path, title: str | None = None
) -> Path:
    """Milliseconds to sample the next token against context: one line per decoder (KV cache,
    recurrent state), fitted log-log slope in the legend (the post's sampling figure)."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name in dict.fromkeys(r["decoder"] for r in rows):
        pts = sorted(
            (r["context"], r["median_ms"])
            for r in rows
            if r["decoder"] == name and r.get("median_ms")
        )
        oom = [r["context"] for r in rows if r["decoder"] == name and r.get("status") == "oom"]
        slope = loglog_slope(*zip(*pts)) if len(pts) >= 2 else None
        label = name + (f" (slope {slope:.2f})" if slope is not None else "")
        (line,) = ax.plot(*zip(*pts), "o-", ms=4, label=label) if pts else ax.plot([], [])
        for ctx in oom[:1]:
            if pts:
                _mark(ax, ctx, pts[-1][1], "OOM", line.get_color())
    _context_axis(ax, [r["context"] for r in rows])
    ax.set_ylabel("ms per sampled token")
    ax.set_title(title or "time to sample the next token")
    ax.legend(fontsize=8)
    return _save(fig, path)


# --------------------------------------------------------------------------------------------
# Learning curves


@dataclasses.dataclass
class Run:
    """One training run: its name, resolved config as dotted keys, and its per-step records
    (the ``metrics.jsonl`` lines: ``step``, ``loss``, ``hours``, optional ``val_loss``)."""

    name: str
    config: dict[str, Any]
    records: list[dict[str, Any]]
    n_params: int | None = None

    @property
    def attention(self) -> str:
        return str(self.config.get("attention.name", "?"))

    @property
    def family(self) -> str:
        """``softmax`` (softmax, flash) or ``linear`` (the LT_* variants)."""
        return "softmax" if self.attention in SOFTMAX_FAMILY else "linear"

    @property
    def context(self) -> int:
        return int(self.config.get("data.context", 0))

    @property
    def variant(self) -> str:
        """The attention and what it forgets: ``flash``, ``LT_chunked``, ``LT_chunked+reset``,
        ``LT_chunked+gate`` (``+fixed`` for RetNet's decay; a non-default feature map is added
        as ``/elu1``; ``+conv3`` for a short convolution)."""
        name = self.attention
        fmap = self.config.get("attention.feature_map", "softplus")
        if self.family == "linear" and fmap not in (None, "softplus"):
            name += f"/{fmap}"
        if self.config.get("attention.doc_reset"):
            name += "+reset"
        if self.config.get("attention.decay") not in (None, "none"):
            name += f"+{self.config['attention.decay']}"
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
        from linear_gpt2.config import PRESETS

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
    from linear_gpt2.config import ModelConfig

    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k.split(".", 1)[1]: v for k, v in config.items() if k.startswith("model.")}
    if not architecture_only and config.get("attention.decay") not in (None, "none"):
        values["decay"] = config["attention.decay"]  # the gate's projection
        values["attention"] = "LT_state"
    key = tuple(sorted((k, v) for k, v in values.items() if k in fields))
    return _count_params(key, architecture_only)


@functools.lru_cache(maxsize=64)
def _count_params(key: tuple[tuple[str, Any], ...], non_embedding: bool = False) -> int | None:
    try:
        from linear_gpt2.config import ModelConfig
        from linear_gpt2.model import count_params, param_shapes

        return count_params(param_shapes(ModelConfig(**dict(key))), non_embedding=non_embedding)
    except Exception:
        return None


def load_run(run_dir: str | Path) -> Run:
    """A local run directory: ``config.yaml`` (the resolved config) and ``metrics.jsonl``."""
    d = Path(run_dir)
    config = flatten(yaml.safe_load((d / "config.yaml").read_text()) or {})
    records = []
    metrics = d / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue  # a line cut by a preemption
    name = str(config.get("log.name") or d.name)
    return Run(name, config, records, count_params_of(config))


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
    x-axis, so the records look like ``metrics.jsonl``'s."""
    import wandb

    api = wandb.Api()
    path = f"{entity}/{project}" if entity else project
    filters = {"group": group} if group else None
    runs = []
    for wr in api.runs(path, filters=filters):
        config = {k: v for k, v in dict(wr.config).items() if not k.startswith("_")}
        records = list(wr.scan_history(keys=["step", "loss", "hours"]))
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


def plot_learning_curves(
    runs: Sequence[Run], path: str | Path, smooth: float = 0.9, title: str | None = None
) -> Path:
    """The post's learning figure: loss against steps (left) and hours (right), one colour per
    context, solid for linear attention and dashed for softmax."""
    plt = _plt()
    contexts = sorted({r.context for r in runs})
    cmap = plt.get_cmap("viridis")
    colors = {c: cmap(i / max(1, len(contexts) - 1)) for i, c in enumerate(contexts)}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, x in zip(axes, ("step", "hours")):
        for r in runs:
            xs, ys = r.series(x, "loss")
            if xs.size == 0:
                continue
            ls = "--" if r.family == "softmax" else "-"
            label = f"{r.family} ({r.attention}), ctx {context_label(r.context)}"
            ax.plot(xs, ema(ys, smooth), ls, color=colors[r.context], lw=1.3, label=label)
        ax.set_xlabel("update steps" if x == "step" else "hours")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss" + (f" (EMA {smooth})" if smooth > 0 else ""))
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[1].legend(handles, labels, fontsize=7)
    fig.suptitle(title or "loss: linear (solid) vs softmax (dashed), by context")
    return _save(fig, path)


def context_table(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """The learning study by context: one row per run (sorted by size, variant, context) with
    its final held-out loss (``val``, the last evaluation), final training loss (``train``),
    ``loss`` (``val``, or ``train`` for runs without evaluations, ``held_out`` saying which) and
    ``gap``: ``loss`` minus that of the softmax baseline (:attr:`Run.is_baseline`, e.g.
    ``flash``) of the same size and context (None without one); also the run's ``seed``,
    ``train_s`` (its step times summed) and ``spikes`` (the trainer's last spike count)."""
    rows = []
    for r in runs:
        steps, _ = r.series("step", "loss")
        _, times = r.series("step", "step_time_s")
        _, spikes = r.series("step", "diag/spikes")
        rows.append(
            dict(
                name=r.name,
                size=r.size,
                variant=r.variant,
                context=r.context,
                seed=r.config.get("seed"),
                steps=int(steps[-1]) if steps.size else 0,
                val=r.final_val_loss(),
                train=r.final_loss(),
                train_s=round(float(times.sum()), 1) if times.size else None,
                spikes=int(spikes[-1]) if spikes.size else None,
                baseline=r.is_baseline,
            )
        )
    for x in rows:
        x["held_out"] = x["val"] is not None
        x["loss"] = x["val"] if x["held_out"] else x["train"]
    base = {(x["size"], x["context"]): x["loss"] for x in rows if x["baseline"]}
    for x in rows:
        ref = base.get((x["size"], x["context"]))
        x["gap"] = x["loss"] - ref if x["loss"] is not None and ref is not None else None
    # The baseline first, then the variants in the order the runs came.
    variants = [r.variant for r in runs if r.is_baseline] + [r.variant for r in runs]
    order = {v: i for i, v in enumerate(dict.fromkeys(variants))}
    return sorted(rows, key=lambda x: (x["size"], order[x["variant"]], x["context"]))


def context_table_markdown(rows: Sequence[dict[str, Any]]) -> str:
    """:func:`context_table` as a Markdown table per size: final loss per variant (rows) and
    context (columns), held-out (training loss, marked ``*``, for runs never evaluated), with
    the gap to the softmax baseline in parentheses."""
    out = []
    for size in dict.fromkeys(x["size"] for x in rows):
        mine = [x for x in rows if x["size"] == size]
        contexts = sorted({x["context"] for x in mine})
        by = {(x["variant"], x["context"]): x for x in mine}
        out += [
            f"| {size} | " + " | ".join(context_label(c) for c in contexts) + " |",
            "|---" * (len(contexts) + 1) + "|",
        ]
        for v in dict.fromkeys(x["variant"] for x in mine):
            cells = []
            for c in contexts:
                x = by.get((v, c))
                if x is None or x["loss"] is None:
                    cells.append("")
                    continue
                mark = "" if x["held_out"] else "*"
                gap = "" if x["baseline"] or x["gap"] is None else f" ({x['gap']:+.3f})"
                cells.append(f"{x['loss']:.3f}{mark}{gap}")
            out.append(f"| {v} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def plot_final_loss_vs_context(
    runs: Sequence[Run], path: str | Path, title: str | None = None
) -> Path:
    """Final held-out loss (training loss for runs never evaluated) against context (log2 x),
    one line per attention variant, dashed for softmax (the post's "final loss by context"
    figure)."""
    plt = _plt()
    rows = [x for x in context_table(runs) if x["loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in dict.fromkeys(x["variant"] for x in rows):
        pts = sorted((x["context"], x["loss"]) for x in rows if x["variant"] == v)
        base = any(x["baseline"] for x in rows if x["variant"] == v)
        ax.plot(*zip(*pts), "s--" if base else "o-", ms=5, label=v)
    contexts = sorted({x["context"] for x in rows})
    ax.set_xscale("log", base=2)
    if contexts:
        ax.set_xticks(contexts)
        ax.set_xticklabels([context_label(c) for c in contexts])
        ax.minorticks_off()
    ax.set_xlabel("context length (tokens)")
    held_out = all(x["held_out"] for x in rows)
    ax.set_ylabel("final held-out loss" if held_out else "final loss (held-out where evaluated)")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    ax.set_title(title or "final held-out loss vs context")
    return _save(fig, path)


def plot_curves_by_context(
    runs: Sequence[Run], path: str | Path, smooth: float = 0.9, title: str | None = None
) -> Path:
    """One panel per context: training loss (EMA, lines) and held-out loss (markers) against
    steps, one colour per attention variant (the post's "curves per context" figure)."""
    plt = _plt()
    contexts = sorted({r.context for r in runs})
    variants = list(dict.fromkeys(r.variant for r in runs))
    colors = {v: plt.get_cmap("tab10")(i % 10) for i, v in enumerate(variants)}
    n = max(1, len(contexts))
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n + 1, 4), sharey=True, squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for r in (r for r in runs if r.context == ctx):
            xs, ys = r.series("step", "loss")
            ls = "--" if r.is_baseline else "-"
            if xs.size:
                ax.plot(xs, ema(ys, smooth), ls, color=colors[r.variant], lw=1.2, label=r.variant)
            vx, vy = r.series("step", "val_loss")
            if vx.size:
                ax.plot(vx, vy, "o", ms=3, color=colors[r.variant])
        ax.set_title(f"context {context_label(ctx)}")
        ax.set_xlabel("update steps")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("loss (lines: train EMA; dots: held-out)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    if handles:
        axes[0][-1].legend(handles, labels, fontsize=7)
    fig.suptitle(title or "learning curves by context")
    return _save(fig, path)


def final_loss_table(runs: Sequence[Run]) -> list[dict[str, Any]]:
    """One row per run: name, size, params, context, attention, family, steps, hours, final
    loss."""
    rows = []
    for r in runs:
        steps, _ = r.series("step", "loss")
        hours, _ = r.series("hours", "loss")
        rows.append(
            dict(
                name=r.name,
                size=r.size,
                n_params=r.n_params,
                context=r.context,
                attention=r.attention,
                family=r.family,
                steps=int(steps[-1]) if steps.size else 0,
                hours=float(hours[-1]) if hours.size else None,
                final_loss=r.final_loss(),
            )
        )
    return rows


def plot_final_loss_vs_params(
    runs: Sequence[Run], path: str | Path, title: str | None = None
) -> Path:
    """Final training loss against parameter count (log x), one colour per context, solid
    circles for linear and dashed squares for softmax (the post's scaling figure)."""
    plt = _plt()
    rows = [r for r in final_loss_table(runs) if r["final_loss"] is not None and r["n_params"]]
    contexts = sorted({r["context"] for r in rows})
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ctx in enumerate(contexts):
        color = cmap(i / max(1, len(contexts) - 1))
        for fam, style in (("linear", "o-"), ("softmax", "s--")):
            pts = sorted(
                (r["n_params"], r["final_loss"])
                for r in rows
                if r["context"] == ctx and r["family"] == fam
            )
            if pts:
                ax.plot(*zip(*pts), style, color=color, label=f"{fam}, ctx {context_label(ctx)}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final training loss")
    ax.grid(alpha=0.3, which="both")
    if rows:
        ax.legend(fontsize=7)
    ax.set_title(title or "final loss vs model size")
    return _save(fig, path)
