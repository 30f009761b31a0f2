"""The analysis notebooks execute headless on the fixture results (so they cannot rot) and on
the repository's own results as a clean clone has them (no run directories: they say which
command makes them; what they show agrees with README.md and docs/results.md), writing nothing
under $HOME or $TMPDIR; scripts/plot_runs.py draws the learning figures from run directories and
labels every run by what sets it apart."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from linear_gpt2.experiments import runs as runs_lib
from tests.test_experiments_bench import load_script

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"


@pytest.fixture
def kernel(tmp_path, monkeypatch):
    """A kernelspec for this interpreter in a private Jupyter path: the notebooks run with the
    project's venv whatever other kernels the machine has registered."""
    spec = tmp_path / "jupyter" / "kernels" / "linear_gpt2_test"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "linear_gpt2 tests",
                "language": "python",
            }
        )
    )
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter"))
    monkeypatch.setenv("JUPYTER_PLATFORM_DIRS", "1")
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    return "linear_gpt2_test"


# Where a library would write by default (and the suite's conftest points elsewhere): unset for
# the kernel, so the notebook itself must keep them in the repository's cache.
CACHE_VARS = ("MPLCONFIGDIR", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "TORCHINDUCTOR_CACHE_DIR",
              "TRITON_CACHE_DIR", "HF_HOME", "WANDB_DIR")  # fmt: skip


def execute(name: str, kernel: str, tmp_path: Path, figs: bool = True, **env: str):
    """Run a notebook headless with an empty ``$HOME`` and ``$TMPDIR`` of its own, the cache
    variables unset and ``LINEAR_GPT2_CACHE`` in ``tmp_path``; fails if the kernel wrote
    anything in that home or temporary directory. ``figs``: ``NOTEBOOK_FIG_DIR`` set (else the
    notebook's default, under the cache)."""
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    fig_dir = tmp_path / "figs" if figs else tmp_path / "cache" / "notebook_figures"
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(parents=True)
    tmp.mkdir()
    old = dict(os.environ)
    for var in CACHE_VARS:
        os.environ.pop(var, None)
    os.environ.update(
        HOME=str(home),
        TMPDIR=str(tmp),
        LINEAR_GPT2_CACHE=str(tmp_path / "cache"),
        # Jupyter's own folders are the launcher's to place (notebooks/make_notebooks.py).
        IPYTHONDIR=str(tmp_path / "ipython"),
        JUPYTER_CONFIG_DIR=str(tmp_path / "jupyter_config"),
        JUPYTER_DATA_DIR=str(tmp_path / "jupyter_data"),
        **({"NOTEBOOK_FIG_DIR": str(fig_dir)} if figs else {}),
        **env,
    )
    if not figs:
        os.environ.pop("NOTEBOOK_FIG_DIR", None)
    try:
        client = nbclient.NotebookClient(
            nb,
            timeout=120,
            kernel_name=kernel,
            resources={"metadata": {"path": str(ROOT / "notebooks")}},
        )
        client.execute()
    finally:
        os.environ.clear()
        os.environ.update(old)
    assert [str(p) for p in home.rglob("*")] == [], "the notebook wrote in $HOME"
    assert [str(p) for p in tmp.rglob("*")] == [], "the notebook wrote in $TMPDIR"
    if any(fig_dir.glob("*.png")):  # matplotlib drew: its cache is the project's
        assert (tmp_path / "cache" / "matplotlib").is_dir()
    return nb, fig_dir


def outputs(nb) -> str:
    text = []
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            text.append(out.get("text", ""))
            text.extend(str(v) for v in out.get("data", {}).values())
    return "\n".join(text)


def test_step_time_notebook(kernel, tmp_path):
    nb, figs = execute(
        "step_time_analysis.ipynb",
        kernel,
        tmp_path,
        STEP_TIME_RESULTS=str(FIXTURES / "step_time_post_124M.json"),
        SAMPLE_TIME_RESULTS=str(FIXTURES / "sample_time_post.json"),
    )
    text = outputs(nb)
    assert "OOM" in text and "LT_chunked" in text and "31.80x" in text  # 70630 / 2221 at 512k
    assert (figs / "step_time_124M.png").exists() and (figs / "sample_time_124M.png").exists()


