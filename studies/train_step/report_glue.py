"""Issue 37's glue of the training step, before and after: ``step_glue_h100_model.md``.

Raw file (``benchmarks/step_glue.py``): ``step_glue_h100_model.json``: per point the compiled
step's bytes, FLOPs and launches by op class and part of the model for each label (``before``:
main's program, ``after``: this tree's), their MODEL ms, the compiled memory, and issue 37's
targets read from the MODEL.
"""

from __future__ import annotations

from collections.abc import Iterable
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
        "target": "the blocks unrolled",
        "summary": "With `model.scan_layers: false` alone (the blocks unrolled; the float32 "
        "residual stream and nanoGPT's numerics kept)",
        "page": "**unrolled**: after with `model.scan_layers: false` (the blocks unrolled: no "
        "stacking of per-layer activations; the same function, the residual stream in float32: "
        "nanoGPT's numerics)",
    },
    "switches": {
        "target": "the blocks unrolled, the residual stream in bfloat16",
        "summary": "With `model.residual_dtype: bfloat16` as well (not nanoGPT's numerics)",
        "page": "**switches**: after with `model.scan_layers: false` and "
        "`model.residual_dtype: bfloat16` (the residual stream in half the bytes; not nanoGPT's "
        "numerics)",
    },
}
# step_glue.PHI_GRAD (not imported: rendering needs no JAX, which step_glue's imports bring).
PHI_GRAD = "phi_grad"
# step_glue.FUSED_1K: "unrolled" with LT_chunked's single-pass kernels forced, its 1k points.
FUSED_1K = "fused_1k"
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


def _verdict(met: bool, met_scaled: bool | None) -> str:
    """``**met** by the MODEL`` and, where the point was timed, the measured time's verdict."""
    out = ("**met**" if met else "**not met**") + " by the MODEL"
    if met_scaled is not None:
        out += (
            ", **met**" if met_scaled else ", **not met**"
        ) + " by the measured time × its ratio"
    return out


def _targets(d: dict[str, Any]) -> list[str]:
    """One line per target: the verdict of ``after`` first (the MODEL before → after), then
    that of each switch label compiled at the target's points (:data:`SWITCHED`), each named."""
    lines = []
    for t in d["targets"]:
        head = f"- {t['target']}: `after`:"
        if "glue" in t["target"]:
            verdict = "**met**" if t["met"] else "**not met**"
            lines.append(f"{head} {t['before_glue_gb']:,.0f} → {t['after_glue_gb']:,.0f} GB "
                         f"(compiled; exact): {verdict}.{_switched(t)}")  # fmt: skip
            continue
        scaled = ""
        if t.get("measured_ms"):
            scaled = (f"; measured {_ms(t['measured_ms'])} ms before, × the MODEL's ratio "
                      f"{_ms(t['scaled_ms'])} ms")  # fmt: skip
        extra = ""
        if "tokens_per_s" in t:
            extra = (f": {t['before_tokens_per_s'] / 1e3:,.0f}k → {t['tokens_per_s'] / 1e3:,.0f}k "
                     "tokens/s")  # fmt: skip
        elif "baseline" in t:
            f = t["baseline"]
            extra = f" (`flash` {_ms(f['before_ms'])} → {_ms(f['after_ms'])} ms" + (
                f"; measured × MODEL ratio {_ms(f['scaled_ms'])} ms)" if f.get("scaled_ms")
                else ")")  # fmt: skip
        lines.append(f"{head} MODEL {_ms(t['before_ms'])} → {_ms(t['after_ms'])} ms{extra}"
                     f"{scaled}: {_verdict(t['met'], t.get('met_scaled'))}.{_switched(t)}")  # fmt: skip
    return lines


