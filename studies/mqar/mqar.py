"""MQAR on CPU: the two published protocols, our runs, and the report beside the papers' numbers.

Protocols (sweep files in ``configs/sweeps/``, one run per attention and setting, each a
normal training run of ``scripts/train.py`` on ``data.source: mqar``; see
``linear_gpt2/training/data/mqar.py`` for the task):

- ``mqar-zoology`` (``mqar_zoology.yaml``): Zoology's figure 2 cells (L, N) = (64, 4),
  (128, 8) and (256, 16), d_model 64, one head, learned positions, two attention-only
  layers. Published: attention and the best gated-convolution model (H3, Hyena, RWKV,
  BaseConv) at (256, 16), :data:`PUBLISHED`.
- ``mqar-rebased`` (``mqar_rebased.yaml``): the ReBased paper's length sweep (Aksenov et al.
  2024, corl-team/rebased), d_model 64, N = 16 at L = 128 and L / 4 beyond, with a kernel-3
  short convolution before the mixer. Published: Based (linear attention with a 2nd-order
  Taylor feature map) and attention (after the same convolution) per L, :data:`PUBLISHED`.

Both use models without biases (``model.bias: false``, ``configs/mqar/base.yaml``): with
GPT-2's biases softmax stayed on the 1/N plateau for thousands of updates where the same model
without them learned the task.

Both papers train AdamW (weight decay 0.1) on 100,000 examples for up to 64 epochs with a cosine
schedule, stop at 99% test accuracy, sweep the learning rate (Zoology 1e-4 .. 1e-2, 4 values;
ReBased 5e-4, 1e-3, 3e-3, 1e-2 with 5 seeds) and report the best. The CPU protocols keep the
task, the models and the stopping rule and shrink the rest (batch, steps, test set, one
learning rate and one seed), which the report states beside every number.

:func:`collect` reads finished run directories; :func:`write_report` writes
``mqar_cpu.{csv,json,md,png}``.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from linear_gpt2 import attention as attention_registry
from linear_gpt2.attention import feature_maps
from linear_gpt2.experiments.plots import pyplot, save
from linear_gpt2.experiments.runs import find_runs
from linear_gpt2.training.config import LogConfig
from studies.common.core import block, page
from studies.mqar import report
from studies.mqar.report import DECIMALS, best, cell_runs  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[2]

SWEEPS = {
    "mqar-zoology": REPO_ROOT / "configs" / "sweeps" / "mqar_zoology.yaml",
    "mqar-rebased": REPO_ROOT / "configs" / "sweeps" / "mqar_rebased.yaml",
}

# Published accuracies at d_model 64 (best over the learning-rate sweep), by protocol and L.
PUBLISHED: dict[str, dict[str, dict[int, float]]] = {
    "mqar-zoology": {
        "attention (Zoology fig. 2)": {64: 1.0, 128: 1.0, 256: 1.0},
        "best gated convolution (Zoology fig. 2, upper bound)": {256: 0.15},
    },
    "mqar-rebased": {
        "attention + conv (ReBased fig. 1)": {128: 1.0, 256: 1.0, 512: 1.0, 1024: 1.0},
        "Based (ReBased fig. 1)": {128: 1.0, 256: 0.98, 512: 0.89, 1024: 0.33},
        # Read off the figure's d_model 64 markers (corl-team/rebased main_fig.png), +-0.01.
        "ReBased (ReBased fig. 1, read off the figure)": {
            128: 1.0,
            256: 0.98,
            512: 0.89,
            1024: 0.55,
        },
    },
}
SOURCES = {
    "mqar-zoology": "Arora et al. 2023, Zoology, figure 2 (HazyResearch/zoology, "
    "zoology/experiments/paper/figure2.py at 66f4918, now "
    "zoology/experiments/paper_configs/iclr24_zoology_figure2/configs.py)",
    "mqar-rebased": "Aksenov et al. 2024, ReBased, figure 1 (corl-team/rebased, "
    "configs/main_fig_sweep.yaml)",
}


def variant(config: dict[str, Any]) -> str:
    """``softmax``, ``LT_chunked/softplus``, ``LT_chunked/elu1``, ``LT_chunked/softplus+gate``
    from a run's flat config; ``+conv`` for a short convolution at Zoology's cells
    (:func:`with_conv`); `` (random fill)`` when the task fills the non-query positions
    with random tokens instead of the papers' zeros, since that is another task, not a recipe."""
    name = str(config.get("attention.name"))
    if attention_registry.family(name, default="other") != "softmax":
        name += f"/{config.get('attention.feature_map', 'softplus')}"
        if config.get("attention.feature_dim"):  # q, k projected to it (Based's 16)
            name += f"({config['attention.feature_dim']})"
        if config.get("attention.decay") not in (None, "none"):
            name += f"+{config['attention.decay']}"
    name = with_conv(name, protocol_of(config), int(config.get("model.short_conv") or 0))
    if config.get("data.mqar.random_non_queries"):
        name += " (random fill)"
    return name