def test_loss_curves_notebook(kernel, tmp_path):
    nb, figs = execute(
        "loss_curves.ipynb", kernel, tmp_path, LEARNING_RUNS=str(FIXTURES / "learning_runs")
    )
    text = outputs(nb)
    assert "8 runs" in text and "| 124M | 1k |" in text
    assert (figs / "learning_124M.png").exists() and (figs / "final_loss_vs_params.png").exists()


def test_learning_on_cpu_notebook(kernel, tmp_path):
    nb, figs = execute(
        "learning_on_cpu.ipynb",
        kernel,
        tmp_path,
        MQAR_RESULTS=str(FIXTURES / "mqar_cpu.json"),
        CONTEXT_RUNS=str(FIXTURES / "context_runs"),
    )
    text = outputs(nb)
    # MQAR: ours beside the published Based numbers, and the softmax check.
    assert "published: Based (ReBased fig. 1)" in text and "0.890" in text
    assert "mqar-rebased, softmax: reaches 99% at L = [128, 256, 512, 1024]" in text
    assert "mqar-rebased, LT_chunked/softplus: below Based at L = [128, 256, 512, 1024]" in text
    # The context table (gap to flash in parentheses) and the trend sentence per variant.
    assert "| LT_chunked | 5.640 (+0.040) | 5.580 (+0.130) |" in text
    assert "LT_chunked: gap to flash +0.040 at 128 -> +0.130 at 512: grows with context" in text
    # Diagnostics: the gated run's state norm, and the spike counts.
    assert "| LT_chunked+gate | 512 | 2 | 1.131 | 0.3 | 0.95 | 0 |" in text
    for name in (
        "mqar_accuracy.png",
        "final_loss_vs_context_3.4M.png",
        "curves_by_context_3.4M.png",
    ):
        assert (figs / name).exists(), name


def _table_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("| ")]


@pytest.mark.slow
def test_notebooks_on_a_clean_clone_say_how_to_make_what_is_missing_and_agree_with_the_docs(
    kernel, tmp_path
):
    """The repository's own inputs, no run directories (a clean clone has none), figures in the
    default place: each notebook says which command makes the runs, and every table it shows
    from the committed results is the one README.md or docs/results.md shows."""
    docs = (ROOT / "docs" / "results.md").read_text() + (ROOT / "README.md").read_text()
    nb, figs = execute(
        "learning_on_cpu.ipynb", kernel, tmp_path / "a", figs=False, CONTEXT_RUNS="/no/runs"
    )
    text = outputs(nb)
    assert "No runs in /no/runs: python scripts/sweep.py configs/sweeps/context_cpu.yaml" in text
    assert "mqar-rebased, softmax: reaches 99% at L = [128, 256, 512, 1024]" in text
    assert "mqar-zoology, softmax (random fill): reaches 99% at L = [256]" in text
    assert "LT_chunked seed=0: gap to flash" in text and "does not grow with context" in text
    shown = _table_lines(text)
    assert len(shown) >= 15 and [line for line in shown if line not in docs] == []
    assert (figs / "mqar_accuracy.png").exists()  # the default folder: the cache's
    nb, _ = execute("loss_curves.ipynb", kernel, tmp_path / "b", figs=False, LEARNING_RUNS="/none")
    text = outputs(nb)
    assert "No runs in /none. The post's study: python scripts/sweep.py" in text
    post = json.loads((ROOT / "benchmarks" / "results" / "published_post.json").read_text())
    assert f"{post['final_train_loss']['124M']['softmax']['1024']:.3f}" in text
    nb, _ = execute("step_time_analysis.ipynb", kernel, tmp_path / "c", figs=False)
    readme = [line for line in _table_lines(outputs(nb)) if "**" in line]
    assert len(readme) == 2 and all(line in docs for line in readme)


def test_notebooks_cite_only_files_in_the_repository():
    """What a notebook cites (a path in its text or code) is in the repository, never a file of
    the machine it was written on."""
    import re

    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        text = nb.read_text() + (ROOT / "notebooks" / "make_notebooks.py").read_text()
        assert not re.search(r"(?<![\w.])/(work|home|tmp|root|Users)/", text), nb.name
        for path in re.findall(
            r"`((?:benchmarks|configs|docs|scripts|tests|linear_gpt2|studies)/[^`* ]+)`", text
        ):
            assert (ROOT / path).exists() or "*" in path or "{" in path, (nb.name, path)


