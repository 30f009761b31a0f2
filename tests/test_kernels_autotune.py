"""``chunk_size: auto``: the autotuner's measurement and cache, the config field, the trace-time
resolution in the attention ``make()``, and the ``--tiny`` kernel benchmark end to end."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import attention
from linear_gpt2.attention import autotune
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import load_config, load_config_from_dict
from tests.helpers import SLOW, rel_err

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _fresh_memo():
    autotune._MEMO.clear()
    yield
    autotune._MEMO.clear()


def test_default_candidates():
    assert autotune.default_candidates("LT_chunked", 96) == [16, 32]
    assert autotune.default_candidates("LT_chunked", 1024) == [16, 32, 64, 128, 256]
    assert autotune.default_candidates("LT_attention_parallel", 40) == [16, 32, 64]


def test_measures_caches_and_reuses(tmp_path, monkeypatch):
    shape = (1, 64, 2, 8)
    c = autotune.best_chunk_size(
        "LT_chunked", shape, jnp.float32, "xla", cache_dir=tmp_path, warmup=1, runs=1
    )
    assert c in (16, 32, 64)
    data = json.loads((tmp_path / "chunk_sizes.json").read_text())
    (key, entry), = data.items()  # fmt: skip
    device_kind, jax_version, name, kernel, key_shape, dtype, fm, cands = json.loads(key)
    assert (device_kind, jax_version) == (jax.devices()[0].device_kind, jax.__version__)
    assert (name, kernel, key_shape, dtype, fm) == ("LT_chunked", "xla", list(shape), "float32",
                                                    "softplus")  # fmt: skip
    assert cands == [16, 32, 64] and entry["chunk_size"] == c
    assert set(entry["seconds"]) == {"16", "32", "64"}

    # Reused from the file (another process: the in-memory memo cleared), nothing measured.
    autotune._MEMO.clear()
    monkeypatch.setattr(autotune, "time_chunk_size", lambda *a, **k: pytest.fail("measured"))
    assert (
        autotune.best_chunk_size("LT_chunked", shape, jnp.float32, "xla", cache_dir=tmp_path) == c
    )
    # Another dtype is another key: measured (and here, the stub fails it).
    with pytest.raises(pytest.fail.Exception):
        autotune.best_chunk_size("LT_chunked", shape, jnp.bfloat16, "xla", cache_dir=tmp_path)


def test_default_cache_path_is_under_xdg_cache_home(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert autotune.cache_path() == tmp_path / "linear_gpt2" / "chunk_sizes.json"


def test_no_measurement_in_interpret_mode_or_without_choice(tmp_path, monkeypatch):
    monkeypatch.setattr(autotune, "time_chunk_size", lambda *a, **k: pytest.fail("measured"))
    if not jax.default_backend() == "gpu":
        # pallas off a GPU runs in interpret mode: the heuristic choice, nothing cached.
        c = autotune.best_chunk_size("LT_chunked", (1, 256, 1, 16), jnp.float32, "pallas",
                                     cache_dir=tmp_path)  # fmt: skip
        assert c == 64 and not (tmp_path / "chunk_sizes.json").exists()
    # One candidate, or none (T = 37: LT_chunked falls back to one chunk of T).
    assert autotune.best_chunk_size("LT_chunked", (1, 48, 1, 8), jnp.float32, "xla") == 16
    assert autotune.best_chunk_size("LT_chunked", (1, 37, 1, 8), jnp.float32, "xla") == 37
    with pytest.raises(ValueError, match="power of two >= 16"):
        autotune.best_chunk_size("LT_chunked", (1, 37, 1, 8), jnp.float32, "pallas")


@pytest.mark.parametrize("name", ["LT_chunked", "LT_attention_parallel"])
def test_auto_chunk_size_resolved_at_trace_time(name, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    shape = (1, 32, 2, 8)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal(shape), jnp.float32) for _ in range(3))
    y = jax.jit(attention.get(name, chunk_size="auto"))(q, k, v)  # measured inside the trace
    ref = attention.get(name, chunk_size=16)(q, k, v)
    assert rel_err(y, ref) <= 1e-5
    assert (tmp_path / "linear_gpt2" / "chunk_sizes.json").exists()


# --------------------------------------------------------------------------------------------
# Config: chunk_size is int | "auto"


def test_config_accepts_auto_and_ints():
    assert ModelConfig(attention="LT_chunked", chunk_size=64).chunk_size == 64
    assert ModelConfig(attention="LT_chunked", chunk_size="auto").chunk_size == "auto"
    cfg = load_config(None, ["attention.name=LT_chunked", "attention.chunk_size=auto",
                             "data.context=96"])  # fmt: skip
    assert cfg.attention.chunk_size == "auto" and cfg.model_config.chunk_size == "auto"
    cfg = load_config(None, ["attention.name=LT_chunked", "attention.chunk_size=32",
                             "data.context=96"])  # fmt: skip
    assert cfg.attention.chunk_size == 32
    for bad in ("fast", 0, True):
        with pytest.raises(
            ConfigError,
            match="chunk_size: (must be an int >= 1 or 'auto'|wrong type: expected int)",
        ):
            ModelConfig(attention="LT_chunked", chunk_size=bad)
    with pytest.raises(ConfigError, match="chunk_size"):
        load_config_from_dict({"attention": {"chunk_size": 1.5}})
    # A chunk size that does not divide the context is still an error; auto is not checked.
    with pytest.raises(ConfigError, match="data.context=96: chunk_size=64 does not divide T=96"):
        load_config_from_dict({"attention": {"name": "LT_chunked", "chunk_size": 64},
                               "data": {"context": 96}})  # fmt: skip


# --------------------------------------------------------------------------------------------
# The benchmark, end to end


def test_bench_kernels_table_takes_rows_without_a_flop_rate():
    """flash-linear-attention's rows (GPU only) have a time and no FLOP rate of ours: the table
    shows a dash, as an H200 window's sweep needed (it measured, then failed on the table)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_kernels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    ours = dict(name="LT_attention_parallel", kernel="pallas", T=4096, seconds=2e-4, tflops=250.0,
                status="ok", design="pallas_tiled")  # fmt: skip
    fla = dict(name="fla.chunk_linear_attn", kernel="fla", T=4096, seconds=1e-3, status="ok")
    rows = [ours | {"mode": "fwd"}, ours | {"mode": "fwd+bwd"},
            fla | {"mode": "fwd"}, fla | {"mode": "fwd+bwd"}]  # fmt: skip
    table = bench_kernels.table({"rows": rows})
    assert "| LT_attention_parallel | pallas (pallas_tiled) | 4096 | 0.200 | 250.000 |" in table
    assert "| fla.chunk_linear_attn | fla | 4096 | 1.000 | - | 1.000 | - |" in table


