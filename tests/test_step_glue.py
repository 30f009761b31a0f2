"""Issue 37's step glue study (``studies/train_step/step_glue.py``, its page
``report_glue.py``): what each label compiles, and the targets read and rendered for each of the
switch labels on synthetic priced points (the compiles themselves are
``benchmarks/step_glue.py``'s, checked against their raw files by ``test_reports.py``)."""

from __future__ import annotations

import pytest

from studies.train_step import report_glue, step_glue

LT64, LT16 = "LT_chunked:124M:65536", "LT_chunked:124M:16x1024"


def test_each_label_compiles_its_own_options():
    p = next(p for p in step_glue.POINTS if p.key == LT64)
    opts = {label: step_glue.spec(p, label)["overrides"] for label in step_glue.OVERRIDES}
    assert opts["before"] == {"remat": "none", "loss_chunk": 4096}
    kernels = {k: v for k, v in opts["after"].items() if k.endswith("_kernel")}
    assert kernels and set(kernels.values()) == {"pallas"}
    # unrolled: the kernels and the blocks unrolled, the residual stream left at its float32
    assert opts["unrolled"] == {**opts["after"], "scan_layers": False}
    assert opts["switches"] == {**opts["unrolled"], "residual_dtype": "bfloat16"}
    assert opts["fused_head"]["loss_kernel"] == "pallas_fused"
    # The labels read as the scanned step name the scan (model.scan_layers' auto unrolls on a
    # GPU), as do model_switches' scan variants: their files on disk were compiled scanned.
    assert opts["after"]["scan_layers"] is True and opts["fused_head"]["scan_layers"] is True
    switches = _script("benchmarks/model_switches.py").VARIANTS
    assert all(v["scan_layers"] is name.startswith("scan") for name, v in switches.items())
    # phi_grad: unrolled's options, compiled by the tree with phi' in the LT_chunked kernels
    assert (
        opts[step_glue.PHI_GRAD] == opts["unrolled"] and report_glue.PHI_GRAD == step_glue.PHI_GRAD
    )
    assert set(step_glue.SWITCH_LABELS) <= set(step_glue.LABELS)
    # fused_1k: unrolled with LT_chunked's single pass forced, at LT_chunked's 1k points only
    assert step_glue.OVERRIDES[step_glue.FUSED_1K] == {
        **step_glue.OVERRIDES["unrolled"], "kernel": "pallas_fused_chunk"}  # fmt: skip
    assert report_glue.FUSED_1K == step_glue.FUSED_1K
    assert all(k.startswith("LT_chunked:") and k.endswith(":1024")
               for k in step_glue.LABEL_POINTS[step_glue.FUSED_1K])  # fmt: skip


