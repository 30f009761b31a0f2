"""Step time on a device beside the post's: the tables and sentences of
``benchmarks/results/step_time_h100_measured.md`` and the README's headline table.

Raw files: ``step_time_*.json`` (``scripts/bench_step.py``: ``meta``, ``results`` with
``median_ms`` per attention x size x context), ``memory_check_*.json``
(``benchmarks/gpu_memory_check.py``: one step per process, ``rows``) and ``published_post.json``
(the post's figures, ``step_time_ms[size][attention][context]``).
"""

from __future__ import annotations

from typing import Any

from studies.common.core import Raw, ReportError, renderer
from studies.common.fmt import context_label, gib, provenance, short, table


def _split(raws: tuple[Raw, ...]) -> tuple[list[Raw], dict[str, Any]]:
    """The step-time files and the post's figures (the raw file with ``step_time_ms``)."""
    post = [r for r in raws if "step_time_ms" in r.data]
    if len(post) != 1:
        raise ReportError(
            "a step-time block needs exactly one published_post.json among its raw files; "
            "add it to the marker"
        )
    return [r for r in raws if r is not post[0]], post[0].data["step_time_ms"]


def _results(files: list[Raw]) -> list[dict[str, Any]]:
    return [r for f in files for r in f.data.get("results", [])]


def _post(post: dict[str, Any], size: str, attention: str, context: int) -> Any:
    return post.get(size, {}).get(attention, {}).get(str(context))


def _ms(x: float) -> str:
    """Milliseconds as the tables print them: one decimal below 1000, none above."""
    return f"{x:.1f}" if x < 1000 else f"{x:.0f}"


def _post_ms(v: Any) -> str:
    return "OOM" if v == "oom" else "—" if v is None else f"{v:g}"


def _ok(r: dict[str, Any]) -> bool:
    return r.get("status") == "ok" and r.get("median_ms") is not None


@renderer("step_time.vs_post")
def vs_post(*raws: Raw, size: str, attentions: str | None = None) -> str:
    """Ours / the post's per attention (rows) and context (columns), with the post's time over
    ours: above 1 ours is faster. ``attentions``: comma-separated, default every one timed."""
    files, post = _split(raws)
    rows = [r for r in _results(files) if r["size"] == size]
    names = (
        attentions.split(",") if attentions else list(dict.fromkeys(r["attention"] for r in rows))
    )
    contexts = sorted({r["context"] for r in rows if r["attention"] in names})
    by = {(r["attention"], r["context"]): r for r in rows}
    fractions = {
        f.data["meta"]["settings"].get("allocator_fraction") for f in files
        if any(r["size"] == size for r in f.data.get("results", []))
    }  # fmt: skip
    body = []
    for name in names:
        cells = [f"`{name}`"]
        for c in contexts:
            r, p = by.get((name, c)), _post(post, size, name, c)
            if r is None:
                cells.append("" if p is None else f"— / {_post_ms(p)}")
            elif _ok(r):
                speed = f" ({p / r['median_ms']:.2f}x)" if isinstance(p, (int, float)) else ""
                cells.append(f"**{_ms(r['median_ms'])}** / {_post_ms(p)}{speed}")
            else:
                share = ", ".join(f"{x:.0%} allocator" for x in sorted(fractions) if x)
                what = r["status"].upper() + (f" ({share})" if share else "")
                cells.append(f"{what} / {_post_ms(p)}")
        body.append(cells)
    return table(["attention", *(context_label(c) for c in contexts)], body)


@renderer("step_time.files")
def files_table(*raws: Raw) -> str:
    """Where each timing file came from: device, commit, jax, the steps each median is of, the
    allocator share and what ``auto`` chose for the memory settings."""
    body = []
    for f in raws:
        prov, meta = provenance(f.data), f.data.get("meta", {})
        s = meta.get("settings", {})
        rows = f.data.get("results", f.data.get("rows", []))
        sizes = ", ".join(dict.fromkeys(r["size"] for r in rows))
        settings = {(r.get("remat"), r.get("loss_chunk")) for r in rows if r.get("status") == "ok"}
        given = str(s.get("remat, loss_chunk", "")).startswith("given")
        if all(a is None for a, _ in settings):
            memory = "not recorded"
        else:
            memory = ("given per point: " if given else "") + "; ".join(
                sorted(f"{a}, loss chunk {b}" for a, b in settings if a)
            )
        fraction = s.get("allocator_fraction")
        body.append([
            f"`{f.path}`", prov["how"], sizes, short(prov["commit"]), prov["jax"],
            prov["time"][:10] if prov["time"] else "not recorded",
            f"{s.get('steps_timed')} after {s.get('warmup')}",
            "" if fraction is None else f"{fraction:.0%}", memory,
        ])  # fmt: skip
    return table(
        ["file", "how", "sizes", "commit", "jax", "date", "median of (steps after warm-up)",
         "allocator share", "memory setting (`auto`'s choice)"],
        body,
    )  # fmt: skip


