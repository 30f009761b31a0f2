"""``auto``'s plan: its memory estimate against the compiled memory
(``memory_estimate_h100_compiled.md``), and the model switches measured in the compiled H100
program (``model_switches_h100_compiled.md``).

Raw files: ``memory_estimate_h100_compiled.json`` (``benchmarks/memory_estimate.py``): ``meta``,
``summary`` per group, ``rows`` (each compiled candidate: its estimate, compiled memory and the
commit it was compiled at), ``fresh`` (compiled at the writing commit, with their collectives)
and ``plans`` (what the planner does with them); ``model_switches_h100_compiled.json``
(``benchmarks/model_switches.py``).
"""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import GiB, gib, provenance, short, table


def _pct(x: float) -> str:
    return f"{x:+.1%}"


@renderer("memory_estimate.summary")
def estimate_summary(raw: Raw) -> str:
    """One sentence: the estimate's error over every compiled setting (docs)."""
    s = raw.data["summary"]["all"]
    return (
        f"`auto`'s estimate is within a median {s['median_abs']:.1%} of the compiled memory "
        f"(from {_pct(s['min'])} to {_pct(s['max'])}) over the {s['n']} settings compiled for "
        "the H100 in `benchmarks/results/` "
        "(`benchmarks/results/memory_estimate_h100_compiled.md`)."
    )