def _script(path: str):
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("_script", Path(__file__).parents[1] / path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _priced(ms: float, glue_gb: float) -> dict:
    return {"ms": ms, "glue_bytes": glue_gb * 1e9, "bytes": 2 * glue_gb * 1e9, "launches": 900,
            "memory_bytes": 20 * 2**30, "compile_seconds": 30.0}  # fmt: skip


def test_targets_are_read_and_rendered_for_each_switch_label():
    """At 64k the blocks unrolled meet 150 ms where the kernels alone do not; at 16 x 1k they
    miss 470k tokens/s (36 ms) where both switches meet it (32 ms): each line says both."""
    points = {
        LT64: {"measured_key": None, "before": _priced(280, 440), "after": _priced(160, 150),
               "unrolled": _priced(140, 40), "switches": _priced(120, 37)},
        LT16: {"measured_key": None, "before": _priced(72, 113), "after": _priced(44, 41),
               "unrolled": _priced(36, 13), "switches": _priced(32, 12)},
    }  # fmt: skip
    targets = {t["target"]: t for t in step_glue.targets(points, {})}
    t64 = targets["LT_chunked 124M at 64k <= 150 ms"]
    assert (t64["met"], t64["met_unrolled"], t64["met_switches"]) == (False, True, True)
    t16 = next(t for k, t in targets.items() if k.startswith("LT_chunked 124M 16 x 1k"))
    assert (t16["met"], t16["met_unrolled"], t16["met_switches"]) == (False, False, True)
    lines = report_glue._targets({"targets": list(targets.values())})
    line = next(x for x in lines if "<= 150 ms" in x)
    assert line.startswith("- LT_chunked 124M at 64k <= 150 ms: `after`: MODEL 280.0 → 160.0 ms")
    assert "`unrolled` (the blocks unrolled): MODEL 140.0 ms: **met** by the MODEL." in line
    line = next(x for x in lines if "16 x 1k" in x)
    assert "`unrolled` (the blocks unrolled): MODEL 36.0 ms, 455k tokens/s: **not met**" in line
    assert ("`switches` (the blocks unrolled, the residual stream in bfloat16): MODEL 32.0 ms, "
            "512k tokens/s: **met**") in line  # fmt: skip
    assert line.index("`unrolled`") < line.index("`switches`")
    d = {"points": points, "targets": list(targets.values())}
    summary = report_glue._summary_switches(d)
    # 64k time and glue met by both; 16 x 1k by the switches only
    assert "nanoGPT's numerics kept), the 64k step moves 40.0 GB" in summary
    assert "MODEL 140.0 ms, and 2 of the targets" in summary
    assert "MODEL 120.0 ms, and 3 of the targets" in summary
    table = report_glue._switches_table(d)
    assert "after → unrolled → switches | 160.0 → 140.0 → **120.0** | -12%, -25%" in table


# A hand-written optimized module: the attention core's Pallas state pass, the segment prefix in
# XLA forward and backward (two launches of the same fusion kind), phi's backward, and an MLP
# GEMM outside the attention core.
HLO = """HloModule jit_step

%twice (x: f32[2,8,16,16]) -> f32[2,8,16,16] {
  %x = f32[2,8,16,16]{3,2,1,0} parameter(0)
  ROOT %m = f32[2,8,16,16]{3,2,1,0} add(%x, %x)
}

%cast (x: f32[128,32]) -> bf16[128,32] {
  %x = f32[128,32]{1,0} parameter(0)
  ROOT %c = bf16[128,32]{1,0} convert(%x)
}

%gemm (p0: bf16[64,32], p1: bf16[32,16]) -> bf16[64,16] {
  %p0 = bf16[64,32]{1,0} parameter(0)
  %p1 = bf16[32,16]{1,0} parameter(1)
  ROOT %dot.1 = bf16[64,16]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (q: bf16[1,128,2,16], s: f32[2,8,16,16], d: f32[128,32], a: bf16[64,32], w: bf16[32,16]) -> bf16[64,16] {
  %q = bf16[1,128,2,16]{3,2,1,0} parameter(0)
  %s = f32[2,8,16,16]{3,2,1,0} parameter(1)
  %d = f32[128,32]{1,0} parameter(2)
  %a = bf16[64,32]{1,0} parameter(3)
  %w = bf16[32,16]{1,0} parameter(4)
  %pallas_call.5 = f32[2,8,16,16]{3,2,1,0} custom-call(%q, %q), custom_call_target="__gpu$xla.gpu.triton", backend_config={grid_x = 8 : i32, grid_y = 2 : i32, grid_z = 1 : i32, ir = "", name = "lt_chunked_fwd_h", num_warps = 4 : i32}, metadata={op_name="jit(step)/jvp(GPT)/Block/attn/pallas_call"}
  %loop_pad_fusion = f32[2,8,16,16]{3,2,1,0} fusion(%s), kind=kLoop, calls=%twice, metadata={op_name="jit(step)/jvp(GPT)/Block/attn/concatenate"}
  %loop_pad_fusion.12 = f32[2,8,16,16]{3,2,1,0} fusion(%s), kind=kLoop, calls=%twice, metadata={op_name="jit(step)/transpose(jvp(GPT))/Block/attn/concatenate"}
  %loop_pad_fusion.13 = f32[2,8,16,16]{3,2,1,0} fusion(%s), kind=kLoop, calls=%twice, metadata={op_name="jit(step)/transpose(jvp(GPT))/Block/attn/concatenate"}
  %loop_convert_fusion.1 = bf16[128,32]{1,0} fusion(%d), kind=kLoop, calls=%cast, metadata={op_name="jit(step)/transpose(jvp(GPT))/Block/attn/checkpoint/convert_element_type"}
  ROOT %g = bf16[64,16]{1,0} fusion(%a, %w), kind=kCustom, calls=%gemm, metadata={op_name="jit(step)/jvp(GPT)/h/mlp/c_fc/dot_general"}
}
"""


def test_the_attention_core_launch_by_launch_sums_to_its_part():
    """attention_rows groups the core's launches by what runs and pass (the Pallas kernel by
    name, an XLA fusion by its kind and primitive), leaves the MLP's GEMM out, and its priced
    rows add up to price()'s "attention core" part, launch overheads included."""
    from linear_gpt2.experiments import hlo_costs
    from studies.train_step import step_costs
    from studies.train_step import step_model as sm

    point = step_glue.GluePoint("LT_chunked", "124M", 1024, 1, 128)
    params = sm.Params()
    detail = step_glue.price_attention(step_glue.attention_rows(HLO, point), params)
    got = {(r["what"], r["backward"]): (r["launches"], r["bytes"], r["class"]) for r in detail}
    state = 2 * 8 * 16 * 16 * 4
    assert got == {
        ("lt_chunked_fwd_h", False): (1, got[("lt_chunked_fwd_h", False)][1], "kernel"),
        ("XLA loop_pad_fusion (concatenate)", False): (1, 2 * state, "elementwise"),
        ("XLA loop_pad_fusion (concatenate)", True): (2, 4 * state, "elementwise"),
        ("XLA loop_convert_fusion (convert_element_type)", True): (
            1, 128 * 32 * (4 + 2), "elementwise"),
    }  # fmt: skip
    # the state pass priced by its cost model at the point's shape, not by the HLO's operands
    k = step_costs.pallas_costs(step_glue.cost_point(point))["lt_chunked_fwd_h"]
    assert got[("lt_chunked_fwd_h", False)][1] == k.bytes
    rows = step_costs.cost_rows(hlo_costs.program_ops(HLO), step_glue.cost_point(point))
    part = step_glue.price(rows, params)["by_part"]["attention core"]
    assert sum(r["ms"] + r["launch_ms"] for r in detail) == pytest.approx(part["ms"])
    assert sum(r["launches"] for r in detail) == part["launches"] == 5


def _core(what_ms: dict[tuple[str, bool], float]) -> list[dict]:
    return [{"what": w, "backward": b, "class": c, "launches": 24, "bytes": 24e6, "ms": ms,
             "launch_ms": 24 * 1.86e-3} for (w, b), ms in what_ms.items()
            for c in [("kernel" if w.startswith(("lt_", "cuDNN", "bias")) else "matmul"
                       if w == "XLA GEMM" else "elementwise")]]  # fmt: skip


def test_lt_against_flash_at_1k_is_read_from_each_label_both_compiled():
    """The 1k comparison takes a verdict per label only where both attentions were compiled with
    it; each line names its labels; the where-it-goes table splits the core by group."""
    lt, fl = "LT_chunked:355M:1024", "flash:355M:1024"
    lt_core = _core({("XLA GEMM", False): 0.2, ("lt_chunked_fwd_o", False): 0.15,
                     ("XLA loop_pad_fusion (concatenate)", True): 0.3})  # fmt: skip
    fl_core = _core({("XLA GEMM", False): 0.2, ("cuDNN flash attention", False): 0.1})
    points = {
        lt: {"measured_key": lt, "before": _priced(24.6, 39), "after": _priced(19.8, 27),
             "unrolled": {**_priced(12.8, 9), "attention": lt_core, "n_layer": 24}},
        fl: {"measured_key": fl, "before": _priced(23.3, 37), "after": _priced(18.5, 26),
             "unrolled": {**_priced(11.8, 8), "attention": fl_core, "n_layer": 24}},
    }  # fmt: skip
    measured = {lt: 23.1, fl: 23.7}
    (t,) = step_glue.targets(points, measured)
    assert (t["met"], t["met_scaled"], t["met_unrolled"]) == (False, True, False)
    # measured x (unrolled / before): 23.1 x 12.8 / 24.6 = 12.02 <= 23.7 x 11.8 / 23.3 = 12.00?
    assert t["met_scaled_unrolled"] is (23.1 * 12.8 / 24.6 <= 23.7 * 11.8 / 23.3)
    assert "met_switches" not in t  # not compiled at these points
    (line,) = report_glue._targets({"targets": [t]})
    assert line.startswith("- LT_chunked <= flash at 1k, 355M: `after`: MODEL 24.6 → 19.8 ms")
    assert ("`unrolled` (the blocks unrolled): MODEL 12.8 ms (`flash` 11.8 ms); measured × each "
            "one's ratio 12.0 ms (`flash` 12.0 ms): **not met** by the MODEL") in line  # fmt: skip
    page = "\n".join(report_glue._attention_1k({"points": points}))
    # step 12.8 / 11.8; core 0.65 + 3 x 0.045 launch / 0.3 + 2 x 0.045; the Pallas and cuDNN
    # kernels apart from XLA's fusions; the rest of the step the same in both
    assert "| 355M | 12.8 / 11.8 | +1.00 | 0.78 / 0.39 | 0.15 / 0.10 | 0.30 / 0.00 |" in page
    assert "| +0.61 |" in page
    assert (
        "| `LT_chunked` | `XLA loop_pad_fusion (concatenate)` | backward | 1 | 1.0 MB, 14.4 µs |"
        in page
    )


def test_phi_grad_section_sets_it_against_unrolled():
    """The phi_grad label's section: each point compiled with both labels, whole step and
    attention core, unrolled first; nothing where a point lacks either."""
    core = lambda ms, gb: {"attention core": {"ms": ms, "bytes": gb * 1e9, "launches": 240}}  # noqa: E731
    a = {**_priced(126.8, 39.5), "by_part": core(33.2, 78.2), "by_class": {}}
    b = {**_priced(123.5, 29.8), "by_part": core(29.9, 68.5), "by_class": {}}
    d = {"points": {LT64: {"unrolled": a, step_glue.PHI_GRAD: b}, LT16: {"unrolled": a}}}
    costs = {"unrolled": {"environment": {"git_commit": "27b47b0"}},
             step_glue.PHI_GRAD: {"environment": {"git_commit": "381bdd3"}}}  # fmt: skip
    text = "\n".join(report_glue._phi_grad_section(d, costs))
    assert "this tree at 27b47b0" in text and "this tree at 381bdd3" in text
    assert "| `LT_chunked` 124M 64k | 126.8 → **123.5** | -2.6% |" in text
    assert "| 33.2 → **29.9** | 78.2 → **68.5** |" in text
    assert "16 × 1k" not in text
    assert report_glue._phi_grad_section({"points": {LT16: {"unrolled": a}}}, costs) == []


def test_fused_1k_is_read_against_flash_unrolled():
    """LT_chunked with its single pass forced (fused_1k) takes its verdict against flash's
    unrolled step, names its label on the target's line, and its section sets the two designs
    and flash side by side, the core's launches per layer with them."""
    lt, fl = "LT_chunked:355M:1024", "flash:355M:1024"
    chunk = _core(
        {("lt_chunked_fwd_o", False): 0.15, ("XLA loop_pad_fusion (concatenate)", True): 0.3}
    )
    fused = _core({("lt_chunked_fused_fwd", False): 0.6})
    fl_core = _core({("cuDNN flash attention", False): 0.1})
    points = {
        lt: {"measured_key": None, "before": _priced(24.6, 39), "after": _priced(19.8, 27),
             "unrolled": {**_priced(12.8, 9), "attention": chunk, "n_layer": 24},
             step_glue.FUSED_1K: {**_priced(13.5, 9), "attention": fused, "n_layer": 24}},
        fl: {"measured_key": None, "before": _priced(23.3, 37), "after": _priced(18.5, 26),
             "unrolled": {**_priced(11.8, 8), "attention": fl_core, "n_layer": 24}},
    }  # fmt: skip
    (t,) = step_glue.targets(points, {})
    assert (t["met_unrolled"], t[f"met_{step_glue.FUSED_1K}"]) == (False, False)
    (line,) = report_glue._targets({"targets": [t]})
    assert ("`fused_1k` (the blocks unrolled, `LT_chunked`'s single pass forced): MODEL 13.5 ms "
            "(`flash` `unrolled` 11.8 ms): **not met** by the MODEL.") in line  # fmt: skip
    points[lt][step_glue.FUSED_1K]["ms"] = 11.5
    (t,) = step_glue.targets(points, {})
    assert t[f"met_{step_glue.FUSED_1K}"] is True
    text = "\n".join(report_glue._fused_1k_section({"points": points}))
    # chunk-parallel / single pass / flash: step, differences, launches per layer (2 / 1 / 1)
    assert "| 355M | 12.8 / 11.5 / 11.8 | -1.30 | -0.30 |" in text
    assert "| 2 / 1 / 1 |" in text
    del points[lt][step_glue.FUSED_1K]
    assert report_glue._fused_1k_section({"points": points}) == []
