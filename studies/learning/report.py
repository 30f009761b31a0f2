"""The post's context study at CPU scale: ``context_cpu.md`` and its summary in docs/results.md.

Raw files: ``context_cpu.csv`` (``scripts/plot_runs.py``'s ``context_table.csv``: one row per run,
final held-out ``val`` and ``gap`` to ``flash`` of the same seed, ``train_s``, ``spikes``), its
``context_cpu.meta.json`` (where and when, the settings, the counted spikes) and
``published_post.json`` (the post's final train losses).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from studies.common.core import Raw, ReportError, renderer
from studies.common.fmt import table


def _rows(csv: Raw) -> list[dict[str, Any]]:
    return csv.data


def _cell(rows: list[dict[str, Any]], variant: str, context: int, seed: int) -> dict | None:
    found = [r for r in rows if (r["variant"], r["context"], r["seed"]) == (variant, context, seed)]
    return found[0] if found else None


LABELS = {
    "LT_chunked+reset": "LT_chunked + doc_reset",
    "LT_chunked+gate": "LT_chunked + decay: gate",
}


@renderer("context.table")
def context_table(csv: Raw, *, baseline: str) -> str:
    """Final held-out loss per variant (rows) and context (columns), the gap to ``baseline``
    (the post's ``flash``) in parentheses; a context run with a second seed gets a second
    column."""
    rows = _rows(csv)
    variants = list(dict.fromkeys(r["variant"] for r in rows))
    cols = sorted({(r["context"], r["seed"]) for r in rows})
    seeded = {c for c, s in cols if s != 0}
    size = rows[0]["size"]
    steps = rows[0]["steps"]
    body = []
    for v in variants:
        cells = [LABELS.get(v, v)]
        for c, s in cols:
            r = _cell(rows, v, c, s)
            if r is None:
                cells.append("")
            elif v == baseline:
                cells.append(f"{r['val']:.3f}")
            else:
                cells.append(f"{r['val']:.3f} ({r['gap']:+.3f})")
        body.append(cells)
    head = [f"{c} (seed {s})" if c in seeded else str(c) for c, s in cols]
    return table([f"{size}, {steps} updates", *head], body)


def _meta(meta: Raw) -> dict[str, Any]:
    return meta.data["meta"]


@renderer("context.about")
def context_about(csv: Raw, meta: Raw) -> str:
    """Where and when: the sessions, the wall time, the settings."""
    m, rows = _meta(meta), _rows(csv)
    env, s = m["environment"], m["settings"]
    first = m["sessions"][0]
    t0, t1 = (
        datetime.fromisoformat(first[k].replace("Z", "+00:00")) for k in ("start_utc", "end_utc")
    )
    wall = int((t1 - t0).total_seconds())
    seed0 = [r for r in rows if r["seed"] == 0]
    tokens = s["tokens_per_update"] * s["updates"]
    return "\n".join([
        f"**{m['how'].capitalize()} on the CPU machine** ({env['processor']}, jax "
        f"{env['jax_version']}, no GPU; commit not recorded, see `context_cpu.meta.json`): "
        f"{first['runs']}, **{len(seed0)} runs in {wall // 60} min {wall % 60} s of wall time** "
        f"({first['start_utc']} to {first['end_utc']}, {first['conditions']}); per run "
        f"{min(r['train_s'] for r in seed0):.0f}-{max(r['train_s'] for r in seed0):.0f} s of "
        "training steps plus start-up and evaluation."
        + "".join(
            f" Then {x['runs']} ({x['start_utc']} to {x['end_utc']}, {x['conditions']}), which "
            "measure the seed-to-seed spread."
            for x in m["sessions"][1:]
        ),
        "",
        f"Settings: {s['model']}, {s['data']}; contexts "
        f"{', '.join(str(c) for c in s['contexts'])} at a constant {s['tokens_per_update']} "
        f"tokens per update, {s['updates']} updates ({tokens / 1e3:.0f}k tokens), "
        f"{s['optimizer']}; {s['evaluation']}.",
    ])  # fmt: skip


def _gaps(rows: list[dict[str, Any]], variant: str, seed: int = 0) -> list[tuple[int, float]]:
    return sorted(
        (r["context"], r["gap"]) for r in rows if r["variant"] == variant and r["seed"] == seed
    )


@renderer("context.reading")
def context_reading(csv: Raw, post: Raw, *, size: str = "124M") -> str:
    """The findings, computed: the plain gap per context against the post's, and the spread
    between seeds where a cell has two."""
    rows = _rows(csv)
    plain = _gaps(rows, "LT_chunked")
    by_family = post.data["final_train_loss"][size]  # the post's losses by family
    theirs = sorted(
        (int(c), by_family["linear"][c] - by_family["softmax"][c])
        for c in by_family["softmax"]
        if c in by_family["linear"]
    )
    lines = [
        "- Plain `LT_chunked`'s gap to `flash`: "
        + " / ".join(f"{g:+.3f}" for _, g in plain)
        + " at "
        + " / ".join(str(c) for c, _ in plain)
        + f". The post's ({size}; {post.data['meta']['settings']['learning']}): "
        + ", ".join(f"{g:+.3f} at {c:,}" for c, g in theirs)
        + ".",
    ]
    spread = []
    for v in dict.fromkeys(r["variant"] for r in rows):
        pair = sorted(
            (r["seed"], r["val"]) for r in rows if r["variant"] == v and r["context"] == 128
        )
        if len(pair) == 2:
            spread.append(f"{LABELS.get(v, v)} {pair[0][1]:.3f} -> {pair[1][1]:.3f}")
    if spread:
        lines.append("- Seed 0 -> seed 1 at 128: " + "; ".join(spread) + ".")
    return "\n".join(lines)


@renderer("context.spikes")
def context_spikes(csv: Raw, meta: Raw) -> str:
    """The counted spikes, each with its losses, checked against the CSV's counts."""
    rows, spikes = _rows(csv), _meta(meta)["spikes"]
    counted = {r["name"]: r["spikes"] for r in rows}
    listed: dict[str, int] = {}
    for s in spikes:
        listed[s["name"]] = listed.get(s["name"], 0) + 1
    if {k: v for k, v in counted.items() if v} != listed:
        raise ReportError(
            f"{meta.path}: its spikes ({listed}) disagree with the CSV's spikes column "
            f"({ {k: v for k, v in counted.items() if v} }); fix one of them"
        )
    parts = [
        f"`{s['name']}` at update {s['update']} ({' -> '.join(f'{x:.2f}' for x in s['losses'])})"
        for s in spikes
    ]
    return (
        f"**Spikes** ({_meta(meta)['settings']['spike_counter']}; `spikes` in `context_cpu.csv`): "
        f"{len(spikes)} in the {len(rows)} runs: " + "; ".join(parts) + "."
    )
