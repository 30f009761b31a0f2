"""The data pipeline's throughput on the CPU machine: the loader, the shards' validation
(``data_throughput.json``, ``benchmarks/bench_data.py``)."""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import how, provenance, short, table


@renderer("data_throughput.page")
def data_page(raw: Raw) -> str:
    d = raw.data
    m, prov = d["machine"], provenance(d)
    rows = d["results"]
    before = (d.get("compared_with") or {}).get("results") or {}
    ref = d["reference_tokens_per_s"]
    header = [
        "measurement",
        "tokens",
        "seconds",
        "tokens/s",
        f"x {ref // 1000}k ({d['reference']})",
    ]
    if before:
        header += ["before: tokens/s", "change"]
    body = []
    for name, r in rows.items():
        row = [name, f"{r['tokens']:,}", f"{r['seconds']:.3g}", f"{r['tokens_per_s']:,.0f}",
               f"{r['tokens_per_s'] / ref:.2f}"]  # fmt: skip
        if before:
            old = before.get(name, {}).get("tokens_per_s")
            row += [f"{old:,.0f}", f"{r['tokens_per_s'] / old - 1:+.1%}"] if old else ["-", "new"]
        body.append(row)
    lines = [
        "# Data pipeline throughput"
        + (" (--tiny)" if d.get("tiny") else "")
        + (f": {d['label']}" if d.get("label") else ""),
        "",
        f"**{how(prov)}** on the CPU machine ({m['cpu_count']} CPUs, "
        f"{m['processor']}, no GPU), Python {m['python']}, jax {prov['jax']}, commit "
        f"{short(prov['commit'])}, {prov['time']}. Each rate is the best of {d['repeats']} runs"
        + (f"; `before`: {d['compared_with']['file']}." if before else "."),
        f"Versions: {', '.join(f'{k} {v}' for k, v in m['versions'].items())}.",
        "",
        table(header, body, "lrrrrrr"[: len(header)]),
    ]
    scans = [r for k, r in rows.items() if k.startswith("shards: first open")]
    if scans:
        rate = max(r["tokens_per_s"] for r in scans)
        lines += [
            "",
            f"Shard validation scans {rate / 1e9:.2g}e9 tokens/s ({rate * 2 / 1e9:.2g} GB/s, from "
            f"the page cache): {1e10 / rate:.2g} s per 10^10 tokens, once per shard; later opens "
            "of unchanged shards only stat them. The loader rows time batches after the open, so "
            "validation does not enter them.",
        ]
    if before:
        lines += [
            "",
            "The encode and prepare_split rows run the same tokenization before and after; their "
            "differences show the run-to-run noise of this shared machine.",
        ]
    return "\n".join(lines)


@renderer("data_throughput.validation")
def data_validation(raw: Raw) -> str:
    """The shard-validation rate in one sentence (docs/training.md)."""
    rows = raw.data["results"]
    rate = max(r["tokens_per_s"] for k, r in rows.items() if k.startswith("shards: first open"))
    return (
        f"Validation scans {rate / 1e9:.2g}e9 tokens/s from the page cache on the "
        f"{raw.data['machine']['cpu_count']}-core CPU machine (the best of {raw.data['repeats']} "
        "runs; `benchmarks/results/data_throughput.md`)."
    )
