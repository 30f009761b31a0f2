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
# Issue 37's switches on top of the kernels (step_glue.SWITCH_LABELS), in the order they add up,
# each with the words that name it in a target's line, in the summary and on the page.
SWITCHED = {
    "unrolled": {
        "target": "with the blocks unrolled",
        "summary": "With `model.scan_layers: false` alone (the blocks unrolled; the float32 "
        "residual stream and nanoGPT's numerics kept)",
        "page": "**unrolled**: after with `model.scan_layers: false` (the blocks unrolled: no "
        "stacking of per-layer activations; the same function, the residual stream in float32: "
        "nanoGPT's numerics)",
    },
    "switches": {
        "target": "with the switches as well",
        "summary": "With `model.residual_dtype: bfloat16` as well (not nanoGPT's numerics)",
        "page": "**switches**: after with `model.scan_layers: false` and "
        "`model.residual_dtype: bfloat16` (the residual stream in half the bytes; not nanoGPT's "
        "numerics)",
    },
}
# step_glue.PHI_GRAD (not imported: rendering needs no JAX, which step_glue's imports bring).
PHI_GRAD = "phi_grad"
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


def _chain(*xs: str) -> str:
    """``a → b → **c**``: the values of successive labels, the last in bold."""
    return " → ".join(xs[:-1]) + f" → **{xs[-1]}**"


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
    sides = [p[label]["by_class"] for label in labels]
    rows = []
    for k in CLASSES:
        xs = [x.get(k, {}) for x in sides]
        if not any(x.get("ms") for x in xs):
            continue
        launches = k != "launch"
        rows.append([
            CLASS_NAMES[k], _chain(*(_ms(x.get("ms", 0.0)) for x in xs)),
            _chain(*(_gb(x.get("bytes", 0.0)) for x in xs)) if launches else "",
            _chain(*(f"{x.get('launches', 0):,}" for x in xs)) if launches else "",
        ])  # fmt: skip
    return table(["op class", "MODEL ms", "GB moved", "launches"], rows, "lrrr")


