"""The step-time MODEL against a GPU's measurement of issue 37's glue A/B (issue 37: "the model
stays honest"), on the step_glue page (``step_glue_h100_model.md``) and in docs/results.md.

Raw files: ``step_glue_h100_costs_compiled.json`` (``benchmarks/step_glue.py``: the cost rows of
each label's programs, compiled for the H100), ``step_glue_h100_model.json`` (its
``meta.model.params``: the MODEL's constants fitted on H100 step times) and a glue A/B measured
on a lent card (``glue_ab_<card>_measured.json``, ``scripts/gpu_check.py``'s glue stage: each
setting's median step time, side by side in one process per point). Each measured setting is
priced from the compiled rows of the label that runs the same options (:data:`LABEL_OF`) at the
fitted fractions of the measuring card's peaks (``step_model.Params.on``).

Pricing imports ``step_model`` (and with it JAX) when a block is rendered, not when the
renderers are loaded.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import glue_point, short, table

# The glue A/B's settings and the step_glue labels compiled with the same glue options.
LABEL_OF = {"xla": "before", "pallas": "after", "unrolled": "unrolled"}
# The op classes of the by-class table, in step_model.CLASSES's order (shown where any moves).
CLASSES = ("matmul", "fmha", "kernel", "elementwise", "reduction", "host", "launch")
CLASS_HEAD = {"matmul": "matmuls", "fmha": "cuDNN attention", "kernel": "Pallas kernels",
              "elementwise": "elementwise", "reduction": "reductions", "host": "host",
              "launch": "launch overhead"}  # fmt: skip


def _point(r: dict[str, Any]) -> str:
    return glue_point(r, "×")


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:.2f}" if x < 100 else f"{x:.1f}"


def _find(label_points: dict[str, Any], r: dict[str, Any]) -> tuple[dict | None, list[str]]:
    """The compiled point of a label that matches a measured row (attention, size, context,
    batch), and what differs where it matches but not wholly (chunk, memory options)."""
    for e in label_points.values():
        s = e["spec"]
        if all(s.get(k) == r.get(k) for k in ("attention", "size", "context", "batch")):
            notes = []
            if s.get("chunk_size") != r.get("chunk_size"):
                notes.append(f"compiled at chunk {s.get('chunk_size')}")
            return e, notes
    return None, []


def compare(costs: dict[str, Any], model: dict[str, Any], measured: dict[str, Any]) -> dict:
    """Each measured (point, setting) beside its MODEL: the MODEL ms on the H100's peaks and on
    the measuring card's, the measured ms, the ratios to the baseline setting, the MODEL's ms
    by op class, and what could not be matched."""
    from linear_gpt2.platform import cards
    from studies.train_step import step_model as sm

    kind = measured["meta"].get("environment", {}).get("device_kind", "")
    card = cards.of_device_kind(kind)
    if card is None:
        raise ValueError(f"{kind!r}: not a card of linear_gpt2/platform/cards.py; add it there")
    h100 = sm.Params(**model["meta"]["model"]["params"])
    on_card = h100.on(card)
    out: list[dict[str, Any]] = []
    for r in measured["rows"]:
        base = r["baseline"]
        settings = [base, *(v for v in r["median_ms"] if v != base)]
        priced: dict[str, dict[str, Any]] = {}
        for v in settings:
            label = LABEL_OF.get(v)
            e, notes = _find(costs["points"].get(label, {}), r) if label else (None, [])
            got = r["median_ms"].get(v) if r["status"].get(v) == "ok" else None
            cell = {"setting": v, "label": label, "measured_ms": got, "notes": notes}
            if label is None:
                cell["notes"] = ["no label compiles this setting"]
            elif e is None:
                cell["notes"] = [f"`{label}` has no such point compiled"]
            else:
                labels = costs["meta"].get("labels", {})
                cell |= {
                    "rows": e["rows"],
                    "model_h100_ms": sm.predict(e["rows"], h100) * 1e3,
                    "model_ms": sm.predict(e["rows"], on_card) * 1e3,
                    "by_class_ms": {k: t * 1e3 for k, t in sm.breakdown(e["rows"], on_card).items()},
                    "commit": e.get("git_commit")
                    or labels.get(label, {}).get("environment", {}).get("git_commit"),
                }  # fmt: skip
            if got is None and r["status"].get(v) not in (None, "ok"):
                cell["notes"].append(f"measured: {r['status'][v]}")
            priced[v] = cell
        b = priced[base]
        for cell in priced.values():
            if cell.get("model_ms") and cell["measured_ms"]:
                cell["model_over_measured"] = cell["model_ms"] / cell["measured_ms"]
            if b.get("model_ms") and cell.get("model_ms"):
                cell["model_ratio"] = cell["model_ms"] / b["model_ms"]
            if b["measured_ms"] and cell["measured_ms"]:
                cell["measured_ratio"] = cell["measured_ms"] / b["measured_ms"]
        out.append({"row": r, "baseline": base, "settings": priced})
    return {"card": card, "h100": h100, "on_card": on_card, "points": out}


def _errors(c: dict[str, Any]) -> dict[str, Any]:
    """The MODEL's error on the points: mean |log(MODEL / measured)| of the step ms (all cells
    and per setting) and of the setting / baseline ratios; per other setting the saving against
    the baseline, MODEL and measured (1 - ratio), over the points where both are known."""
    cells = [(p["baseline"], s) for p in c["points"] for s in p["settings"].values()]
    step = [abs(math.log(s["model_over_measured"])) for _, s in cells if "model_over_measured" in s]
    per: dict[str, list[float]] = {}
    for _, s in cells:
        if "model_over_measured" in s:
            per.setdefault(s["setting"], []).append(abs(math.log(s["model_over_measured"])))
    # (baseline, cell) of the other settings with both ratios to the baseline known
    pairs = [(b, s) for b, s in cells
             if s["setting"] != b and "model_ratio" in s and "measured_ratio" in s]  # fmt: skip
    ratio = [abs(math.log(s["model_ratio"] / s["measured_ratio"])) for _, s in pairs]
    saving: dict[tuple[str, str], tuple[list[float], list[float]]] = {}
    for b, s in pairs:
        m, g = saving.setdefault((s["setting"], b), ([], []))
        m.append(1 - s["model_ratio"])
        g.append(1 - s["measured_ratio"])
    over = [s["model_ratio"] < s["measured_ratio"] for _, s in pairs]
    return {"step": step, "per": per, "ratio": ratio, "saving": saving, "over": over}


# The setting whose only change from the baseline is the glue kernels (its ratios fit their
# bandwidth), and the one that adds a switch on top (checked out of sample).
FIT_ON, CHECK_ON = "pallas", "unrolled"
# The range of the glue kernels' fraction of the bandwidth searched, and the search's steps
# (golden section on log(fraction); the error is smooth and one-dimensional).
GLUE_RANGE, _STEPS = (0.02, 1.0), 80


def _pairs(c: dict[str, Any], setting: str) -> list[tuple[dict, dict, float]]:
    """(baseline rows, setting rows, measured ratio to the baseline) of each point that has
    both priced and measured."""
    out = []
    for p in c["points"]:
        b, s = p["settings"][p["baseline"]], p["settings"].get(setting)
        if s and "rows" in b and "rows" in s and "measured_ratio" in s:
            out.append((b["rows"], s["rows"], s["measured_ratio"]))
    return out


def _ratio_errors(pairs, p) -> list[float]:
    from studies.train_step import step_model as sm

    return [math.log(sm.predict(rows, p) / sm.predict(base, p) / got) for base, rows, got in pairs]


def _fit_glue(pairs, on) -> float:
    """The glue kernels' fraction of the bandwidth (``step_model.Params.glue``) minimising the
    squared log errors of ``pairs``' ratios at ``on``'s other constants."""
    a, b = (math.log(x) for x in GLUE_RANGE)
    cost = lambda x: sum(
        e * e for e in _ratio_errors(pairs, dataclasses.replace(on, glue=math.exp(x)))
    )  # noqa: E731,E501
    g = (math.sqrt(5) - 1) / 2
    for _ in range(_STEPS):
        c, d = b - g * (b - a), a + g * (b - a)
        a, b = (a, d) if cost(c) <= cost(d) else (c, b)
    return math.exp((a + b) / 2)


def recalibrate(c: dict[str, Any], costs: dict[str, Any], model: dict[str, Any]) -> dict | None:
    """The glue kernels' bandwidth the measuring card implies: ``Params.glue`` fitted to the
    :data:`FIT_ON` setting's measured ratios to the baseline (the MODEL's other constants as
    fitted on the H100), each point's error left out of the fit, :data:`CHECK_ON`'s errors (not
    fitted), and issue 37's targets re-read from the step_glue points priced on the H100's peaks
    with it (``step_glue.summarise``). None without two fitting points."""
    from studies.train_step import step_glue as sg

    pairs = _pairs(c, FIT_ON)
    if len(pairs) < 2:
        return None
    glue = _fit_glue(pairs, c["on_card"])
    on = dataclasses.replace(c["on_card"], glue=glue)
    loo = []
    for i in range(len(pairs)):
        g = _fit_glue(pairs[:i] + pairs[i + 1 :], c["on_card"])
        loo.append(_ratio_errors(pairs[i : i + 1], dataclasses.replace(c["on_card"], glue=g))[0])
    measured = model.get("measured", {})
    points = [{"key": p.measured_key, "measured_ms": measured[p.key]}
              for p in sg.POINTS if p.key in measured]  # fmt: skip
    h100 = dataclasses.replace(c["h100"], glue=glue)
    summary = sg.summarise(costs, {"params": {}, "points": points}, h100)
    return {
        "glue": glue, "memory": c["on_card"].memory,
        "before": _ratio_errors(pairs, c["on_card"]), "fitted": _ratio_errors(pairs, on),
        "loo": loo, "check": _ratio_errors(_pairs(c, CHECK_ON), on),
        "check_before": _ratio_errors(_pairs(c, CHECK_ON), c["on_card"]),
        "summary": summary,
    }  # fmt: skip


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else math.nan


def _savings(e: dict[str, Any]) -> str:
    parts = []
    for (v, b), (m, g) in e["saving"].items():
        parts.append(
            f"`{v}` saves {min(m):.0%} to {max(m):.0%} of `{b}`'s step by the MODEL (mean "
            f"{_mean(m):.0%}), {min(g):.0%} to {max(g):.0%} measured (mean {_mean(g):.0%})"
        )
    return "; ".join(parts)


def _summary_line(c: dict[str, Any], e: dict[str, Any]) -> str:
    card = c["card"].name
    return f"On the {card}'s peaks, against the {card}'s own step times: " + _findings(e)


def _findings(e: dict[str, Any]) -> str:
    over = e["over"]
    per = ", ".join(f"`{k}` {_mean(v):.2f}" for k, v in e["per"].items())
    return (
        f"{_savings(e)}; the "
        f"MODEL's saving is the larger at {sum(over)} of the {len(over)} (point, setting) "
        "pairs. The "
        f"MODEL's mean |log(MODEL / measured)| over the {len(e['step'])} step times is "
        f"{_mean(e['step']):.2f} ({per}), over the {len(e['ratio'])} ratios to the baseline "
        f"{_mean(e['ratio']):.2f}."
    )


def _commits(c: dict[str, Any], label: str) -> str:
    got = {short(s["commit"]) for p in c["points"] for s in p["settings"].values()
           if s["label"] == label and s.get("commit")}  # fmt: skip
    return ", ".join(sorted(got)) or "—"


def _ratio(cell: dict[str, Any], k: str) -> str:
    return f"{cell[k]:.3f}" if k in cell else "—"


def _key(r: dict[str, Any]) -> str:
    """A measured row's point as step_glue keys it (``step_glue.GluePoint.key``)."""
    b = f"{r['batch']}x" if r.get("batch", 1) > 1 else ""
    return f"{r['attention']}:{r['size']}:{b}{r['context']}"


