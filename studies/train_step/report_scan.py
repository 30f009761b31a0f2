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
    margins = s["margins"]
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
    errs = [p["error"] for p in d["points"] if p["setting"] == "unrolled"]
    if errs:
        lines += [
            f"The memory plan compiles a candidate whose estimate is at most the budget "
            f"times 1 + its margin: {margins['scanned']:.0%} for a scanned step, "
            f"{margins['unrolled']:.0%} for an unrolled one when this file was written. The "
            f"unrolled estimates here err from {min(errs):+.1%} to {max(errs):+.1%}.",
            "",
        ]
    return "\n".join(lines)


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
