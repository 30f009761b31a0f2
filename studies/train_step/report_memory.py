"""Memory of the training step: the frontier compiled for the H100, the check of compiled
against real memory on the device, the learning-study configs and the forgetting step.

Raw files: ``memory_frontier_*_compiled.json`` (``scripts/bench_step.py --target``: ``points``
per attention x size x context with the setting ``auto`` chose and every setting ``tried``),
``memory_check_*.json`` (``benchmarks/gpu_memory_check.py``), ``configs_*_compiled.json``
(``benchmarks/compile_configs.py``) and ``forget_memory_*_compiled.json``
(``benchmarks/forget_memory.py``).
"""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, block, renderer
from studies.common.fmt import (
    GiB,
    context_label,
    gib,
    how,
    provenance,
    short,
    table,
)

SIZES = ("124M", "355M", "774M", "1.6B")


def frontier_page(json_name: str) -> str:
    """A new frontier page: how it was compiled, then the table."""
    return "\n".join([
        "# Memory frontier: largest context whose training step fits",
        "",
        block("frontier.about", json_name),
        "Each cell: our largest power-of-two context (memory there, the setting `auto` chose) / "
        "the post's largest; `>=`: a lower bound, the next doubling was not compiled.",
        "",
        block("frontier.table", json_name),
    ])  # fmt: skip


def _label(remat: str, loss_chunk: int) -> str:
    """The ``tried`` labels of the frontier (``memory_plan.label``)."""
    return f"loss_chunk={loss_chunk} remat={remat}"


