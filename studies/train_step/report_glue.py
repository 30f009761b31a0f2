"""Issue 37's glue of the training step, before and after: ``step_glue_h100_model.md``.

Raw file (``benchmarks/step_glue.py``): ``step_glue_h100_model.json``: per point the compiled
step's bytes, FLOPs and launches by op class and part of the model for each label (``before``:
main's program, ``after``: this tree's), their MODEL ms, the compiled memory, and issue 37's
targets read from the MODEL.
"""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, provenance, short, table

CLASSES = ("matmul", "fmha", "kernel", "elementwise", "reduction", "host", "launch")
CLASS_NAMES = {
    "matmul": "matmuls (XLA GEMMs)",
    "fmha": "cuDNN flash attention",
    "kernel": "Pallas kernels",
    "elementwise": "elementwise (XLA loop fusions, copies, scan stacking)",
    "reduction": "reductions and transposes (XLA input fusions)",
    "host": "host offload",
    "launch": "launch overhead",
}
FOCUS = ("LT_chunked:124M:65536", "flash:124M:65536", "LT_chunked:124M:16x1024",
         "LT_chunked:124M:1024")  # fmt: skip


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:,.1f}" if x < 100e9 else f"{x / 1e9:,.0f}"


def _pair(a: str, b: str) -> str:
    return f"{a} → **{b}**"


def _label(key: str) -> str:
    att, size, ctx = key.split(":")
    batch, _, t = ctx.rpartition("x")
    return f"`{att}` {size} " + (f"{batch} × " if batch else "") + context_label(int(t))


def _points_table(d: dict[str, Any]) -> str:
    rows = []
    for key, p in d["points"].items():
        b, a = p.get("before"), p.get("after")
        if not (a and b):
            continue
        m = d["measured"].get(key)
        rows.append([
            _label(key),
            f"{p['point']['remat']}, {p['point']['loss_chunk']}",
            _pair(_ms(b["ms"]), _ms(a["ms"])),
            f"{a['ms'] / b['ms'] - 1:+.0%}",
            "—" if m is None else _pair(_ms(m), _ms(m * a["ms"] / b["ms"])),
            _pair(f"{b['launches']:,}", f"{a['launches']:,}"),
            _pair(_gb(b["bytes"]), _gb(a["bytes"])),
            _pair(_gb(b["glue_bytes"]), _gb(a["glue_bytes"])),
            _pair(f"{b['memory_bytes'] / 2**30:.1f}", f"{a['memory_bytes'] / 2**30:.1f}"),
        ])  # fmt: skip
    return table(
        ["point", "remat, loss chunk", "MODEL ms", "change", "measured ms → × MODEL ratio",
         "launches", "GB moved", "glue GB", "compiled GiB"],
        rows, "llrrrrrrr",
    )  # fmt: skip


def _class_table(p: dict[str, Any], labels=("before", "after")) -> str:
    b, a = p[labels[0]]["by_class"], p[labels[1]]["by_class"]
    rows = []
    for k in CLASSES:
        x, y = b.get(k, {}), a.get(k, {})
        if not (x.get("ms") or y.get("ms")):
            continue
        launches = k != "launch"
        rows.append([
            CLASS_NAMES[k], _pair(_ms(x.get("ms", 0.0)), _ms(y.get("ms", 0.0))),
            _pair(_gb(x.get("bytes", 0.0)), _gb(y.get("bytes", 0.0))) if launches else "",
            _pair(f"{x.get('launches', 0):,}", f"{y.get('launches', 0):,}") if launches else "",
        ])  # fmt: skip
    return table(["op class", "MODEL ms", "GB moved", "launches"], rows, "lrrr")


def _part_table(p: dict[str, Any], labels=("before", "after")) -> str:
    b, a = p[labels[0]]["by_part"], p[labels[1]]["by_part"]
    parts = sorted(set(b) | set(a), key=lambda k: -b.get(k, {}).get("ms", 0.0))
    rows = [
        [k, _pair(_ms(b.get(k, {}).get("ms", 0.0)), _ms(a.get(k, {}).get("ms", 0.0))),
         _pair(_gb(b.get(k, {}).get("bytes", 0.0)), _gb(a.get(k, {}).get("bytes", 0.0))),
         _pair(_gb(b.get(k, {}).get("glue_bytes", 0.0)), _gb(a.get(k, {}).get("glue_bytes", 0.0))),
         _pair(f"{b.get(k, {}).get('launches', 0):,}", f"{a.get(k, {}).get('launches', 0):,}")]
        for k in parts
    ]  # fmt: skip
    return table(["part of the model", "MODEL ms", "GB moved", "glue GB", "launches"], rows,
                 "lrrrr")  # fmt: skip


