"""The cost of the expanded state (issue 39): ``feature_map_cost_h100_compiled.json``
(``benchmarks/feature_map_cost.py``), the 124M step per feature map compiled for the H100."""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, gib, how, provenance, short, table


def _ms(x: float | None) -> str:
    return "" if x is None else f"{x:.1f}"


def _kernels(p: dict[str, Any]) -> str:
    ks = p.get("kernels") or []
    if not ks:
        return ""
    regs = [k["registers"] for k in ks if k["registers"] is not None]
    spills = [k["spills"] for k in ks if k["spills"] is not None]
    if not regs:
        return f"{len(ks)} kernels (registers not logged)"
    return f"{len(ks)} kernels, {min(regs)}-{max(regs)} registers, spills {max(spills or [0])} B"


def _first_try(p: dict[str, Any]) -> str:
    """What ``auto`` resolves to before compiling (the plan's estimates, traced): the candidate
    it compiles first, or the most frugal where none is estimated to fit."""
    plan = p.get("plan")
    if not plan:
        return ""
    cands = plan["candidates"]
    fit = [c for c in cands if c["compiled"]]
    if fit:
        c = min(fit, key=lambda c: c["modelled_ms"])
        return f"estimated {gib(c['memory_bytes'])} GiB at {c['setting']} (auto's first try)"
    c = min(cands, key=lambda c: c["memory_bytes"])
    return (
        f"no setting estimated to fit {gib(plan['budget_bytes'])} GiB: the most frugal, "
        f"{c['setting']}, {gib(c['memory_bytes'])} GiB"
    )


def _unfinished(p: dict[str, Any]) -> str | None:
    """A point without a compiled step: its timeout or error, or None."""
    if "timeout_s" in p:
        return f"compile did not finish in {p['timeout_s']:.0f} s"
    if "error" in p:
        return "does not compile: " + p["error"][:120]
    return None


def _commits(points: dict[str, dict[str, Any]], default: str | None) -> str:
    """Which commit each point was compiled at: one commit, or each with its points."""
    by: dict[str | None, list[str]] = {}
    for p in sorted(points.values(), key=lambda p: p["context"]):
        by.setdefault(p.get("commit", default), []).append(
            f"{p['feature_map']} {context_label(p['context'])}"
        )
    if len(by) == 1:
        return f"commit {short(next(iter(by)))}"
    return "commits " + "; ".join(f"{short(c)} ({', '.join(ps)})" for c, ps in by.items())


