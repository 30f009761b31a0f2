"""The step-time MODEL of the H100 against the measured steps: ``train_step_h100_model.md``.

Raw file (``benchmarks/step_model.py``): ``train_step_h100_model.json``: ``meta``, the fitted
``params``, the ``fit`` summary (in sample, leave-one-out, held out), per point the measured and
modelled ms and the error, the ``focus`` breakdowns (124M at 64k and 1M) and the ``targets``
with the changes priced on each.
"""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, provenance, short, table

CLASS_LABELS = {
    "matmul": "matmuls (XLA GEMM fusions)",
    "fmha": "cuDNN flash attention",
    "kernel": "Pallas LT kernels",
    "elementwise": "elementwise kernels (XLA loop fusions, copies, scan stacking)",
    "reduction": "reductions and transposes (XLA input fusions)",
    "host": "host offload transfers",
    "launch": "launch overhead",
}
PARAM_LABELS = {
    "matmul": "matmul FLOPs, fraction of 989 TFLOP/s",
    "fmha": "flash attention FLOPs, fraction of 989 TFLOP/s",
    "kernel": "Pallas kernel FLOPs, fraction of 989 TFLOP/s",
    "memory": "elementwise kernels' and Pallas kernels' bytes, fraction of 3.35 TB/s",
    "reduction": "reduction and transpose kernels' bytes, fraction of 3.35 TB/s",
    "launch_us": "overhead per launch, us",
}


SHORT = {"matmul": "matmuls", "fmha": "cuDNN attention", "kernel": "LT kernels",
         "elementwise": "elementwise", "reduction": "reductions/transposes", "host": "host offload",
         "launch": "launches"}  # fmt: skip


def _ms(x: float | None) -> str:
    if x is None:
        return "—"
    return f"{x:,.1f}" if x < 1000 else f"{x:,.0f}"


def _pct(x: float | None, sign: bool = True) -> str:
    return "—" if x is None else (f"{x:+.1%}" if sign else f"{x:.1%}")


def _point(r: dict[str, Any]) -> str:
    return f"`{r['attention']}` {r['size']} {context_label(r['context'])}"


@renderer("step_model.summary")
def summary(model: Raw) -> str:
    """One sentence: the model's error on the measured points (docs/results.md)."""
    d = model.data
    f = d["fit"]
    loo = f.get("loo") or {}
    held = f.get("held_out") or {}
    return (
        f"A step-time MODEL of the H100 (each step compiled for it here, priced per kernel, "
        f"{len(d['fitted'])} fitted constants) is off by a median {f['median_abs']:.1%} (max "
        f"{f['max_abs']:.1%}) on the {f['n']} measured steps"
        + (f", {loo['median_abs']:.1%} (max {loo['max_abs']:.1%}) left out of its fit one at a "
           "time" if loo else "")
        + (f", and by a median {held['median_abs']:.1%} (max {held['max_abs']:.1%}) on the "
           f"{held['n']} memory-check steps it was not fitted to" if held else "")
        + " (`benchmarks/results/train_step_h100_model.md`)."
    )  # fmt: skip


def _errors_table(points: list[dict[str, Any]]) -> str:
    body = [
        [_point(r), f"{r['remat']}, {r['loss_chunk']}" + ("" if r["settings_from"] == "given"
                                                          else " (matched)"),
         _ms(r["measured_ms"]), _ms(r["modelled_ms"]), _pct(r["error"]), _pct(r["loo_error"]),
         f"{r['launches']:,}",
         " / ".join(_ms(r["breakdown_ms"].get(k, 0.0)) for k in CLASS_LABELS)]
        for r in points
    ]  # fmt: skip
    return table(
        ["point", "remat, loss chunk", "measured ms", "MODEL ms", "error", "error left out",
         "launches", "MODEL ms: " + " / ".join(CLASS_LABELS)],
        body, "llrrrrrl",
    )  # fmt: skip


def _focus(key: str, f: dict[str, Any], points: dict[str, dict]) -> list[str]:
    r = points.get(key, {})
    total = sum(f["by_class_ms"].values())
    tot = f["totals"]
    lines = [
        f"### {key.split(':')[0]} {key.split(':')[1]} at {context_label(int(key.split(':')[2]))}"
        + (f" ({r['remat']}, loss chunk {r['loss_chunk']})" if r else ""),
        "",
        f"Measured {_ms(r.get('measured_ms'))} ms; MODEL {_ms(total)} ms.",
        "",
        table(
            ["op class (MODEL)", "ms", "share", "TFLOP", "GB moved", "launches"],
            [[CLASS_LABELS[k], _ms(v), f"{v / total:.0%}",
              f"{tot.get(k, {}).get('flops', 0) / 1e12:.1f}" if k in tot else "",
              f"{tot.get(k, {}).get('bytes', 0) / 1e9:,.0f}" if k in tot else "",
              f"{tot[k]['launches']:,}" if k in tot else ""]
             for k, v in f["by_class_ms"].items() if v > 0],
            "lrrrrr",
        ),  # fmt: skip
        "",
        "By part of the model (MODEL ms, launch overhead included): "
        + ", ".join(f"{k} {_ms(v)}" for k, v in sorted(f["by_part_ms"].items(),
                                                      key=lambda kv: -kv[1]))
        + "; forward " + _ms(f["by_pass_ms"].get("forward")) + ", backward "
        + _ms(f["by_pass_ms"].get("backward")) + ".",
    ]  # fmt: skip
    return lines


