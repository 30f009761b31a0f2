"""The roofline MODEL of the ``LT_chunked`` kernels: ``kernel_roofline_h100_model.md``.

Raw files (``benchmarks/roofline.py``): ``kernel_roofline_h100_model.json`` (``meta``, per-(T, c)
``summary`` of the three designs, the compiled ``resources`` per design, c and kernel, and the
block-size ``choices``) and ``kernel_roofline_h100_model.csv`` (one row per kernel, design, T and
c: FLOPs, bytes, programs, steps, bound).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import how, provenance, short, table


def _us(x: float) -> str:
    return f"{x:,.1f}"


def _dash(x: Any, thousands: bool = False) -> str:
    return "-" if x is None else f"{x:,}" if thousands else str(x)


def _kept(s: dict[str, Any]) -> str:
    """Where a repriced model's compiled resources came from (``roofline.py --reprice``)."""
    kept = s.get("resources_from")
    return f", compiled at commit {short(kept['commit'])}" if kept else ""


def _what(prov: dict[str, Any]) -> str:
    return "A model, not a measurement" if prov["how"] == "modelled" else how(prov)


@renderer("roofline.page")
def page(model: Raw, kernels: Raw) -> str:
    d, rows = model.data, kernels.data
    s, prov = d["meta"]["settings"], provenance(d)
    res = d["resources"]
    compiled = s.get("compiled", True)
    compiles = {c: isinstance(v, dict) for c, v in res.get("old", {}).items()}
    about = [
        "",
        "## How the model prices",
        "",
        ("**A model, not a measurement.**" if prov["how"] == "modelled" else f"**{how(prov)}.**")
        + " Lower-bound times computed from each "
        "kernel's FLOPs, HBM bytes and launch shape (`linear_gpt2/kernels/lt_chunked/cost.py`): "
        f"the roofline at {s['peak_tflops']:g} TFLOP/s (dense bf16) and {s['peak_tb_per_s']:.2f} "
        f"TB/s, divided by the share of the {s['sms']} SMs the launch can occupy; a sequential "
        "pass pays its steps in sequence (they are one program's work). 'with launches' adds "
        f"{s['launch_us']:g} us per launch ({s.get('launch_origin', 'assumed')}). "
        + (
            f"Registers, shared memory and spills are compile measurements (deviceless, "
            f"T={s['compile_T']}{_kept(s)}); the old kernel's {s['old_kernel_resources']}."
            if compiled
            else "Registers and shared memory were not compiled in this run."
        ),
        "",
        f"B={s['B']}, H={s['H']}, D={s['D']}, {s['dtype']}, {s['pass']}. jax {prov['jax']}, "
        f"commit {short(prov['commit'])}.",
    ]
    # The page leads with its table; how the model prices follows it.
    lines = [
        "# LT_chunked kernels on the H100: a roofline MODEL",
        "",
        f"**{_what(prov)}** (B={s['B']}, H={s['H']}, D={s['D']}, {s['pass']}; how it prices: below).",
        "",
        "## Totals (us): old single pass, chunk-parallel, single pass now",
        "",
        table(
            ["T", "c", "old bound", "chunk bound", "fused bound", "old w/ launches",
             "chunk w/ launches", "fused w/ launches", "chunk min programs", "old / chunk", "auto"],
            [[f"{r['T']:,}", r["c"],
              _us(r["old_bound_us"]) + ("*" if compiled and not compiles.get(str(r["c"])) else ""),
              _us(r["chunk_bound_us"]), _us(r["fused_bound_us"]), _us(r["old_with_launches_us"]),
              _us(r["chunk_with_launches_us"]), _us(r["fused_with_launches_us"]),
              r["chunk_min_programs"], f"{r['old_bound_us'] / r['chunk_bound_us']:.1f}x", r["auto"]]
             for r in d["summary"]],
            "rrrrrrrrrrl",
        ),
    ]  # fmt: skip
    for c, ok in compiles.items():
        if not ok:
            lines += ["", f"\\* the old kernel at c={c} {res['old'][c]} (modelled anyway)."]
    lines += about
    body = []
    for design in sorted(res):
        for c, kernels_ in sorted(res[design].items(), key=lambda kv: int(kv[0])):
            if not isinstance(kernels_, dict):
                body.append([design, c, "-", kernels_, "", ""])
                continue
            for name, k in sorted(kernels_.items()):
                body.append([design, c, name, k["registers"], f"{k['shared_memory']:,}",
                             k["spill_stores"]])  # fmt: skip
    lines += [
        "",
        f"## Compiled resources per kernel (B={s['B']}, T={s['compile_T']:,}, H={s['H']}, "
        f"D={s['D']}, {s['dtype']})",
        "",
        table(
            ["design", "c", "kernel", "registers", "shared memory (B)", "spill stores (B)"],
            body,
            "lrlrrr",
        ),  # fmt: skip
    ]
    for T in sorted({r["T"] for r in d["choices"]}):
        at = [r for r in rows if r["T"] == T and r["c"] == 64]
        if not at:
            continue
        lines += [
            "",
            f"## Per kernel at T={T:,}, c=64",
            "",
            table(
                ["design", "kernel", "programs", "steps", "GFLOP", "MB", "FLOP/B", "SM share",
                 "bound us", "regs", "smem"],
                [[r["design"], r["kernel"], f"{r['programs']:,}", r["steps"],
                  f"{r['flops'] / 1e9:.2f}", f"{r['bytes'] / 1e6:.1f}", r["intensity"],
                  f"{r['sm_share']:.2f}", _us(r["bound_us"]), _dash(r["registers"]),
                  _dash(r["shared_memory"], True)] for r in at],
                "llrrrrrrrrr",
            ),
        ]  # fmt: skip
    if not d["choices"]:
        return "\n".join(lines)
    lines += [
        "",
        "## Block-size choices priced by the model (chunk-parallel, c=64 unless stated)",
        "",
        table(
            ["T", "choice", "value", "chosen", "bound us", "note"],
            [[f"{p['T']:,}", p["choice"], p["value"], "yes" if p["chosen"] else "",
              _us(p["bound_us"]), p["note"]] for p in d["choices"]],
            "rlllrl",
        ),
    ]  # fmt: skip
    return "\n".join(lines)