def _switched(t: dict[str, Any]) -> str:
    """The target read from each switch label compiled at its points (step_glue.SWITCH_LABELS),
    each verdict named by its label."""
    out = ""
    for label, words in SWITCHED.items():
        if f"met_{label}" not in t:
            continue
        head = f" `{label}` ({words['target']}):"
        if "glue" in t["target"]:
            verdict = "**met**" if t[f"met_{label}"] else "**not met**"
            out += f"{head} {t[f'{label}_glue_gb']:,.0f} GB: {verdict}."
        elif f"{label}_tokens_per_s" in t:
            out += (f"{head} MODEL {_ms(t[f'{label}_ms'])} ms, "
                    f"{t[f'{label}_tokens_per_s'] / 1e3:,.0f}k tokens/s: "
                    f"{_verdict(t[f'met_{label}'], None)}.")  # fmt: skip
        elif "baseline" in t:  # the comparison: both attentions' programs with the label
            f, scaled = t["baseline"], t.get(f"scaled_{label}_ms")
            out += (f"{head} MODEL {_ms(t[f'{label}_ms'])} ms (`flash` "
                    f"{_ms(f[f'{label}_ms'])} ms)"
                    + (f"; measured × each one's ratio {_ms(scaled)} ms (`flash` "
                       f"{_ms(f[f'scaled_{label}_ms'])} ms)" if scaled else "")
                    + f": {_verdict(t[f'met_{label}'], t.get(f'met_scaled_{label}'))}.")  # fmt: skip
        else:
            scaled = t.get(f"scaled_{label}_ms")
            out += (f"{head} MODEL {_ms(t[f'{label}_ms'])} ms"
                    + (f" (measured × its ratio {_ms(scaled)} ms)" if scaled else "")
                    + f": {_verdict(t[f'met_{label}'], None)}.")  # fmt: skip
    if f"met_{FUSED_1K}" in t:  # LT_chunked with FUSED_1K against flash with "unrolled"
        out += (
            f" `{FUSED_1K}` (the blocks unrolled, `LT_chunked`'s single pass forced): MODEL "
            f"{_ms(t[f'{FUSED_1K}_ms'])} ms (`flash` `unrolled` "
            f"{_ms(t['baseline']['unrolled_ms'])} ms): {_verdict(t[f'met_{FUSED_1K}'], None)}."
        )
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
    after, fused = (_commit_list((a.get("commits", {}).get(side) for a in alts.values()), label,
                                 d["meta"]["costs"])
                    for side, label in (("as_built", "after"), ("fused", "fused_head")))  # fmt: skip
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


def _commit_list(recorded: Iterable[str | None], label: str, costs: dict[str, Any]) -> str:
    """The commits some of ``label``'s points were compiled at, short and sorted: each point's
    own as ``recorded`` (None where the point predates per-point commits: then the label's)."""
    default = costs.get(label, {}).get("environment", {}).get("git_commit")
    return ", ".join(sorted({short(c or default) for c in recorded})) or short(default)


def _commits(d: dict[str, Any], label: str, costs: dict[str, Any]) -> str:
    """The commits ``label``'s points were compiled at."""
    return _commit_list((p[label].get("commit") for p in d["points"].values() if label in p),
                        label, costs)  # fmt: skip


# The attention core at 1k: the sizes of the LT_chunked <= flash target, 124M beside them.
SIZES_1K = ("124M", "355M", "774M", "1.6B")
ATTENTION_KERNELS = ("lt_chunked_", "cuDNN")


def _core_groups(rows: list[dict[str, Any]]) -> dict[str, float]:
    """MODEL ms of a priced attention core (``step_glue.price_attention``) by group: the
    attention's own kernels (LT's Pallas kernels or cuDNN's), XLA's data-moving fusions, the
    rest (the GEMM, the bias-gradient kernel: the same in both), the launch overhead."""
    out = {"attention": 0.0, "xla": 0.0, "rest": 0.0, "launch": 0.0, "launches": 0}
    for r in rows:
        if r["what"].startswith(ATTENTION_KERNELS):
            out["attention"] += r["ms"]
        elif r["class"] in ("elementwise", "reduction"):
            out["xla"] += r["ms"]
        else:
            out["rest"] += r["ms"]
        out["launch"] += r["launch_ms"]
        out["launches"] += r["launches"]
    return out


