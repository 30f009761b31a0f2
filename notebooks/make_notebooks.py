"""Writes the analysis notebooks (kept as code here so they diff and review as Python).

    .venv/bin/python notebooks/make_notebooks.py

The notebooks read their inputs from environment variables (set by tests/test_experiments_
notebooks.py to the fixtures in tests/fixtures/) or default to the newest files in the
repository, and write figures to ``NOTEBOOK_FIG_DIR`` (default: a temporary directory).
"""

from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

SETUP = """\
import os, sys, tempfile
from pathlib import Path

REPO = next(p for p in [Path.cwd(), *Path.cwd().parents] if (p / "pyproject.toml").exists())
sys.path.insert(0, str(REPO))
from linear_gpt2.platform import process
process.configure()  # JAX's process settings (the CUDA plugin without a GPU), before JAX runs
FIG_DIR = Path(os.environ.get("NOTEBOOK_FIG_DIR") or tempfile.mkdtemp(prefix="figures_"))
FIG_DIR.mkdir(parents=True, exist_ok=True)
from IPython.display import Image, Markdown, display
"""

STEP_TIME = [
    new_markdown_cell(
        "# Step time against context\n\n"
        "Milliseconds per full GPT-2 training step (forward, backward, AdamW; batch 1) for every "
        "attention, from `scripts/bench_step.py` (`benchmarks/results/step_time_*.json`), and "
        "time to sample the next token from `scripts/bench_sample.py`. Compare with the post's "
        "figures (`/work/shared/anchors/published-figures.md`): the fitted log-log slope is the "
        "exponent of time ~ context^slope — ~2 for softmax at long context, ~1 for LT_chunked."
    ),
    new_code_cell(
        SETUP
        + """
# Parameters: result files (environment variables, else the newest in benchmarks/results).
def newest(pattern):
    files = sorted((REPO / "benchmarks" / "results").glob(pattern), key=os.path.getmtime)
    return str(files[-1]) if files else None

STEP_TIME_RESULTS = os.environ.get("STEP_TIME_RESULTS") or newest("step_time_*.json")
SAMPLE_TIME_RESULTS = os.environ.get("SAMPLE_TIME_RESULTS") or newest("sample_time_*.json")
print(STEP_TIME_RESULTS, SAMPLE_TIME_RESULTS)
""",
        metadata={"tags": ["parameters"]},
    ),
    new_code_cell(
        """\
import json
from linear_gpt2.experiments import axes, plots
from linear_gpt2.experiments import step_time as bench

data = bench.read_results(STEP_TIME_RESULTS)
results = data["results"]
env = data["meta"].get("environment", {})
sizes = list(dict.fromkeys(r["size"] for r in results))
names = list(dict.fromkeys(r["attention"] for r in results))
contexts = sorted({r["context"] for r in results})
print(f"{len(results)} settings on {env.get('device_kind')} (jax {env.get('jax_version')}, "
      f"commit {env.get('git_commit')}); sizes {sizes}")
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
if SAMPLE_TIME_RESULTS:
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
    print("no sampling results (run scripts/bench_sample.py)")
"""
    ),
]