@renderer("roofline.totals")
def totals(model: Raw, *, c: str = "64", T: str = "4096,16384,131072,524288") -> str:
    """One sentence for docs/attention.md: the old single pass against the chunk-parallel
    kernels at the given lengths."""
    wanted = [int(t) for t in T.split(",")]
    rows = {r["T"]: r for r in model.data["summary"] if r["c"] == int(c)}
    old = ", ".join(f"{rows[t]['old_bound_us']:,.0f} us ({_k(t)})" for t in wanted)
    new = ", ".join(f"{rows[t]['chunk_bound_us']:,.0f}" for t in wanted)
    ratios = [rows[t]["old_bound_us"] / rows[t]["chunk_bound_us"] for t in wanted]
    return (
        f"at c = {c} the old single pass is bounded at {old}; the chunk-parallel kernels at "
        f"{new} us ({min(ratios):.1f}x to {max(ratios):.1f}x lower)."
    )


def _k(t: int) -> str:
    return f"{t // 1024}k"


@renderer("roofline.resources")
def resources(model: Raw, kernels: Raw, *, c: str = "64", T: str = "16384,131072") -> str:
    """The compiled registers and shared memory of each design at one chunk size, the old
    kernels' spills, and the programs the chunk-parallel kernels launch (docs/attention.md)."""
    d = model.data
    res, s = d["resources"], d["meta"]["settings"]

    def kib(b: int) -> str:
        return f"{b / 1024:.0f} KiB"

    chunk = res["chunk"][c]
    fused = res["fused"][c]
    old = {cc: v for cc, v in res.get("old", {}).items()}
    lines = [
        f"At D = {s['D']}, c = {c}, T = {s['compile_T']:,}: "
        + ", ".join(
            f"`{k}` {v['registers']} registers / {kib(v['shared_memory'])} shared"
            for k, v in chunk.items()
        )  # fmt: skip
        + "; single pass: "
        + ", ".join(f"`{k}` {v['registers']}" for k, v in fused.items())
        + " registers; every one with "
        + (
            "0 bytes spilled."
            if all(v["spill_stores"] == 0 for v in [*chunk.values(), *fused.values()])
            else "spills (the roofline page)."
        )  # fmt: skip
    ]
    parts = []
    for cc, kernels_ in sorted(old.items(), key=lambda kv: int(kv[0])):
        if isinstance(kernels_, dict):
            parts.append(
                f"at c = {cc} " + " and ".join(
                    f"{v['registers']} registers ({v['spill_stores']:,} B spilled)"
                    for v in kernels_.values()
                )
            )  # fmt: skip
        else:
            parts.append(f"at c = {cc} {kernels_}")
    if parts:
        lines.append("The old single-pass kernels used " + "; ".join(parts) + ".")
    rows = [r for r in kernels.data if r["design"] == "chunk" and r["c"] == int(c)]
    progs = []
    for t in (int(x) for x in T.split(",")):
        at = {r["kernel"]: r["programs"] for r in rows if r["T"] == t}
        if at:
            progs.append(
                f"at T = {t:,}: " + ", ".join(f"`{k}` {v:,}" for k, v in at.items()
                                              if not k.startswith("xla") and "recomputed" not in k)
            )  # fmt: skip
    if progs:
        lines.append(f"Programs launched at B = {s['B']}, H = {s['H']} " + "; ".join(progs) + ".")
    return " ".join(lines)