def test_plot_runs_draws_the_context_figures(tmp_path):
    script = load_script("plot_runs")
    out = tmp_path / "figs"
    assert script.main([str(FIXTURES / "context_runs"), "--out", str(out)]) == 0
    size = runs_lib.find_runs([FIXTURES / "context_runs"])[0].size
    for name in (f"final_loss_vs_context_{size}.png", f"curves_by_context_{size}.png"):
        assert (out / name).stat().st_size > 0
    table = (out / "context_table.md").read_text()
    assert "| flash | 5.600 | 5.450 |" in table and "LT_chunked+reset" in table
    csv_rows = (out / "context_table.csv").read_text().splitlines()
    header = "size,variant,context,seed,steps,val,train,gap,train_s,spikes,name,label,step_ms"
    assert csv_rows[0] == header
    assert len(csv_rows) == 9
    for row in csv.DictReader(csv_rows):
        records = [
            json.loads(x)
            for x in (FIXTURES / "context_runs" / row["name"] / "metrics.jsonl").open()
        ]
        spikes = [x["diag/spikes"] for x in records if "diag/spikes" in x]
        assert row["spikes"] == str(spikes[-1]) and row["seed"] == "0", row


def _write_run(root: Path, name: str, attention: dict, seed: int = 0, cp: int = 1, val=5.0):
    """A run directory as the trainer writes one (config.yaml, metrics.jsonl): four steps, the
    first slow (it compiled), an evaluation at the last."""
    import yaml

    run = root / name
    run.mkdir(parents=True)
    config = {
        "model": {"n_layer": 2, "n_head": 2, "n_embd": 64, "block_size": 128, "vocab_size": 50304},
        "attention": {"chunk_size": 64, "kernel": "auto", **attention},
        "data": {"context": 128, "path": str(root / "data" / name)},
        "train": {"context_parallel": cp, "max_steps": 4},
        "log": {"name": name, "run_dir": str(run)},
        "checkpoint": {"every": 100},
        "seed": seed,
    }
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    times = [9.0, 0.1 * (1 + seed + cp), 0.1 * (1 + seed + cp), 0.5]
    lines = [{"step": i + 1, "loss": 6.0 - 0.1 * i, "step_time_s": t, "hours": i / 3600}
             for i, t in enumerate(times)]  # fmt: skip
    lines[-1]["val_loss"] = val
    (run / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))