def _targets(d: dict[str, Any]) -> list[str]:
    lines = []
    for t in d["targets"]:
        verdict = "**met**" if t["met"] else "**not met**"
        scaled = ""
        if t.get("measured_ms"):
            scaled = (f"; measured {_ms(t['measured_ms'])} ms before, × the MODEL's ratio "
                      f"{_ms(t['scaled_ms'])} ms")  # fmt: skip
        if t.get("met_scaled") is not None:
            verdict += (" by the MODEL, **met**" if t["met_scaled"] else
                        " by the MODEL, **not met**") + " by the measured time × its ratio"  # fmt: skip
            verdict = verdict.removesuffix(" by the MODEL")
        extra = ""
        if "tokens_per_s" in t:
            extra = (f": {t['before_tokens_per_s'] / 1e3:,.0f}k → {t['tokens_per_s'] / 1e3:,.0f}k "
                     "tokens/s")  # fmt: skip
        elif "baseline" in t:
            f = t["baseline"]
            extra = f" (`flash` {_ms(f['before_ms'])} → {_ms(f['after_ms'])} ms" + (
                f"; measured × MODEL ratio {_ms(f['scaled_ms'])} ms)" if f.get("scaled_ms")
                else ")")  # fmt: skip
        if "glue" in t["target"]:
            lines.append(f"- {t['target']}: {t['before_glue_gb']:,.0f} → "
                         f"{t['after_glue_gb']:,.0f} GB (compiled; exact): {verdict}."
                         f"{_switched(t)}")  # fmt: skip
            continue
        tail = "" if t.get("met_scaled") is not None else " by the MODEL"
        lines.append(f"- {t['target']}: MODEL {_ms(t['before_ms'])} → {_ms(t['after_ms'])} ms"
                     f"{extra}{scaled}: {verdict}{tail}.{_switched(t)}")  # fmt: skip
    return lines


def _switched(t: dict[str, Any]) -> str:
    """The target with the two switches on as well (step_glue.SWITCHES), where compiled."""
    if "met_switches" not in t:
        return ""
    verdict = "**met**" if t["met_switches"] else "**not met**"
    if "glue" in t["target"]:
        return f" With the switches as well: {t['switches_glue_gb']:,.0f} GB: {verdict}."
    if "switches_tokens_per_s" in t:
        return (f" With the switches as well: MODEL {_ms(t['switches_ms'])} ms, "
                f"{t['switches_tokens_per_s'] / 1e3:,.0f}k tokens/s: {verdict} by the MODEL.")  # fmt: skip
    scaled = t.get("scaled_switches_ms")
    return (f" With the switches as well: MODEL {_ms(t['switches_ms'])} ms"
            + (f" (measured × its ratio {_ms(scaled)} ms)" if scaled else "")
            + f": {verdict} by the MODEL.")  # fmt: skip


def _switches_table(d: dict[str, Any]) -> str:
    rows = []
    for key, p in d["points"].items():
        a, w = p.get("after"), p.get("switches")
        if not (a and w):
            continue
        rows.append([
            _label(key), _pair(_ms(a["ms"]), _ms(w["ms"])), f"{w['ms'] / a['ms'] - 1:+.0%}",
            _pair(f"{a['launches']:,}", f"{w['launches']:,}"),
            _pair(_gb(a["bytes"]), _gb(w["bytes"])),
            _pair(_gb(a["glue_bytes"]), _gb(w["glue_bytes"])),
            _pair(f"{a['memory_bytes'] / 2**30:.1f}", f"{w['memory_bytes'] / 2**30:.1f}"),
            _pair(f"{a['compile_seconds']:.0f}", f"{w['compile_seconds']:.0f}"),
        ])  # fmt: skip
    if not rows:
        return ""
    return table(["point", "MODEL ms", "change", "launches", "GB moved", "glue GB",
                  "compiled GiB", "compile s (this machine)"], rows, "lrrrrrrr")  # fmt: skip