def _frontier_cells(data: dict[str, Any]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per (attention, size): the largest context that fits, its point, and whether it is a
    lower bound (the next doubling was not compiled, and it is not the longest context tried)."""
    points = data["points"]
    longest = max(p["context"] for p in points)
    by = {(p["attention"], p["size"], p["context"]): p for p in points}
    out = {}
    for name, sizes in data["limits"].items():
        for size, ctx in sizes.items():
            if not ctx:
                continue
            bound = ctx < longest and (name, size, 2 * ctx) not in by
            out[(name, size)] = {"context": ctx, "point": by[(name, size, ctx)], "bound": bound}
    return out


@renderer("frontier.table")
def frontier_table(raw: Raw, *, style: str = "full") -> str:
    """Largest power-of-two context whose step fits, per attention x size, with its memory and
    the setting ``auto`` chose, beside the post's longest (``post_frontier``). A ``>=`` cell
    is a lower bound: the next doubling was not compiled."""
    data = raw.data
    cells = _frontier_cells(data)
    post = data.get("post_frontier", {})
    names = sorted(
        data["limits"],
        key=lambda n: list(post.get("124M", {})).index(n) if n in post.get("124M", {}) else 99,
    )
    if style == "compact":  # the README's: most capable first
        names = sorted(names, key=lambda n: -sum(1 for s in SIZES if (n, s) in cells))
    sizes = [s for s in SIZES if any(p["size"] == s for p in data["points"])]
    body = []
    for name in names:
        row = [f"`{name}`"]
        for size in sizes:
            cell, theirs = cells.get((name, size)), post.get(size, {}).get(name)
            if cell is None:
                row.append("" if style == "compact" else f"- / {_ctx(theirs)}")
                continue
            p = cell["point"]
            mark = ">= " if cell["bound"] else ""
            chunk = f", loss chunk {p['loss_chunk']}" if p["loss_chunk"] else ""
            if style == "compact":
                row.append(f"{mark}{_ctx(cell['context'])}: {gib(p['memory_bytes'], 1)} GiB, "
                           f"{p['remat']} / {_ctx(theirs)}")  # fmt: skip
            else:
                row.append(f"{mark}{_ctx(cell['context'])} ({gib(p['memory_bytes'], 1)} GiB, "
                           f"{p['remat']}{chunk}) / {_ctx(theirs)}")  # fmt: skip
        body.append(row)
    return table(["attention", *sizes], body)


def _ctx(n: int | None) -> str:
    return context_label(n) if n else "-"


@renderer("frontier.about")
def frontier_about(raw: Raw) -> str:
    """How the frontier was compiled, and from which commits its points come."""
    data = raw.data
    meta, prov = data["meta"], provenance(data)
    s = meta["settings"]
    commits: dict[str, list[str]] = {}
    for p in data["points"]:
        commits.setdefault(short(p.get("git_commit")), [])
        if p["attention"] not in commits[short(p.get("git_commit"))]:
            commits[short(p.get("git_commit"))].append(p["attention"])
    by_commit = "; ".join(
        f"{', '.join(f'`{n}`' for n in names)} at {c}" for c, names in commits.items()
    )
    tried = {p["context"] for p in data["points"]}
    return (
        f"**{how(prov)}** for the `{s['target']}` target on a machine without a GPU "
        f"(XLA's GPU compiler, deviceless; no step was run): batch {s['batch']}, {s['dtype']}, "
        f"AdamW, the trainer's step, memory settings `auto` (the cheapest that fits "
        f"{s['budget_gib']:g} GiB per device). jax {prov['jax']}; the file was last written at "
        f"{short(prov['commit'])}, {prov['time']}. Each point records the commit it was "
        f"compiled at (`git_commit`): {by_commit}. Contexts tried: "
        f"{context_label(min(tried))} to {context_label(max(tried))}."
    )


@renderer("memory_check.table")
def memory_check_table(raw: Raw) -> str:
    """Compiled memory against the allocator's peak, per point (``benchmarks/gpu_memory_check.py``)."""
    body = []
    for r in raw.data["rows"]:
        if r.get("status") != "ok":
            body.append([r["attention"], r["size"], r["context"], r["remat"], r["loss_chunk"],
                         r.get("chunk_size", ""), "", "", "", "", f"{r.get('status')}"])  # fmt: skip
            continue
        comp, peak = r["compiled_bytes"], r["peak_bytes_in_use"]
        body.append([
            r["attention"], r["size"], r["context"], r["remat"], r["loss_chunk"],
            r.get("chunk_size") or "", gib(comp), gib(peak),
            "no peak (a CPU)" if peak is None or comp is None else f"{peak - comp:,}",
            f"{r['median_ms']:.1f}", "" if r["loss"] is None else f"{r['loss']:.3f}",
        ])  # fmt: skip
    return table(
        ["attention", "size", "context", "remat", "loss_chunk", "chunk", "compiled GiB",
         "peak GiB", "peak - compiled (bytes)", "step ms", "loss"],
        body,
    )  # fmt: skip


@renderer("memory_check.about")
def memory_check_about(raw: Raw) -> str:
    meta, prov = raw.data["meta"], provenance(raw.data)
    s = meta["settings"]
    return (
        f"**{how(prov)}** on one {prov['device']} (jax {prov['jax']}, commit "
        f"{short(prov['commit'])}), one process per point, allocator share "
        f"{_share(s.get('allocator_fraction'))}. Batch {s['batch']}, {s['dtype']}, AdamW; "
        "`compiled`: XLA's buffer assignment on the device (arguments + outputs + temporaries "
        "- donated aliases), the figure that compiling for the H100 without one reports; "
        "`peak`: the allocator's `peak_bytes_in_use` over the warm-up and the timed steps. "
        f"Times: the median of {s['steps_timed']} steps after {s['warmup']} warm-up."
    )


def _share(fraction: float | None) -> str:
    return "not recorded" if fraction is None else f"{fraction:.0%} of the card"


def _deviceless(frontier: dict[str, Any], r: dict[str, Any]) -> int | None:
    """The deviceless compile of the memory check's point, at the same setting: the row's own
    ``deviceless_bytes`` where it records one (the compile of the code the device ran; the
    frontier's point may since have been recompiled with other code), else the frontier's."""
    if r.get("deviceless_bytes") is not None:
        return r["deviceless_bytes"]
    for p in frontier["points"]:
        if (p["attention"], p["size"], p["context"]) == (r["attention"], r["size"], r["context"]):
            found = dict(p["tried"]).get(_label(r["remat"], r["loss_chunk"]))
            if found:
                return found
    return None


@renderer("memory_check.vs_deviceless")
def vs_deviceless(check: Raw, frontier: Raw) -> str:
    """Per point: the deviceless compile (CPU machine), the compile on the device, the real
    peak."""
    body = []
    for r in check.data["rows"]:
        if r.get("status") != "ok":
            continue
        setting = r["remat"] + (f", loss_chunk {r['loss_chunk']}" if r["loss_chunk"] else "")
        body.append([
            r["attention"], f"{r['context']:,}", setting, gib(_deviceless(frontier.data, r)),
            gib(r["compiled_bytes"]), gib(r["peak_bytes_in_use"]),
        ])  # fmt: skip
    return table(
        [f"attention, {check.data['rows'][0]['size']}", "context", "setting",
         "deviceless compile (CPU machine), GiB", "compiled on the device, GiB",
         "real peak on the device, GiB"],
        body,
    )  # fmt: skip


@renderer("memory_check.reading")
def memory_check_reading(check: Raw, frontier: Raw) -> str:
    """What the check shows, computed: the peak against the device's compile, the deviceless
    compile against both, and the offload points."""
    rows = [r for r in check.data["rows"] if r.get("status") == "ok"]
    extra = [r["peak_bytes_in_use"] - r["compiled_bytes"] for r in rows]
    plain = [r for r in rows if r["remat"] != "offload"]
    off = [r for r in rows if r["remat"] == "offload"]
    err = [
        abs(_deviceless(frontier.data, r) - r["compiled_bytes"]) / r["compiled_bytes"]
        for r in plain
    ]
    same = min(extra) == max(extra)
    lines = [
        f"- The allocator's peak is {min(extra):,}"
        + ("" if same else f" to {max(extra):,}")
        + " bytes above what XLA's buffer assignment reports on the device, at every point: the "
        f"compiled figure is the step's memory to within {max(extra) / 1e3:.1f} kB.",
        f"- The deviceless compile agrees within {max(err):.2%} at the {len(plain)} points "
        "without host offload.",
    ]
    for r in off:
        d = _deviceless(frontier.data, r)
        lines.append(
            f"- With host offload ({r['attention']}, {r['context']:,} tokens) it is "
            f"{(r['compiled_bytes'] - d) / GiB:.1f} GiB low "
            f"({(r['compiled_bytes'] - d) / r['compiled_bytes']:.0%}): the device's compiler "
            "keeps more on the GPU than the deviceless one plans, so offload points of the "
            f"compiled frontier are lower bounds. The step ran at {r['median_ms'] / 1e3:.2f} s."
        )
    return "\n".join(lines)


@renderer("configs.table")
def configs_table(raw: Raw) -> str:
    """Per-device memory of each learning-study config compiled for a node, with the commit and
    ``auto``'s choices each row records and, where the file keeps them (``before``), the rows
    it replaced beside the new ones."""
    meta, prov = raw.data["meta"], provenance(raw.data)
    rows, before = raw.data["rows"], raw.data.get("before")
    commits = sorted({short(r.get("git_commit")) for r in rows})
    lines = [
        f"{meta['target']}. **{how(prov)}**: the trainer's step compiled for the "
        f"target on a machine without a GPU (deviceless XLA); jax {prov['jax']}, commit "
        f"{short(prov['commit'])}, {prov['time']}; rows compiled at {', '.join(commits)}. "
        f"Kernel design: {meta.get('settings', {}).get('kernel_design', 'not recorded')}"
        + (f" ({_designs(rows)})" if _designs(rows) else "")
        + ". Blocks and glue: `auto`'s choices for the target as each row records them (the "
        "glue: LayerNorm, bias + GELU, bias gradient, cross-entropy)."
        + (f" Before: {before['note']}." if before else ""),
        "",
    ]
    old = {r["config"]: r for r in before["rows"]} if before else {}
    head = ["config", "context", "micro-batch x devices x accum", "remat", "loss chunk",
            "blocks", "glue", "GiB per device", "fits"]  # fmt: skip
    if before:
        head += ["before: remat, loss chunk", "before: GiB per device", "change"]
    body = []
    for r in sorted(rows, key=lambda r: r["config"]):
        if "error" in r:
            row = [r["config"], "", "", "", "", "", "", f"error: {r['error']}", "no"]
        else:
            row = [r["config"], r["context"], f"{r['micro_batch']} x {r['devices']} x {r['accum']}",
                   r["remat"], r["loss_chunk"], *_choices(r.get("choices")),
                   gib(r["memory_bytes"]), "yes" if r["fits"] else "no"]  # fmt: skip
        if before:
            b = old.get(r["config"])
            if b is None or "error" in b:
                row += ["", f"error: {b['error']}" if b else "not compiled", ""]
            else:
                row += [f"{b['remat']}, {b['loss_chunk']}", gib(b["memory_bytes"]),
                        "" if "error" in r else _rel(b["memory_bytes"], r["memory_bytes"])]  # fmt: skip
        body.append(row)
    return "\n".join(lines) + table(head, body)


def _choices(c: dict[str, Any] | None) -> tuple[str, str]:
    """A row's blocks (scanned / unrolled) and glue kernels: ``pallas`` or ``xla`` where all four
    agree, else each named; ``not recorded`` for rows compiled before they were."""
    if not c:
        return "not recorded", "not recorded"
    glue = {k: c[f"{k}_kernel"] for k in ("layernorm", "mlp", "bias", "loss")}
    same = set(glue.values())
    return (
        "scanned" if c["scan_layers"] else "unrolled",
        same.pop() if len(same) == 1 else ", ".join(f"{k} {v}" for k, v in glue.items()),
    )


def _bytes(d: dict[str, Any]) -> float:
    """A step's memory: ``memory_bytes``, or ``memory_gib`` where only GiB were recorded."""
    return d["memory_bytes"] if d.get("memory_bytes") is not None else d["memory_gib"] * GiB


def _designs(rows: list[dict[str, Any]]) -> str:
    """``LT_chunked``: pallas_chunk, ...: the kernel design per attention, where rows record it."""
    seen: dict[str, list[str]] = {}
    for r in rows:
        if r.get("kernel_design"):
            seen.setdefault(r["attention"], [])
            if r["kernel_design"] not in seen[r["attention"]]:
                seen[r["attention"]].append(r["kernel_design"])
    return "; ".join(f"`{a}`: {', '.join(d)}" for a, d in seen.items())


@renderer("forget_memory.page")
def forget_page(raw: Raw) -> str:
    """The step with resets and gates against the plain one at the setting ``auto`` chose, then
    every setting compiled, then the figures before ``c_gate``'s fix."""
    d, prov = raw.data, provenance(raw.data)
    s, rows = d["meta"]["settings"], d["rows"]
    budget = s["budget_gib"]
    lines = [
        "# 124M training step with forgetting: compiled memory for the H100",
        "",
        f"**{how(prov)}** for the H100 on a CPU machine (deviceless, "
        "`compile_step.compile_train_step`: XLA's buffer assignment of the H100 program, nothing "
        f"run) with the code of commit {short(prov['commit'])}, jax {prov['jax']}. Batch "
        f"{s['batch']}, {s['dtype']}, AdamW, `{s['attention']}` with `kernel: {s['kernel']}` (the "
        "Pallas kernels), the auto memory settings (`remat`, `loss_chunk`) resolved against the "
        f"{budget:g} GiB budget; `{s['command']}`.",
        "",
        table(
            ["context", f"plain {s['attention']}", "+ doc_reset + decay gate", "difference",
             "settings (plain / forget)", f"fits {budget:g} GiB"],
            [[f"{r['context']:,}", f"{gib(_bytes(r['plain']))} GiB",
              f"{gib(_bytes(r['forget']))} GiB", _rel(_bytes(r['plain']), _bytes(r['forget'])),
              f"{r['plain']['setting']} / {r['forget']['setting']}",
              f"{_yes(r['plain']['fits'])} / {_yes(r['forget']['fits'])}"] for r in rows],
        ),
        "",
        "Every setting compiled (the auto ladder, cheapest first, from the rung given: "
        + ", ".join(f"{int(c):,} tokens from rung {n}" for c, n in s["start_rung"].items())
        + "; `training/memory_plan.py`):",
        "",
        table(
            ["context", "setting", f"plain {s['attention']}", "+ doc_reset + decay gate",
             "difference"],
            [[f"{r['context']:,}", name, f"{gib(a)} GiB", f"{gib(b)} GiB", _rel(a, b)]
             for r in rows for name, a, b in _both_tried(r)],
        ),
    ]  # fmt: skip
    e = d["meta"].get("earlier")
    if e:
        plain = {r["context"]: _bytes(r["plain"]) for r in rows}
        parts = []
        for c, g in e["forget_memory_gib"].items():
            over = " (over the budget)" if e.get("over_budget", {}).get(c) else ""
            setting = e.get("forget_setting", {}).get(c)
            parts.append(
                f"{g:.2f} GiB at {int(c):,} tokens ({_rel(plain[int(c)], g * GiB)}"
                + (f", {setting}" if setting else "")
                + f"){over}"
            )
        a = e["attention_alone"]
        lines += [
            "",
            f"Earlier, {e['what']}, the step with forgetting compiled to {' and '.join(parts)}. "
            f"The attention alone ({a['what']}): {a['plain_gib']:.2f} GiB plain, "
            f"{a['forget_gib']:.2f} GiB with resets and log-gates.",
        ]
    return "\n".join(lines)


def _tried(d: dict[str, Any]) -> list[tuple[str, float]]:
    """Every setting compiled, in bytes (``tried``; ``tried_gib`` where only GiB were kept)."""
    if "tried" in d:
        return [(n, b) for n, b in d["tried"]]
    return [(n, g * GiB) for n, g in d["tried_gib"]]


def _both_tried(r: dict[str, Any]) -> list[tuple[str, float, float]]:
    forget = dict(_tried(r["forget"]))
    return [(n, a, forget[n]) for n, a in _tried(r["plain"]) if n in forget]


def _rel(a: float, b: float) -> str:
    return f"{(b - a) / a:+.1%}"


def _yes(x: bool) -> str:
    return "yes" if x else "no"