@pytest.mark.slow
def test_plot_runs_labels_each_run_by_what_sets_it_apart_and_never_merges_two(tmp_path):
    """A chunk-size sweep, a kernel, context parallelism, a variant's own option, two seeds and
    two identical runs, all at one size and context: scripts/plot_runs.py gives each run its own
    row and line, labelled by what differs, with its median step time (its first, compiling
    step left out); logging, checkpointing and data paths, which differ in every run, never
    label."""
    runs = tmp_path / "runs"
    _write_run(runs, "flash_s0", {"name": "flash"}, val=5.00)
    _write_run(runs, "flash_s1", {"name": "flash"}, seed=1, val=5.02)
    _write_run(runs, "lt_c32", {"name": "LT_chunked", "chunk_size": 32}, val=5.10)
    _write_run(runs, "lt_c64", {"name": "LT_chunked"}, val=5.11)
    _write_run(runs, "lt_c64_pallas", {"name": "LT_chunked", "kernel": "pallas"}, val=5.12)
    _write_run(runs, "lt_c64_cp2", {"name": "LT_chunked"}, cp=2, val=5.13)
    _write_run(runs, "mine_a", {"name": "my_lab.attn", "extra": {"alpha": 0.5}}, val=5.2)
    _write_run(runs, "mine_b", {"name": "my_lab.attn", "extra": {"alpha": 1.0}}, val=5.3)
    _write_run(runs, "mine_b_again", {"name": "my_lab.attn", "extra": {"alpha": 1.0}}, val=5.4)
    out = tmp_path / "figs"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_runs.py"), str(runs), "--out", str(out)],
        capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["name"]: r for r in csv.DictReader((out / "context_table.csv").open())}
    assert len(rows) == 9 and len({r["label"] for r in rows.values()}) == 9
    assert rows["flash_s0"]["label"] == "flash seed=0"
    assert rows["flash_s1"]["label"] == "flash seed=1"
    lt = "LT_chunked chunk_size={}, kernel={}, context_parallel={}"
    assert rows["lt_c32"]["label"] == lt.format(32, "auto", 1)
    assert rows["lt_c64_pallas"]["label"] == lt.format(64, "pallas", 1)
    assert rows["lt_c64_cp2"]["label"] == lt.format(64, "auto", 2)
    assert rows["mine_a"]["label"] == "my_lab.attn alpha=0.5"
    assert {rows["mine_b"]["label"], rows["mine_b_again"]["label"]} == {
        "my_lab.attn alpha=1.0 [mine_b]", "my_lab.attn alpha=1.0 [mine_b_again]"}  # fmt: skip
    # The median step without the compiling first: 0.1 * (1 + seed + cp) seconds.
    assert float(rows["flash_s1"]["step_ms"]) == pytest.approx(300.0)
    assert float(rows["lt_c64_cp2"]["step_ms"]) == pytest.approx(300.0)
    assert float(rows["lt_c32"]["gap"]) == pytest.approx(0.10)  # against flash of its seed
    table = (out / "context_table.md").read_text()
    assert (
        "| LT_chunked chunk_size=32, kernel=auto, context_parallel=1 | 5.100 (+0.100), 200 ms/step |"
        in table
    )
    assert table.count("| my_lab.attn alpha=1.0 [") == 2 and "data" not in table.split("|")[1]
    final = (out / "final_loss.md").read_text()
    row = next(line for line in final.splitlines() if line.startswith("| lt_c64_cp2 |"))
    assert "| LT_chunked chunk_size=64, kernel=auto, context_parallel=2 |" in row
    assert row.endswith("| 300.0 |")  # the median step beside the final loss


def test_one_model_swept_over_contexts_and_gates_is_one_size():
    """The size label ignores position embeddings and the gate's projection (nanoGPT's count):
    the CPU grid's model at 2048 positions is not a different model from the one at 128."""
    base = runs_lib.find_runs([FIXTURES / "context_runs"])[0].config
    runs = [
        runs_lib.Run(f"r{i}", {**base, **extra}, [], runs_lib.count_params_of({**base, **extra}))
        for i, extra in enumerate(
            [
                {"model.block_size": 128, "data.context": 128},
                {"model.block_size": 2048, "data.context": 2048},
                {"model.block_size": 2048, "data.context": 2048, "attention.decay": "gate"},
            ]
        )
    ]
    assert len({r.n_params for r in runs}) == 3  # the full counts differ ...
    assert len({r.size for r in runs}) == 1  # ... the label does not
    assert (
        runs[0].size
        == f"{runs_lib.count_params_of(runs[0].config, architecture_only=True) / 1e6:.1f}M"
    )


def test_plot_runs_script(tmp_path):
    script = load_script("plot_runs")
    out = tmp_path / "figs"
    assert script.main([str(FIXTURES / "learning_runs"), "--out", str(out)]) == 0
    for name in (
        "learning_curves_124M.png",
        "learning_curves_355M.png",
        "final_loss_vs_params.png",
    ):
        assert (out / name).stat().st_size > 0
    runs = runs_lib.find_runs([FIXTURES / "learning_runs"])
    assert len(runs) == 8 and {r.size for r in runs} == {"124M", "355M"}
    by = {(r.size, r.context, r.family): r for r in runs}
    # The fixtures decay towards the post's final losses (e.g. 124M, 1k: 3.207 vs 3.296).
    assert by[("124M", 1024, "softmax")].final_loss() == pytest.approx(3.207, abs=0.05)
    assert by[("124M", 1024, "linear")].final_loss() == pytest.approx(3.296, abs=0.05)
    assert by[("355M", 4096, "linear")].n_params > by[("124M", 4096, "linear")].n_params
    assert script.main([str(tmp_path / "nothing"), "--out", str(out)]) == 2