def with_conv(name: str, protocol: str, short_conv: int) -> str:
    """``name`` + ``+conv`` for a run with a short convolution at Zoology's cells, which have
    none (Based's recipe adds one), so that its row is not read as the plain mixer's; ReBased's
    cells all have one."""
    if short_conv and protocol == "mqar-zoology" and "+conv" not in name:
        base, fill, rest = name.partition(" (random fill)")
        return f"{base}+conv{fill}{rest}"
    return name


# Training settings a run may change from configs/mqar/base.yaml, as the report names them:
# (dotted key, base value, label). A run's recipe lists the ones it changed.
RECIPE_KEYS: tuple[tuple[str, Any, str], ...] = (
    ("model.dropout", 0.0, "dropout {}"),
    ("model.bias", False, "biases {}"),
    ("model.identity_state_mixer", False, "x + ln_2(x) blocks"),
    ("train.beta2", 0.95, "beta2 {}"),
    ("train.weight_decay", 0.1, "wd {}"),
    ("train.grad_clip", 1.0, "clip {}"),
    ("train.warmup_steps", 50, "warmup {}"),
    ("data.mqar.train_examples", 100000, "{} train examples"),
)


def recipe(config: dict[str, Any]) -> str:
    """The run's departures from the base recipe (``RECIPE_KEYS``), e.g. ``"dropout 0.1, fresh
    train examples"``; ``"base"`` when none. At least 10^8 training examples read as fresh data
    (each example is drawn once in any feasible run)."""
    parts = []
    if protocol_of(config) == "mqar-zoology" and config.get("model.short_conv"):
        parts.append(f"short conv {config['model.short_conv']}")  # Zoology's cells have none
    for key, base, label in RECIPE_KEYS:
        value = config.get(key, base)
        if value is None or value == base:
            continue
        if key == "data.mqar.train_examples" and int(value) >= 10**8:
            parts.append("fresh train examples")
        else:
            parts.append(label.format(f"{value:g}" if _num(value) else value))
    return ", ".join(parts) or "base"


def state_floats(config: dict[str, Any]) -> int:
    """The recurrent state of one attention layer, in floats, as Zoology counts it (its mixers'
    ``state_size``: Based's ``H (D d' + d')``, attention's KV cache ``2 L d_model``): the linear
    family's ``S [d', D]`` and ``z [d']`` per head, d' the feature map's features of the q, k
    dimension; softmax's keys and values of all L positions."""
    C, H = int(config["model.n_embd"]), int(config.get("model.n_head") or 1)
    name = str(config.get("attention.name"))
    if attention_registry.family(name, default="other") == "softmax":
        return 2 * int(config["data.context"]) * C
    D = C // H
    d = feature_maps.key_dim(
        str(config.get("attention.feature_map") or "softplus"),
        int(config.get("attention.feature_dim") or 0) or D,
    )
    return H * (D * d + d)