def _attention_1k(d: dict[str, Any], label: str = "unrolled") -> list[str]:
    """``LT_chunked`` against ``flash`` at 1k, both compiled with ``label``: the step, the
    attention core by group, and the core launch by launch per layer."""
    pairs = []
    for size in SIZES_1K:
        a, f = (d["points"].get(f"{att}:{size}:1024", {}).get(label) for att in
                ("LT_chunked", "flash"))  # fmt: skip
        if a and f and "attention" in a and "attention" in f:
            pairs.append((size, a, f))
    if not pairs:
        return []
    rows, rest, slower = [], [], []
    for size, a, f in pairs:
        ga, gf = _core_groups(a["attention"]), _core_groups(f["attention"])
        core_a = sum(ga[k] for k in ("attention", "xla", "rest", "launch"))
        core_f = sum(gf[k] for k in ("attention", "xla", "rest", "launch"))
        n = a["n_layer"]
        rows.append([
            size, f"{_ms(a['ms'])} / {_ms(f['ms'])}", f"{a['ms'] - f['ms']:+.2f}",
            f"{core_a:.2f} / {core_f:.2f}", f"{ga['attention']:.2f} / {gf['attention']:.2f}",
            f"{ga['xla']:.2f} / {gf['xla']:.2f}", f"{ga['launch']:.2f} / {gf['launch']:.2f}",
            f"{ga['launches'] / n:.0f} / {gf['launches'] / n:.0f}",
            f"{(a['ms'] - core_a) - (f['ms'] - core_f):+.2f}",
        ])  # fmt: skip
        rest.append(abs((a["ms"] - core_a) - (f["ms"] - core_f)))
        if a["ms"] > f["ms"]:
            slower.append(size)
    lines = [
        f"## `LT_chunked` against `flash` at 1k, both `{label}`: where the difference is "
        "(MODEL ms)",
        "",
        f"Both attentions' steps compiled with the `{label}` label ({SWITCHED[label]['target']}; "
        "batch 1, `LT_chunked` at chunks of 128 as timed), the launches of the attention core "
        "(`hlo_costs.part_of`: sourced in the block's `attn` and not named as its projections; "
        "the `c_attn` GEMMs fall in it) grouped by what "
        "runs: the attention's own kernels (`LT_chunked`'s Pallas kernels, cuDNN's flash "
        "attention), XLA's data-moving fusions, and the rest (the `c_attn` GEMMs and the "
        "bias-gradient kernel, the same in both); each launch's overhead apart. Every cell is "
        "`LT_chunked` / `flash`.",
        "",
        table(
            [
                "size",
                "step MODEL ms",
                "LT − flash",
                "attention core",
                "attention kernels",
                "XLA fusions in the core",
                "core launch overhead",
                "core launches per layer",
                "rest of the step: LT − flash",
            ],
            rows,
            "lrrrrrrrr",
        ),  # fmt: skip
        "",
        "By the MODEL `LT_chunked`'s step is the slower "
        + (
            f"at every size compiled ({', '.join(slower)})"
            if len(slower) == len(pairs)
            else f"at {', '.join(slower) or 'no size'} of {', '.join(s for s, _, _ in pairs)}"
        )
        + ", and the "
        f"steps differ outside the attention core by at most {max(rest):.2f} ms: the difference "
        "is the core's, split by the columns into its kernels, its XLA fusions and its launches.",
        "",
    ]
    return lines + _attention_layers(pairs)


def _attention_layers(pairs) -> list[str]:
    """The attention core launch by launch, per layer: launches, MB and MODEL µs (its launch
    overhead included) at each size compiled; a row for every (what, pass) any size has, in
    program order."""
    sizes = [size for size, _, _ in pairs]
    body = []
    for att, i in (("LT_chunked", 1), ("flash", 2)):
        keys: dict[tuple[str, bool], tuple[bool, int]] = {}  # forward first, program order
        for _, *sides in pairs:
            for j, r in enumerate(sides[i - 1]["attention"]):
                keys.setdefault((r["what"], r["backward"]), (r["backward"], j))
        for what, backward in sorted(keys, key=keys.get):
            cells, launches = [], set()
            for _, *sides in pairs:
                n = sides[0]["n_layer"]
                x = next((y for y in sides[i - 1]["attention"]
                          if (y["what"], y["backward"]) == (what, backward)), None)  # fmt: skip
                if x is None:
                    cells.append("—")
                    continue
                launches.add(f"{x['launches'] / n:g}")
                cells.append(f"{x['bytes'] / n / 1e6:.1f} MB, "
                             f"{(x['ms'] + x['launch_ms']) / n * 1e3:.1f} µs")  # fmt: skip
            body.append([f"`{att}`", f"`{what}`", "backward" if backward else "forward",
                         ", ".join(sorted(launches)), *cells])  # fmt: skip
    return [
        "Per layer, launch by launch (XLA fusions by XLA's name for them and the JAX primitive "
        "their source ends in; µs with each launch's overhead):",
        "",
        table(
            ["attention", "what runs", "pass", "launches per layer", *sizes],
            body,
            "lllr" + "r" * len(sizes),
        ),  # fmt: skip
        "",
        *ATTENTION_NOTES,
        "",
    ]


