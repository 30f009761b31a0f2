"""The CPU step-time A/B: a config's step time at two commits, side by side
(``ab_step_time_*.json``, ``benchmarks/ab_step_time.py``)."""

from __future__ import annotations

from studies.common.core import Raw, renderer
from studies.common.fmt import how, provenance, short, table


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