@renderer("feature_map_cost.page")
def page(raw: Raw) -> str:
    """Per context: flash (measured and modelled, from the step model's cache), then each
    feature map's compiled memory, setting, modelled time (and softplus's measured), the key
    features and state, and the kernels' registers and spills."""
    d, prov = raw.data, provenance(raw.data)
    s = d["meta"]["settings"]
    points, cached = d["points"], d.get("cached", {})
    contexts = sorted({p["context"] for p in points.values()})
    maps = list(s["maps"])
    lines = [
        "# What recall costs: the 124M step per feature map, compiled for the H100",
        "",
        f"**{how(prov)}** for the H100 on a CPU machine (deviceless: XLA's buffer assignment of "
        "the H100 program and ptxas's registers, nothing run) with the code of "
        f"{_commits(points, prov['commit'])}, jax {prov['jax']}: the training step of {s['size']} (batch "
        f"{s['batch']}, {s['dtype']}, AdamW) with `{s['attention']}` (chunk {s['chunk_size']}, "
        f"`kernel: {s['kernel']}`: the Pallas kernels) and each feature map, the auto memory "
        "settings resolved against the H100's budget; `" + s["command"] + "`. The step times are "
        "a **MODEL** (`studies/train_step/step_model.py` at the parameters fitted to the 37 measured "
        f"H100 steps, `{d['meta']['model']}`), not measured, except the columns marked measured "
        "(the lent H100, the points the model was fitted on). Keys wider than the 64 value "
        "columns run as blocks of 64 folded into the heads (`kernels/key_blocks.py`: 3 blocks "
        "for 153 features, 33 for 2,080), so every kernel is the softplus one at more heads. "
        "A point whose compile did not finish within its bound (`--timeout`, one compile at a "
        "time on 2 shared cores) or failed says so, with the memory auto's plan estimated "
        "(traced, not compiled) for the setting it would compile first.",
        "",
    ]
    for T in contexts:
        rows = []
        f = cached.get(f"flash:{T}")
        if f:
            rows.append(["`flash`", "", "", f"{gib(f['memory_bytes'])} GiB", f["setting"],
                         _ms(f["modelled_ms"]), _ms(f["measured_ms"]), "1.00x", ""])  # fmt: skip
        base = points.get(f"softplus:{T}", {}).get("modelled_ms")
        for fm in maps:
            p = points.get(f"{fm}:{T}")
            if p is None:
                continue
            why = _unfinished(p)
            if why:
                rows.append([f"`{fm}`", "", "", why, _first_try(p), "", "", "", ""])
                continue
            measured = (
                cached.get(f"LT_chunked:{T}", {}).get("measured_ms") if fm == "softplus" else None
            )
            vs_flash = f"{p['modelled_ms'] / f['modelled_ms']:.2f}x" if f else ""
            vs_soft = (
                f" ({p['modelled_ms'] / base:.2f}x softplus)" if base and fm != "softplus" else ""
            )
            dim = (
                f"{p['feature_dim']} -> {p['key_features']}"
                if p["feature_dim"]
                else f"64 -> {p['key_features']}"
            )
            rows.append([
                f"`{fm}`", dim, f"{p['state_floats_per_head'] * 4 / 1024:.1f} KiB",
                f"{gib(p['memory_bytes'])} GiB" + ("" if p["fits"] else " (over)"), p["setting"],
                _ms(p["modelled_ms"]) + vs_soft, _ms(measured), vs_flash, _kernels(p),
            ])  # fmt: skip
        settings = {p["setting"] for fm in maps if (p := points.get(f"{fm}:{T}"))
                    and not _unfinished(p)}  # fmt: skip
        mixed = (
            ["", "The maps run at different auto settings here (column 'setting'): a ratio "
             "between two of them prices the setting as well as the feature map."]
            if len(settings) > 1 else []
        )  # fmt: skip
        lines += [
            f"## {context_label(T)} tokens",
            "",
            table(
                ["feature map", "q, k dims -> features", "state per head (float32)",
                 "compiled memory", "setting (auto)", "step ms, MODEL", "step ms, measured",
                 "modelled / flash's", "Pallas kernels (max over launches)"],
                rows,
            ),
            *mixed,
            "",
        ]  # fmt: skip
    return "\n".join(lines).rstrip()


@renderer("feature_map_cost.table")
def summary_table(raw: Raw) -> str:
    """One row per feature map (and flash), one column per context: the modelled step in ms,
    its ratio to softplus's, and the compiled memory (docs/results.md)."""
    d = raw.data
    points, cached = d["points"], d.get("cached", {})
    contexts = sorted({p["context"] for p in points.values()})
    rows = []
    f = [cached.get(f"flash:{T}") for T in contexts]
    rows.append(["`flash` (measured; MODEL)", *(
        "" if x is None else f"{x['measured_ms']:.1f}; {x['modelled_ms']:.1f}, "
        f"{gib(x['memory_bytes'], 1)} GiB" for x in f)])  # fmt: skip
    for fm, fdim in d["meta"]["settings"]["maps"].items():
        cells = []
        for T in contexts:
            p = points.get(f"{fm}:{T}")
            base = points.get(f"softplus:{T}", {}).get("modelled_ms")
            if p is None:
                cells.append("")
            elif "timeout_s" in p:
                est = _first_try(p).split(" (")[0]
                cells.append(f"compile > {p['timeout_s']:.0f} s" + (f"; {est}" if est else ""))
            elif "error" in p:
                cells.append("does not compile")
            else:
                rel = f" ({p['modelled_ms'] / base:.2f}x)" if base and fm != "softplus" else ""
                cells.append(
                    f"{p['modelled_ms']:.1f}{rel}, {gib(p['memory_bytes'], 1)} GiB"
                    + ("" if p["fits"] else " (over)")
                )
        label = f"`{fm}`" + (f" (feature_dim {fdim})" if fdim else "")
        rows.append([label, *cells])
    return table(
        ["feature map", *(f"{context_label(T)}: step ms, MODEL (x softplus), memory"
                          for T in contexts)],
        rows,
    )  # fmt: skip
