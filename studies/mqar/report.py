"""MQAR on the CPU: our runs beside the papers, the attention probe, and Zoology's own code.

Raw files: ``mqar_cpu.json`` (``scripts/mqar.py``: ``rows`` one per run, ``published``, ``meta``
with the session ``notes``), ``mqar_probe_cpu.json`` (``benchmarks/mqar_probe.py``: ``rows``, one
per probed run) and ``mqar_zoology_reference_cpu.jsonl`` with its ``.meta.json``
(``benchmarks/mqar_zoology_reference.py``: one evaluation per line).

A note may quote a run's final numbers as ``{{PROTOCOL/RUN.FIELD}}`` (``FIELD`` a column of its
row, optionally ``:FORMAT``), so that the notes cannot drift from the rows.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from studies.common.core import Raw, ReportError, renderer
from studies.common.fmt import how, provenance, short, table

# Accuracies are compared and printed at three decimals: runs on a plateau differ only by noise.
DECIMALS = 3
PLACEHOLDER = re.compile(
    # the run name may hold dots (``lr0.01``): the field is the name after its last dot
    r"\{\{(?P<protocol>[^/{}]+)/(?P<run>[^{}:]+)\.(?P<field>\w+)(?::(?P<fmt>[^}]+))?\}\}"
)


def cell_runs(rows: Iterable[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    """The run each (attention, L) cell of the table shows (:func:`best` of the cell's runs)."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in rows:
        cells.setdefault((r["attention"], r["L"]), []).append(r)
    return {k: best(v) for k, v in cells.items()}


def best(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The run a table cell shows: one that reached the target, else the highest final
    accuracy; the papers likewise report the best of their runs. Accuracies equal at the
    table's precision go to the run with the most updates, the one that says most about the
    cell."""
    return max(
        rows,
        key=lambda r: (
            bool(r["reached_target"]),
            round(r["accuracy"] or 0.0, DECIMALS),
            r["steps"],
        ),
    )


def _state(r: dict[str, Any]) -> str:
    """The layer's recurrent state in floats (Zoology's state size; rows written before the
    column: blank)."""
    n = r.get("state_floats")
    return "" if n is None else f"{n:,}"


def _fmt(v: float | None) -> str:
    return "" if v is None else f"{v:.{DECIMALS}f}"


def fill(note: str, rows: Sequence[dict[str, Any]]) -> str:
    """``note`` with each ``{{PROTOCOL/RUN.FIELD[:FORMAT]}}`` replaced by that run's value."""

    def value(m: re.Match) -> str:
        found = [r for r in rows if r["protocol"] == m["protocol"] and r.get("run") == m["run"]]
        if len(found) != 1 or m["field"] not in found[0]:
            raise ReportError(
                f"note placeholder {m[0]!r}: no run {m['protocol']}/{m['run']} with field "
                f"{m['field']!r} in the rows; fix the note"
            )
        v = found[0][m["field"]]
        if m["fmt"]:
            return format(v, m["fmt"])
        return _fmt(v) if isinstance(v, float) else str(v)

    filled = PLACEHOLDER.sub(value, note)
    if "{{" in filled:
        raise ReportError(f"note placeholder {filled[filled.index('{{'):][:80]!r} is not "
                          "{{PROTOCOL/RUN.FIELD[:FORMAT]}}; fix the note")  # fmt: skip
    return filled


def markdown(
    rows: Sequence[dict[str, Any]], meta: dict[str, Any], published: dict | None = None
) -> str:
    """The report: per protocol, our accuracy per attention and L beside the published ones
    (``published``: ``{protocol: {name: {L: accuracy}}}``, L as int or str)."""
    published = {
        p: {name: {int(L): a for L, a in v.items()} for name, v in d.items()}
        for p, d in (published or {}).items()
    }
    sources = meta.get("published_sources", {})
    how = meta.get("how", "measured")
    protocols = list(dict.fromkeys(r["protocol"] for r in rows))
    lines = ["# MQAR on CPU: ours beside the published numbers", ""]
    # The tables lead (best run per cell), then one paragraph of reading, then how and the rest.
    for protocol in protocols:
        mine = [r for r in rows if r["protocol"] == protocol]
        lines += [f"## {protocol}", "", cells_table(mine, published.get(protocol, {})), ""]
    reading = expanded_reading(rows, published)
    if reading:
        lines += ["## Reading", "", reading, ""]
    lines += [
        "## How these were obtained",
        "",
        f"{how.capitalize()} on {meta.get('machine', 'this machine')} ({meta.get('note', '')}); "
        f"commit {short(meta.get('environment', {}).get('git_commit'))}.",
        "Ours: final held-out accuracy (fraction of queries whose value is the argmax over the "
        "8192-way vocabulary) on the first 'test examples' of the test split (as many as the run's "
        "evaluation read), one seed and one learning rate per run, stopped at 99% as the papers "
        "stop; where a cell has several runs (settings below) it shows the best; a cell with "
        "'N steps' stopped below 99% after N updates. Recipe: the run's departures from "
        "configs/mqar/base.yaml. State / layer: one attention layer's recurrent state in floats as "
        "Zoology counts it (linear: H (D d' + d'), d' features; softmax: the 2 L d_model of its KV "
        "cache). Published: best over the papers' learning-rate sweeps.",
        "",
    ]
    for protocol in protocols:
        mine = [r for r in rows if r["protocol"] == protocol]
        lines += [f"### {protocol}: settings of our runs", ""]
        if protocol in sources:
            lines += [f"Published: {sources[protocol]}.", ""]
        lines += [
            table(
                ["attention", "L", "N", "lr", "seed", "batch", "recipe", "state / layer",
                 "steps (max)", "stopped at 99%", "accuracy (best)", "test examples", "train s"],
                [[r["attention"], r["L"], r["N"], f"{r['lr']:g}", r["seed"], r["batch"],
                  r.get("recipe", "base"), _state(r), f"{r['steps']} ({r['max_steps']})",
                  "yes" if r["reached_target"] else "no",
                  f"{_fmt(r['accuracy'])} ({_fmt(r['best_accuracy'])})", r["test_examples"],
                  f"{r['train_seconds']:.0f}"] for r in mine],
            ),
            "",
        ]  # fmt: skip
    curves = [r for r in rows if r.get("curve")]
    if curves:
        lines += ["## Held-out accuracy during training", "",
                  "Runs that recorded their evaluations (report rows since issue 39): the "
                  "held-out accuracy (and loss) at the evaluation nearest each update.", "",
                  curves_table(curves), ""]  # fmt: skip
    if meta.get("notes"):
        lines += ["## Notes", "", *(f"- {fill(n, rows)}" for n in meta["notes"]), ""]
    return "\n".join(lines)


# The feature maps that expand the keys (issue 39): their runs are what the reading is about.
EXPANDED = re.compile(r"/(taylor2|power2|rebased)\b")


def expanded_reading(
    rows: Sequence[dict[str, Any]], published: dict[str, dict[str, dict[int, float]]]
) -> str:
    """One paragraph on the runs with an expanding feature map (Based's recipe and kin), every
    figure read from the rows: per feature map and cell, the best run's accuracy, its updates
    of its budget, how many learning rates were tried, and the published Based number."""
    runs = [r for r in rows if EXPANDED.search(r["attention"])]
    if not runs:
        return ""
    parts = []
    for (att, protocol, L), r in sorted(
        {(x["attention"], x["protocol"], x["L"]): best([y for y in runs if (y["attention"],
         y["protocol"], y["L"]) == (x["attention"], x["protocol"], x["L"])]) for x in runs}.items()
    ):  # fmt: skip
        tried = sorted({y["lr"] for y in runs if (y["attention"], y["protocol"], y["L"]) ==
                        (att, protocol, L)})  # fmt: skip
        based = next((v.get(L) for k, v in published.get(protocol, {}).items()
                      if k.startswith("Based")), None)  # fmt: skip
        parts.append(
            f"{att} on {protocol} L={L} (N={r['N']}): {_fmt(r['accuracy'])} after {r['steps']} of "
            f"{r['max_steps']} updates (lr {r['lr']:g}; {len(tried)} learning rate"
            f"{'s' if len(tried) > 1 else ''} tried: {', '.join(f'{x:g}' for x in tried)})"
            + (f", Based published {_fmt(based)}" if based is not None else "")
        )
    reached = [r for r in runs if r["reached_target"]]
    short_runs = [r for r in runs if not r["reached_target"] and r["steps"] < r["max_steps"]]
    tail = (
        f" {len(reached)} of {len(runs)} runs reached 99%; {len(short_runs)} stopped before "
        "their update budget (cut short, not converged): a cell below the published number here "
        "is a lower bound of what the recipe reaches, and the held-out curves below say where "
        "each run stood."
    )
    return "The expanding feature maps, as far as their runs went: " + "; ".join(parts) + "." + tail


CURVE_STEPS = (100, 250, 500, 1000, 1500, 2000, 3000)


def curves_table(rows: Sequence[dict[str, Any]]) -> str:
    """One row per run: accuracy (held-out loss) at :data:`CURVE_STEPS` it reached."""
    steps = [s for s in CURVE_STEPS if any(r["curve"][-1][0] >= s for r in rows)]

    def at(r: dict[str, Any], s: int) -> str:
        if r["curve"][-1][0] < s:
            return ""
        step, loss, acc = min(r["curve"], key=lambda e: abs(e[0] - s))
        return f"{acc:.3f} ({loss:.2f})" if loss is not None else f"{acc:.3f}"

    return table(
        ["protocol", "attention", "L", "lr", "recipe", *(f"{s}" for s in steps), "last"],
        [[r["protocol"], r["attention"], r["L"], f"{r['lr']:g}", r.get("recipe", "base"),
          *(at(r, s) for s in steps),
          f"{r['curve'][-1][2]:.3f} at {r['curve'][-1][0]}"] for r in rows],
    )  # fmt: skip


def cells_table(mine: Sequence[dict[str, Any]], published: dict[str, dict[int, float]]) -> str:
    """Our best run per attention x L of one protocol, then the published rows."""
    Ls = sorted({r["L"] for r in mine} | {L for v in published.values() for L in v})
    Ns = {r["L"]: r["N"] for r in mine}
    by = cell_runs(mine)
    body = []
    for att in dict.fromkeys(r["attention"] for r in mine):
        cells = []
        for L in Ls:
            r = by.get((att, L))
            if r is None:
                cells.append("")
                continue
            stop = "" if r["reached_target"] else f", {r['steps']} steps"
            acc = "not evaluated" if r["accuracy"] is None else _fmt(r["accuracy"])
            cells.append(f"{acc}{stop}")
        body.append([f"ours: {att}", *cells])
    for name, values in published.items():
        body.append([f"published: {name}", *(_fmt(values.get(L)) for L in Ls)])
    head = [f"L={L}" + (f" (N={Ns[L]})" if L in Ns else "") for L in Ls]
    return table(["attention", *head], body)


@renderer("mqar.report")
def report(raw: Raw) -> str:
    d = raw.data
    return markdown(d["rows"], d["meta"], d.get("published"))


@renderer("mqar.cells")
def cells(raw: Raw, *, protocol: str) -> str:
    """One protocol's table of our best run per cell beside the papers (docs/results.md)."""
    d = raw.data
    mine = [r for r in d["rows"] if r["protocol"] == protocol]
    if not mine:
        raise ReportError(f"{raw.path} has no runs of protocol {protocol!r}; fix the marker")
    pub = {
        k: {int(L): a for L, a in v.items()} for k, v in d["published"].get(protocol, {}).items()
    }
    return cells_table(mine, pub)


def _probe_rows(data: Any) -> list[dict[str, Any]]:
    return data["rows"] if isinstance(data, dict) else data


def probe_table(rows: Sequence[dict[str, Any]]) -> str:
    """One column per probed run, one row per statistic."""
    keys = list(dict.fromkeys(k for r in rows for k in r if k not in ("run", "label")))
    body = [
        [k, *(f"{r[k]:.4f}" if isinstance(r.get(k), float) else r.get(k, "") for r in rows)]
        for k in keys
    ]
    return table(["statistic", *(r["label"] for r in rows)], body)


@renderer("mqar.probe")
def probe_page(raw: Raw) -> str:
    """The probe's page (``benchmarks/mqar_probe.py``): where and how, then the table."""
    rows, prov = _probe_rows(raw.data), provenance(raw.data)
    s = raw.data.get("meta", {}).get("settings", {})
    return "\n".join([
        f"# MQAR: where the recall heads look ({how(prov).lower()} on the CPU machine, "
        f"{(prov['time'] or 'date not recorded')[:10]})",
        "",
        f"{len(rows)} runs, {s.get('examples')} held-out examples each (benchmarks/mqar_probe.py"
        f"{', zero-filled examples' if s.get('zero_fill') else ''}); jax {prov['jax']}, commit "
        f"{short(prov['commit'])}.",
        "",
        probe_table(rows),
    ])  # fmt: skip


@renderer("mqar.probe_summary")
def probe_summary(raw: Raw) -> str:
    """What the probe shows, as ranges over the runs that learned recall and those that stalled
    (held-out accuracy below one half)."""
    rows = _probe_rows(raw.data)
    learned = [r for r in rows if r["accuracy"] >= 0.5]
    stalled = [r for r in rows if r["accuracy"] < 0.5]

    def span(rs: list[dict[str, Any]], key: str, digits: int = 2) -> str:
        lo, hi = min(r[key] for r in rs), max(r[key] for r in rs)
        a, b = f"{lo:.{digits}f}", f"{hi:.{digits}f}"
        return a if a == b else f"{a}-{b}"

    return (
        f"In the {len(learned)} probed runs that learned recall, layer 1 at the value positions "
        f"puts {span(learned, 'layer1_value_on_its_key')} of its attention on the value's key and "
        f"layer 2 at the queries {span(learned, 'layer2_query_on_right_value')} on the right "
        f"value. In the {len(stalled)} that stalled, layer 1 puts "
        f"{span(stalled, 'layer1_value_on_its_key')} on the value's key, and layer 2 puts "
        f"{span(stalled, 'layer2_query_on_right_value', 4)} on the right value, "
        f"{span(stalled, 'layer2_query_on_values', 3)} on all values together and "
        f"{span(stalled, 'layer2_query_on_query_region')} on the query region (the zeros after "
        "the pairs)."
    )


@renderer("mqar.zoology_reference")
def zoology_table(evals: Raw, meta: Raw) -> str:
    """Zoology's own code, one row per evaluation, with the sequences seen."""
    batch = meta.data["meta"]["settings"]["batch"]
    return table(
        ["update", "epoch", "sequences", "lr", "train loss", "test loss", "test accuracy",
         "train s"],
        [[r["update"], r["epoch"], f"{r['update'] * batch:,}", f"{r['lr']:.3g}",
          f"{r['train_loss']:.3f}", f"{r['test_loss']:.3f}", f"{r['test_acc']:.4f}",
          f"{r['train_s']:.0f}"] for r in evals.data],
    )  # fmt: skip


@renderer("mqar.zoology_vs_ours")
def zoology_vs_ours(evals: Raw, meta: Raw) -> str:
    """Zoology's code against ours at equal sequences: the last evaluation, and ours at each
    evaluation the meta file records."""
    m = meta.data["meta"]
    batch, last = m["settings"]["batch"], evals.data[-1]
    by_seq = {r["update"] * batch: r for r in evals.data}
    ours = m["compare"]
    lines = [
        f"- Zoology's own code: test accuracy {last['test_acc']:.3f} (loss {last['test_loss']:.2f}) "
        f"at update {last['update']}, {last['update'] * batch:,} sequences "
        f"({last['update'] * batch / m['settings']['budget_sequences']:.1%} of the "
        f"{m['settings']['budget_sequences']:,} its schedule allows), when stopped for time."
    ]
    fitting = next((r for r in evals.data if r["train_loss"] < r["test_loss"]), None)
    if fitting:
        lines.append(
            f"- Its training loss is below its test loss from update {fitting['update']} (epoch "
            f"{fitting['epoch']}, counted from 0) on: it starts to fit its "
            f"{m['settings']['train_examples']:,} examples."
        )
    for e in ours["evaluations"]:
        near = min(by_seq, key=lambda s: abs(s - e["sequences"]))
        lines.append(
            f"- At {e['sequences']:,} sequences ours ({ours['run']}, {ours['what']}) had "
            f"{e['accuracy']:.3f}; Zoology's had {by_seq[near]['test_acc']:.3f} at {near:,}."
        )
    return "\n".join(lines)


@renderer("mqar.zoology_about")
def zoology_about(evals: Raw, meta: Raw) -> str:
    """How Zoology's own code was run: the command, the versions, the settings."""
    m = meta.data["meta"]
    env, s = m["environment"], m["settings"]
    start, _, end = (env.get("time_utc") or "/").partition("/")
    last = evals.data[-1]
    return (
        f"**How obtained ({m['how']}, {start} to {end}):** `{m['command']}`, on the CPU machine "
        f"(no GPU), {env['device_kind']}: PyTorch {env['torch_version']} from PyPI, in a venv "
        f"apart from this project's; commit {short(env['git_commit'])}. ZOOLOGY is a checkout "
        f"of HazyResearch/zoology at {env['zoology_commit']} (the paper's version): its model "
        "(`LanguageModel`, `MHA` with attention dropout 0.1, embedding dropout 0.1, "
        "`state_mixer` Identity), generator (`multiquery_ar`, random_non_queries "
        f"{s['random_non_queries']}) and training recipe, with the settings of its figure 2 "
        f"configs: d_model {s['d_model']}, {s['heads']} head, {s['layers']} layers, "
        f"{s['train_examples']:,} training and {s['test_examples']:,} test examples, batch "
        f"{s['batch']}, lr {s['lr']:g}, AdamW weight decay {s['weight_decay']:g}, cosine over "
        f"{s['epochs']} epochs stepped per epoch. The one change: its head is applied at the "
        f"query positions only (the loss and gradients are equal; a test holds it). Stopped at "
        f"{s['max_hours']:g} h of training: update {last['update']}, "
        f"{last['update'] * s['batch'] / s['train_examples']:.1f} of its {s['epochs']} epochs. "
        f"'test accuracy' is on all {s['test_examples']:,} test examples."
    )