def test_mqar_report_puts_ours_beside_the_published_numbers(tmp_path, capsys):
    from studies.mqar import mqar

    rows = mqar.read_report(FIXTURES / "mqar_cpu.json")["rows"]
    meta = {"machine": "the 2-core CPU machine", "note": "test", "notes": ["one", "two"]}
    paths = mqar.write_report(rows, tmp_path, meta, name="r")
    md = paths["md"].read_text()
    assert "## mqar-rebased" in md and "| published: Based (ReBased fig. 1) |" in md
    assert "0.890" in md and "- one\n- two" in md
    assert mqar.read_report(paths["json"])["rows"] == rows
    assert paths["png"].stat().st_size > 0 and paths["csv"].read_text().startswith("protocol,L,N")
    # A run stopped before its first evaluation says so instead of an empty accuracy.
    early = {**rows[0], "accuracy": None, "best_accuracy": None, "reached_target": False}
    early.update(steps=99, L=4096)
    md = mqar.markdown([*rows, early], meta)
    assert "not evaluated, 99 steps" in md and "| , 99 steps" not in md
    # The report alone needs runs: one line, exit 2, naming the command that makes them.
    script = load_script("mqar")
    code = script.main(["--report-only", "--sweep", str(write_empty_sweep(tmp_path))])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "no finished MQAR runs" in err[0], err