def test_bench_kernels_counts_the_causal_half_and_stays_under_the_peak():
    """The TFLOP/s column counts the quadratic forms' causal pairs only (the fused kernels skip
    the masked half): under the old count, every query against all T keys, the H200 sweep's
    Pallas forward read above the card's dense bf16 peak. The recounted results file is under
    it at every row, its times untouched, and --recount is idempotent."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import bench_kernels
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    from linear_gpt2.platform import cards

    T = 4096
    full = bench_kernels.fwd_flops("LT_chunked", 1, T, 12, 64, 64)
    assert full > 0
    causal = bench_kernels.fwd_flops("LT_attention_parallel", 1, T, 12, 64, 64)
    assert causal == 4 * 12 * 64 * T * (T + 1) / 2  # scores and weighted sums of the pairs j <= i
    path = ROOT / "benchmarks" / "results" / "kernel_sweep_h200_measured.json"
    data = json.loads(path.read_text())
    assert data["meta"]["settings"]["flop_count"] == bench_kernels.FLOP_COUNT
    rated = [r for r in data["rows"] if r.get("tflops")]
    assert rated and all(r["tflops"] * 1e12 < cards.H200.peak_bf16_flops for r in rated)
    again = bench_kernels.recount(json.loads(path.read_text()))
    for a, b in zip(again["rows"], data["rows"]):
        assert a["seconds"] == b["seconds"] and a.get("tflops") == pytest.approx(b.get("tflops"))


@SLOW
def test_bench_kernels_tiny(tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_kernels.py"),
            "--tiny",
            "--out",
            str(tmp_path),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (json_path,) = tmp_path.glob("bench_kernels-*.json")
    (csv_path,) = tmp_path.glob("bench_kernels-*.csv")
    (md_path,) = tmp_path.glob("bench_kernels-*.md")
    result = json.loads(json_path.read_text())
    assert result["jax_version"] == jax.__version__ and result["device_kind"]
    assert result["git_commit"]
    measured = {(r["name"], r["mode"]) for r in result["rows"] if r["status"] == "ok"}
    for name in attention.names():
        assert (name, "fwd") in measured and (name, "fwd+bwd") in measured, name
    assert all(r["seconds"] > 0 for r in result["rows"] if r["status"] == "ok")
    assert csv_path.read_text().startswith("name,kernel,T,mode,seconds,tflops,status")
    table = md_path.read_text()
    assert "| LT_chunked | xla | 64 |" in table and table == out.stdout.split("\nwrote ")[0]


@pytest.mark.gpu
def test_gpu_measures_the_pallas_kernel_inside_a_trace(tmp_path):
    """On a GPU the Pallas kernels are timed for real, also when the chunk size is resolved while
    the model is being traced (a jitted call under ensure_compile_time_eval is evaluated op by op,
    which a Pallas kernel cannot be)."""
    shape = (1, 1024, 2, 64)
    seen = []

    @jax.jit
    def traced(x):
        seen.append(
            autotune.best_chunk_size(
                "LT_chunked", shape, jnp.bfloat16, "pallas", cache_dir=tmp_path, measure=True,
                candidates=[64, 128], warmup=1, runs=1,
            )
        )  # fmt: skip
        return x + 1

    traced(jnp.zeros(()))
    assert seen and seen[0] in (64, 128)
    entry = next(iter(json.loads((tmp_path / "chunk_sizes.json").read_text()).values()))
    assert set(entry["seconds"]) == {"64", "128"} and all(entry["seconds"].values())
