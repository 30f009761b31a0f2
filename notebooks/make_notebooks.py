"""Writes the analysis notebooks (kept as code here so they diff and review as Python).

    .venv/bin/python notebooks/make_notebooks.py

The notebooks read their inputs from environment variables (set by tests/test_experiments_
notebooks.py to the fixtures in tests/fixtures/) or default to the repository's own result files
(those README.md and docs/results.md are rendered from, so the notebooks show the same numbers)
and run directories; where runs are missing they say which command produces them. They write
figures to ``NOTEBOOK_FIG_DIR`` (default: ``.cache/notebook_figures`` in the repository) and
point matplotlib's and the other libraries' caches at the repository's ``.cache``
(``linear_gpt2.platform.env``), nothing under ``$HOME`` or ``$TMPDIR``. Jupyter's own folders
(IPython's profile) are the launcher's: keep them in the repository too with

    IPYTHONDIR=.cache/ipython JUPYTER_CONFIG_DIR=.cache/jupyter JUPYTER_DATA_DIR=.cache/jupyter \
        .venv/bin/jupyter lab notebooks/
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import os, sys
from pathlib import Path

REPO = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists())
sys.path.insert(0, str(REPO))
from linear_gpt2.platform import env, process

env.configure()  # matplotlib's and the other caches under the repository's .cache, not $HOME
process.configure()  # JAX's process settings (the CUDA plugin without a GPU), before JAX runs
FIG_DIR = Path(os.environ.get("NOTEBOOK_FIG_DIR") or env.cache_root() / "notebook_figures")
FIG_DIR.mkdir(parents=True, exist_ok=True)
RESULTS = REPO / "benchmarks" / "results"
from IPython.display import Image, Markdown, display
"""