LOSS = [
    new_markdown_cell(
        "# Loss curves: linear vs softmax, by context and model size\n\n"
        "The post's learning study: GPT-2 trained for 24 hours on C4 at four contexts with "
        "flash softmax and LT_chunked. Runs are read from run directories (`config.yaml` + "
        "`metrics.jsonl`, e.g. the output of `scripts/sweep.py configs/sweeps/post_learning_*`)"
        "; `linear_gpt2.experiments.runs.load_wandb_runs` reads the same from a wandb project."
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

runs = runs_lib.find_runs([RUNS_DIR])
sizes = list(dict.fromkeys(r.size for r in runs))
print(f"{len(runs)} runs: " + ", ".join(r.name for r in runs))
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
        "The post: the gap grows with context (3.296 vs 3.207 at 1k, 3.571 vs 3.361 at 64k for "
        "124M)."
    ),
    new_code_cell(
        """\
table = runs_lib.final_loss_table(runs)
lines = ["| size | context | softmax | linear | gap |", "|---|---|---|---|---|"]
keys = sorted({(r["size"], r["context"]) for r in table}, key=lambda k: (k[0], k[1]))
for size, ctx in keys:
    fam = {r["family"]: r["final_loss"] for r in table if (r["size"], r["context"]) == (size, ctx)}
    s, l = fam.get("softmax"), fam.get("linear")
    gap = f"{l - s:+.3f}" if s is not None and l is not None else ""
    fmt = lambda v: "" if v is None else f"{v:.3f}"
    lines.append(f"| {size} | {axes.context_label(ctx)} | {fmt(s)} | {fmt(l)} | {gap} |")
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
MQAR_RESULTS = os.environ.get("MQAR_RESULTS") or str(REPO / "benchmarks" / "results" / "mqar_cpu.json")
CONTEXT_RUNS = os.environ.get("CONTEXT_RUNS") or str(REPO / "runs" / "context-cpu")
SMOOTH = float(os.environ.get("LOSS_SMOOTH", "0.8"))
print(MQAR_RESULTS, CONTEXT_RUNS)
""",
        metadata={"tags": ["parameters"]},
    ),
    new_markdown_cell("## MQAR: ours beside the published accuracies"),
    new_code_cell(
        """\
from linear_gpt2.experiments import mqar

report = mqar.read_report(MQAR_RESULTS)
rows = report["rows"]
print(f"{len(rows)} runs; {report['meta'].get('machine')}; {report['meta'].get('note')}")
display(Markdown(mqar.markdown(rows, report["meta"])))
png = mqar.plot(rows, FIG_DIR / "mqar_accuracy.png")
display(Image(filename=str(png)))
"""
    ),
    new_code_cell(
        """\
soft = [r for r in rows if r["attention"] in ("softmax", "flash")]
ok = all(r["accuracy"] is not None and r["accuracy"] >= 0.99 for r in soft)
print(f"softmax >= 99% in every setting: {ok} "
      f"({', '.join(f'{r[\'protocol\']} L={r[\'L\']}: {r[\'accuracy\']:.3f}' for r in soft)})")
based = mqar.PUBLISHED["mqar-rebased"]["Based (ReBased fig. 1)"]
for att in dict.fromkeys(r["attention"] for r in rows if r["protocol"] == "mqar-rebased"):
    pts = {r["L"]: r["accuracy"] for r in rows if r["protocol"] == "mqar-rebased" and r["attention"] == att}
    below = [L for L, a in sorted(pts.items()) if a is not None and L in based and a < based[L]]
    print(f"{att}: below Based at L = {below or 'none'}")
"""
    ),
    new_markdown_cell("## Loss against context: final held-out loss and the gap to flash"),
    new_code_cell(
        """\
from linear_gpt2.experiments import plots
from linear_gpt2.experiments import runs as runs_lib

runs = runs_lib.find_runs([CONTEXT_RUNS])
table = runs_lib.context_table(runs)
print(f"{len(runs)} runs: " + ", ".join(r.name for r in runs))
display(Markdown(runs_lib.context_table_markdown(table)))
gaps = {}
for x in table:
    if x["gap"] is not None and not x["baseline"]:
        gaps.setdefault(x["variant"], []).append((x["context"], x["gap"]))
for v, pts in gaps.items():
    pts.sort()
    trend = "grows" if pts[-1][1] > pts[0][1] else "does not grow"
    print(f"{v}: gap to flash {pts[0][1]:+.3f} at {pts[0][0]} -> {pts[-1][1]:+.3f} at {pts[-1][0]}: {trend}")
"""
    ),
    new_code_cell(
        """\
for size in dict.fromkeys(r.size for r in runs):
    group = [r for r in runs if r.size == size]
    display(Image(filename=str(plots.plot_final_loss_vs_context(group, FIG_DIR / f"final_loss_vs_context_{size}.png"))))
    display(Image(filename=str(plots.plot_curves_by_context(group, FIG_DIR / f"curves_by_context_{size}.png", smooth=SMOOTH))))
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
for r in sorted(runs, key=lambda r: (r.variant, r.context)):
    spikes = max([x.get("diag/spikes", 0) for x in r.records] or [0])
    lines.append(f"| {r.variant} | {r.context} | " + " | ".join(fmt(last_diag(r, n)) for n in ("den_min", "state_norm", "out_rms", "gamma_mean")) + f" | {spikes} |")
display(Markdown("\\n".join(lines)))
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