def _targets(targets: list[dict[str, Any]]) -> list[str]:
    lines = []
    for t in targets:
        goal = (f"no slower than `{t['baseline']}` (measured {_ms(t['goal_ms'])} ms)"
                if t["baseline"] else f"{_ms(t['goal_ms'])} ms")  # fmt: skip
        note = ""
        if t["baseline"]:
            gap = t["measured_ms"] / t["goal_ms"] - 1
            err = max(abs(t["model_error"]), abs(t["baseline_model_error"]))
            a, b = t["breakdown_ms"], t["baseline_breakdown_ms"]
            diff = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in {**a, **b}}
            note = (
                " MODEL difference to the baseline by class: "
                + ", ".join(f"{SHORT[k]} {v:+.1f} ms" for k, v in diff.items() if abs(v) >= 0.05)
                + "."
                + (f" The MODEL's error on these two points (up to {err:.1%}) exceeds the "
                   f"measured gap ({gap:+.1%}): it says which classes differ, not whether a "
                   "change closes the gap." if err > abs(gap) else "")
            )  # fmt: skip
        lines += [
            f"**{t['target']}** (now: {t['now']}; measured {_ms(t['measured_ms'])} ms, MODEL "
            f"{_ms(t['modelled_ms'])} ms; goal {goal}).{note}",
            "",
            table(
                ["change (MODEL)", "MODEL ms", "measured x MODEL ratio, ms", "what"],
                [[c["name"], _ms(c["ms"]), _ms(c["scaled_ms"]), c["what"]] for c in t["changes"]]
                + [
                    [
                        "**all of the above**",
                        _ms(t["all_changes_ms"]),
                        _ms(t["all_changes_scaled_ms"]),
                        "goal met" if t["met_by_all"] else "goal NOT met",
                    ]
                ],
                "lrrl",
            ),  # fmt: skip
            "",
        ]
    return lines


CEILING_LABELS = {"matmul_flops_per_s": "the card's bf16 matmul", "hbm_bytes_per_s":
                  "the card's streaming bandwidth"}  # fmt: skip


def _constants(d: dict[str, Any]) -> list[str]:
    """The fitted constants with the bound each was fitted within and where it comes from."""
    ceilings, bounds = d.get("ceilings") or {}, d.get("bounds")
    if bounds is None:  # a file written before the fit was bounded by the card
        return [table(["constant", "fitted"],
                      [[PARAM_LABELS[k], f"{d['params'][k]:.3g}"] for k in d["fitted"]], "lr")]  # fmt: skip
    body = []
    for k in d["fitted"]:
        c = d["bound_from"].get(k)
        if c and c in ceilings:
            unit = "TFLOP/s" if c.startswith("matmul") else "TB/s"
            src = f"{CEILING_LABELS[c]}, measured: {ceilings[c] / 1e12:,.3g} {unit}"
        elif c:
            src = "the datasheet peak (the card's ceiling not measured)"
        else:
            src = "physical range"
        body.append([PARAM_LABELS[k], f"{d['params'][k]:.3g}", f"{bounds[k][1]:.3g}", src,
                     "yes" if k in d.get("at_bound", []) else "no"])  # fmt: skip
    src = d["meta"]["settings"].get("ceilings_file")
    return [
        table(["constant", "fitted", "upper bound", "bound from", "at its bound"], body, "lrrll"),
        "",
        "Each fraction of a peak is fitted within what the lent card reached"
        + (f" (`{src}`)" if src else "")
        + ": no kernel multiplies faster than the card's dense bf16 matmul (cuDNN's "
        "attention and the Pallas kernels included), and none moves bytes faster than its "
        "measured bandwidth, where measured.",
    ]


