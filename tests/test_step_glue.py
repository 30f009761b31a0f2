"""Issue 37's step glue study (``studies/train_step/step_glue.py``, its page
``report_glue.py``): what each label compiles, and the targets read and rendered for each of the
switch labels on synthetic priced points (the compiles themselves are
``benchmarks/step_glue.py``'s, checked against their raw files by ``test_reports.py``)."""

from __future__ import annotations

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
    # phi_grad: unrolled's options, compiled by the tree with phi' in the LT_chunked kernels
    assert (
        opts[step_glue.PHI_GRAD] == opts["unrolled"] and report_glue.PHI_GRAD == step_glue.PHI_GRAD
    )
    assert set(step_glue.SWITCH_LABELS) <= set(step_glue.LABELS)


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
    assert "With the blocks unrolled: MODEL 140.0 ms: **met** by the MODEL." in line
    line = next(x for x in lines if "16 x 1k" in x)
    assert "With the blocks unrolled: MODEL 36.0 ms, 455k tokens/s: **not met**" in line
    assert "With the switches as well: MODEL 32.0 ms, 512k tokens/s: **met**" in line
    assert line.index("blocks unrolled") < line.index("switches as well")
    d = {"points": points, "targets": list(targets.values())}
    summary = report_glue._summary_switches(d)
    # 64k time and glue met by both; 16 x 1k by the switches only
    assert "nanoGPT's numerics kept), the 64k step moves 40.0 GB" in summary
    assert "MODEL 140.0 ms, and 2 of the targets" in summary
    assert "MODEL 120.0 ms, and 3 of the targets" in summary
    table = report_glue._switches_table(d)
    assert "after → unrolled → switches | 160.0 → 140.0 → **120.0** | -12%, -25%" in table


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