def _cards_line(c: dict[str, Any], model: dict[str, Any]) -> list[str]:
    """The card change alone: where the lent H100 timed a point's step (``model["measured"]``,
    the times step_glue's page scales), its time over the measuring card's baseline setting,
    beside the MODEL's H100-peaks / card-peaks ratio of the baseline label."""
    got = []
    for p in c["points"]:
        h100 = model.get("measured", {}).get(_key(p["row"]))
        b = p["settings"][p["baseline"]]
        if h100 and b["measured_ms"] and b.get("model_ms"):
            got.append(f"{_point(p['row'])} {h100 / b['measured_ms']:.2f}× measured, "
                       f"{b['model_h100_ms'] / b['model_ms']:.2f}× by the MODEL")  # fmt: skip
    if not got:
        return []
    card = c["card"].name
    return [
        "The card alone: where the lent H100 timed the same point (the step as the fit's "
        "points ran it, `train_step_h100_model.json`: another tree than the programs here; the "
        f"times `step_glue.page` scales), the {card}'s `{c['points'][0]['baseline']}` step is "
        "faster by "
        + "; ".join(got)
        + " (H100 ms / "
        + card
        + " ms; the MODEL's ratio is its baseline "
        "label's on the two cards' peaks).",
        "",
    ]


def _pct(xs: list[float]) -> str:
    """Log errors as signed percentages (MODEL / measured - 1)."""
    return ", ".join(f"{math.exp(x) - 1:+.1%}" for x in xs)