@renderer("step_model.page")
def page(model: Raw) -> str:
    d = model.data
    prov, meta, f = provenance(d), d["meta"], d["fit"]
    s = meta["settings"]
    fitted = [r for r in d["points"] if not r["held_out"]]
    held = [r for r in d["points"] if r["held_out"]]
    by_key = {r["key"]: r for r in d["points"]}
    loo, ho, mm = f.get("loo"), f.get("held_out"), f["matmul_fixed_0.7"]
    goal = "met" if f["median_abs"] <= 0.15 and f["max_abs"] <= 0.35 else "NOT met"
    lines = [
        "# Training-step time on the H100: a MODEL, checked against the measured steps",
        "",
        "**A model, not a measurement.** Each measured step is compiled for the H100 on the CPU "
        "machine as it ran (`benchmarks/step_model.py`; the memory setting `auto` chose matched "
        "by the compiled memory the device reported), every launch of its optimized program "
        "priced by a roofline (FLOPs and HBM bytes read from the HLO, `hlo_costs.py`; the Pallas "
        "kernels by their cost model, `lt_chunked/cost.py`; cuDNN's flash attention in closed "
        f"form) at fitted fractions of the H100's peaks ({s['peak_tflops']:g} TFLOP/s bf16, "
        f"{s['peak_tb_per_s']:.2f} TB/s), plus a fitted overhead per launch, summed in program "
        f"order. Host transfers at an assumed {s['host_gb_per_s']:g} GB/s. Measured: "
        f"{s['measured']}. jax {prov['jax']}, commit {short(prov['commit'])}.",
        "",
        "## Fitted constants (least squares on log(MODEL / measured), "
        f"{f['n']} points)",
        "",
        *_constants(d),
        "",
        f"Error on the {f['n']} fitted points: median {_pct(f['median_abs'], False)}, max "
        f"{_pct(f['max_abs'], False)} (goal: median within 15%, none above 35%: **{goal}**)"
        + (f"; each left out of the fit in turn: median {_pct(loo['median_abs'], False)}, max "
           f"{_pct(loo['max_abs'], False)}" if loo else "")
        + (f"; the {ho['n']} memory-check steps, never fitted: median "
           f"{_pct(ho['median_abs'], False)}, max {_pct(ho['max_abs'], False)}" if ho else "")
        + f". With the matmul fraction fixed at 0.7 instead: median {_pct(mm['median_abs'], False)}"
          f", max {_pct(mm['max_abs'], False)}"
        + (f"; bounded by the datasheet peaks only (the fit before the card's ceilings): "
           f"median {_pct(f['unbounded']['median_abs'], False)}, max "
           f"{_pct(f['unbounded']['max_abs'], False)}, matmul fraction "
           f"{f['unbounded']['params']['matmul']:.3g}" if f.get("unbounded") else "")
        + ".",
        "",
        "## Per point",
        "",
        _errors_table(fitted),
    ]  # fmt: skip
    if held:
        lines += ["", "Held out (memory check, settings given, one process per point):", "",
                  _errors_table(held)]  # fmt: skip
    if d["focus"]:
        lines += ["", "## Where the time goes (MODEL)", ""]
        for key, fo in d["focus"].items():
            lines += _focus(key, fo, by_key) + [""]
    if d["targets"]:
        lines += ["## The targets for the next GPU, and what the MODEL says would close them",
                  "",
                  "Each change priced on the point's compiled costs; 'measured x MODEL ratio' "
                  "applies the model's relative change to the measured time.", ""]  # fmt: skip
        lines += _targets(d["targets"])
    return "\n".join(lines).rstrip() + "\n"


@renderer("step_model.where")
def where(model: Raw) -> str:
    """Bullets for docs/results.md: where the focus points' modelled time goes, and what the
    model says the targets' changes would do."""
    d = model.data
    by_key = {r["key"]: r for r in d["points"]}
    lines = []
    for key, f in d["focus"].items():
        total = sum(f["by_class_ms"].values())
        parts = sorted(f["by_class_ms"].items(), key=lambda kv: -kv[1])
        r = by_key[key]
        lines.append(
            f"- {_point(r)} ({r['remat']}, loss chunk {r['loss_chunk']}): measured "
            f"{_ms(r['measured_ms'])} ms, MODEL {_ms(total)} ms: "
            + ", ".join(f"{SHORT[k]} {v / total:.0%}" for k, v in parts if v / total >= 0.01)
            + "."
        )
    for t in d["targets"]:
        best = sorted(t["changes"], key=lambda c: c["ms"])[0]
        lines.append(
            f"- {t['target']}: the largest single step the MODEL finds is *{best['name']}* "
            f"({_ms(best['scaled_ms'])} ms scaled to the measurement); with all its changes "
            f"{_ms(t['all_changes_scaled_ms'])} ms"
            + (f" against `{t['baseline']}`'s measured {_ms(t['goal_ms'])} ms" if t["baseline"]
               else "")
            + "."
        )  # fmt: skip
    return "\n".join(lines)
