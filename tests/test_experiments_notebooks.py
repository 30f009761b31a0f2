"""The analysis notebooks execute on the fixture results (so they cannot rot), and
scripts/plot_runs.py draws the learning figures from run directories."""

import csv
import json
import os
import sys
from pathlib import Path

import pytest

from linear_gpt2 import plots
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


def execute(name: str, kernel: str, tmp_path: Path, **env: str):
    nbclient = pytest.importorskip("nbclient")
    nbformat = pytest.importorskip("nbformat")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    figs = tmp_path / "figs"
    old = dict(os.environ)
    os.environ.update(NOTEBOOK_FIG_DIR=str(figs), **env)
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
    return nb, figs


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
    assert "softmax >= 99% in every setting: True" in text
    assert "LT_chunked/softplus: below Based at L = [128, 256, 512, 1024]" in text
    # The context table (gap to flash in parentheses) and the trend sentence per variant.
    assert "| LT_chunked | 5.640 (+0.040) | 5.580 (+0.130) |" in text
    assert "LT_chunked: gap to flash +0.040 at 128 -> +0.130 at 512: grows" in text
    # Diagnostics: the gated run's state norm, and the spike counts.
    assert "| LT_chunked+gate | 512 | 2 | 1.131 | 0.3 | 0.95 | 0 |" in text
    for name in (
        "mqar_accuracy.png",
        "final_loss_vs_context_3.4M.png",
        "curves_by_context_3.4M.png",
    ):
        assert (figs / name).exists(), name


def test_plot_runs_draws_the_context_figures(tmp_path):
    script = load_script("plot_runs")
    out = tmp_path / "figs"
    assert script.main([str(FIXTURES / "context_runs"), "--out", str(out)]) == 0
    size = plots.find_runs([FIXTURES / "context_runs"])[0].size
    for name in (f"final_loss_vs_context_{size}.png", f"curves_by_context_{size}.png"):
        assert (out / name).stat().st_size > 0
    table = (out / "context_table.md").read_text()
    assert "| flash | 5.600 | 5.450 |" in table and "LT_chunked+reset" in table
    csv_rows = (out / "context_table.csv").read_text().splitlines()
    assert csv_rows[0] == "size,variant,context,seed,steps,val,train,gap,train_s,spikes,name"
    assert len(csv_rows) == 9
    for row in csv.DictReader(csv_rows):
        records = [
            json.loads(x)
            for x in (FIXTURES / "context_runs" / row["name"] / "metrics.jsonl").open()
        ]
        spikes = [x["diag/spikes"] for x in records if "diag/spikes" in x]
        assert row["spikes"] == str(spikes[-1]) and row["seed"] == "0", row


def test_one_model_swept_over_contexts_and_gates_is_one_size():
    """The size label ignores position embeddings and the gate's projection (nanoGPT's count):
    the CPU grid's model at 2048 positions is not a different model from the one at 128."""
    base = plots.find_runs([FIXTURES / "context_runs"])[0].config
    runs = [
        plots.Run(f"r{i}", {**base, **extra}, [], plots.count_params_of({**base, **extra}))
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
        == f"{plots.count_params_of(runs[0].config, architecture_only=True) / 1e6:.1f}M"
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
    runs = plots.find_runs([FIXTURES / "learning_runs"])
    assert len(runs) == 8 and {r.size for r in runs} == {"124M", "355M"}
    by = {(r.size, r.context, r.family): r for r in runs}
    # The fixtures decay towards the post's final losses (e.g. 124M, 1k: 3.207 vs 3.296).
    assert by[("124M", 1024, "softmax")].final_loss() == pytest.approx(3.207, abs=0.05)
    assert by[("124M", 1024, "linear")].final_loss() == pytest.approx(3.296, abs=0.05)
    assert by[("355M", 4096, "linear")].n_params > by[("124M", 4096, "linear")].n_params
    assert script.main([str(tmp_path / "nothing"), "--out", str(out)]) == 2


def test_mqar_report_puts_ours_beside_the_published_numbers(tmp_path, capsys):
    from linear_gpt2 import mqar

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


def write_empty_sweep(tmp_path):
    path = tmp_path / "sweep.yaml"
    path.write_text(
        f"name: mqar-x\nbase: {ROOT / 'configs' / 'mqar' / 'base.yaml'}\n"
        f"out_dir: {tmp_path / 'none'}\ngrid:\n  a:\n    - {{attention.name: softmax}}\n"
    )
    return path