def _part_table(p: dict[str, Any], labels=("before", "after")) -> str:
    sides = [p[label]["by_part"] for label in labels]
    parts = sorted(set().union(*sides), key=lambda k: -sides[0].get(k, {}).get("ms", 0.0))

    def cells(k: str, field: str, fmt) -> str:
        return _chain(*(fmt(x.get(k, {}).get(field, 0)) for x in sides))

    rows = [
        [k, cells(k, "ms", _ms), cells(k, "bytes", _gb), cells(k, "glue_bytes", _gb),
         cells(k, "launches", lambda n: f"{n:,}")]
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
    """The target with each of the switches on as well (step_glue.SWITCH_LABELS), where
    compiled."""
    out = ""
    for label, words in SWITCHED.items():
        if f"met_{label}" not in t:
            continue
        verdict = "**met**" if t[f"met_{label}"] else "**not met**"
        head = f" {words['target'].capitalize()}:"
        if "glue" in t["target"]:
            out += f"{head} {t[f'{label}_glue_gb']:,.0f} GB: {verdict}."
        elif f"{label}_tokens_per_s" in t:
            out += (f"{head} MODEL {_ms(t[f'{label}_ms'])} ms, "
                    f"{t[f'{label}_tokens_per_s'] / 1e3:,.0f}k tokens/s: {verdict} by the MODEL.")  # fmt: skip
        else:
            scaled = t.get(f"scaled_{label}_ms")
            out += (f"{head} MODEL {_ms(t[f'{label}_ms'])} ms"
                    + (f" (measured × its ratio {_ms(scaled)} ms)" if scaled else "")
                    + f": {verdict} by the MODEL.")  # fmt: skip
    return out


def _switches_table(d: dict[str, Any]) -> str:
    """After and each switch label compiled at a point, side by side: the change is the last
    label's against after."""
    rows = []
    for key, p in d["points"].items():
        labels = ["after", *(k for k in SWITCHED if k in p)]
        if "after" not in p or len(labels) < 2:
            continue
        xs = [p[k] for k in labels]
        a = xs[0]
        rows.append([
            _label(key), " → ".join(labels),
            _chain(*(_ms(x["ms"]) for x in xs)),
            ", ".join(f"{x['ms'] / a['ms'] - 1:+.0%}" for x in xs[1:]),
            _chain(*(f"{x['launches']:,}" for x in xs)),
            _chain(*(_gb(x["bytes"]) for x in xs)),
            _chain(*(_gb(x["glue_bytes"]) for x in xs)),
            _chain(*(f"{x['memory_bytes'] / 2**30:.1f}" for x in xs)),
            _chain(*(f"{x['compile_seconds']:.0f}" for x in xs)),
        ])  # fmt: skip
    if not rows:
        return ""
    return table(["point", "labels", "MODEL ms", "change vs after", "launches", "GB moved",
                  "glue GB", "compiled GiB", "compile s (this machine)"], rows,
                 "llrrrrrrr")  # fmt: skip


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
    p = d["points"].get("LT_chunked:124M:65536", {})
    out = ""
    for label, words in SWITCHED.items():
        w = p.get(label)
        if not w:
            continue
        met = sum(bool(t.get(f"met_{label}", t["met"])) for t in d["targets"])
        out += (
            f" {words['summary']}, the 64k step moves {_gb(w['glue_bytes'])} GB of glue in "
            f"{w['launches']:,} launches ({w['memory_bytes'] / 2**30:.1f} GiB), MODEL "
            f"{_ms(w['ms'])} ms, and {met} of the targets are met by the MODEL."
        )
    return out


def _switches_section(d: dict[str, Any], costs: dict[str, Any]) -> list[str]:
    """**after** against each switch label (``step_glue.SWITCH_LABELS``): the kernels, with
    ``model.scan_layers: false``, and with ``model.residual_dtype: bfloat16`` as well (issue 37,
    item 4)."""
    body = _switches_table(d)
    if not body:
        return []
    said = [
        f"{SWITCHED[k]['page']}, this tree at {short(costs[k].get('environment', {}).get('git_commit'))}"
        for k in SWITCHED if k in costs
    ]  # fmt: skip
    lines = [
        "## The two switches on top of the kernels (MODEL ms)", "",
        "**after** as above; " + "; ".join(said) + ". Each label was compiled by the tree at "
        "its commit, so a change between two labels includes whatever else changed between "
        "their trees. Compile seconds are this shared 2-core machine's.", "",
        body, "",
    ]  # fmt: skip
    for key in FOCUS:
        p = d["points"].get(key)
        labels = ("after", *(k for k in SWITCHED if p and k in p))
        if p and "after" in p and len(labels) > 1:
            lines += [f"### {_label(key)}: {' → '.join(labels)}", "",
                      _class_table(p, labels), "", _part_table(p, labels), ""]  # fmt: skip
    return lines


def _phi_grad_section(d: dict[str, Any], costs: dict[str, Any]) -> list[str]:
    """``unrolled`` against ``phi_grad`` (``step_glue.PHI_GRAD``): the same options, compiled by
    a tree without and with phi' in ``LT_chunked``'s gradient kernels."""
    label = PHI_GRAD
    rows, done = [], []
    for key, p in d["points"].items():
        if "unrolled" not in p or label not in p:
            continue
        a, b = p["unrolled"], p[label]
        att = [x["by_part"].get("attention core", {}) for x in (a, b)]
        done.append(key)
        rows.append([
            _label(key), _pair(_ms(a["ms"]), _ms(b["ms"])), f"{b['ms'] / a['ms'] - 1:+.1%}",
            _pair(f"{a['launches']:,}", f"{b['launches']:,}"),
            _pair(_gb(a["bytes"]), _gb(b["bytes"])),
            _pair(_gb(a["glue_bytes"]), _gb(b["glue_bytes"])),
            _pair(f"{a['memory_bytes'] / 2**30:.1f}", f"{b['memory_bytes'] / 2**30:.1f}"),
            _pair(_ms(att[0].get("ms")), _ms(att[1].get("ms"))),
            _pair(_gb(att[0].get("bytes", 0.0)), _gb(att[1].get("bytes", 0.0))),
            _pair(f"{att[0].get('launches', 0):,}", f"{att[1].get('launches', 0):,}"),
        ])  # fmt: skip
    if not rows:
        return []
    commit = {k: short(costs.get(k, {}).get("environment", {}).get("git_commit"))
              for k in ("unrolled", label)}  # fmt: skip
    lines = [
        "## The feature map's phi' in the `LT_chunked` gradient kernels (compiled; MODEL ms)", "",
        f"**unrolled** as above (this tree at {commit['unrolled']}: phi applied by XLA before "
        "the Pallas op, phi' by XLA after it); **phi_grad**: the same options compiled by this "
        f"tree at {commit[label]}, where the op takes an elementwise map's raw q, k, phi fuses "
        "into the bias add and split before it and its gradient kernels return dq, dk with phi' "
        "applied from the features they read (docs/design.md, \"No pass of its own for phi'\"). "
        "Each label was compiled by the tree at its commit.", "",
        table(["point", "MODEL ms", "change", "launches", "GB moved", "glue GB",
               "compiled GiB", "attention core MODEL ms", "its GB moved", "its launches"],
              rows, "lrrrrrrrrr"), "",
    ]  # fmt: skip
    for key in done:
        p = d["points"][key]
        lines += [f"### {_label(key)}: unrolled → {label}", "",
                  _class_table(p, ("unrolled", label)), "",
                  _part_table(p, ("unrolled", label)), ""]  # fmt: skip
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
        *_switches_section(d, costs),
        *_phi_grad_section(d, costs),
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