def _met(targets: list[dict[str, Any]], label: str | None = None) -> int:
    return sum(bool(t.get(f"met_{label}", t["met"]) if label else t["met"]) for t in targets)


def _target_cell(x: dict[str, Any], label: str) -> str:
    """A target's MODEL figure for a step_glue label (``after`` or a switch label)."""
    if x.get("tokens_per_s") is not None:
        v = x["tokens_per_s"] if label == "after" else x.get(f"{label}_tokens_per_s")
        return "—" if v is None else f"{v:,.0f} tokens/s"
    if "glue" in x["target"]:
        v = x.get(f"{label}_glue_gb")
        return "—" if v is None else f"{v:,.1f} GB"
    v, base = x.get(f"{label}_ms"), x.get("baseline") or {}
    if v is None:
        return "—"
    other = base.get(f"{label}_ms")
    return f"{_ms(v)} ms" + ("" if other is None else f" vs {_ms(other)}")


def _recalibrated(c: dict[str, Any], r: dict[str, Any] | None) -> list[str]:
    """The glue kernels' bandwidth the card implies, the errors before and after, and issue
    37's targets re-read with it (a paragraph and a table)."""
    if r is None:
        return []
    card, t = c["card"].name, r["summary"]["targets"]
    rows = []
    for x in t:
        verdict = lambda m: "—" if m is None else ("**met**" if m else "not met")  # noqa: E731
        rows.append([x["target"], _target_cell(x, "after"), verdict(x["met"]), _target_cell(x, "unrolled"),
                     verdict(x.get("met_unrolled"))])  # fmt: skip
    return [
        f"### The glue kernels' bandwidth the {card} implies",
        "",
        f"The `{FIT_ON}` setting differs from the baseline only by the glue's Pallas kernels "
        f"(`step_model.GLUE_KERNELS`), so its measured ratios to the baseline price them: with "
        "the MODEL's other constants as fitted on the H100, the kernels' fraction of the "
        f"bandwidth that fits the {len(r['fitted'])} ratios best (`Params.glue`, least squares "
        f"on log ratio) is **{r['glue']:.2f}**, against the {r['memory']:.2f} of XLA's "
        "fusions the MODEL assumed for them. A MODEL fitted on a GPU's timings, not a "
        "measurement of the kernels: only a profile of the step on a GPU prices them one by one. "
        f"The `{FIT_ON}` ratios' errors (MODEL / measured − 1, in the table's order) go from "
        f"{_pct(r['before'])} to {_pct(r['fitted'])}; each with its point left out of the fit, "
        f"{_pct(r['loo'])}. Not fitted: `{CHECK_ON}`'s go from {_pct(r['check_before'])} to "
        f"{_pct(r['check'])}; what is left at 1k is the switch's own saving, which the MODEL "
        "credits mostly to launch overhead the card did not save.",
        "",
        "Issue 37's targets re-read with it (the step_glue points priced on the H100's peaks, "
        f"the glue kernels at {r['glue']:.2f} of its bandwidth; a MODEL of a MODEL). With the "
        f"kernels (`after`) {_met(t)} of the {len(t)} are met, with the blocks unrolled as "
        f"well {_met(t, 'unrolled')}:",
        "",
        table(["target", "`after` (MODEL)", "", "`unrolled` (MODEL)", ""], rows, "lrlrl"),
        "",
    ]