# Where the launches of LT_chunked's attention core that flash's lacks come from (the code; the
# numbers are the tables').
ATTENTION_NOTES = [
    "Where `LT_chunked`'s launches that `flash`'s core lacks come from:",
    "",
    "- `lt_chunked_fwd_h`, `lt_chunked_bwd_dh`: the two state passes, each a launch of its "
    "own because every output (gradient) program reads the totals of the chunks before (after) "
    "its own, which must all be written first. At 1k with chunks of 128 every chunk is a "
    "segment of its own (`plan.segments`), so the passes write only each chunk's total and the "
    "output and gradient kernels sum the ones they need (`plan.own_prefix`, "
    "`kernels/lt_chunked/ops.py`): no XLA prefix or suffix, and the forward's totals are kept "
    "for the backward instead of a recomputed pass. The reverse pass also forms the row "
    "cotangents r = 1 / (den + eps) and delta = r (dY . y), which cuDNN's backward call "
    "computes itself.",
    "- Recomputing each chunk's entering state in the output and gradient kernels from the "
    "keys and values before it would drop the forward pass's launch; priced by this MODEL its "
    "extra dots cost more than that launch (docs/design.md), so the passes stay.",
    "- The four kernels' cost against cuDNN's two: each launch is priced over the share of the "
    "132 SMs its grid fills, and at 1k, batch 1 the grids are a few waves, the last one partly "
    "idle at some head counts. `cost.plan_blocks` halves the output and gradient kernels' row "
    "tile (64 to 32 rows) and splits the state passes' value block (`Blocks.bs`) where the kernel "
    "cost model (`kernels/lt_chunked/cost.py`) prices the kernels a split changes at least 5% "
    "faster with it (`cost.SPLIT_GAIN`): the tables above are compiled with those plans; sizes "
    "whose grids already fill their waves keep the unsplit ones. What is left against cuDNN is "
    "the two state passes' launches and, at the largest sizes, grids that still leave part of "
    "a wave idle (docs/design.md).",
]


def _switches_section(d: dict[str, Any], costs: dict[str, Any]) -> list[str]:
    """**after** against each switch label (``step_glue.SWITCH_LABELS``): the kernels, with
    ``model.scan_layers: false``, and with ``model.residual_dtype: bfloat16`` as well (issue 37,
    item 4)."""
    body = _switches_table(d)
    if not body:
        return []
    said = [f"{SWITCHED[k]['page']}, compiled at {_commits(d, k, costs)}"
            for k in SWITCHED if k in costs]  # fmt: skip
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


def _fused_1k_section(d: dict[str, Any]) -> list[str]:
    """``LT_chunked`` at 1k with its two designs (``unrolled``: ``kernel=pallas``'s choice;
    ``fused_1k``: the single pass forced) against ``flash`` (``unrolled``): the step and the
    attention core, MODEL ms and launches per layer."""
    rows = []
    for size in SIZES_1K:
        a = d["points"].get(f"LT_chunked:{size}:1024", {})
        f = d["points"].get(f"flash:{size}:1024", {}).get("unrolled")
        chunk, fused = a.get("unrolled"), a.get(FUSED_1K)
        if not (chunk and fused and f and "attention" in fused):
            continue
        g = [_core_groups(x["attention"]) for x in (chunk, fused, f)]
        n = fused["n_layer"]
        rows.append([
            size, " / ".join(_ms(x["ms"]) for x in (chunk, fused, f)),
            f"{fused['ms'] - chunk['ms']:+.2f}", f"{fused['ms'] - f['ms']:+.2f}",
            " / ".join(f"{sum(x[k] for k in ('attention', 'xla', 'rest', 'launch')):.2f}"
                       for x in g),
            " / ".join(f"{x['attention']:.2f}" for x in g),
            " / ".join(f"{x['launch']:.2f}" for x in g),
            " / ".join(f"{x['launches'] / n:.0f}" for x in g),
        ])  # fmt: skip
    if not rows:
        return []
    return [
        "## `LT_chunked`'s single pass at 1k: `fused_1k` (compiled; MODEL ms)", "",
        "`LT_chunked`'s steps at 1k, batch 1, chunks of 128, compiled with the `unrolled` "
        "options and each of its designs (`kernels/lt_chunked/ops.py`): `kernel=pallas`'s "
        "choice (`unrolled`; `cost.choose`: the chunk-parallel design at these shapes) and the "
        "single pass forced (`fused_1k`: one program per (batch, head) walking all chunks, few "
        "launches); `flash` compiled with `unrolled` beside them. Every cell is "
        "`LT_chunked` chunk-parallel / `LT_chunked` single pass / `flash`; the MODEL prices a "
        "Pallas launch over the share of the 132 SMs its grid occupies, and the single pass "
        "has B × H programs.", "",
        table(["size", "step MODEL ms", "single pass − chunk-parallel", "single pass − flash",
               "attention core", "attention kernels", "core launch overhead",
               "core launches per layer"], rows, "lrrrrrrr"), "",
    ]  # fmt: skip


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
    # the commits of the points compared (a label's other points may be compiled later)
    commit = {k: _commit_list((d["points"][key][k].get("commit") for key in done), k, costs)
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
        "Each verdict names the program it reads: `after` (the kernels; MODEL before → after), "
        "then each switch label compiled at the target's points: `unrolled` (after with "
        "`model.scan_layers: false`), `switches` (that and `model.residual_dtype: bfloat16`). A "
        "comparison of two attentions reads both from the same label.",
        "",
        *_targets(d),
        "",
        *_switches_section(d, costs),
        *_attention_1k(d),
        *_fused_1k_section(d),
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