def _head(d: dict[str, Any]) -> list[str]:
    alts = d.get("head_alternatives", {})
    if not alts:
        return ["(not compiled: `benchmarks/step_glue.py --label fused_head --only KEY`)"]
    labels = d["meta"]["costs"]
    after, fused = (short(labels.get(k, {}).get("environment", {}).get("git_commit"))
                    for k in ("after", "fused_head"))  # fmt: skip
    lines = [
        "The head and loss as built (XLA's three GEMMs per chunk of `loss_chunk` tokens, the "
        'cross-entropy kernel between them: the "after" step) against the step with '
        "`model.loss_kernel=pallas_fused` (`kernels/head_loss/`: a forward kernel with an online "
        "log-sum-exp over vocabulary tiles and a backward kernel recomputing each block of "
        "logits, dx and dW by float32 atomic adds; no logits written), both compiled for the "
        "H100; bytes, launches and memory exact, ms a MODEL (the fused kernels at the Pallas "
        'kernels\' fitted FLOP fraction). The "after" steps were compiled at '
        f"{after}, the fused ones at {fused}: the whole-step columns include whatever else "
        "changed between the two trees; the head and loss columns are that part alone.",
        "",
        "| point | head and loss MODEL ms | its GB moved | its launches | step MODEL ms | "
        "step GB moved | step launches | compiled GiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for key, a in alts.items():
        b, f = a["as_built"], a["fused"]
        bh, fh = b["head"], f["head"]
        cells = [
            _pair(_ms(bh.get("ms")), _ms(fh.get("ms"))),
            _pair(_gb(bh.get("bytes", 0.0)), _gb(fh.get("bytes", 0.0))),
            _pair(f"{bh.get('launches', 0):,}", f"{fh.get('launches', 0):,}"),
            _pair(_ms(b["ms"]), _ms(f["ms"])),
            _pair(_gb(b["bytes"]), _gb(f["bytes"])),
            _pair(f"{b['launches']:,}", f"{f['launches']:,}"),
            _pair(f"{b['memory_bytes'] / 2**30:.1f}", f"{f['memory_bytes'] / 2**30:.1f}"),
        ]
        lines.append(f"| {_label(key)} | " + " | ".join(cells) + " |")
    flops = ", ".join(f"{_label(k)} {a['fused_flops'] / 1e12:,.1f} TFLOP" for k, a in alts.items())
    lines += ["", f"The fused kernels' FLOPs (the logits computed twice, 8 N V C): {flops}."]
    return lines


@renderer("step_glue.summary")
def summary(raw: Raw) -> str:
    """One paragraph for the README and docs/results.md: the 124M 64k step and the targets."""
    d = raw.data
    p = d["points"].get("LT_chunked:124M:65536", {})
    if "after" not in p or "before" not in p:
        return "(no compiled points yet: run benchmarks/step_glue.py)"
    b, a = p["before"], p["after"]
    met = sum(t["met"] for t in d["targets"])
    scaled = [t for t in d["targets"] if t.get("met_scaled") is not None]
    return (
        "Compiled for the H100, the fused LayerNorm + residual, MLP activation, bias gradient and "
        f"cross-entropy kernels (issue 37) take the 124M `LT_chunked` step at 64k from {_gb(b['glue_bytes'])} "
        f"to {_gb(a['glue_bytes'])} GB of glue traffic, {b['launches']:,} to {a['launches']:,} "
        f"launches and {b['memory_bytes'] / 2**30:.1f} to {a['memory_bytes'] / 2**30:.1f} GiB; "
        f"the step-time MODEL from {_ms(b['ms'])} to {_ms(a['ms'])} ms. By the MODEL, {met} of "
        f"issue 37's {len(d['targets'])} targets are met; of the {len(scaled)} whose points were "
        f"timed, {sum(t['met_scaled'] for t in scaled)} by the measured times scaled by the "
        "MODEL's ratios (`benchmarks/results/step_glue_h100_model.md` lists them)."
        + _summary_switches(d)
    )


def _summary_switches(d: dict[str, Any]) -> str:
    w = d["points"].get("LT_chunked:124M:65536", {}).get("switches")
    if not w:
        return ""
    met = sum(bool(t.get("met_switches", t["met"])) for t in d["targets"])
    return (
        f" With `model.scan_layers: false` and `model.residual_dtype: bfloat16` as well, the "
        f"64k step moves {_gb(w['glue_bytes'])} GB of glue in {w['launches']:,} launches "
        f"({w['memory_bytes'] / 2**30:.1f} GiB), MODEL {_ms(w['ms'])} ms, and {met} of the "
        "targets are met by the MODEL."
    )


def _switches_section(d: dict[str, Any], commit: str) -> list[str]:
    """**after** against **switches**: the kernels, and the kernels with ``model.scan_layers:
    false`` and ``model.residual_dtype: bfloat16`` (issue 37, item 4)."""
    body = _switches_table(d)
    if not body:
        return []
    lines = [
        "## The two switches on top of the kernels (MODEL ms)", "",
        "**after** as above; **switches**: the same with `model.scan_layers: false` (the blocks "
        "unrolled: no stacking of per-layer activations) and `model.residual_dtype: bfloat16` "
        f"(the residual stream in half the bytes; not nanoGPT's numerics), this tree at {commit}. "
        "Compile seconds are this shared 2-core machine's.", "",
        body, "",
    ]  # fmt: skip
    for key in FOCUS:
        p = d["points"].get(key)
        if p and "after" in p and "switches" in p:
            lines += [f"### {_label(key)}: after → switches", "",
                      _class_table(p, ("after", "switches")), "",
                      _part_table(p, ("after", "switches")), ""]  # fmt: skip
    return lines


@renderer("step_glue.page")
def page(raw: Raw) -> str:
    d = raw.data
    prov, meta = provenance(d), d["meta"]
    costs = meta["costs"]
    before, after = costs.get("before", {}), costs.get("after", {})
    commit = lambda m: short(m.get("environment", {}).get("git_commit"))  # noqa: E731
    lines = [
        "# The step's glue on the H100, before and after issue 37's kernels (compiled; MODEL ms)",
        "",
        "Each point is the trainer's training step (clip + AdamW, state donated, batch as "
        "named, bf16) compiled for the H100 on the CPU machine (`benchmarks/step_glue.py`): "
        f"**before**, main's own code at {commit(before)}; **after**, this tree at "
        f"{commit(after)}, where `auto` takes the fused LayerNorm + residual, MLP activation, bias "
        "gradient and cross-entropy kernels for a GPU target. Bytes moved and launches are counted from the "
        "compiled programs (every launch of the optimized HLO, loops by their trip counts: "
        "`hlo_costs.py`; exact), as is the memory. **Milliseconds are a MODEL**, not a "
        "measurement: the roofline of `train_step_h100_model.md` at its fitted constants "
        f"(commit {short(meta['model']['commit'])}; Pallas kernels' FLOPs at "
        f"{meta['model']['params']['kernel']:.3g} of the bf16 peak, their bytes at "
        f"{meta['model']['params']['memory']:.3g} of the HBM bandwidth). Where the point was "
        "timed on the lent H100, the measured time is scaled by the MODEL's after / before "
        "ratio. Glue = the elementwise and reduction classes (XLA's data-moving kernels). "
        f"jax {prov['jax']}.",
        "",
        "## Every point",
        "",
        _points_table(d),
        "",
        "## Issue 37's targets (MODEL until a GPU measures them)",
        "",
        *_targets(d),
        "",
        *_switches_section(d, commit(costs.get("switches", {}))),
        "## The head and loss: as built, and fused without logits (compiled; MODEL ms)",
        "",
        *_head(d),
        "",
        "## By op class and part of the model",
    ]  # fmt: skip
    for key in FOCUS:
        p = d["points"].get(key)
        if not p or "before" not in p or "after" not in p:
            continue
        lines += ["", f"### {_label(key)}", "", _class_table(p), "", _part_table(p)]
    return "\n".join(lines).rstrip() + "\n"
