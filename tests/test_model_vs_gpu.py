"""The step-time MODEL priced on another card's peaks (``step_model.Params.on``) and set beside
a GPU's glue A/B (``studies/train_step/report_model_vs_gpu.py``), on small synthetic raw files
(the real ones are checked against their page by ``test_reports.py``)."""

from __future__ import annotations

import dataclasses

import pytest

from linear_gpt2.platform.cards import A100, H100, H200
from studies.common.core import Raw
from studies.train_step import report_model_vs_gpu as vs
from studies.train_step import step_model as sm

FIT = {"matmul": 0.8, "fmha": 0.5, "kernel": 0.2, "memory": 0.5, "reduction": 0.4,
       "launch_us": 2.0, "host_bytes_per_s": 50e9}  # fmt: skip


def _row(kind: str, flops: float, nbytes: float, **kw) -> dict:
    return {"kind": kind, "part": "mlp", "backward": False, "flops": flops, "bytes": nbytes,
            "count": 1, **kw}  # fmt: skip


def test_a_card_scales_the_memory_bound_rows_by_its_bandwidth_and_the_h100_is_unchanged():
    p = sm.Params(**FIT)
    memory_bound = [_row("memory", 0.0, 3e9, fusion="loop"), _row("memory", 0.0, 1e9, fusion="input"),
                    _row("kernel", 1e6, 2e9, programs=132), _row("matmul", 1e9, 4e9)]  # fmt: skip
    compute_bound = _row("matmul", 4e13, 1e6)
    h200 = p.on(H200)
    bw = H100.hbm_bytes_per_s / H200.hbm_bytes_per_s
    for r in memory_bound:
        assert sm.row_seconds(r, h200) == pytest.approx(sm.row_seconds(r, p) * bw, rel=1e-12), r
    # the same dense bf16 peak: a compute-bound GEMM and each launch's overhead stay
    assert sm.row_seconds(compute_bound, h200) == pytest.approx(sm.row_seconds(compute_bound, p))
    assert h200.launch_us == p.launch_us and h200.vector() == p.vector()
    # on the H100 (the default peaks) the prices are the same to the bit
    rows = [*memory_bound, compute_bound, _row("kernel", 1e11, 1e8, programs=66)]
    assert (p.peak_flops, p.peak_bytes) == (H100.peak_bf16_flops, H100.hbm_bytes_per_s)
    assert sm.predict(rows, p.on(H100)) == sm.predict(rows, p)
    assert sm.breakdown(rows, p.on(H100)) == sm.breakdown(rows, p)
    with pytest.raises(ValueError, match="no HBM bandwidth"):
        p.on(A100)
    with pytest.raises(ValueError, match="SMs"):
        p.on(dataclasses.replace(H200, sms=114))


def _spec(context: int, chunk: int | None) -> dict:
    return {"attention": "LT_chunked", "size": "124M", "context": context, "batch": 1,
            "chunk_size": chunk, "overrides": {"remat": "none", "loss_chunk": 0}}  # fmt: skip


def _raws() -> tuple[Raw, Raw, Raw]:
    """One elementwise launch per program, priced at FIT (memory 0.5, launch 2 µs) on the
    H200's bandwidth: 2.4e10 bytes are 10 ms + 2 µs. ``before`` holds both points (the first
    compiled at chunk 64, timed at 128), ``after`` only the first."""
    gb = 0.01 * 0.5 * H200.hbm_bytes_per_s
    one = lambda b, ctx, chunk: {
        "spec": _spec(ctx, chunk),
        "rows": [  # noqa: E731
            _row("memory", 0.0, b, fusion="loop")
        ],
        "memory_bytes": 1,
        "compile_seconds": 1.0,
    }
    labels = {
        k: {"environment": {"git_commit": c * 40}} for k, c in (("before", "a"), ("after", "b"))
    }
    costs = {"meta": {"labels": labels}, "points": {
        "before": {"k1": one(gb, 1024, 64), "k2": one(gb, 2048, 128)},
        "after": {"k1": one(gb / 2, 1024, 64)}}}  # fmt: skip
    model = {"meta": {"model": {"params": FIT, "commit": "c" * 40}}, "measured": {}}
    env = {"device_kind": "NVIDIA H200", "git_commit": "d" * 40, "jax_version": "0.11.2"}
    rows = [{"attention": "LT_chunked", "size": "124M", "context": t, "batch": 1,
             "chunk_size": 128, "baseline": "xla", "median_ms": {"xla": 12.5, "pallas": 10.0},
             "status": {"xla": "ok", "pallas": "ok"}, "ratio": {"pallas": 0.8}}
            for t in (1024, 2048)]  # fmt: skip
    ab = {"meta": {"how": "measured", "environment": env, "settings": {}}, "rows": rows}
    return (
        Raw("costs.json", costs),
        Raw("model.json", model),
        Raw("glue_ab_h200_measured.json", ab),
    )


