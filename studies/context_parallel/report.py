"""Context parallelism compiled for multi-GPU H100 targets: ``context_parallel_h100x8_compiled.md``
and the README's long-context lines.

Raw file (``benchmarks/context_parallel_compile.py``): ``context_parallel_h100x8_compiled.json``:
per ``configs/long`` point the per-device memory of the compiled training step, the memory
setting chosen, every collective counted from the optimised HLO (kind, mesh axes, launches and
bytes sent per device per step) and the MODEL of the attention's and the parameters' traffic.
"""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, gib, provenance, short, table

GB = 1e9


def _gb(x: float) -> str:
    return f"{x / GB:,.2f}" if x < 100 * GB else f"{x / GB:,.0f}"


def _point(r: dict[str, Any]) -> str:
    docs = ", document resets" if r.get("doc_reset") else ""
    return f"`{r['attention']}` {_size(r)} {context_label(r['context'])}{docs}"


def _size(r: dict[str, Any]) -> str:
    return r["config"].rsplit("/", 1)[-1].split("_", 1)[0]


def _rest(r: dict[str, Any]) -> float:
    return sum(c["sent_bytes"] for c in r["collectives"] if c["where"] != "attention")


def _rows(raw: Raw) -> list[dict[str, Any]]:
    return sorted(raw.data["rows"], key=lambda r: (r["devices"], r["attention"], r["context"]))


def _commits(rows: list[dict[str, Any]]) -> str:
    """The commit each point was compiled at (a point can be compiled again alone)."""
    by: dict[str, list[str]] = {}
    for r in rows:
        by.setdefault(short(r["environment"]["git_commit"]), []).append(_point(r))
    if len(by) == 1:
        return f"commit {next(iter(by))}"
    return "commits " + "; ".join(f"{c} ({', '.join(points)})" for c, points in by.items())


def _table(rows: list[dict[str, Any]]) -> str:
    """One row per point; links relative to ``benchmarks/results/``."""
    header = ["point", "target", "N (seq)", "tokens per GPU", "memory setting", "GiB per GPU",
              "fits 72 GiB", "attention sends, GB", "model (fwd+bwd / +recompute)",
              "other collectives, GB", "model (parameters)"]  # fmt: skip
    body = [
        [f"[{_point(r)}](../../{r['config']})", r["target"], r["context_parallel"],
         f"{r['tokens_per_device']:,}", f"{r['remat']}, loss_chunk={r['loss_chunk']}",
         gib(r["memory"]["total"]), "yes" if r["fits"] else "**no**",
         _gb(r["attention_sent_bytes"]),
         f"{_gb(r['model']['attention_seq'])} / {_gb(r['model']['attention_seq_remat'])}",
         _gb(_rest(r)), _gb(r["model"]["parameters_all"])]
        for r in rows
    ]  # fmt: skip
    return table(header, body, "llrrlrlrrrr")


@renderer("context_parallel.table")
def frontier_table(raw: Raw) -> str:
    """The points' table alone (the memory frontier's page, beside the raw file)."""
    return _table(_rows(raw))


@renderer("context_parallel.page")
def page(raw: Raw) -> str:
    prov = provenance(raw.data)
    rows = _rows(raw)
    # The page leads with its table; how it was compiled follows it.
    out = [
        "# Context parallelism compiled for H100 nodes",
        "",
        _table(rows),
        "",
        "**Compiled, not run.** Each `configs/long/` point's training step (clip + AdamW, bf16, "
        "one sequence per update, parameters sharded with `train.fsdp`) compiled on the CPU "
        "machine for a multi-GPU H100 target (`benchmarks/context_parallel_compile.py`, "
        "deviceless XLA). Memory is one device's, from XLA's buffer assignment, against the "
        "target's 72 GiB budget; the collectives are counted from the optimised program, as the "
        "bytes each device sends per step by the ring algorithms (`experiments/collectives.py`); "
        "the model beside them is MODELLED (the slice states per layer for linear attention, "
        "(N-1)/N of K and V per layer for flash's ring; with rematerialisation the forward's "
        "exchange runs twice). No time here: links' speeds are the GPU's to measure. "
        f"jax {prov['jax']}, {_commits(rows)}.",
        "",
        "Per point, every collective of the step (bytes sent per device per step; `all`: every "
        "device of the mesh; `attention`: inside the attention's `shard_map` over `seq`):",
    ]
    for r in rows:
        out += [
            "",
            f"**{_point(r)}** on {r['target']} ({r['model']['attention_what']}):",
            "",
            table(
                ["collective", "axes", "where", "launches", "operand GB", "sent GB"],
                [
                    [
                        c["kind"],
                        c["axes"],
                        c["where"],
                        c["launches"],
                        _gb(c["operand_bytes"]),
                        _gb(c["sent_bytes"]),
                    ]
                    for c in r["collectives"]
                ],  # fmt: skip
                "lllrrr",
            ),
        ]
    return "\n".join(out)


@renderer("context_parallel.summary")
def summary(raw: Raw) -> str:
    """One line per point for the README: tokens, GPUs, memory per GPU, attention traffic."""
    rows = _rows(raw)
    return "\n".join(
        f"- {_point(r)} over {r['context_parallel']} GPUs ({r['target']}): "
        f"{gib(r['memory']['total'], 1)} GiB per GPU "
        f"({'fits' if r['fits'] else 'does not fit'}), the attention sending "
        f"{_gb(r['attention_sent_bytes'])} GB per GPU per step "
        f"([`{r['config']}`]({r['config']}))"
        for r in rows
    )


@renderer("context_parallel.rings")
def rings(raw: Raw) -> str:
    """``flash_context_h100x8_compiled.json``: one layer's ring attention per context and ring
    layout, compiled for one node: memory, bytes counted and modelled, and the MODEL of the
    busiest device's work."""
    prov = provenance(raw.data)
    body = [
        [context_label(r["context"]), f"{r['per_device_tokens']:,}", f"`{r.get('ring', 'contiguous')}`",
         r["cudnn_calls_in_hlo"], gib(r["memory_bytes"]),
         f"{_gb(r['compiled_ring_bytes']['forward'])} / {_gb(r['compiled_ring_bytes']['backward'])}",
         f"{_gb(r['modelled_ring_bytes']['forward'])} / {_gb(r['modelled_ring_bytes']['backward'])}",
         f"{r['modelled_critical_blocks']:g}" if "modelled_critical_blocks" in r else "n/a"]
        for r in sorted(raw.data["rows"], key=lambda r: (r["context"], r.get("ring", "")))
    ]  # fmt: skip
    header = ["context", "tokens per GPU", "ring", "cuDNN calls", "GiB per GPU",
              "sent GB fwd / bwd (counted)", "model fwd / bwd", "critical path, blocks (model)"]  # fmt: skip
    return "\n".join([
        "**Compiled, not run**: one layer's `flash` attention of the 124M model (batch 1, bf16), "
        "forward + backward, over the 8 GPUs of one node (`benchmarks/flash_context_memory.py`). "
        "The balanced ring (`zigzag`) against the contiguous one: bytes per GPU per layer "
        "counted from the compiled program beside their MODEL, and the MODELLED critical path "
        "(the busiest GPU's attention in [T/N, T/N] blocks, a causal block counting half). "
        f"jax {prov['jax']}, commit {short(prov['commit'])}.",
        "",
        table(header, body, "lrlrrrrr"),
    ])  # fmt: skip
