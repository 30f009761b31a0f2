"""The step-time MODEL of the H100 (issue 30 item 2): per-launch costs read from optimized HLO
against hand counts, the model's arithmetic and fit, and the script on its cache and on a tiny
config compiled for the H100."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from linear_gpt2.experiments import hlo_costs
from studies.train_step import step_costs, step_targets
from studies.train_step import step_model as sm
from tests.helpers import SLOW

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# A hand-written optimized module: a GEMM fusion, an in-place stacking of a [4, 8] slice into a
# [3, 4, 8] buffer with scalar indices, a slice read back, a zero fill, a cuDNN attention call
# and a Pallas kernel, the stacking inside a loop of known trip count 3, and a host offload.
HLO = """HloModule jit_step

%gemm (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%stack (b: f32[3,4,8], u: f32[4,8], i: s32[]) -> f32[3,4,8] {
  %b = f32[3,4,8]{2,1,0} parameter(0)
  %u = f32[4,8]{1,0} parameter(1)
  %i = s32[] parameter(2)
  %bc = f32[1,4,8]{2,1,0} bitcast(%u)
  %z = s32[] constant(0)
  ROOT %dus = f32[3,4,8]{2,1,0} dynamic-update-slice(%b, %bc, %i, %z, %z)
}

%unstack (b: f32[3,4,8], i: s32[]) -> f32[1,4,8] {
  %b = f32[3,4,8]{2,1,0} parameter(0)
  %i = s32[] parameter(1)
  %z = s32[] constant(0)
  ROOT %ds = f32[1,4,8]{2,1,0} dynamic-slice(%b, %i, %z, %z), dynamic_slice_sizes={1,4,8}
}

%fill () -> f32[3,4,8] {
  %c = f32[] constant(0)
  ROOT %bz = f32[3,4,8]{2,1,0} broadcast(%c), dimensions={}
}

%twice (x: f32[4,8]) -> f32[4,8] {
  %x = f32[4,8]{1,0} parameter(0)
  ROOT %m = f32[4,8]{1,0} add(%x, %x)
}

%body (t: (s32[], f32[3,4,8], f32[4,8])) -> (s32[], f32[3,4,8], f32[4,8]) {
  %t = (s32[], f32[3,4,8]{2,1,0}, f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %b = f32[3,4,8]{2,1,0} get-tuple-element(%t), index=1
  %u = f32[4,8]{1,0} get-tuple-element(%t), index=2
  %s = f32[3,4,8]{2,1,0} fusion(%b, %u, %i), kind=kLoop, calls=%stack, metadata={op_name="jit(step)/jvp(GPT)/while/body/dynamic_update_slice"}
  %u2 = f32[4,8]{1,0} fusion(%u), kind=kLoop, calls=%twice, metadata={op_name="jit(step)/jvp(GPT)/while/body/eval_jaxpr/h/mlp/mul"}
  ROOT %r = (s32[], f32[3,4,8]{2,1,0}, f32[4,8]{1,0}) tuple(%i, %s, %u2)
}

%cond (t: (s32[], f32[3,4,8], f32[4,8])) -> pred[] {
  %t = (s32[], f32[3,4,8]{2,1,0}, f32[4,8]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (a: bf16[64,32], w: bf16[32,16], q: bf16[1,128,2,16], u: f32[4,8]) -> f32[1,4,8] {
  %a = bf16[64,32]{1,0} parameter(0)
  %w = bf16[32,16]{1,0} parameter(1)
  %q = bf16[1,128,2,16]{3,2,1,0} parameter(2)
  %u = f32[4,8]{1,0} parameter(3)
  %g = bf16[64,16]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/jvp(GPT)/h/mlp/c_fc/dot_general"}
  %fa = (bf16[1,2,128,16]{3,1,2,0}, f32[1,2,128]{2,1,0}, u8[0]{0}) custom-call(%q, %q, %q), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config": {"intermediate_tensor_shape": {"element_type": "BF16", "dimensions": ["1", "2", "128", "128"]}, "mask_type": "CAUSAL"}}
  %pk = bf16[1,128,2,16]{3,2,1,0} custom-call(%q, %q), custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 4 : i32, grid_y = 2 : i32, grid_z = 1 : i32, ir = "", name = "lt_chunked_fwd_o", num_warps = 4 : i32}
  %zero = f32[3,4,8]{2,1,0} fusion(), kind=kLoop, calls=%fill
  %i0 = s32[] constant(0)
  %t0 = (s32[], f32[3,4,8]{2,1,0}, f32[4,8]{1,0}) tuple(%i0, %zero, %u)
  %wh = (s32[], f32[3,4,8]{2,1,0}, f32[4,8]{1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %st = f32[3,4,8]{2,1,0} get-tuple-element(%wh), index=1
  %one = s32[] constant(1)
  %back = f32[1,4,8]{2,1,0} fusion(%st, %one), kind=kLoop, calls=%unstack, metadata={op_name="jit(step)/transpose(jvp(GPT))/while/body/dynamic_slice"}
  %h = f32[3,4,8]{2,1,0:S(5)} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %out = f32[1,4,8]{2,1,0} copy(%back)
}
"""


def by_name(ops):
    return {o.name: o for o in ops}


def test_costs_of_each_launch_match_a_hand_count():
    ops = by_name(hlo_costs.program_ops(HLO))
    g = ops["g"]  # 2 m n k; inputs and output once
    assert (g.kind, g.count, g.part) == ("matmul", 1, "mlp")
    assert g.flops == 2 * 64 * 16 * 32 and g.bytes == (64 * 32 + 32 * 16 + 64 * 16) * 2
    fa = ops["fa"]  # causal: half of 4 B H T^2 D; q, k, v read, output and stats written
    assert (fa.kind, fa.flops) == ("fmha", 4 * 1 * 2 * 128 * 128 * 16 * 0.5)
    assert fa.bytes == 3 * (128 * 2 * 16 * 2) + 128 * 2 * 16 * 2 + 2 * 128 * 4
    pk = ops["pk"]  # Pallas: FLOPs from the kernel cost model, not the HLO
    assert (pk.kind, pk.flops, pk.detail["kernel"], pk.detail["grid"]) == (
        "kernel", 0.0, "lt_chunked_fwd_o", [4, 2, 1]
    )  # fmt: skip
    s = ops["s"]  # in place, in a loop of 3: the update read and written (and the index), not
    # the buffer
    assert (s.count, s.bytes, s.part, s.detail["role"]) == (
        3, 2 * 4 * 8 * 4 + 4, "saved activations", "copy"
    )  # fmt: skip
    assert (ops["u2"].count, ops["u2"].bytes, ops["u2"].detail["role"]) == (3, 2 * 32 * 4, None)
    back = ops["back"]  # a slice: only the slice is read
    assert (back.bytes, back.backward) == (2 * 32 * 4 + 4, True)
    zero = ops["zero"]  # a fill writes its buffer
    assert (zero.bytes, zero.detail["role"], zero.part) == (3 * 32 * 4, "fill", "unattributed")
    assert ops["lt"].count == 4  # the condition runs trip count + 1 times
    assert ops["out"].kind == "copy" and ops["out"].bytes == 2 * 32 * 4
    assert "h" not in ops  # AllocateBuffer launches nothing


def test_costs_of_a_program_compiled_for_the_h100():
    """A tiny program compiled for the H100 (deviceless): a matmul in a loop of 5 and an
    elementwise op, against a hand count."""
    import jax
    import jax.numpy as jnp

    from linear_gpt2.platform import target

    def f(x, w):
        y = jax.lax.fori_loop(0, 5, lambda i, y: jnp.tanh(y @ w), x)
        return y * 2.0

    rep = target.replicated("h100")
    x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16, sharding=rep)
    w = jax.ShapeDtypeStruct((128, 128), jnp.bfloat16, sharding=rep)
    _, compiled = target.compile_program(jax.jit(f), (x, w), "h100", keep_executable=True)
    ops = hlo_costs.program_ops(compiled.as_text())
    mm = [o for o in ops if o.kind == "matmul"]
    assert sum(o.flops * o.count for o in mm) == 5 * 2 * 256 * 128 * 128
    assert sum(o.count for o in mm) == 5
    assert all(o.bytes >= (256 * 128 + 128 * 128 + 256 * 128) * 2 for o in mm)


ROWS = [
    {"kind": "matmul", "part": "mlp", "backward": False, "flops": 1e12, "bytes": 1e9, "count": 2},
    {"kind": "fmha", "part": "attention core", "backward": True, "flops": 5e11, "bytes": 1e8,
     "count": 1},
    {"kind": "memory", "part": "layernorm", "backward": False, "flops": 0.0, "bytes": 3e9,
     "count": 10, "fusion": "loop", "f32": 1.0},
    {"kind": "memory", "part": "mlp", "backward": True, "flops": 0.0, "bytes": 1e9, "count": 4,
     "fusion": "input"},
    {"kind": "kernel", "part": "attention core", "backward": False, "flops": 1e11, "bytes": 1e8,
     "count": 3, "programs": 66},
    {"kind": "host", "part": "saved activations", "backward": False, "flops": 0.0, "bytes": 5e9,
     "count": 2},
]  # fmt: skip


def test_the_models_arithmetic():
    p = sm.Params(matmul=0.5, fmha=0.4, kernel=0.25, memory=0.8, reduction=0.5, launch_us=2.0)
    P, W = sm.PEAK_FLOPS, sm.PEAK_BYTES
    expect = {
        "matmul": 2 * max(1e12 / (0.5 * P), 1e9 / (0.8 * W)),
        "fmha": max(5e11 / (0.4 * P), 1e8 / (0.8 * W)),
        "elementwise": 10 * 3e9 / (0.8 * W),
        "reduction": 4 * 1e9 / (0.5 * W),
        # 66 programs use half the 132 SMs: the roofline at half the GPU
        "kernel": 3 * max(1e11 / (0.25 * P), 1e8 / (0.8 * W)) * 2,
        "host": 2 * 5e9 / sm.HOST_BYTES_PER_S,
        "launch": 22 * 2e-6,
    }
    got = sm.breakdown(ROWS, p)
    assert got.keys() == expect.keys()
    for k, v in expect.items():
        assert got[k] == pytest.approx(v, rel=1e-12), k
    assert sm.predict(ROWS, p) == pytest.approx(sum(expect.values()), rel=1e-12)
    assert sum(sm.breakdown(ROWS, p, by="part").values()) == pytest.approx(sm.predict(ROWS, p))
    assert sm.launches(ROWS) == 22
    assert sm.totals(ROWS)["matmul"] == {"flops": 2e12, "bytes": 2e9, "launches": 2}


def test_the_fit_recovers_the_constants_that_made_the_times():
    truth = sm.Params(matmul=0.7, fmha=0.45, kernel=0.2, memory=0.85, reduction=0.4,
                      launch_us=2.5)  # fmt: skip
    import numpy as np

    mixes = np.random.default_rng(0).integers(1, 12, size=(16, len(ROWS)))
    points = []
    for i in range(16):  # mixes in which every constant matters somewhere
        rows = [dict(r, count=r["count"] * int(mixes[i, j])) for j, r in enumerate(ROWS)]
        rows.append({"kind": "memory", "part": "other", "backward": False, "flops": 0.0,
                     "bytes": 1e3, "count": 1000 * (1 + i % 4), "fusion": "loop"})  # fmt: skip
        points.append((rows, sm.predict(rows, truth)))
    got = sm.fit(points)
    for k in sm.FITTED:
        assert getattr(got, k) == pytest.approx(getattr(truth, k), rel=1e-3), k
    assert sm.summary(sm.errors(points, got))["max_abs"] < 1e-6
    held = sm.fit(points[1:], start=got)
    assert abs(sm.errors(points[:1], held)[0]) < 1e-6


def test_the_fit_stays_within_the_cards_ceilings():
    """Times made at the datasheet's matmul peak fit a matmul fraction of 1 unbounded; bounded
    by a card that reached 80% of it, the fraction stops at 0.8, as does every FLOP fraction,
    and the bandwidth fractions follow a measured bandwidth."""
    ceilings = {"matmul_flops_per_s": 0.8 * sm.PEAK_FLOPS, "hbm_bytes_per_s": 0.9 * sm.PEAK_BYTES}
    limits = sm.bounds(ceilings)
    assert limits["matmul"][1] == limits["fmha"][1] == limits["kernel"][1] == pytest.approx(0.8)
    assert limits["memory"][1] == limits["reduction"][1] == pytest.approx(0.9)
    assert sm.bounds()["matmul"][1] == 1.0 and sm.bounds({"hbm_bytes_per_s": None}) == sm.bounds()
    truth = sm.Params(matmul=1.0, fmha=0.45, kernel=0.2, memory=0.85, reduction=0.4, launch_us=0)
    points = [([dict(r, count=r["count"] * (1 + i)) for r in ROWS[:1]], 0.0) for i in range(3)]
    points = [(rows, sm.predict(rows, truth)) for rows, _ in points]
    free = ["matmul"]
    assert sm.fit(points, truth, free).matmul == pytest.approx(1.0, rel=1e-6)
    assert sm.fit(points, truth, free, limits).matmul == pytest.approx(0.8, rel=1e-6)
    loo = sm.leave_one_out(points, sm.fit(points, truth, free, limits), limits)
    assert all(e == pytest.approx(1.0 / 0.8 - 1, rel=1e-4) for e in loo)


def test_card_ceilings_measure_on_any_backend(tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("card_ceilings",
                                                  ROOT / "benchmarks" / "card_ceilings.py")  # fmt: skip
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.device_stem("NVIDIA H100 80GB HBM3") == "h100"
    assert mod.device_stem("NVIDIA H200") == "h200" and mod.device_stem("cpu") == "cpu"
    assert mod.main(["--tiny", "--out", str(tmp_path)]) == 0
    got = json.loads((tmp_path / "card_ceilings_cpu.json").read_text())
    assert got["meta"]["how"] == "measured" and got["meta"]["settings"]["tiny"]
    assert got["ceilings"]["matmul_flops_per_s"] > 0 and got["ceilings"]["hbm_bytes_per_s"] > 0


def test_changes_edit_rows_and_parameters():
    p = sm.Params()
    rows = [dict(r) for r in ROWS]
    assert step_targets.price(rows, p) == pytest.approx(sm.predict(rows, p))
    # Overlapped host transfers cost only what exceeds the rest of the step.
    hidden = step_targets.HOST_OVERLAPPED.rows(rows)
    rest = sm.predict([r for r in rows if r["kind"] != "host"], p)
    host = sm.predict([r for r in rows if r["kind"] == "host"], p)
    assert step_targets.price(hidden, p) == pytest.approx(rest + max(0.0, host - rest))
    # bf16 activations halve the float32 share of the activations' bytes (and the offload's).
    edited = step_targets.BF16_ACTIVATIONS.rows(rows)
    assert edited[2]["bytes"] == 1.5e9 and edited[5]["bytes"] == 5e9  # host f32 share: 0
    fast = step_targets.FAST_REDUCTIONS.params(dataclasses.replace(p, reduction=0.3))
    assert fast.reduction == p.memory
    fill = {"kind": "memory", "part": "unattributed", "backward": False, "flops": 0.0,
            "bytes": 1e9, "count": 1, "fusion": "loop", "role": "fill"}  # fmt: skip
    assert step_targets.NO_SCAN_STACKING.rows([*rows, fill]) == rows


def test_measured_points_are_the_37_and_the_memory_check():
    points = step_costs.measured_points(RESULTS)
    fitted = [p for p in points if not p.held_out]
    assert len(fitted) == 37 and len(points) == 41
    # The H100 model fits H100 times only: the H200's measured steps (step_time_h200_*) beside
    # them in the folder are another card.
    assert (RESULTS / "step_time_h200_measured.json").exists()
    assert all(p.source.startswith(("step_time_h100_", "memory_check_h100")) for p in points)
    assert {p.key for p in points if p.held_out} >= {"LT_chunked:124M:1048576:offload:4096"}
    # Pallas kernels priced by the cost model, by the name they are launched with.
    one = next(p for p in fitted if p.key == "LT_chunked:124M:65536")
    names = set(step_costs.pallas_costs(one))
    assert {"lt_chunked_fwd_h", "lt_chunked_fwd_o", "lt_chunked_bwd_dh"} <= names
    # LT_attention_parallel's: the single pass it was measured with, and the tiled kernels
    # kernel=pallas launches now (the tiled forward, the two-kernel backward), priced by FLOPs.
    one = next(p for p in fitted if p.key == "LT_attention_parallel:124M:16384")
    costs = step_costs.pallas_costs(one)
    now = {f"lt_attention_parallel_{k}" for k in ("tiled_fwd", "tiled_dkv", "tiled_dq")}
    assert {"lt_attention_parallel_forward", "lt_attention_parallel_backward"} | now <= set(costs)
    assert all(costs[k].flops > 0 and costs[k].programs >= 132 for k in now)


def test_the_committed_model_meets_the_error_goal_and_reruns_from_its_cache(tmp_path):
    """The script on the committed cache (no compile) reproduces the committed model file."""
    for name in ("train_step_h100_costs_compiled.json", "published_post.json"):
        (tmp_path / name).write_text((RESULTS / name).read_text())
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_model.py"), "--no-compile",
           "--out", str(tmp_path), "--results", str(RESULTS)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    new = json.loads((tmp_path / "train_step_h100_model.json").read_text())
    old = json.loads((RESULTS / "train_step_h100_model.json").read_text())
    assert new["fit"]["n"] == 37 and new["fit"]["median_abs"] <= 0.15
    assert new["fit"]["max_abs"] <= 0.35
    assert new["params"] == pytest.approx(old["params"], rel=1e-6)
    assert [r["modelled_ms"] for r in new["points"]] == pytest.approx(
        [r["modelled_ms"] for r in old["points"]], rel=1e-6)  # fmt: skip
    page = (tmp_path / "train_step_h100_model.md").read_text()
    assert "MODEL" in page and "LT_chunked 124M at 64k" in page
    # Every fraction within the lent card's ceilings, not the datasheet's peaks.
    card = json.loads((RESULTS / "card_ceilings_h100.json").read_text())["ceilings"]
    assert new["params"]["matmul"] <= card["matmul_flops_per_s"] / sm.PEAK_FLOPS + 1e-9
    assert max(new["params"][k] for k in ("fmha", "kernel")) <= new["params"]["matmul"]
    assert "bound from" in page and new["fit"]["loo"]["n"] == 37
    assert {t["target"] for t in new["targets"]} >= {"1M tokens <= 4.4 s"}


def test_no_compile_without_a_cost_cache_is_one_line(tmp_path):
    """``--no-compile`` where ``--out`` holds no cost cache: exit 2, one line naming the cache
    and the fix, nothing written (it was a traceback: no median for empty data)."""
    out = tmp_path / "empty"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_model.py"), "--no-compile",
           "--out", str(out)]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    err = run.stderr.strip().splitlines()
    assert run.returncode == 2 and len(err) == 1, run.stderr
    assert err[0].startswith("error: --no-compile:") and "without --no-compile" in err[0]
    assert "train_step_h100_costs_compiled.json" in err[0] and not out.exists()


@SLOW
def test_the_script_compiles_a_tiny_config_for_the_h100(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "step_model.py"), "--tiny", "--no-loo",
           "--out", str(tmp_path)]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    costs = json.loads((tmp_path / "train_step_h100_costs_compiled.json").read_text())
    assert costs["meta"]["how"] == "compiled" and len(costs["points"]) == 3
    lt = costs["points"]["LT_chunked:tiny:256"]["rows"]
    assert any(r["kind"] == "kernel" and r["modelled"] for r in lt)
    model = json.loads((tmp_path / "train_step_h100_model.json").read_text())
    assert (
        model["meta"]["how"] == "modelled" and "synthetic" in model["meta"]["settings"]["measured"]
    )
    assert all(math.isfinite(r["modelled_ms"]) for r in model["points"])
    assert "A model, not a measurement" in (tmp_path / "train_step_h100_model.md").read_text()