@renderer("step_time.larger")
def larger(*raws: Raw) -> str:
    """``flash`` against ``LT_chunked`` per size and context, ours and the post's."""
    files, post = _split(raws)
    by = {(r["size"], r["attention"], r["context"]): r for r in _results(files) if _ok(r)}
    keys = sorted({(s, c) for s, a, c in by}, key=lambda k: (_size_order(k[0]), k[1]))
    body = []
    for size, c in keys:
        f, lt = by.get((size, "flash", c)), by.get((size, "LT_chunked", c))
        pf, pl = _post(post, size, "flash", c), _post(post, size, "LT_chunked", c)
        if not (f and lt):
            continue
        body.append([
            size, f"{c:,}", _ms(f["median_ms"]), _ms(lt["median_ms"]),
            f"{lt['median_ms'] / f['median_ms']:.3f}", _post_ms(pf), _post_ms(pl),
            f"{pl / pf:.3f}" if isinstance(pf, float) and isinstance(pl, float) else "",
        ])  # fmt: skip
    return table(
        ["model", "context", "flash", "LT_chunked", "LT/flash", "post flash", "post LT_chunked",
         "post LT/flash"],
        body,
    )  # fmt: skip


def _size_order(size: str) -> float:
    return float(size.rstrip("MB")) * (1000 if size.endswith("B") else 1)


def _speedups(files: list[Raw], post: dict[str, Any], names: tuple[str, ...]) -> dict[str, list]:
    """Post / ours per (size group) for ``names``, where both exist."""
    out: dict[str, list] = {}
    for r in _results(files):
        p = _post(post, r["size"], r["attention"], r["context"])
        if r["attention"] in names and _ok(r) and isinstance(p, (int, float)):
            out.setdefault(r["size"], []).append((p / r["median_ms"], r))
    return out


@renderer("step_time.reading")
def reading(*raws: Raw, baseline: str, candidate: str) -> str:
    """The findings the tables support, computed from them: how much faster than the post,
    ``candidate`` (the post's ``LT_chunked``) against ``baseline`` (its ``flash``), and where ours
    is slower than the post."""
    files, post = _split(raws)
    ups = _speedups(files, post, (baseline, candidate))
    base = [x for x, _ in ups.get("124M", [])]
    larger_ = [x for s, v in ups.items() if s != "124M" for x, _ in v]
    everywhere = all(x > 1 for x in base + larger_)
    lines = [
        f"- `{baseline}` and `{candidate}` are faster than the post's "
        f"{'at every setting timed' if everywhere else 'at some settings'}: "
        f"{min(base):.2f}x to {max(base):.2f}x at 124M; {min(larger_):.2f}x to "
        f"{max(larger_):.2f}x for the larger models."
    ]
    lines += _pair(files, post, baseline, candidate)
    slower = [
        (r, p) for s, v in _speedups(files, post, tuple(_names(files))).items()
        for x, r in v if x < 1 for p in [_post(post, s, r["attention"], r["context"])]
    ]  # fmt: skip
    if slower:
        lines.append(
            "- Slower than the post: "
            + "; ".join(
                f"`{r['attention']}` at {r['size']} {context_label(r['context'])} "
                f"({_ms(r['median_ms'])} vs {p:g} ms)"
                for r, p in slower
            )
            + "."
        )
    return "\n".join(lines)


def _names(files: list[Raw]) -> list[str]:
    return list(dict.fromkeys(r["attention"] for r in _results(files)))


def _pair(files: list[Raw], post: dict[str, Any], baseline: str, candidate: str) -> list[str]:
    """``candidate`` against ``baseline`` per size and context: the baseline's time over the
    candidate's (above 1: the candidate is faster)."""
    by = {(r["size"], r["attention"], r["context"]): r for r in _results(files) if _ok(r)}
    pairs: dict[str, list[tuple[int, float]]] = {}
    for size, c in sorted({(s, c) for s, _, c in by}):
        b, x = by.get((size, baseline, c)), by.get((size, candidate, c))
        if b and x:
            pairs.setdefault(size, []).append((c, b["median_ms"] / x["median_ms"]))
    lines = []
    if "124M" in pairs:
        pts = sorted(pairs["124M"])
        wins = all(x > 1 for _, x in pts)
        lines.append(
            f"- At 124M `{candidate}` {'beats' if wins else 'against'} `{baseline}` at every "
            f"context timed: {', '.join(f'{x:.2f}x at {context_label(c)}' for c, x in pts)}."
        )
    lines += pair_larger(pairs, post, baseline, candidate)
    return lines