def test_mqar_report_keeps_earlier_rows_and_shows_the_best_run_per_cell(tmp_path, capsys):
    from studies.mqar import mqar

    rows = mqar.read_report(FIXTURES / "mqar_cpu.json")["rows"]
    first = rows[0]
    # A second run of the same cell with another recipe: the table shows the one that reached
    # the target; the settings table lists both, each with its recipe.
    config = {"model.dropout": 0.1, "train.beta2": 0.999, "data.mqar.train_examples": 10**9}
    assert mqar.recipe(config) == "dropout 0.1, beta2 0.999, fresh train examples"
    assert mqar.recipe({"data.mqar.train_examples": 100000, "train.beta2": 0.95}) == "base"
    assert mqar.recipe({"data.mqar.train_examples": 200000}) == "200000 train examples"
    zoo = {"model.identity_state_mixer": True, "model.bias": True}
    assert mqar.recipe(zoo) == "biases True, x + ln_2(x) blocks"
    # Based's recipe at Zoology's cells (issue 39): the projection in the name, the short
    # convolution a departure there, the state as Zoology counts it (153 features x 64 + 153).
    based = {"attention.name": "LT_chunked", "attention.feature_map": "taylor2",
             "attention.feature_dim": 16, "model.short_conv": 3, "model.n_embd": 64,
             "model.n_head": 1, "data.context": 64, "log.wandb_group": "mqar-zoology"}  # fmt: skip
    assert (
        mqar.variant(based) == "LT_chunked/taylor2(16)+conv"
        and mqar.recipe(based) == "short conv 3"
    )
    assert mqar.variant({**based, "data.mqar.random_non_queries": True}) == (
        "LT_chunked/taylor2(16)+conv (random fill)")  # fmt: skip
    rebased = {**based, "log.wandb_group": "mqar-rebased"}  # every cell there has the convolution
    assert mqar.variant(rebased) == "LT_chunked/taylor2(16)" and mqar.recipe(rebased) == "base"
    kept = {
        **first,
        "protocol": "mqar-zoology",
        "attention": "softmax (random fill)",
        "short_conv": 3,
    }
    assert mqar.merge([kept], [])[0]["attention"] == "softmax+conv (random fill)"
    assert mqar.state_floats(based) == 64 * 153 + 153
    assert mqar.state_floats({**based, "attention.name": "softmax"}) == 2 * 64 * 64
    # Random fill is another task: its own row, never the zero-filled cell's best run.
    fill = {"attention.name": "softmax", "data.mqar.random_non_queries": True}
    assert mqar.variant(fill) == "softmax (random fill)" and mqar.recipe(fill) == "base"
    worse = {**first, "run": "other", "accuracy": 0.5, "reached_target": False}
    better = {**first, "run": "other2", "accuracy": 0.995, "reached_target": True}
    better["recipe"] = mqar.recipe(config)
    assert mqar.best([worse, better]) is better and mqar.best([worse, first]) is first
    # Runs on a plateau (equal at the table's three decimals): the cell shows the longest one.
    short = {**first, "run": "s", "accuracy": 0.00026, "reached_target": False, "steps": 467}
    long = {**first, "run": "l", "accuracy": 0.00018, "reached_target": False, "steps": 5838}
    assert mqar.best([short, long]) is long
    assert mqar.best([{**short, "accuracy": 0.0021}, long])["run"] == "s"
    # merge: kept rows (no recipe column in older reports) read as the base recipe; a new row of
    # the same protocol and run name replaces the kept one.
    kept = [{k: v for k, v in r.items() if k != "recipe"} for r in rows]
    replaced = {**first, "accuracy": 0.25, "recipe": "base"}
    merged = mqar.merge(kept, [replaced, better])
    assert len(merged) == len(rows) + 1
    assert [
        r for r in merged if r["run"] == first["run"] and r["protocol"] == first["protocol"]
    ] == [replaced]
    assert all(r["recipe"] for r in merged)
    md = mqar.markdown(merged, {"machine": "m", "note": "n"})
    assert "dropout 0.1, beta2 0.999, fresh train examples" in md
    cell = f"| ours: {first['attention']} | "
    # the first protocol's section comes first (rows are sorted by protocol)
    line = next(ln for ln in md.splitlines() if ln.startswith(cell))
    assert "0.995" in line and "0.250" not in line
    # Ad-hoc runs (no sweep group) belong to the protocol their model says.
    assert mqar.protocol_of({"model.short_conv": 3}) == "mqar-rebased"
    assert mqar.protocol_of({"model.short_conv": 0}) == "mqar-zoology"
    assert mqar.protocol_of({"log.wandb_group": "mine"}) == "mine"
    # --keep: writes the earlier rows again; a missing report is one line, exit 2.
    script = load_script("mqar")
    sweep = str(write_empty_sweep(tmp_path))
    out = tmp_path / "out"
    keep = ["--keep", str(FIXTURES / "mqar_cpu.json")]
    assert script.main(["--report-only", "--sweep", sweep, *keep, "--out", str(out)]) == 0
    report = mqar.read_report(out / "mqar_cpu.json")
    assert len(report["rows"]) == len(rows)
    # The sweeps a report names are repo-relative (a committed report names no one's checkout).
    assert report["meta"]["sweeps"] == [sweep]  # outside the repo: as given
    inside = script._shown(mqar.SWEEPS["mqar-zoology"], mqar.REPO_ROOT)
    assert inside == "configs/sweeps/mqar_zoology.yaml"
    capsys.readouterr()
    bad = ["--report-only", "--sweep", sweep, "--keep", str(tmp_path / "no.json")]
    assert script.main(bad) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no such report" in err[0], err