STEP_TIME = [
    new_markdown_cell(
        "# Step time against context\n\n"
        "Milliseconds per full GPT-2 training step (forward, backward, AdamW; batch 1) for every "
        "attention, from `scripts/bench_step.py` (`benchmarks/results/step_time_*.json`), and "
        "time to sample the next token from `scripts/bench_sample.py`. Compare with the post's "
        "figures (their numbers: `benchmarks/results/published_post.json`): the fitted log-log "
        "slope is the exponent of time ~ context^slope — ~2 for softmax at long context, ~1 for "
        "LT_chunked. By default the notebook reads the H100 measurements README.md shows; "
        "`scripts/bench_step.py` writes new ones."
    ),
    new_code_cell(
        SETUP
        + """
# Parameters: result files (environment variables, else the ones README.md and docs show).
STEP_TIME_RESULTS = os.environ.get("STEP_TIME_RESULTS") or str(
    RESULTS / "step_time_h100_124M_flash_LT_chunked.json")
SAMPLE_TIME_RESULTS = os.environ.get("SAMPLE_TIME_RESULTS") or str(RESULTS / "sample_time_tiny_cpu.json")
print(STEP_TIME_RESULTS, SAMPLE_TIME_RESULTS)
""",
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        """\
import json
from linear_gpt2.experiments import axes, plots
from studies.train_step import step_time as bench

data = bench.read_results(STEP_TIME_RESULTS)
results = data["results"]
where = data["meta"].get("environment", {})
sizes = list(dict.fromkeys(r["size"] for r in results))
names = list(dict.fromkeys(r["attention"] for r in results))
contexts = sorted({r["context"] for r in results})
print(f"{len(results)} settings on {where.get('device_kind')} (jax {where.get('jax_version')}, "
      f"commit {where.get('git_commit')}); sizes {sizes}")
"""
    ),
    new_markdown_cell("## Table: ms per step (OOM = out of memory, the limit)"),
    new_code_cell(
        """\
def cell(r):
    if r is None:
        return ""
    if r["status"] != "ok":
        return r["status"].upper()
    chunk = f" (c={r['chunk_size']})" if r.get("chunk_size") else ""
    return f"{r['median_ms']:.4g}{chunk}"

for size in sizes:
    by = {(r["attention"], r["context"]): r for r in results if r["size"] == size}
    lines = [f"### {size}", "", "| context | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for t in contexts:
        lines.append(f"| {axes.context_label(t)} | "
                     + " | ".join(cell(by.get((n, t))) for n in names) + " |")
    display(Markdown("\\n".join(lines)))
"""
    ),
    new_code_cell(
        """\
# README.md's table, by the renderer that writes it (ours / the post's), for README's own file.
if Path(STEP_TIME_RESULTS) == RESULTS / "step_time_h100_124M_flash_LT_chunked.json":
    from studies.common import core as reports
    from studies.train_step import report as step_time_report

    raws = [reports.Raw(p.name, reports.load(p))
            for p in (Path(STEP_TIME_RESULTS), RESULTS / "published_post.json")]
    display(Markdown(step_time_report.vs_post(*raws, size="124M", attentions="flash,LT_chunked")))
"""
    ),
    new_markdown_cell("## Figures: log-log, one line per attention, fitted slopes in the legend"),
    new_code_cell(
        """\
for size in sizes:
    png = plots.plot_step_times(results, size, FIG_DIR / f"step_time_{size}.png")
    display(Image(filename=str(png)))
"""
    ),
    new_markdown_cell(
        "## Limits, slopes, and LT_chunked against flash\n\n"
        "The limit is the largest context that ran; the slope is fitted over all measured "
        "contexts (and over the last three, where the quadratic term dominates)."
    ),
    new_code_cell(
        """\
lims = bench.limits([bench.StepResult(**r) for r in results])
rows = ["| size | attention | max context | OOM at | slope (all) | slope (last 3) |",
        "|---|---|---|---|---|---|"]
for size in sizes:
    for n in names:
        pts = sorted((r["context"], r["median_ms"]) for r in results
                     if r["size"] == size and r["attention"] == n and r["status"] == "ok")
        s_all = axes.loglog_slope(*zip(*pts)) if len(pts) >= 2 else None
        s_tail = axes.loglog_slope(*zip(*pts[-3:])) if len(pts) >= 3 else None
        lim = lims.get(n, {}).get(size, {})
        fmt = lambda s: "" if s is None else f"{s:.2f}"
        rows.append(f"| {size} | {n} | {lim.get('max_context')} | {lim.get('oom_at') or ''} | "
                    f"{fmt(s_all)} | {fmt(s_tail)} |")
display(Markdown("\\n".join(rows)))

speed = ["| size | context | flash ms | LT_chunked ms | flash / LT_chunked |", "|---|---|---|---|---|"]
for size in sizes:
    by = {(r["attention"], r["context"]): r for r in results
          if r["size"] == size and r["status"] == "ok"}
    for t in contexts:
        f, c = by.get(("flash", t)), by.get(("LT_chunked", t))
        if f and c:
            speed.append(f"| {size} | {axes.context_label(t)} | {f['median_ms']:.4g} | "
                         f"{c['median_ms']:.4g} | {f['median_ms'] / c['median_ms']:.2f}x |")
display(Markdown("\\n".join(speed)))
"""
    ),
    new_markdown_cell("## Sampling: time to the next token, KV cache vs recurrent state"),
    new_code_cell(
        """\
if Path(SAMPLE_TIME_RESULTS).is_file():
    sample = json.loads(Path(SAMPLE_TIME_RESULTS).read_text())
    rows = sample["rows"]
    for size in dict.fromkeys(r.get("size", "") for r in rows):
        group = [r for r in rows if r.get("size", "") == size]
        png = plots.plot_sample_times(group, FIG_DIR / f"sample_time_{size or 'all'}.png",
                                      title=f"{size}: time to sample the next token")
        display(Image(filename=str(png)))
        for dec in dict.fromkeys(r["decoder"] for r in group):
            pts = [(r["context"], r["median_ms"]) for r in group
                   if r["decoder"] == dec and r.get("median_ms")]
            print(f"{size} {dec}: slope {axes.loglog_slope(*zip(*pts)):.2f}")
else:
    print(f"no sampling results at {SAMPLE_TIME_RESULTS}: scripts/bench_sample.py writes them")
"""
    ),
]