@renderer("memory_estimate.page")
def estimate_page(raw: Raw) -> str:
    d = raw.data
    meta, prov = d["meta"], provenance(d)
    margin = meta["settings"]["estimate_margin"]
    budget = meta["settings"]["budget_bytes"]
    lines = [
        "# `auto`'s memory estimate against the compiled memory (H100)",
        "",
        "**Estimated, then compiled.** Before compiling anything, `auto` "
        "(`linear_gpt2/training/memory_plan.py`) estimates each candidate setting's memory per "
        "device from the configuration: parameters, AdamW state and gradients (as FSDP shards "
        "them), the activations autodiff keeps for the backward (JAX's own list of saved "
        "residuals, traced at one device's shapes with one and two layers: nothing compiled), "
        "and the backward's largest working set (one block's recomputed activations and the "
        "stream's cotangents, or the plain head's logit gradients; with `flash`'s ring under "
        "context parallelism, the K and V it received). Under context parallelism the linear "
        "family's slices also keep their slice state's inputs (`kernels/context.py`), which "
        "the one-device trace does not see: the attention alone is traced in its "
        "context-parallel form and in its one-device form, and the difference is added per "
        "layer. It compiles only the candidates whose "
        f"estimate is at most the budget plus {margin:.0%}, fastest first by a MODELLED step "
        "time, and takes the first whose compiled memory fits. Here every setting compiled "
        "for an H100 target in `benchmarks/results/` is estimated at this commit and set "
        "beside its compiled memory (XLA's buffer assignment, deviceless), each at the commit "
        "its file records (the fresh points at "
        + ", ".join(sorted({short(f["git_commit"]) for f in d.get("fresh", {}).values()}))
        + f"); estimated at {short(prov['commit'])}. jax {prov['jax']}, {prov['time']}.",
        "",
        "## Error by group",
        "",
    ]
    body = []
    for g, s in d["summary"].items():
        body.append([g, s["n"], f"{s['median_abs']:.1%}", f"{s['max_abs']:.1%}",
                     f"{_pct(s['min'])} to {_pct(s['max'])}"])  # fmt: skip
    lines.append(table(["group", "settings", "median abs. error", "max abs. error", "range"],
                       body, "lrrrl"))  # fmt: skip
    fits = [r for r in d["rows"] if r["compiled_bytes"] <= budget]
    skipped = [r for r in fits if r["estimate_bytes"] > budget * (1 + r.get("margin", margin))]
    over = [r for r in d["rows"] if r["error"] > r.get("margin", margin)]
    worst_fit = max((r["error"] for r in fits), default=0.0)
    lines += [
        "",
        f"Of the {len(fits)} settings whose compiled step fits the {budget / GiB:.0f} GiB "
        f"budget, {len(skipped)} would be skipped on the estimate's word (estimate above the "
        f"budget plus {margin:.0%}, or {meta['settings'].get('unrolled_estimate_margin', margin):.0%} "
        "with the blocks unrolled, where XLA recomputes in its fusions LayerNorm and GELU "
        "intermediates a scan keeps); the largest overestimate among them is "
        f"{_pct(worst_fit)}. {len(over)} of all {len(d['rows'])} settings are overestimated "
        f"by more than their margin. An underestimate costs only a compile: the compiler, not "
        "the estimate, decides what fits. The estimate is low where an attention's backward "
        "holds more than its residuals: XLA's quadratic `softmax`, `LT_state_parallel` and "
        "`LT_attention_parallel_no_flash` under rematerialisation (their score or state "
        "tensors), steps compiled past the device's memory, where XLA's own "
        "rematerialisation is at work, and the context-parallel steps of `configs/long` "
        "compiled with XLA's glue, where XLA lays the kept block inputs out a second time, "
        "transposed, for the backward (the 1.6B point's buffer assignment; with `auto`'s "
        "kernels the same step, among the fresh points, keeps them once).",
    ]
    if d.get("plans"):
        lines += ["", "## What `auto` compiles", ""]
        for p in d["plans"]:
            lines += [f"**{p['point']}** ({p['target']}, budget {p['budget_bytes'] / GiB:.0f} "
                      f"GiB): chooses `{p['chosen']}`"
                      + (f", compiling {len(p['compiled'])} of {len(p['candidates'])} "
                         f"candidates ({', '.join(f'`{c}`' for c in p['compiled'])})") + ".",
                      ""]  # fmt: skip
            body = []
            for c in p["candidates"]:
                body.append([
                    f"`{c['setting']}`", gib(c["estimate_bytes"], 1),
                    f"{c['modelled_ms']:,.0f}",
                    ", ".join(f"{k} {v / 1e9:,.2f}" for k, v in c["collective_bytes"].items())
                    or "—",
                    "—" if c.get("compiled_bytes") is None else gib(c["compiled_bytes"], 1),
                    "yes" if c["setting"] in p["compiled"] else "no (estimate over)"
                    if c["estimate_bytes"] > p["budget_bytes"] * (1 + margin) else "no",
                ])  # fmt: skip
            lines.append(table(["setting", "estimate GiB", "MODEL ms", "MODEL collectives "
                                "(GB per device)", "compiled GiB", "compiled by auto"],
                               body, "lrrlrl"))  # fmt: skip
            if p.get("collectives_compiled"):
                lines += ["", "Collectives counted in the compiled step, per device (GB): "
                          + "; ".join(f"`{s}`: " + ", ".join(
                              f"{c['kind']} over {c['axes']} {c['sent_bytes'] / 1e9:,.2f}"
                              for c in cols if c["sent_bytes"] >= 1e7)
                              for s, cols in p["collectives_compiled"].items()) + "."]  # fmt: skip
            lines.append("")
    lines += ["## Every setting", ""]
    body = []
    for r in sorted(d["rows"], key=lambda r: (r["group"], r["point"], r["setting"])):
        body.append([r["group"], r["point"], f"`{r['setting']}`", gib(r["estimate_bytes"]),
                     gib(r["compiled_bytes"]), _pct(r["error"]), short(r["source_commit"])])  # fmt: skip
    lines.append(table(["group", "point", "setting", "estimate GiB", "compiled GiB", "error",
                        "compiled at"], body, "lllrrrl"))  # fmt: skip
    return "\n".join(lines)


