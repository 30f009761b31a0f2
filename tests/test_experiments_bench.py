"""The step-time benchmark: every attention end to end on CPU, the out-of-memory limit (a
simulated one through the memory cap, and a real XLA error), and its table and plot."""

import csv
import importlib.util
import json
from pathlib import Path

import pytest

from linear_gpt2 import attention
from linear_gpt2.platform import provenance
from linear_gpt2.platform.memory import is_oom
from studies.train_step import frontier
from studies.train_step import step_time as bench
from tests.helpers import SLOW

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(f"script_{name}", ROOT / "scripts" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@SLOW
def test_every_attention_runs_and_the_memory_cap_records_the_limit(tmp_path):
    script = load_script("bench_step")
    # Every registered attention, one short context (compilation dominates on CPU).
    assert script.main(["--tiny", "--contexts", "16", "--out", str(tmp_path), "--stem", "all"]) == 0
    data = bench.read_results(tmp_path / "all.json")
    rows = data["results"]
    assert [r["attention"] for r in rows] == attention.names()  # one context: registry order
    for r in rows:
        assert r["status"] == "ok", r
        assert r["median_ms"] > 0 and len(r["times_ms"]) == 3 and r["memory_bytes"] > 0
        # auto's resolution is recorded: the CPU reports no memory limit, so the plain step.
        assert (r["remat"], r["loss_chunk"]) == ("none", 0), r
    chunked = next(r for r in rows if r["attention"] == "LT_chunked")
    assert chunked["chunk_size"] == 16 and set(chunked["chunk_ms"]) == {16}
    assert chunked["autotune_chunk_size"] == 16  # the only candidate dividing the context
    assert chunked["kernel_design"] == "xla"  # kernel=auto off a GPU
    env = data["meta"]["environment"]
    assert env["device_kind"] and env["jax_version"] and env["git_commit"]
    with (tmp_path / "all.csv").open() as f:
        table = list(csv.DictReader(f))
    assert len(table) == len(rows) and all(float(t["median_ms"]) > 0 for t in table)
    assert all(t["remat"] == "none" and t["loss_chunk"] == "0" for t in table)
    assert all(t["device_kind"] and t["jax_version"] for t in table)
    assert (tmp_path / "all_tiny.png").stat().st_size > 0

    # A cap one byte below what softmax needs at context 32: 16 fits, 32 is the limit, 64 is
    # never tried. The step at 16 is the one compiled above (cached), 32 is compiled once.
    need = bench.step_memory_bytes(
        bench.compile_step(bench.model_config("tiny", "softmax", 32), 1, bench.FAST_COMPILE)[0]
    )
    cap = need - 1
    args = ["--tiny", "--attentions", "softmax", "--contexts", "16", "32", "64"]
    assert (
        script.main([*args, "--max-bytes", str(cap), "--out", str(tmp_path), "--stem", "cap"]) == 0
    )
    data = json.loads((tmp_path / "cap.json").read_text())
    got = [(r["context"], r["status"]) for r in data["results"]]
    assert got == [(16, "ok"), (32, "oom")]
    assert data["results"][0]["memory_bytes"] <= cap < data["results"][1]["memory_bytes"] == need
    assert "simulated" in data["results"][1]["oom_reason"]
    assert data["limits"]["softmax"]["tiny"] == {"max_context": 16, "oom_at": 32, "error_at": None}
    assert data["meta"]["settings"]["max_bytes"] == cap
    assert (tmp_path / "cap_tiny.png").stat().st_size > 0


@SLOW
def test_a_real_oom_ends_the_sweep_for_that_setting(monkeypatch):
    """XLA's RESOURCE_EXHAUSTED from the device (faked: CPU memory is unbounded) is the limit
    of that attention and size; the next attention starts again from the shortest context."""
    calls = []

    def fake_time_step(cfg, **kwargs):
        # softmax has no chunk_size option since each variant owns its options (issue 36)
        chunk = getattr(cfg, "chunk_size", None)
        calls.append((cfg.attention, cfg.block_size, chunk))
        if cfg.attention == "softmax" and cfg.block_size >= 64:
            raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.2GiB")
        if cfg.attention == "LT_chunked" and chunk == 32:
            raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")  # only this candidate fails
        return [0.002, 0.001, 0.003], 1000

    monkeypatch.setattr(bench, "time_step", fake_time_step)
    results = bench.run_benchmark(
        ["softmax", "LT_chunked"], ["tiny"], [32, 64, 128], chunk_sizes=(16, 32)
    )
    got = [(r.attention, r.context, r.status) for r in results]
    assert got == [  # context-major order; softmax is not tried after its limit
        ("softmax", 32, "ok"),
        ("LT_chunked", 32, "ok"),
        ("softmax", 64, "oom"),
        ("LT_chunked", 64, "ok"),
        ("LT_chunked", 128, "ok"),
    ]
    assert ("softmax", 128, 64) not in calls  # never tried past the limit
    assert "RESOURCE_EXHAUSTED" in results[2].oom_reason
    assert results[0].median_ms == pytest.approx(2.0)
    assert [r.chunk_size for r in results if r.attention == "LT_chunked"] == [16, 16, 16]
    lim = bench.limits(results)
    assert lim["softmax"]["tiny"]["oom_at"] == 64 and lim["LT_chunked"]["tiny"]["oom_at"] is None


def test_other_errors_are_recorded_not_raised(monkeypatch):
    def broken(cfg, **kwargs):
        raise NotImplementedError("kernel=pallas needs a GPU")

    monkeypatch.setattr(bench, "time_step", broken)
    (r,) = bench.run_benchmark(["flash"], ["tiny"], [16, 32])
    assert r.status == "error" and "pallas" in r.error and r.context == 16


def test_helpers():
    assert bench.default_contexts(1024, 8192) == [1024, 2048, 4096, 8192]
    assert bench.chunk_candidates(96, (32, 64, 128)) == [32]
    assert bench.chunk_candidates(8, (16, 32)) == [8]
    assert is_oom(RuntimeError("RESOURCE_EXHAUSTED: foo")) and not is_oom(ValueError("shape"))
    assert provenance.device_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    from linear_gpt2.experiments.plots import loglog_slope

    assert loglog_slope([1, 2, 4, 8], [3, 12, 48, 192]) == pytest.approx(2.0)


def test_frontier_sweep_stops_at_the_first_misfit_and_resumes_without_losing_points(
    tmp_path, monkeypatch
):
    """The bookkeeping of ``bench_step.py --target`` with the compiler replaced by a memory law
    (the real compiles are tested in test_target.py): each attention x size stops at its first
    context that does not fit, a later run for other attentions keeps the earlier points in the
    files, and a resumed run compiles nothing it already has."""
    script = load_script("bench_step")
    compiled = []

    def fake_point(name, size, context, target, *, batch, dtype, start_rung):
        compiled.append((name, size, context, start_rung))
        fits = context <= {"flash": 4096, "softmax": 2048}[name]
        return frontier.FrontierPoint(
            attention=name, size=size, context=context, status="fits" if fits else "too_big",
            n_params=1, target=target, memory_bytes=context * 2**20,
            remat="dots" if context > 1024 else "none", loss_chunk=4096 if context > 1024 else 0,
        )  # fmt: skip

    monkeypatch.setattr(frontier, "frontier_point", fake_point)
    common = ["--target", "h100", "--no-plot", "--out", str(tmp_path), "--sizes", "124M"]
    ctx = ["--contexts", "1024", "2048", "4096", "8192", "16384"]
    assert script.main([*common, *ctx, "--attentions", "flash"]) == 0
    assert [c[2] for c in compiled] == [1024, 2048, 4096, 8192]  # stops at the first misfit
    assert [c[3] for c in compiled] == [0, 0, 2, 2]  # next context starts at the rung that fit
    stem = tmp_path / "memory_frontier_h100_compiled"
    data = json.loads(stem.with_suffix(".json").read_text())
    data["meta"]["backfilled"] = {"points[].git_commit": "from the page"}  # added by hand
    stem.with_suffix(".json").write_text(json.dumps(data))
    assert script.main([*common, *ctx, "--attentions", "softmax"]) == 0
    data = json.loads(stem.with_suffix(".json").read_text())
    assert data["meta"]["backfilled"] == {"points[].git_commit": "from the page"}  # kept
    limits = data["limits"]
    assert limits == {"flash": {"124M": 4096}, "softmax": {"124M": 2048}}
    assert "| `flash` |" in stem.with_suffix(".md").read_text()  # rendered from the JSON
    n = len(compiled)
    assert script.main([*common, *ctx, "--attentions", "flash", "softmax"]) == 0
    assert len(compiled) == n  # every point was already in the file


def test_commit_is_dirty_only_for_code(tmp_path, monkeypatch):
    """A raw file, a page or the README changed since HEAD leave the commit clean (a benchmark
    writes its file after every point); a changed code file marks it ``+dirty``."""
    import subprocess

    from linear_gpt2.platform import provenance

    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    for rel in ("benchmarks/results/x.json", "docs/a.md", "README.md", "linear_gpt2/m.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("0\n")
    git("init", "-q")
    git("add", "-A")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "c")
    monkeypatch.setattr(provenance, "REPO", tmp_path)
    for rel in ("benchmarks/results/x.json", "docs/a.md", "README.md"):
        (tmp_path / rel).write_text("1\n")
    head = provenance.git_commit()
    assert head is not None and len(head) == 40, head
    (tmp_path / "linear_gpt2/m.py").write_text("1\n")
    assert provenance.git_commit() == head + "+dirty"
