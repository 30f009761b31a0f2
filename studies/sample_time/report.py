"""Results measured on the CPU machine: a config's step time at two commits, the data
pipeline's throughput, and the time to sample a token.

Raw files: ``ab_step_time_*.json`` (``benchmarks/ab_step_time.py``), ``data_throughput.json``
(``benchmarks/bench_data.py``) and ``sample_time_*.json`` (``scripts/bench_sample.py``).
"""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, how, provenance, short, table


@renderer("ab_step_time.page")
def ab_page(raw: Raw) -> str:
    d = raw.data
    prov = provenance(d)
    base, this = d["base_commit"], d["this_commit"]
    load = ", ".join(f"{x:.1f}" for x in d["load_average"])
    return "\n".join([
        f"# CPU step time of `{d['config']}`: {short(this)} against {short(base)}",
        "",
        f"**{how(prov)}** on this CPU machine ({d['cpus']} cores, load average "
        f"{load} at the end, {d['time_utc']}), no GPU, jax {prov['jax']}: `scripts/train.py` at "
        f"each commit in turn, {d['rounds']} rounds of {d['steps']} steps, the first "
        f"{d['skip']} of each run left out. Milliseconds per step: 25th / 50th / 75th "
        "percentile over all pooled steps.",
        "",
        table(
            ["commit", "p25", "median", "p75"],
            [[f"base {short(base)}", *(f"{x:.2f}" for x in d["base_ms"])],
             [f"this {short(this)}", *(f"{x:.2f}" for x in d["this_ms"])]],
            "lrrr",
        ),  # fmt: skip
        "",
        f"Ratio of medians this / base: **{d['ratio_of_medians']:.3f}**; per round: "
        + ", ".join(f"{r:.3f}" for r in d["round_ratios"])
        + ".",
    ])  # fmt: skip


@renderer("ab_step_time.ratio")
def ab_ratio(raw: Raw) -> str:
    """One sentence: the ratio, for the README."""
    d = raw.data
    return (
        f"The default run's CPU step time at {short(d['this_commit'])} against "
        f"{short(d['base_commit'])}: {d['ratio_of_medians']:.2f} this / base, {d['rounds']} "
        "rounds side by side, per round " + ", ".join(f"{r:.2f}" for r in d["round_ratios"]) + "."
    )


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


@renderer("sample_time.page")
def sample_page(raw: Raw) -> str:
    d = raw.data
    meta, prov = d["meta"], provenance(d)
    rows = d["rows"]
    decoders = list(dict.fromkeys(r["decoder"] for r in rows))
    by = {(r["decoder"], r["context"]): r for r in rows}
    body = []
    for ctx in sorted({r["context"] for r in rows}):
        cells = []
        for dec in decoders:
            r = by.get((dec, ctx))
            cells.append(
                "" if r is None else "OOM" if r["status"] != "ok" else f"{r['median_ms']:.3g}"
            )
        body.append([context_label(ctx), *cells])
    s = meta.get("settings", {})
    slopes = ", ".join(
        f"{k}: {v:.2f}" if v is not None else f"{k}: n/a" for k, v in d["slopes"].items()
    )
    return "\n".join([
        f"# Time to sample the next token (ms), {meta.get('title', '')}".rstrip(", "),
        "",
        table(["context", *decoders], body),
        "",
        f"Fitted log-log slopes (time ~ context^slope): {slopes}",
        "",
        f"**{how(prov)}** on {prov['device']}, jax {prov['jax']}, commit "
        f"{short(prov['commit'])}, {prov['time']}: the median over {s.get('rounds')} interleaved "
        f"rounds of {s.get('steps')} tokens, batch {s.get('batch')}, {s.get('dtype')}.",
    ])  # fmt: skip
