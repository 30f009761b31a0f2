"""``model.scan_layers``: the compile time of the unrolled blocks against the scan, and the memory
plan's estimate of each beside its compiled memory (``scan_compile_h100_compiled.md``).

Raw file: ``scan_compile_h100_compiled.json`` (``benchmarks/scan_compile.py``): ``meta`` (with
the plan's margins when it was written), ``points`` (one per (size, context, setting): compile
wall and CPU seconds, compiled bytes, estimated bytes, the estimate's error, the commit).
"""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import gib, provenance, short, table


def _pairs(raw: Raw) -> list[tuple[dict, dict]]:
    """(scanned, unrolled) per point, in the file's order; a point missing either is left out."""
    by = {(p["size"], p["context"], p["setting"]): p for p in raw.data["points"]}
    pairs = []
    for size, context, *_ in raw.data["meta"]["settings"]["points"]:
        s, u = by.get((size, context, "scanned")), by.get((size, context, "unrolled"))
        if s and u:
            pairs.append((s, u))
    return pairs


def _point(p: dict) -> str:
    return f"{p['size']} {p['context']:,}"


@renderer("scan_compile.page")
def scan_page(raw: Raw) -> str:
    d = raw.data
    prov, s = provenance(d), d["meta"]["settings"]
    lines = [
        "# `model.scan_layers`: compile time and memory, scanned and unrolled, compiled for "
        "the H100",
        "",
        f"**Compiled.** The trainer's step (clip + AdamW, state donated) for `{s['attention']}`, "
        f"batch {s['batch']}, {s['dtype']} matmuls, the glue kernels at `{s['glue_kernels']}` "
        "(the Pallas kernels, as a GPU run has them), compiled for the H100 on a machine "
        "without a GPU (deviceless XLA; `benchmarks/scan_compile.py`) with the blocks scanned "
        "(`model.scan_layers: true`) and unrolled (`false`, what `auto` picks on a GPU). "
        "Compile seconds are trace + lower + compile, wall and CPU (the process's and its "
        f"ptxas children's), on {s['compile_host']}: read a point's ratio, not the seconds "
        "themselves. Memory is XLA's buffer "
        "assignment; the estimate is the memory plan's (`training/memory_plan.py`, traced for "
        "the H100, nothing compiled), its error (estimate / compiled - 1) beside it. jax "
        f"{prov['jax']}, commit {short(prov['commit'])}, {prov['time']}.",
        "",
    ]
    body = []
    for p in d["points"]:
        body.append([
            f"{p['size']}", f"{p['context']:,}", f"{p['remat']}, {p['loss_chunk']}",
            p["setting"], f"{p['compile_seconds']:,.0f}", f"{p['compile_cpu_seconds']:,.0f}",
            gib(p["memory_bytes"]), gib(p["estimate_bytes"]), f"{p['error']:+.1%}",
            short(p["git_commit"]),
        ])  # fmt: skip
    lines.append(table(["size", "context", "remat, loss chunk", "blocks", "compile s",
                        "compile CPU s", "compiled GiB", "estimate GiB", "error", "commit"],
                       body, "lrllrrrrrl"))  # fmt: skip
    lines += ["", scan_summary(raw), ""]
    lines += plans_section(d.get("plans", []))
    lines += margin_reading(d)
    return "\n".join(lines)


def margin_reading(d: dict) -> list[str]:
    """The plan's margins against the estimates' errors, by setting."""
    s = d["meta"]["settings"]
    margins, budget = s["margins"], s["budget_bytes"]
    parts = []
    for setting in ("scanned", "unrolled"):
        pts = [p for p in d["points"] if p["setting"] == setting]
        if not pts:
            continue
        errs = [p["error"] for p in pts]
        excess = max(p["estimate_bytes"] - p["memory_bytes"] for p in pts)
        parts.append(
            f"{setting}, margin {margins[setting]:.0%}: the estimates err from {min(errs):+.1%} "
            f"to {max(errs):+.1%}, at most {gib(excess)} GiB over the compiled memory "
            f"({excess / budget:.1%} of the H100's budget of {gib(budget, 0)} GiB)"
        )  # fmt: skip
    if not parts:
        return []
    return [
        "The memory plan compiles a candidate whose estimate is at most the budget times 1 + "
        "its margin (`training/memory_plan.py`, the margins when this file was written): "
        + "; ".join(parts) + ".",
        "",
    ]  # fmt: skip


def plans_section(plans: list[dict]) -> list[str]:
    """Each shipped config planned as ``scripts/compile.py`` plans it: the candidates' estimates,
    which were compiled and to what."""
    lines = []
    for p in plans:
        blocks = "scanned" if p["scan_layers"] is True else "unrolled"
        lines += [
            f"## `scripts/compile.py {p['config']} --target {p['target']}` at "
            f"{short(p['git_commit'])}",
            "",
            f"The chosen setting's blocks {blocks} (`auto`), budget {gib(p['budget_bytes'])} GiB per "
            f"device, margin {p['margin']:.0%}: {p['chosen']} chosen "
            f"({'fits' if p['fits'] else 'does NOT fit'}), the plan and its compiles "
            f"{p['compile_seconds']:,.0f} s ({p['compile_cpu_seconds']:,.0f} s CPU), commit "
            f"{short(p['git_commit'])}.",
            "",
        ]  # fmt: skip
        body = [[c["setting"], gib(c["estimate_bytes"]),
                 "not compiled" if c["compiled_bytes"] is None else gib(c["compiled_bytes"]),
                 "" if c["compiled_bytes"] is None
                 else f"{c['estimate_bytes'] / c['compiled_bytes'] - 1:+.1%}"]
                for c in p["candidates"]]  # fmt: skip
        lines += [table(["setting", "estimate GiB", "compiled GiB", "error"], body, "lrrr"), ""]
    return lines


@renderer("scan_compile.summary")
def scan_summary(raw: Raw) -> str:
    """One sentence per point: unrolled against scanned, compile time and memory (docs)."""
    parts = []
    for s, u in _pairs(raw):
        parts.append(
            f"{_point(s)} ({s['n_layer']} layers) compiled in {u['compile_seconds']:,.0f} s "
            f"unrolled against {s['compile_seconds']:,.0f} s scanned "
            f"({u['compile_seconds'] / s['compile_seconds']:.1f}x; CPU "
            f"{u['compile_cpu_seconds'] / s['compile_cpu_seconds']:.1f}x), "
            f"{gib(u['memory_bytes'])} GiB against {gib(s['memory_bytes'])}"
        )  # fmt: skip
    return ("Compiled for the H100 with `LT_chunked`, unrolled against scanned: "
            + "; ".join(parts) + " (`benchmarks/results/scan_compile_h100_compiled.md`).")  # fmt: skip