@pytest.mark.parametrize(
    "context, tokens, test_examples, eval_batches, expected",
    [
        (512, 8192, 512, 8, 128),  # ReBased L = 512 at batch 16: 8 of 32 batches
        (128, 8192, 512, 8, 512),  # batch 64: the whole split
        (256, 65536, 512, 8, 512),  # batch 256: the split holds 2 batches, read once
        (1024, 8192, 512, 64, 512),  # batch 8, 64 batches: the whole split
        (64, 4096, 100, 8, 64),  # a partial last batch is not read
    ],
)
def test_mqar_report_counts_the_test_examples_the_evaluation_read(
    context, tokens, test_examples, eval_batches, expected
):
    """The report's 'test examples' is what the trainer's evaluation read (log.eval_batches
    batches of one update's sequences from the validation loader), not the split's size."""
    from linear_gpt2.training import data as data_lib
    from linear_gpt2.training.config import load_config
    from studies.mqar import mqar

    overrides = [
        f"data.context={context}",
        f"model.block_size={context}",
        f"train.tokens_per_update={tokens}",
        f"train.micro_batch={tokens // context}",
        f"data.mqar.test_examples={test_examples}",
        f"log.eval_batches={eval_batches}",
    ]
    cfg = load_config(ROOT / "configs" / "mqar" / "base.yaml", overrides)
    flat = dict(o.split("=") for o in overrides)  # the run's flat config, as collect reads it
    assert mqar.evaluated_examples(flat) == expected
    # the trainer's evaluation: the first eval_batches batches of the validation loader
    loader = data_lib.make_loader(cfg.data, "validation", tokens // context)
    try:
        read = sum(len(b["inputs"]) for _, b in zip(range(eval_batches), loader))
    finally:
        loader.close()
    assert read == expected


def write_empty_sweep(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(
        f"name: mqar-x\nbase: {ROOT / 'configs' / 'mqar' / 'base.yaml'}\n"
        f"out_dir: {tmp_path / 'none'}\ngrid:\n  a:\n    - {{attention.name: softmax}}\n"
    )
    return path


def load_benchmark(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        f"bench_{name}", ROOT / "benchmarks" / f"{name}.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_mqar_probe_reads_the_library_model_and_measures_its_heads(tmp_path, capsys):
    import jax
    import numpy as np

    from linear_gpt2.model import forward, init_params
    from linear_gpt2.model.config import ModelConfig
    from linear_gpt2.training.data.mqar import example

    probe = load_benchmark("mqar_probe")
    cfg = ModelConfig(
        vocab_size=64, block_size=24, n_layer=2, n_head=1, n_embd=16, mlp=False, bias=False
    )
    params = init_params(cfg, 3)
    # Larger weights than the init so that attention is far from uniform and a wrong mapping
    # (a transposed kernel, a missing layer norm, layers swapped) changes the logits.
    params = jax.tree_util.tree_map(lambda a: a * 20 if a.ndim >= 2 else a, params)
    p = probe.reference_params(params)
    x, _ = example(0, length=24, num_kv_pairs=3, vocab_size=64, split="validation")
    maps, scores, logits = probe.attention(p, x)
    ours = np.asarray(forward(params, x[None], cfg))[0]
    assert np.linalg.norm(logits - ours) / np.linalg.norm(ours) < 1e-5
    assert len(maps) == 2 and np.allclose([m.sum(-1) for m in maps], 1.0, atol=1e-5)
    assert np.all(np.triu(maps[0], 1) == 0) and maps[0].std() > 0.05
    stats = probe.probe(p, 24, 3, examples=4, vocab_size=64)
    # layer 2's mass at a query splits into values, keys and the query region, which tile [0, t]
    parts = ("values", "keys", "query_region")
    assert sum(stats[f"layer2_query_on_{k}"] for k in parts) == pytest.approx(1.0, abs=1e-5)
    assert 0 <= stats["layer2_query_on_right_value"] <= stats["layer2_query_on_values"]
    assert max(stats[k] for k in stats if k.startswith("layer2_logit_")) <= 0
    # a model with biases is refused with the fix named
    with pytest.raises(ValueError, match="without biases"):
        probe.reference_params(init_params(cfg.replace(bias=True), 0))
    # Based's recipe (issue 39): short convolution, q and k of 4 dims, the Taylor kernel
    based = cfg.replace(attention="LT_chunked", chunk_size=8, feature_map="taylor2",
                        feature_dim=4, short_conv=3)  # fmt: skip
    bp = jax.tree_util.tree_map(lambda a: a * 5 if a.ndim >= 2 else a, init_params(based, 4))
    _, _, logits = probe.attention(probe.reference_params(bp, based), x)
    ours = np.asarray(forward(bp, x[None], based))[0]
    assert np.linalg.norm(logits - ours) / np.linalg.norm(ours) < 1e-5
    with pytest.raises(ValueError, match="short convolution"):  # softmax with one: refused
        probe.reference_params(init_params(cfg.replace(short_conv=3), 0))
    # The table: one column per run, one row per statistic.
    md = probe.markdown(
        [
            {"run": "a", "label": "a (L=8)", "accuracy": 0.5},
            {"run": "b", "label": "b", "accuracy": 1.0},
        ]
    )
    assert (
        md.splitlines()[0] == "| statistic | a (L=8) | b |"
        and "| accuracy | 0.5000 | 1.0000 |" in md
    )


def test_zoology_reference_loss_at_the_queries_equals_zoologys_loss_over_all_positions(tmp_path):
    """The reference driver applies the head at the labelled positions only; its loss, accuracy
    and gradients must equal Zoology's cross-entropy over every position with -100 ignored."""
    torch = pytest.importorskip("torch", reason="the parity extra installs torch")
    import torch.nn.functional as F

    ref = load_benchmark("mqar_zoology_reference")
    torch.manual_seed(0)
    backbone = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Tanh())
    head = torch.nn.Linear(8, 50, bias=False)
    inputs = torch.randint(50, (3, 11))
    labels = torch.full((3, 11), -100)
    labels[:, [4, 7, 10]] = torch.randint(50, (3, 3))
    loss, acc = ref.query_loss(backbone, head, inputs, labels)
    grads = torch.autograd.grad(loss, list(backbone.parameters()) + list(head.parameters()))
    logits = head(backbone(inputs))  # [B, T, V]: Zoology's head at every position
    full = F.cross_entropy(logits.reshape(-1, 50), labels.reshape(-1), ignore_index=-100)
    full_grads = torch.autograd.grad(full, list(backbone.parameters()) + list(head.parameters()))
    assert abs(loss.item() - full.item()) < 1e-6 * full.item()
    for g, h in zip(grads, full_grads):
        assert torch.linalg.norm(g - h) <= 1e-5 * torch.linalg.norm(h)
    mask = labels != -100
    assert acc.item() == (logits.argmax(-1)[mask] == labels[mask]).float().mean().item()
    # No checkout: one line naming the fix, exit 2, nothing written.
    out = tmp_path / "o.jsonl"
    assert ref.main(["--zoology", str(tmp_path / "none"), "--out", str(out)]) == 2
    assert not out.exists()
    # The table of a run's evaluations, with the sequences seen (update x batch).
    row = dict(
        update=50,
        epoch=0,
        lr=2.1544e-3,
        train_loss=8.5,
        test_loss=8.37,
        test_acc=0.25,
        train_s=157.7,
    )
    out.write_text(json.dumps(row) + "\n")
    md = tmp_path / "t.md"
    # The page needs the run's provenance, which training writes before its first update.
    assert ref.main(["--out", str(out), "--table", str(md)]) == 2
    args = ref.parse_args(["--out", str(out), "--batch", "4", "--max-hours", "1"])
    ref.write_meta(args, tmp_path, torch.__version__)
    meta = json.loads(ref.meta_path(out).read_text())["meta"]
    assert meta["how"] == "measured" and meta["settings"]["batch"] == 4
    assert meta["environment"]["torch_version"] == torch.__version__
    assert ref.main(["--out", str(out), "--table", str(md)]) == 0
    assert "| 50 | 0 | 200 | 0.00215 | 8.500 | 8.370 | 0.2500 | 158 |" in md.read_text()


def test_mqar_note_placeholders_take_run_names_with_dots():
    """A note's ``{{PROTOCOL/RUN.FIELD[:FORMAT]}}`` is filled from the rows, run names with dots
    (``lr0.01``) included; a placeholder that names no run, or is malformed, is an error, not
    text left in the report."""
    from studies.common.core import ReportError
    from studies.mqar import report

    rows = [{"protocol": "mqar-rebased", "run": "ctx128_lr0.01_x", "accuracy": 0.99021,
             "steps": 1900}]  # fmt: skip
    note = ("{{mqar-rebased/ctx128_lr0.01_x.accuracy}} at {{mqar-rebased/ctx128_lr0.01_x.steps}}"
            " ({{mqar-rebased/ctx128_lr0.01_x.accuracy:.4f}})")  # fmt: skip
    assert report.fill(note, rows) == "0.990 at 1900 (0.9902)"
    with pytest.raises(ReportError, match="no run mqar-rebased/other"):
        report.fill("{{mqar-rebased/other.accuracy}}", rows)
    with pytest.raises(ReportError, match="no run mqar-rebased/ctx128_lr0 with field '01_x'"):
        report.fill("{{mqar-rebased/ctx128_lr0.01_x}}", rows)  # no field: the name's tail
    with pytest.raises(ReportError, match="is not"):
        report.fill("{{mqar-rebased ctx128_lr0.01_x.accuracy}}", rows)