def pair_larger(
    pairs: dict[str, list[tuple[int, float]]], post: dict, baseline: str, candidate: str
) -> list[str]:
    """Per context above 124M: ``candidate``'s time against ``baseline``'s per size, the post's
    beside it, and where ours is not faster (the post's claim for ``LT_chunked`` against
    ``flash`` was "strictly faster at all context and model sizes")."""
    sizes = sorted((s for s in pairs if s != "124M"), key=_size_order)
    contexts = sorted({c for s in sizes for c, _ in pairs[s]})
    lines, slower = [], []
    for c in contexts:
        parts = []
        for s in sizes:
            x = dict(pairs[s]).get(c)  # baseline / candidate
            if x is None:
                continue
            pf, pl = _post(post, s, baseline, c), _post(post, s, candidate, c)
            theirs = (
                f" (post {_less_more(pl / pf)})"
                if isinstance(pf, float) and isinstance(pl, float)
                else ""
            )
            parts.append(f"{s} {_less_more(1 / x)}{theirs}")
            if x < 1:
                slower.append(f"{s} at {context_label(c)}")
        lines.append(
            f"- `{candidate}`'s step against `{baseline}`'s at {context_label(c)}: "
            + ", ".join(parts)
            + "."
        )
    if slower:
        lines.append(
            f"- The post's claim, `{candidate}` strictly faster than `{baseline}` at every "
            f"context and model size, is not met by ours at {', '.join(slower)}."
        )
    return lines


def _less_more(r: float) -> str:
    """A time ratio (candidate / baseline) in words: ``2.3% less time``, ``1.75x faster``."""
    if r < 1 / 1.1:
        return f"{1 / r:.2f}x faster"
    return f"{abs(1 - r):.1%} {'less' if r < 1 else 'more'} time"


@renderer("step_time.pair")
def pair(*raws: Raw, baseline: str, candidate: str) -> str:
    """``candidate`` against ``baseline`` alone (the README's sentence on ``LT_chunked`` and
    ``flash``)."""
    files, post = _split(raws)
    return "\n".join(_pair(files, post, baseline, candidate))


@renderer("step_time.long_contexts")
def long_contexts(*raws: Raw, first: str = "") -> str:
    """The longer contexts timed by the memory check, one process per point, beside the
    post's; the rows of attention ``first`` lead."""
    files, post = _split(raws)
    body = []
    for f in files:
        s = f.data["meta"]["settings"]
        for r in sorted(f.data["rows"], key=lambda r: (r["attention"] != first, r["context"])):
            if r.get("status") != "ok":
                continue
            p = _post(post, r["size"], r["attention"], r["context"])
            if p is None:
                longest = max(
                    (int(c) for c in post.get(r["size"], {}).get(r["attention"], {})), default=0
                )
                p_text = f"not reached (post max {longest:,})" if r["context"] > longest else "—"
            else:
                p_text = _post_ms(p)
            body.append([
                f"`{r['attention']}`", r["size"], f"{r['context']:,}",
                f"{r['remat']}, {r['loss_chunk']}", f"{_ms(r['median_ms'])}",
                f"{len(r['step_ms'])} after {s['warmup']}", p_text,
            ])  # fmt: skip
    return table(
        ["attention", "size", "context", "remat, loss_chunk", "ms per step",
         "median of (steps after warm-up)", "post"],
        body,
    )  # fmt: skip


@renderer("step_time.memory_note")
def memory_note(step: Raw, check: Raw, *, size: str) -> str:
    """What the timed steps at ``size``'s longest context needed against the plain step (the
    memory check's ``remat none`` rows): below it, ``auto`` had rematerialised."""
    results = [r for r in step.data["results"] if r["size"] == size and _ok(r)]
    longest = max(r["context"] for r in results)
    plain = {
        r["attention"]: r["compiled_bytes"] for r in check.data["rows"]
        if r["size"] == size and r["context"] == longest and r["remat"] == "none"
    }  # fmt: skip
    parts = [
        f"`{r['attention']}` {gib(r['memory_bytes'], 1)} GiB (plain step "
        f"{gib(plain[r['attention']], 1)} GiB)"
        for r in results
        if r["context"] == longest and r["attention"] in plain
    ]
    share = step.data["meta"]["settings"]["allocator_fraction"]
    below = all(
        r["memory_bytes"] < 0.99 * plain[r["attention"]]
        for r in results
        if r["context"] == longest and r["attention"] in plain
    )
    return (
        f"Compiled memory of the timed {size} steps at {context_label(longest)}, against the "
        f"plain step (`remat none`, memory check): {', '.join(parts)}."
        + (
            f" Below the plain step's: with the allocator at {share:.0%}, `auto` chose a cheaper "
            "setting there."
            if below
            else ""
        )
    )