LOSS = [
    new_markdown_cell(
        "# Loss curves: linear vs softmax, by context and model size\n\n"
        "The post's learning study: GPT-2 trained for 24 hours on C4 at four contexts with "
        "flash softmax and LT_chunked. Runs are read from run directories (`config.yaml` + "
        "`metrics.jsonl`, e.g. the output of `scripts/sweep.py configs/sweeps/post_learning_*`)"
        "; `linear_gpt2.experiments.runs.load_wandb_runs` reads the same from a wandb project. "
        "Runs are labelled by what differs between them (a chunk size, a kernel, a seed), so "
        "no curve or row stands for two runs."
    ),
    new_code_cell(
        SETUP
        + """
# Parameters: where the runs are (environment variable, else runs/ in the repository).
RUNS_DIR = os.environ.get("LEARNING_RUNS") or str(REPO / "runs")
SMOOTH = float(os.environ.get("LOSS_SMOOTH", "0.9"))
print(RUNS_DIR)
""",
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        """\
from linear_gpt2.experiments import axes, plots
from linear_gpt2.experiments import runs as runs_lib

runs = runs_lib.find_runs([RUNS_DIR]) if Path(RUNS_DIR).exists() else []
sizes = list(dict.fromkeys(r.size for r in runs))
if runs:
    print(f"{len(runs)} runs: " + ", ".join(r.name for r in runs))
else:
    print(f"No runs in {RUNS_DIR}. The post's study: python scripts/sweep.py "
          "configs/sweeps/post_learning_124M.yaml (8 GPUs, 24 hours a run; --slurm writes the "
          "array job), then set LEARNING_RUNS to its out_dir. For a look at the figures, "
          "tests/fixtures/learning_runs holds synthetic runs.")
"""
    ),
    new_markdown_cell("## Loss against steps and against hours"),
    new_code_cell(
        """\
for size in sizes:
    group = [r for r in runs if r.size == size]
    png = plots.plot_learning_curves(group, FIG_DIR / f"learning_{size}.png", smooth=SMOOTH,
                                     title=f"GPT-2 {size}: linear (solid) vs softmax (dashed)")
    display(Image(filename=str(png)))
"""
    ),
    new_markdown_cell(
        "## Final loss, and the gap linear - softmax\n\n"
        "The post's final training losses (`benchmarks/results/published_post.json`): the gap "
        "grows with context. Ours: one row per run, labelled by what differs, with its median "
        "step time."
    ),
    new_code_cell(
        """\
import json

post = json.loads((RESULTS / "published_post.json").read_text())["final_train_loss"]
lines = ["| size | context | post: softmax | post: linear | gap |", "|---|---|---|---|---|"]
for size, fam in post.items():
    for ctx in sorted(fam["softmax"], key=int):
        s, l = fam["softmax"][ctx], fam["linear"].get(ctx)
        gap = f"{l - s:+.3f}" if l is not None else ""
        lines.append(f"| {size} | {axes.context_label(int(ctx))} | {s:.3f} | "
                     f"{'' if l is None else f'{l:.3f}'} | {gap} |")
display(Markdown("\\n".join(lines)))
table = runs_lib.final_loss_table(runs)
fmt = lambda v, f: "" if v is None else format(v, f)
lines = ["| run | label | size | context | final loss | median step (ms) |", "|---|---|---|---|---|---|"]
for r in table:
    lines.append(f"| {r['name']} | {r['label']} | {r['size']} | {axes.context_label(r['context'])} | "
                 f"{fmt(r['final_loss'], '.3f')} | {fmt(r['step_ms'], '.1f')} |")
if table:
    display(Markdown("\\n".join(lines)))
    png = plots.plot_final_loss_vs_params(runs, FIG_DIR / "final_loss_vs_params.png")
    display(Image(filename=str(png)))
"""
    ),
]