def evaluated_examples(config: dict[str, Any]) -> int:
    """How many held-out examples each evaluation of the run read: the trainer reads the first
    ``log.eval_batches`` batches of one update's sequences (``tokens_per_update / context``)
    from the test split, which its loader reads once, so at most the whole batches it holds."""
    batch = int(config["train.tokens_per_update"]) // int(config["data.context"])
    held_out = int(config["data.mqar.test_examples"])
    batches = int(config.get("log.eval_batches", LogConfig.eval_batches))
    return min(batches, held_out // batch) * batch


def protocol_of(config: dict[str, Any]) -> str:
    """The sweep's name (``log.wandb_group``); a run started outside a sweep belongs to ReBased's
    protocol when it has the short convolution and to Zoology's otherwise."""
    group = config.get("log.wandb_group")
    if group:
        return str(group)
    return "mqar-rebased" if int(config.get("model.short_conv") or 0) else "mqar-zoology"


def collect(run_dirs: Iterable[str | Path]) -> list[dict[str, Any]]:
    """One row per MQAR run directory (``config.yaml`` + ``metrics.jsonl``): protocol
    (:func:`protocol_of`), L, N, attention variant, learning rate, seed, batch, recipe, steps
    run, whether it stopped at the target accuracy, the final and best held-out accuracy, the
    training wall time."""
    rows = []
    for run in find_runs(run_dirs):
        c = run.config
        if c.get("data.source") != "mqar":
            continue
        accs = [(r["step"], r["val_acc"]) for r in run.records if _num(r.get("val_acc"))]
        steps = [r["step"] for r in run.records if _num(r.get("loss"))]
        times = [r["step_time_s"] for r in run.records if _num(r.get("step_time_s"))]
        target = c.get("train.target_val_acc")
        final = accs[-1][1] if accs else None
        rows.append(
            dict(
                protocol=protocol_of(c),
                L=int(c["data.context"]),
                N=int(c["data.mqar.num_kv_pairs"]),
                attention=variant(c),
                d_model=int(c["model.n_embd"]),
                short_conv=int(c.get("model.short_conv") or 0),
                lr=float(c["train.lr"]),
                seed=int(c.get("seed", 0)),
                batch=int(c["train.tokens_per_update"]) // int(c["data.context"]),
                recipe=recipe(c),
                state_floats=state_floats(c),
                max_steps=int(c["train.max_steps"]),
                steps=int(steps[-1]) if steps else 0,
                reached_target=bool(target is not None and final is not None and final >= target),
                accuracy=final,
                best_accuracy=max(a for _, a in accs) if accs else None,
                test_examples=evaluated_examples(c),
                # every evaluation: [update, held-out loss, held-out accuracy]
                curve=[
                    [r["step"], r.get("val_loss"), r["val_acc"]]
                    for r in run.records
                    if _num(r.get("val_acc"))
                ],  # fmt: skip
                train_seconds=round(sum(times), 1),
                run=run.name,
                # The commit of the run's last start (run_info.jsonl); None for older runs.
                commit=run.commits[-1] if run.commits else None,
            )
        )
    return _sorted(rows)


def _sorted(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    def softmax_first(r: dict[str, Any]) -> int:  # the plain softmax rows lead each cell
        return 0 if attention_registry.family(r["attention"], default="other") == "softmax" else 1

    return sorted(rows, key=lambda r: (r["protocol"], r["L"], softmax_first(r), r["attention"]))


def merge(kept: Sequence[dict[str, Any]], new: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows of an earlier report (``kept``: runs whose directories are no longer here) joined
    with ``new`` ones; a new row replaces a kept one of the same protocol and run name. Rows
    written before the recipe column read as ``"base"``, before the commit column as None."""
    fresh = {(r["protocol"], r["run"]) for r in new}
    old = [{**r, "recipe": r.get("recipe", "base"), "commit": r.get("commit"),
            "attention": with_conv(r["attention"], r["protocol"], int(r.get("short_conv") or 0))}
           for r in kept]  # fmt: skip
    return _sorted([r for r in old if (r["protocol"], r["run"]) not in fresh] + list(new))


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def markdown(rows: Sequence[dict[str, Any]], meta: dict[str, Any]) -> str:
    """The report: per protocol, our accuracy per attention and L beside the published ones
    (:data:`PUBLISHED`, :data:`SOURCES`); rendered by ``studies.mqar.report``, as ``mqar_cpu.md`` is."""
    meta = {"published_sources": SOURCES, **meta}
    return report.markdown(rows, meta, PUBLISHED)


def plot(rows: Sequence[dict[str, Any]], path: str | Path, title: str | None = None) -> Path:
    """Accuracy against L: one panel per protocol, our attentions as lines (markers filled
    where the run reached the target accuracy, hollow where it stopped before: at its step
    budget or cut short), the published ones dashed."""
    plt = pyplot()
    protocols = list(dict.fromkeys(r["protocol"] for r in rows)) or list(PUBLISHED)
    fig, axes = plt.subplots(1, len(protocols), figsize=(5.5 * len(protocols), 4.2), squeeze=False)
    for ax, protocol in zip(axes[0], protocols):
        mine = [r for r in rows if r["protocol"] == protocol]
        by = cell_runs(mine)
        for att in dict.fromkeys(r["attention"] for r in mine):
            pts = sorted(
                (L, r["accuracy"], bool(r["reached_target"]))
                for (a, L), r in by.items()
                if a == att and r["accuracy"] is not None
            )
            if pts:
                xs, ys, _ = zip(*pts)
                (line,) = ax.plot(xs, ys, "-", label=f"ours: {att}")
                c = line.get_color()
                for x, y, d in pts:
                    ax.plot(x, y, "o", color=c, mfc=c if d else "white", zorder=3)
        if any(not r["reached_target"] for r in mine):
            ax.plot([], [], "o", color="gray", mfc="white", label="ours, hollow: stopped below 99%")
        for name, values in PUBLISHED.get(protocol, {}).items():
            pts = sorted(values.items())
            ax.plot(*zip(*pts), "x--", alpha=0.7, label=f"published: {name}")
        ax.set_xscale("log", base=2)
        Ls = sorted(
            {r["L"] for r in mine} | {L for v in PUBLISHED.get(protocol, {}).values() for L in v}
        )
        ax.set_xticks(Ls)
        ax.set_xticklabels([str(L) for L in Ls])
        ax.minorticks_off()
        ax.set_ylim(-0.02, 1.05)
        ax.set_xlabel("sequence length L")
        ax.set_ylabel("MQAR accuracy")
        ax.set_title(protocol)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    return save(fig, path)


def write_report(
    rows: Sequence[dict[str, Any]],
    out_dir: str | Path,
    meta: dict[str, Any],
    name: str = "mqar_cpu",
) -> dict[str, Path]:
    """``<name>.csv``, ``.json`` (rows, published numbers, ``meta``), ``.md`` and ``.png`` in
    ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {ext: out / f"{name}.{ext}" for ext in ("csv", "json", "md", "png")}
    fields = list(dict.fromkeys(k for r in rows for k in r if k != "curve")) or [
        "protocol", "L", "N", "attention", "accuracy"
    ]  # fmt: skip
    with paths["csv"].open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    published = {
        p: {k: {str(L): a for L, a in v.items()} for k, v in d.items()}
        for p, d in PUBLISHED.items()
    }
    meta = {"how": "measured", "published_sources": SOURCES, **meta}
    paths["json"].write_text(
        json.dumps({"meta": meta, "rows": list(rows), "published": published}, indent=1) + "\n"
    )
    page(paths["md"], block("mqar.report", paths["json"].name))
    machine = meta.get("machine", "this machine")
    title = f"ours: measured on {machine} (steps and settings: {name}.md); published: dashed"
    plot(rows, paths["png"], title=title)
    if any(r.get("curve") for r in rows):
        paths["curves"] = plot_curves(rows, out / f"{name}_curves.png")
    return paths


def plot_curves(rows: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """Held-out accuracy against updates of the runs that recorded their evaluations, one panel
    per (protocol, L)."""
    plt = pyplot()
    mine = [r for r in rows if r.get("curve")]
    cells = sorted({(r["protocol"], r["L"]) for r in mine})
    fig, axes = plt.subplots(1, len(cells), figsize=(4.5 * len(cells), 3.6), squeeze=False)
    for ax, (protocol, L) in zip(axes[0], cells):
        for r in (r for r in mine if (r["protocol"], r["L"]) == (protocol, L)):
            steps, _, acc = zip(*r["curve"])
            ax.plot(steps, acc, label=f"{r['attention']} lr {r['lr']:g}")
        ax.set_ylim(-0.02, 1.02)
        ax.set_xlabel("update")
        ax.set_ylabel("held-out accuracy")
        ax.set_title(f"{protocol} L={L}", fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    return save(fig, path)


def read_report(path: str | Path) -> dict[str, Any]:
    """A ``mqar_cpu.json`` written by :func:`write_report`."""
    return json.loads(Path(path).read_text())