@renderer("step_glue.vs_gpu")
def vs_gpu(costs: Raw, model: Raw, measured: Raw) -> str:
    """The MODEL beside the GPU's measurement for every glue point and setting, priced on the
    measuring card's peaks: the table, the MODEL's change by op class, the error, the
    caveats."""
    c = compare(costs.data, model.data, measured.data)
    card, h100, on = c["card"], c["h100"], c["on_card"]
    env = measured.data["meta"].get("environment", {})
    rows, by_class, moved = [], [], set()
    for p in c["points"]:
        r, base = p["row"], p["baseline"]
        b = p["settings"][base]
        for v, s in p["settings"].items():
            rows.append([
                _point(r), f"`{v}` (`{s['label']}`)", _ms(s.get("model_h100_ms")),
                _ms(s.get("model_ms")), _ms(s["measured_ms"]), _ratio(s, "model_over_measured"),
                "" if v == base else _ratio(s, "model_ratio"),
                "" if v == base else _ratio(s, "measured_ratio"), "; ".join(s["notes"]),
            ])  # fmt: skip
            if v == base or "by_class_ms" not in s or "by_class_ms" not in b:
                continue
            d = {k: s["by_class_ms"].get(k, 0.0) - b["by_class_ms"].get(k, 0.0) for k in CLASSES}
            moved |= {k for k, x in d.items() if abs(x) >= 0.005}
            got = (
                (s["measured_ms"] - b["measured_ms"])
                if s["measured_ms"] and b["measured_ms"]
                else None
            )
            by_class.append((_point(r), v, s["model_ms"] - b["model_ms"], got, d))
    shown = [k for k in CLASSES if k in moved]
    e = _errors(c)
    tflops = lambda x: f"{x / 1e12:,.0f}"  # noqa: E731
    tbs = lambda x: f"{x / 1e12:.2f}"  # noqa: E731
    labels = costs.data["meta"].get("labels", {})
    names = ", ".join(f"`{v}` → `{lab}`" for v, lab in LABEL_OF.items())
    return "\n".join([
        f"## The MODEL against the {card.name}'s measurement of the glue A/B",
        "",
        f"Each setting the lent {card.name} timed (`{measured.path}`, `gpu_check.glue`: "
        f"{env.get('device_kind')}, commit {short(env.get('git_commit'))}, the program compiled "
        "on the GPU, the settings side by side in one process per point) beside the MODEL of "
        f"the step_glue label compiled with the same glue options ({names}; points matched by "
        "attention, size, context and batch, a chunk that differs said in the row). **MODEL "
        "ms are not a measurement**: the compiled rows priced by `step_model.py` at the "
        "fractions fitted on H100 step times (commit "
        f"{short(model.data['meta']['model'].get('commit'))}), on the H100's peaks "
        f"({tflops(h100.peak_flops)} TFLOP/s bf16, {tbs(h100.peak_bytes)} TB/s HBM) and on the "
        f"{card.name}'s ({tflops(on.peak_flops)} TFLOP/s, {tbs(on.peak_bytes)} TB/s: "
        "`platform/cards.py`), the launch overhead the H100's fit "
        f"({on.launch_us:.2f} µs) on both. Ratios: MODEL / measured, and each setting's step "
        f"over its point's `{c['points'][0]['baseline'] if c['points'] else 'xla'}`, by the "
        "MODEL and measured.",
        "",
        table(["point", "setting (label)", "MODEL ms, H100 peaks", f"MODEL ms, {card.name} peaks",
               f"measured ms, {card.name}", "MODEL / measured", "MODEL ratio to baseline",
               "measured ratio to baseline", "note"], rows, "llrrrrrrl"),
        "",
        f"{_summary_line(c, e)}",
        "",
        f"Where the MODEL finds each setting's saving against the baseline (MODEL ms on the "
        f"{card.name}'s peaks, by op class; negative: faster), beside the measured change:",
        "",
        table(["point", "setting", "MODEL change ms", "measured change ms",
               "measured − MODEL", *(CLASS_HEAD[k] for k in shown)],
              [[pt, f"`{v}`", f"{m:+.2f}", "—" if g is None else f"{g:+.2f}",
                "—" if g is None else f"{g - m:+.2f}", *(f"{d[k]:+.2f}" for k in shown)]
               for pt, v, m, g, d in by_class],
              "llrrr" + "r" * len(shown)),  # fmt: skip
        "",
        *_cards_line(c, model.data),
        *_recalibrated(c, recalibrate(c, costs.data, model.data)),
        "Caveats, each true of these files: the cost rows are programs compiled for the H100 "
        "(deviceless, on the CPU machine) by older trees: "
        + "; ".join(f"`{lab}` at {_commits(c, lab)}"
                    + (" (main's code before the glue kernels)" if lab == "before" else "")
                    for lab in dict.fromkeys(LABEL_OF.values()) if lab in labels)
        + f"; the {card.name} compiled its own program on the GPU at "
        f"{short(env.get('git_commit'))} with the glue kernels set per setting, so a row sets "
        "two compilers' programs and two trees side by side. The fit is the H100's: the "
        f"fractions of the peaks were fitted on H100 step times and are assumed to hold on the "
        f"{card.name}, whose launch overhead is not measured. The measured and MODEL ratios "
        "come from the same side-by-side runs and compiled rows as the step times, so they "
        "carry the same caveats, less the card's overall speed.",
    ])  # fmt: skip


@renderer("step_glue.vs_gpu_summary")
def vs_gpu_summary(costs: Raw, model: Raw, measured: Raw) -> str:
    """One line for docs/results.md: the MODEL's savings beside the measured ones, and its
    error (``vs_gpu``'s summary line)."""
    c = compare(costs.data, model.data, measured.data)
    card = c["card"].name
    r = recalibrate(c, costs.data, model.data)
    line = (
        f"The step-time MODEL on the {card}'s peaks against the {card}'s glue A/B "
        f"(`benchmarks/results/step_glue_h100_model.md`, its last section): "
        + _findings(_errors(c))
    )
    if r is None:
        return line
    t = r["summary"]["targets"]
    return line + (
        f" Those ratios imply the glue's Pallas kernels move their bytes at {r['glue']:.2f} of "
        f"the bandwidth, not the {r['memory']:.2f} the MODEL assumed (fitted on `{FIT_ON}`; "
        "out of sample, each point's ratio within "
        f"{max(abs(math.exp(x) - 1) for x in r['loo']):.1%}); re-read with it, {_met(t)} of "
        f"issue 37's {len(t)} targets are met by the MODEL, {_met(t, 'unrolled')} with the "
        "blocks unrolled."
    )
