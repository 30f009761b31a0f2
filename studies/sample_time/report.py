"""The time to sample a token, KV cache against recurrent state, on the CPU machine
(``sample_time_*.json``, ``scripts/bench_sample.py``)."""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import context_label, how, provenance, short, table


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