LEARNING = [
    new_markdown_cell(
        "# Learning experiments on CPU: MQAR and the context finding\n\n"
        "Two results this repository produces on a 2-core CPU with the cluster's code paths:\n\n"
        "1. **MQAR** (`scripts/mqar.py`, `benchmarks/results/mqar_cpu.json`): associative "
        "recall accuracy of softmax and linear attentions at Zoology's (L, N) = (256, 16) cell "
        "and ReBased's length sweep, beside the published numbers.\n"
        "2. **Loss against context** (`scripts/sweep.py configs/sweeps/context_cpu.yaml`, run "
        "directories under `runs/context-cpu`): a small GPT-2 on Shakespeare at contexts "
        "128..2048 for flash, LT_chunked, LT_chunked + doc_reset and LT_chunked + decay gate; "
        "the post's two learning figures, the gap to flash, and the stability diagnostics "
        "(`log.diagnostics`) of each run."
    ),
    new_code_cell(
        SETUP
        + """
# Parameters: the MQAR report and the context runs (environment variables, else the repository's).
MQAR_RESULTS = os.environ.get("MQAR_RESULTS") or str(RESULTS / "mqar_cpu.json")
CONTEXT_RUNS = os.environ.get("CONTEXT_RUNS") or str(REPO / "runs" / "context-cpu")
SMOOTH = float(os.environ.get("LOSS_SMOOTH", "0.8"))
print(MQAR_RESULTS, CONTEXT_RUNS)
""",
        metadata={"tags": ["parameters"]},
    ),
    new_markdown_cell(
        "## MQAR: ours beside the published accuracies\n\n"
        "Each cell shows its best run (one that reached 99%, else the highest accuracy), as "
        "docs/results.md does, by the same function; every run is in the report's settings."
    ),
    new_code_cell(
        """\
from studies.mqar import mqar
from studies.mqar import report as mqar_report

report = mqar.read_report(MQAR_RESULTS)
rows = report["rows"]
published = report.get("published", {})
print(f"{len(rows)} runs; {report['meta'].get('machine')}; {report['meta'].get('note')}")
for protocol in dict.fromkeys(r["protocol"] for r in rows):
    pub = {k: {int(L): a for L, a in v.items()} for k, v in published.get(protocol, {}).items()}
    display(Markdown(f"**{protocol}**\\n\\n"
                     + mqar_report.cells_table([r for r in rows if r["protocol"] == protocol], pub)))
png = mqar.plot(rows, FIG_DIR / "mqar_accuracy.png")
display(Image(filename=str(png)))
"""
    ),
    new_code_cell(
        """\
for protocol in dict.fromkeys(r["protocol"] for r in rows):
    cells = mqar_report.cell_runs([r for r in rows if r["protocol"] == protocol])
    for att in dict.fromkeys(a for a, _ in cells if a.startswith(("softmax", "flash"))):
        best = {L: r for (a, L), r in sorted(cells.items()) if a == att}
        met = [L for L, r in best.items() if (r["accuracy"] or 0) >= 0.99]
        missed = {L: r["accuracy"] for L, r in best.items() if L not in met}
        print(f"{protocol}, {att}: reaches 99% at L = {met or 'none'}"
              + ("" if not missed else "; not at " + ", ".join(
                  f"L = {L} (best {a:.3f})" for L, a in missed.items())))
# The linear variants against Based (ReBased's linear attention with a convolution).
based = published.get("mqar-rebased", {}).get("Based (ReBased fig. 1)", {})
cells = mqar_report.cell_runs([r for r in rows if r["protocol"] == "mqar-rebased"])
for att in dict.fromkeys(a for a, _ in cells if not a.startswith(("softmax", "flash"))):
    below = [L for (a, L), r in sorted(cells.items())
             if a == att and r["accuracy"] is not None and str(L) in based and r["accuracy"] < based[str(L)]]
    print(f"mqar-rebased, {att}: below Based at L = {below or 'none'}")
"""
    ),
    new_markdown_cell(
        "## Loss against context: final held-out loss and the gap to flash\n\n"
        "From the run directories when they are here; else the committed results "
        "(`benchmarks/results/context_cpu.csv`, what docs/results.md shows) and the command "
        "that produces the runs."
    ),
    new_code_cell(
        """\
from linear_gpt2.experiments import plots
from linear_gpt2.experiments import runs as runs_lib

runs = runs_lib.find_runs([CONTEXT_RUNS]) if Path(CONTEXT_RUNS).exists() else []
if runs:
    table = runs_lib.context_table(runs)
    print(f"{len(runs)} runs: " + ", ".join(r.name for r in runs))
    display(Markdown(runs_lib.context_table_markdown(table)))
else:
    from studies.common import core as reports
    from studies.learning import report as learning_report

    csv = RESULTS / "context_cpu.csv"
    print(f"No runs in {CONTEXT_RUNS}: python scripts/sweep.py configs/sweeps/context_cpu.yaml "
          "trains them (12 runs, about an hour on 2 CPU cores), then python scripts/plot_runs.py "
          f"runs/context-cpu draws their figures. Below: the committed results, {csv.relative_to(REPO)}.")
    raw = reports.Raw(csv.name, reports.load(csv))
    post = reports.Raw("published_post.json", reports.load(RESULTS / "published_post.json"))
    display(Markdown(learning_report.context_table(raw, baseline="flash")))
    display(Markdown(learning_report.context_reading(raw, post)))
    table = [{**x, "label": f"{x['variant']} seed={x['seed']}", "baseline": x["variant"] == "flash"}
             for x in raw.data]
gaps = {}
for x in table:
    if x["gap"] is not None and not x["baseline"]:
        gaps.setdefault(x["label"], []).append((x["context"], x["gap"]))
for v, pts in gaps.items():
    if len(pts) < 2:
        continue
    pts.sort()
    grows = all(b[1] > a[1] for a, b in zip(pts, pts[1:]))
    print(f"{v}: gap to flash " + " -> ".join(f"{g:+.3f} at {c}" for c, g in pts)
          + (": grows with context" if grows else ": does not grow with context"))
"""
    ),
    new_code_cell(
        """\
for size in dict.fromkeys(r.size for r in runs):
    group = [r for r in runs if r.size == size]
    display(Image(filename=str(plots.plot_final_loss_vs_context(group, FIG_DIR / f"final_loss_vs_context_{size}.png"))))
    display(Image(filename=str(plots.plot_curves_by_context(group, FIG_DIR / f"curves_by_context_{size}.png", smooth=SMOOTH))))
if not runs:
    print("The figures need the runs (above).")
"""
    ),
    new_markdown_cell(
        "## Stability diagnostics\n\n"
        "Last logged value per run, averaged over layers (`diag/layer{i}/...` in "
        "`metrics.jsonl`): the linear normaliser's minimum, the state's norm at the end of the "
        "row, the attention output's RMS, the mean decay; and the loss spikes counted."
    ),
    new_code_cell(
        """\
import numpy as np

def last_diag(run, name):
    for r in reversed(run.records):
        vals = [v for k, v in r.items() if k.startswith("diag/layer") and k.endswith("/" + name)]
        if vals:
            return float(np.mean(vals))
    return None

fmt = lambda v: "" if v is None else f"{v:.4g}"
lines = ["| run | context | den_min | state_norm | out_rms | gamma_mean | spikes |", "|---|---|---|---|---|---|---|"]
labels = dict(zip((r.name for r in runs), runs_lib.run_labels(runs)))
for r in sorted(runs, key=lambda r: (labels[r.name], r.context)):
    spikes = max([x.get("diag/spikes", 0) for x in r.records] or [0])
    lines.append(f"| {labels[r.name]} | {r.context} | " + " | ".join(fmt(last_diag(r, n)) for n in ("den_min", "state_norm", "out_rms", "gamma_mean")) + f" | {spikes} |")
if runs:
    display(Markdown("\\n".join(lines)))
else:
    print("The diagnostics need the runs (above): configs/shakespeare.yaml logs them (log.diagnostics).")
"""
    ),
]


def write(name, cells):
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    nb.metadata["language_info"] = {"name": "python"}
    nbformat.validate(nb)
    nbformat.write(nb, HERE / name)


if __name__ == "__main__":
    write("step_time_analysis.ipynb", STEP_TIME)
    write("loss_curves.ipynb", LOSS)
    write("learning_on_cpu.ipynb", LEARNING)
    print(
        "wrote notebooks/step_time_analysis.ipynb, notebooks/loss_curves.ipynb and "
        "notebooks/learning_on_cpu.ipynb"
    )
