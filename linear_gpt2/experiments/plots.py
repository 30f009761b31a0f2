"""The post's figures from our result files: step time and sampling time against context
(log-log, fitted slopes in the legend), and the learning study's loss curves.

Inputs are plain records so the functions serve the scripts, the notebooks and the tests alike:

- step time: the ``results`` of a :mod:`studies.train_step.step_time` JSON file (dicts with ``attention``,
  ``size``, ``context``, ``status``, ``median_ms``, ``chunk_size``);
- sampling time: the rows of a :mod:`studies.sample_time.sample_time` benchmark (``decoder``, ``context``,
  ``median_ms``);
- learning: :class:`~linear_gpt2.experiments.runs.Run` objects, read from run directories (``metrics.jsonl`` +
  ``config.yaml``, see :func:`load_run`) or from a wandb project (:func:`load_wandb_runs`).

Matplotlib runs headless (Agg); each function writes one PNG and returns its path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from linear_gpt2.experiments.axes import context_label, loglog_slope
from linear_gpt2.experiments.runs import Run, context_table, ema, final_loss_table, run_labels


def pyplot():
    # matplotlib: imported only to draw (headless).
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: str | Path) -> Path:
    """Write ``fig`` as a PNG at ``path`` (creating its folder) and free it."""
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=120)
    pyplot().close(fig)
    return out


def _mark(ax, x: float, y: float, tag: str, color) -> None:
    """An x marker with a small label (an OOM or failed setting) at ``(x, y)``."""
    ax.plot([x], [y], "x", ms=9, mew=2, color=color)
    ax.annotate(tag, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7, color=color)


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
    plt = pyplot()
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
    return save(fig, path)


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
    plt = pyplot()
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
    return save(fig, path)


def plot_sample_times(
    rows: Sequence[dict[str, Any]], path: str | Path, title: str | None = None
) -> Path:
    """Milliseconds to sample the next token against context: one line per decoder (KV cache,
    recurrent state), fitted log-log slope in the legend (the post's sampling figure)."""
    plt = pyplot()
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
    return save(fig, path)


# Line styles for the runs of one family at one context: solid (linear) or dashed (softmax)
# first, then the others, so two runs never share a colour and a style.
_STYLES = {
    "softmax": ["--", (0, (3, 1, 1, 1)), (0, (6, 2)), (0, (3, 1, 1, 1, 1, 1))],
    "linear": ["-", ":", "-.", (0, (1, 3))],
}


def plot_learning_curves(
    runs: Sequence[Run], path: str | Path, smooth: float = 0.9, title: str | None = None
) -> Path:
    """The post's learning figure: loss against steps (left) and hours (right), one colour per
    context, solid for linear attention and dashed for softmax; runs of one family at one
    context (two chunk sizes, say) get styles of their own and their labels say what differs
    (:func:`~linear_gpt2.experiments.runs.run_labels`)."""
    plt = pyplot()
    contexts = sorted({r.context for r in runs})
    cmap = plt.get_cmap("viridis")
    colors = {c: cmap(i / max(1, len(contexts) - 1)) for i, c in enumerate(contexts)}
    labels, styles, taken = run_labels(runs), [], {}
    for r in runs:
        family = "softmax" if r.family == "softmax" else "linear"
        i = taken[(r.context, family)] = taken.get((r.context, family), -1) + 1
        styles.append(_STYLES[family][i % len(_STYLES[family])])
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, x in zip(axes, ("step", "hours")):
        for r, label, ls in zip(runs, labels, styles):
            xs, ys = r.series(x, "loss")
            if xs.size == 0:
                continue
            label = f"{r.family} ({label}), ctx {context_label(r.context)}"
            ax.plot(xs, ema(ys, smooth), ls=ls, color=colors[r.context], lw=1.3, label=label)
        ax.set_xlabel("update steps" if x == "step" else "hours")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("training loss" + (f" (EMA {smooth})" if smooth > 0 else ""))
    handles, labels = axes[0].get_legend_handles_labels()
    if handles:
        axes[1].legend(handles, labels, fontsize=7)
    fig.suptitle(title or "loss: linear (solid) vs softmax (dashed), by context")
    return save(fig, path)


def plot_final_loss_vs_context(
    runs: Sequence[Run], path: str | Path, title: str | None = None
) -> Path:
    """Final held-out loss (training loss for runs never evaluated) against context (log2 x),
    one line per run label (the attention variant and what else differs), dashed for softmax
    (the post's "final loss by context" figure)."""
    plt = pyplot()
    rows = [x for x in context_table(runs) if x["loss"] is not None]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for v in dict.fromkeys(x["label"] for x in rows):
        pts = sorted((x["context"], x["loss"]) for x in rows if x["label"] == v)
        base = any(x["baseline"] for x in rows if x["label"] == v)
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
    return save(fig, path)


def plot_curves_by_context(
    runs: Sequence[Run], path: str | Path, smooth: float = 0.9, title: str | None = None
) -> Path:
    """One panel per context: training loss (EMA, lines) and held-out loss (markers) against
    steps, one colour per run label (the attention variant and what else differs; the post's
    "curves per context" figure)."""
    plt = pyplot()
    contexts = sorted({r.context for r in runs})
    labels = run_labels(runs)
    names = list(dict.fromkeys(labels))
    colors = {v: plt.get_cmap("tab10" if len(names) <= 10 else "tab20")(i % 20)
              for i, v in enumerate(names)}  # fmt: skip
    n = max(1, len(contexts))
    fig, axes = plt.subplots(1, n, figsize=(3.6 * n + 1, 4), sharey=True, squeeze=False)
    for ax, ctx in zip(axes[0], contexts):
        for r, label in zip(runs, labels):
            if r.context != ctx:
                continue
            xs, ys = r.series("step", "loss")
            ls = "--" if r.is_baseline else "-"
            if xs.size:
                ax.plot(xs, ema(ys, smooth), ls, color=colors[label], lw=1.2, label=label)
            vx, vy = r.series("step", "val_loss")
            if vx.size:
                ax.plot(vx, vy, "o", ms=3, color=colors[label])
        ax.set_title(f"context {context_label(ctx)}")
        ax.set_xlabel("update steps")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("loss (lines: train EMA; dots: held-out)")
    # Every panel's lines in one legend, each label once.
    legend: dict[str, Any] = {}
    for ax in axes[0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, h)
    if legend:
        axes[0][-1].legend(list(legend.values()), list(legend), fontsize=7)
    fig.suptitle(title or "learning curves by context")
    return save(fig, path)


def plot_final_loss_vs_params(
    runs: Sequence[Run], path: str | Path, title: str | None = None
) -> Path:
    """Final training loss against parameter count (log x), one colour per context, solid
    circles for linear and dashed squares for softmax (the post's scaling figure): one line
    per run label (the attention variant and what else differs,
    :func:`~linear_gpt2.experiments.runs.run_labels`), so runs that differ are not joined."""
    plt = pyplot()
    table = final_loss_table(runs)
    rows = [r for r in table if r["final_loss"] is not None and r["n_params"]]
    contexts = sorted({r["context"] for r in rows})
    cmap = plt.get_cmap("viridis")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, ctx in enumerate(contexts):
        color = cmap(i / max(1, len(contexts) - 1))
        for fam, style in (("linear", "o-"), ("softmax", "s--")):
            mine = [r for r in rows if r["context"] == ctx and r["family"] == fam]
            for label in dict.fromkeys(r["label"] for r in mine):
                pts = sorted((r["n_params"], r["final_loss"]) for r in mine if r["label"] == label)
                ax.plot(*zip(*pts), style, color=color, label=f"{label}, ctx {context_label(ctx)}")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final training loss")
    ax.grid(alpha=0.3, which="both")
    if rows:
        ax.legend(fontsize=7)
    ax.set_title(title or "final loss vs model size")
    return save(fig, path)