@renderer("model_switches.page")
def switches_page(raw: Raw) -> str:
    d = raw.data
    prov, s = provenance(d), d["meta"]["settings"]
    lines = [
        "# `model.residual_dtype` and `model.scan_layers` in the step compiled for the H100",
        "",
        f"**Compiled; time MODELLED.** The trainer's step (clip + AdamW, state donated) for "
        f"{s['size']} `{s['attention']}` (chunk {s['chunk_size']}, batch {s['batch']}, "
        f"{s['dtype']} matmuls) compiled for the H100 on a machine without a GPU (deviceless "
        "XLA; `benchmarks/model_switches.py`), with each switch. Memory is XLA's buffer "
        "assignment; HBM bytes and launches are read from the optimized program "
        "(`experiments/hlo_costs.py`: each launch's operands and outputs, loops by their trip "
        "counts); 'stacking' is the kernels that only zero-fill the scan's `[n_layer, ...]` "
        "buffers or copy activations into and out of them; the compile time is this shared "
        "2-core machine's; the step time is the step-time MODEL's (`train_step_h100_model.md`,"
        f" fitted at {short(s['model_commit'])}), not a measurement. jax {prov['jax']}, commit "
        f"{short(prov['commit'])}, {prov['time']}.",
        "",
    ]
    for context in dict.fromkeys(p["context"] for p in d["points"]):
        pts = [p for p in d["points"] if p["context"] == context]
        base = pts[0]
        lines += [f"## {context:,} tokens (remat {base['remat']}, loss chunk "
                  f"{base['loss_chunk']})", ""]  # fmt: skip
        body = []
        for p in pts:
            st = p["stacking"]
            body.append([
                p["variant"], gib(p["memory_bytes"]), f"{p['bytes'] / 1e9:,.1f}",
                f"{p['launches']:,}", f"{st['bytes'] / 1e9:,.2f} ({st['launches']:,})",
                f"{p['compile_seconds']:,.0f}", f"{p['modelled_ms']:,.1f}",
                f"{p['modelled_ms'] / base['modelled_ms']:.3f}",
            ])  # fmt: skip
        lines.append(table(["variant", "memory GiB", "HBM GB moved", "launches",
                            "stacking GB (launches)", "compile s", "MODEL ms",
                            "MODEL / default"], body, "lrrrrrrr"))  # fmt: skip
        classes = ("matmul", "kernel", "elementwise", "reduction")
        lines += ["", "HBM GB moved by op class (matmul / Pallas / elementwise / reductions "
                  "and transposes): " + "; ".join(
                      f"{p['variant']} " + " / ".join(
                          f"{p['by_class'].get(k, {}).get('bytes', 0) / 1e9:,.1f}"
                          for k in classes) for p in pts) + ".", ""]  # fmt: skip
    return "\n".join(lines)


@renderer("model_switches.summary")
def switches_summary(raw: Raw) -> str:
    """One line per context: what each switch changes against today's program (docs)."""
    out = []
    for context in dict.fromkeys(p["context"] for p in raw.data["points"]):
        pts = [p for p in raw.data["points"] if p["context"] == context]
        base = pts[0]
        parts = []
        for p in pts[1:]:
            parts.append(
                f"{p['variant']}: {gib(p['memory_bytes'])} GiB (default {gib(base['memory_bytes'])}),"
                f" {p['bytes'] / base['bytes'] - 1:+.1%} HBM bytes, {p['launches']:,} launches "
                f"(default {base['launches']:,}), MODEL {p['modelled_ms'] / base['modelled_ms']:.3f}"
                f"x the default's time, compiled in {p['compile_seconds']:,.0f} s (default "
                f"{base['compile_seconds']:,.0f} s)"
            )  # fmt: skip
        out.append(f"- 124M `LT_chunked` at {context:,} tokens, compiled for the H100: "
                   + "; ".join(parts) + ".")  # fmt: skip
    return "\n".join(out) + "\n\n(`benchmarks/results/model_switches_h100_compiled.md`)"