def test_the_model_beside_the_measured_glue_ab_and_a_missing_point():
    text = vs.vs_gpu(*_raws())
    xla, pallas = 10.002, 5.002  # MODEL ms on the H200's peaks, launch included
    slower = H200.hbm_bytes_per_s / H100.hbm_bytes_per_s  # the same bytes on the H100's
    # the first point: MODEL / measured, then the MODEL's ratio to xla beside the measured one
    assert (
        f"| `LT_chunked` 124M 1k, chunk 128 | `xla` (`before`) | {10 * slower + 0.002:.2f} | "
        f"10.00 | 12.50 | {xla / 12.5:.3f} |  |  | compiled at chunk 64 |"
    ) in text
    assert (f"| `LT_chunked` 124M 1k, chunk 128 | `pallas` (`after`) | {5 * slower + 0.002:.2f} | "
            f"5.00 | 10.00 | {pallas / 10:.3f} | {pallas / xla:.3f} | 0.800 | "
            "compiled at chunk 64 |") in text  # fmt: skip
    # the second point: after lacks it, said in the row and left out of every ratio
    assert (
        "| `pallas` (`after`) | — | — | 10.00 | — | — | 0.800 | `after` has no such point" in text
    )
    assert "the MODEL's saving is the larger at 1 of the 1 (point, setting) pairs" in text
    assert "`pallas` saves 50% to 50% of `xla`'s step by the MODEL (mean 50%), 20% to 20%" in text
    assert "`before` at aaaaaaa (main's code before the glue kernels); `after` at bbbbbbb" in text
    assert "the H200 compiled its own program on the GPU at ddddddd" in text
    assert "over the 3 step times" in text and "over the 1 ratios to the baseline" in text
    # the one-line summary reads the same numbers
    assert "the MODEL's saving is the larger at 1 of the 1" in vs.vs_gpu_summary(*_raws())


def test_the_step_glue_page_holds_the_blocks_its_writer_would_write():
    """``benchmarks/step_glue.py`` writes a new page from its template; the committed page,
    whose blocks render_reports re-renders, must hold the same blocks (the comparison block
    included for each glue A/B measured)."""
    import importlib.util

    from studies.common import core

    spec = importlib.util.spec_from_file_location("step_glue_writer", core.STUDIES.parent
                                                  / "benchmarks" / "step_glue.py")  # fmt: skip
    writer = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(writer)
    template = core.parse(writer.page_template(), "template")
    page = writer.RESULTS / f"{writer.STEM}.md"
    on_page = core.parse(page.read_text(), str(page))
    assert [(b.name, b.sources) for b in on_page] == [(b.name, b.sources) for b in template]
    assert any(b.name == "step_glue.vs_gpu" for b in template)


def _glue_raws(truth: float) -> tuple[Raw, Raw, Raw]:
    """Three points whose ``after`` swaps XLA's fusions for a glue kernel; the measured ratios
    are what the MODEL gives with the glue kernels at ``truth`` of the bandwidth."""
    base = [_row("memory", 0.0, 4e9, fusion="loop"), _row("memory", 0.0, 2e9, fusion="input")]
    on = sm.Params(**FIT).on(H200)
    costs = {"meta": {"labels": {}}, "points": {"before": {}, "after": {}}}
    rows = []
    for i, t in enumerate((1024, 2048, 4096)):
        after = [_row("memory", 0.0, 1e9 * (i + 1), fusion="loop"),
                 _row("kernel", 0.0, 3e9, kernel="layernorm_bwd", programs=528)]  # fmt: skip
        for label, r in (("before", base), ("after", after)):
            costs["points"][label][f"k{i}"] = {"spec": _spec(t, 128), "rows": r,
                                               "memory_bytes": 1, "compile_seconds": 1.0}  # fmt: skip
        ratio = sm.predict(after, dataclasses.replace(on, glue=truth)) / sm.predict(base, on)
        rows.append({"attention": "LT_chunked", "size": "124M", "context": t, "batch": 1,
                     "chunk_size": 128, "baseline": "xla",
                     "median_ms": {"xla": 10.0, "pallas": 10.0 * ratio},
                     "status": {"xla": "ok", "pallas": "ok"}})  # fmt: skip
    model = {"meta": {"model": {"params": FIT, "commit": "c" * 40}}, "measured": {}}
    env = {"device_kind": "NVIDIA H200", "git_commit": "d" * 40}
    ab = {"meta": {"how": "measured", "environment": env, "settings": {}}, "rows": rows}
    return Raw("costs.json", costs), Raw("model.json", model), Raw("ab.json", ab)


def test_the_glue_kernels_bandwidth_is_recovered_from_the_measured_ratios():
    costs, model, ab = _glue_raws(truth=0.25)
    c = vs.compare(costs.data, model.data, ab.data)
    r = vs.recalibrate(c, costs.data, model.data)
    assert r["glue"] == pytest.approx(0.25, rel=1e-4)
    assert max(map(abs, r["fitted"])) < 1e-4 and max(map(abs, r["loo"])) < 1e-4
    assert min(r["before"]) < -0.1  # at XLA's fraction (0.5) the kernels look cheaper
    # only the glue kernels move: XLA's fusions and the other kernels keep their prices
    p = dataclasses.replace(sm.Params(**FIT), glue=0.1)
    other = [_row("kernel", 1e9, 1e8, kernel="lt_chunked_fwd_o", programs=132),
             _row("memory", 0.0, 1e9, fusion="loop")]  # fmt: skip
    assert sm.predict(other, p) == sm.predict(other, sm.Params(**FIT))
    assert "is **0.25**" in vs.vs_gpu(costs, model, ab)
    assert "move their bytes at 0.25 of the bandwidth" in vs.vs_gpu_summary(costs, model, ab)


def test_the_glue_kernels_are_the_kernels_on_file_that_count_no_flops():
    """A kernel added to the step is priced as glue or as compute on purpose: the compiled
    costs on file hold every kernel the step runs."""
    import json
    from pathlib import Path

    path = (
        Path(__file__).resolve().parents[1]
        / "benchmarks/results/step_glue_h100_costs_compiled.json"
    )
    flops: dict[str, bool] = {}
    for points in json.loads(path.read_text())["points"].values():
        for p in points.values():
            for r in p["rows"]:
                if r["kind"] == "kernel":
                    flops[r["kernel"]] = flops.get(r["kernel"], False) or r["flops"] > 0
    assert {k for k, f in flops.items() if not f} == set(sm.GLUE_KERNELS)
    assert all(sm.is_glue_kernel({"kind": "kernel", "kernel": k}) for k in sm.GLUE_KERNELS)