# --------------------------------------------------------------------------------------------
# LT_attention_parallel: kernel_roofline_parallel_h100_model.{json,csv}


def _l2(x: float | None) -> str:
    return "any" if x is None else f"{x:.1f} TB/s"


def _measured(s: dict[str, Any]) -> str:
    """The timing ``kernel=pallas``'s tiled backward rests on, as the model file records it."""
    return f"`{Path(s['pallas_measured']).name}`"


@renderer("roofline.parallel_page")
def parallel_page(model: Raw, kernels: Raw) -> str:
    d, rows = model.data, kernels.data
    s, prov = d["meta"]["settings"], provenance(d)
    compiled = s.get("compiled", True)
    about = [
        "",
        "## How the model prices",
        "",
        ("**A model, not a measurement.**" if prov["how"] == "modelled" else f"**{how(prov)}.**")
        + " Lower-bound times from each launch's FLOPs, compulsory HBM bytes, operand traffic "
        "from L2 and programs (`linear_gpt2/kernels/lt_attention_parallel/cost.py`): the largest "
        f"of the FLOPs at {s['peak_tflops']:g} TFLOP/s (dense bf16), the bytes at "
        f"{s['peak_tb_per_s']:.2f} TB/s, and the makespan of the programs on the {s['sms']} SMs "
        "in launch order, each loop step taking the longer of its FLOPs and its tile loads at a "
        f"{s['sms']}th of the peaks, the L2 at {s['l2_tb_per_s']:.1f} TB/s "
        f"({s['l2_assumption']}). 'plain' leaves the L2 term out (unbounded L2, the LT_chunked "
        "page's model). Totals add "
        f"{s['launch_us']:g} us per launch ({s.get('launch_origin', 'assumed')}), XLA's passes "
        "around the kernels included. "
        + (
            "Registers, shared memory, spills and programs are compile measurements "
            f"(deviceless, T={s['compile_T']:,}{_kept(s)})."
            if compiled
            else "Registers and shared memory were not compiled in this run."
        ),
        "",
        f"B={s['B']}, H={s['H']}, block size c={s['c']}, {s['dtype']}, {s['pass']}. jax "
        f"{prov['jax']}, commit {short(prov['commit'])}. `blocked`: the old kernels (one query "
        "block per program, launched shortest first; a backward kernel of two loops); `tiled`: "
        "the new ones (resident blocks, longest first; one backward kernel, dphi(q) by atomic "
        "adds, `pallas_tiled`), at their best tiling; `tiled_dq`: the same forward with "
        "FlashAttention 2's two backward kernels, no atomics (`pallas_tiled_dq`), at theirs. "
        "'auto': what `kernel=pallas` runs, the design the model ranks first, a tiled one with "
        "the two-kernel backward: an H200 timed it faster than the atomic one at every length "
        f"it ran ({_measured(s)}), where this model ranks the atomic one first (it prices "
        "neither the atomics' memory barriers nor the `mma.sync` path of the atomic kernel's "
        "32-row query tiles: `cost.py`). 'L2 crossover': the L2 bandwidth above which the old "
        "total would be below the atomic tiled one's ('any': the tiled total is lower even "
        "with unbounded L2).",
    ]
    # The page leads with its tables; how the model prices follows them.
    lines = [
        "# LT_attention_parallel kernels on the H100: a roofline MODEL",
        "",
        f"**{_what(prov)}** (B={s['B']}, H={s['H']}, c={s['c']}, {s['pass']}; how it prices: below).",
    ]
    for D in sorted({r["D"] for r in d["summary"]}):
        at = [r for r in d["summary"] if r["D"] == D]
        lines += [
            "",
            f"## Totals (us) at D={D}: old and tiled kernels",
            "",
            table(
                ["T", "old", "tiled", "tiled_dq", "old / tiled", "old plain", "tiled plain",
                 "old / tiled plain", "old min programs", "tiled min programs", "tiled tiles",
                 "L2 crossover", "auto"],
                [[f"{r['T']:,}", _us(r["blocked_us"]), _us(r["tiled_us"]),
                  _us(r["tiled_dq_us"]), f"{r['blocked_us'] / r['tiled_us']:.2f}x",
                  _us(r["blocked_plain_us"]), _us(r["tiled_plain_us"]),
                  f"{r['blocked_plain_us'] / r['tiled_plain_us']:.2f}x",
                  f"{r['blocked_min_programs']:,}", f"{r['tiled_min_programs']:,}", r["tiles"],
                  _l2(r["crossover_l2_tb_per_s"]), r["auto"]] for r in at],
                "rrrrrrrrrrlll",
            ),
        ]  # fmt: skip
    lines += about
    res = d["resources"]
    if res:
        body = []
        for design in sorted(res):
            for D, kinds in sorted(res[design].items(), key=lambda kv: int(kv[0])):
                for kind, kernels_ in kinds.items():
                    for name, k in sorted(kernels_.items()):
                        body.append([design, D, kind, name, f"{k['programs']:,}", k["threads"],
                                     k["registers"], f"{k['shared_memory']:,}",
                                     k["spill_stores"]])  # fmt: skip
        lines += [
            "",
            f"## Compiled for the H100 (B={s['B']}, T={s['compile_T']:,}, H={s['H']}, "
            f"c={s['c']}, {s['dtype']})",
            "",
            table(
                ["design", "D", "inputs", "kernel", "programs", "threads", "registers",
                 "shared memory (B)", "spill stores (B)"],
                body,
                "lrllrrrrr",
            ),
        ]  # fmt: skip
    for T in sorted({r["T"] for r in d["choices"]}):
        at = [r for r in rows if r["T"] == T and r["D"] == 64]
        if not at:
            continue
        lines += [
            "",
            f"## Per launch at T={T:,}, D=64",
            "",
            table(
                ["design", "launch", "programs", "steps", "GFLOP", "HBM MB", "L2 MB",
                 "FLOP / L2 B", "SMs busy", "bound us", "plain us"],
                [[r["design"], r["kernel"], f"{r['programs']:,}", f"{r['steps']:,}",
                  f"{r['flops'] / 1e9:.2f}", f"{r['bytes'] / 1e6:.1f}",
                  f"{r['l2_bytes'] / 1e6:,.1f}",
                  "-" if not r["l2_bytes"] else f"{r['intensity']:.0f}",
                  f"{r['busy']:.2f}", _us(r["bound_us"]), _us(r["plain_bound_us"])]
                 for r in at],
                "llrrrrrrrrr",
            ),
        ]  # fmt: skip
    if d["choices"]:
        lines += [
            "",
            "## The tiled design's alternatives priced by the model (D=64, fwd + bwd with "
            "launches)",
            "",
            table(
                ["T", "choice", "value", "chosen", "bound us", "plain us", "note"],
                [[f"{p['T']:,}", p["choice"], p["value"], "yes" if p["chosen"] else "",
                  _us(p["bound_us"]), _us(p["plain_bound_us"]), p["note"]]
                 for p in d["choices"]],
                "rlllrrl",
            ),
        ]  # fmt: skip
    return "\n".join(lines)


@renderer("roofline.parallel_totals")
def parallel_totals(model: Raw, *, D: str = "64", T: str = "4096,16384,131072,524288") -> str:
    """One sentence for docs/attention.md: the old kernels' bound against the tiled ones' at
    the given lengths, with and without the L2 term, and where the model picks which."""
    d = model.data
    s = d["meta"]["settings"]
    rows = {r["T"]: r for r in d["summary"] if r["D"] == int(D)}
    wanted = [int(t) for t in T.split(",") if int(t) in rows]
    old = ", ".join(f"{rows[t]['blocked_us']:,.0f} us ({_k(t)})" for t in wanted)
    new = ", ".join(f"{rows[t]['tiled_us']:,.0f}" for t in wanted)
    ratios = [rows[t]["blocked_us"] / rows[t]["tiled_us"] for t in wanted]
    plain = [rows[t]["blocked_plain_us"] / rows[t]["tiled_plain_us"] for t in wanted]
    dq = ", ".join(f"{rows[t]['tiled_dq_us']:,.0f}" for t in wanted)
    # What kernel=pallas runs (cost.choose, recorded per row): the old kernels where the model
    # ranks them first, else the tiled design with the backward the model file names.
    picked = {t: r["auto"].split(" ")[0] for t, r in rows.items()}
    old_picked = [t for t in sorted(rows) if picked[t] == "pallas_blocked"]
    tiled = ", ".join(sorted({f"`{k}`" for k in picked.values() if k != "pallas_blocked"}))
    cross = {t: rows[t]["crossover_l2_tb_per_s"] for t in wanted}
    bounded = [f"{c:.0f} TB/s ({_k(t)})" for t, c in cross.items() if c is not None]
    return (
        f"at D = {D}, c = {s['c']}, with the L2 at {s['l2_tb_per_s']:.1f} TB/s (assumed), the old "
        f"kernels are bounded at {old}; the tiled ones with the atomic backward at {new} us "
        f"({min(ratios):.2f}x to {max(ratios):.2f}x lower), with the two-kernel backward at "
        f"{dq} us (a sixth dot per tile pair, no atomic adds). Without the L2 term the "
        f"ratios are {min(plain):.2f}x to {max(plain):.2f}x"
        + (
            "; the old kernels' total would be the lower only with an L2 bandwidth above "
            + ", ".join(bounded)
            if bounded
            else ""
        )
        + (
            f". `kernel=pallas` runs the old kernels at {', '.join(_k(t) for t in old_picked)} "
            f"of this table (D = {D}), the tiled forward with the two-kernel backward ({tiled}: "
            f"measured the faster, {_measured(s)}) at every other length."
            if old_picked
            else f". `kernel=pallas` runs the tiled forward with the two-kernel backward "
            f"({tiled}: measured the faster, {_measured(s)}) at every length of this table "
            f"(D = {D})."
        )
    )
