#!/usr/bin/env python
"""The post's learning figures from training runs.

    python scripts/plot_runs.py runs/post-learning-124M runs/post-learning-355M --out figures/
    python scripts/plot_runs.py --wandb-project linear_gpt2 --wandb-group post-learning-124M

Runs come from local directories (each run directory holds ``config.yaml`` and
``metrics.jsonl``; a directory of runs is searched recursively) or from a wandb project through
its API (needs network and ``wandb login``). Writes into ``--out``:

- ``learning_curves_<size>.png``: loss against update steps and against hours, one colour per
  context, solid = linear attention, dashed = softmax (one figure per model size);
- ``final_loss_vs_params.png``: final loss against parameter count, one line per context and
  run label;
- ``final_loss.md``: one row per run: its label, final loss and median step time;
- ``final_loss_vs_context_<size>.png``: final held-out loss against context, one line per
  run label;
- ``curves_by_context_<size>.png``: one panel per context, the runs' loss curves;
- ``context_table.md``: held-out loss per run label x context with the gap to the softmax
  baseline (``flash``/``softmax`` without resets) at each context and the median step time;
  ``context_table.csv`` the same, one row per run.

A run's label is its attention variant (``flash``, ``LT_chunked``, ``LT_chunked+reset``,
``LT_chunked+gate``, ...) and every setting that differs between runs of that variant at one
context (``LT_chunked chunk_size=64``, ``kernel=pallas``, ``context_parallel=2``, an option of
your own variant, ``seed=1``), then the run's name if nothing else tells two apart: no row or
line stands for two runs. Step times are the median of ``metrics.jsonl``'s ``step_time_s``
without each start's first (compiling) step.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from linear_gpt2.experiments import plots
    from linear_gpt2.experiments import runs as runs_lib
    from linear_gpt2.platform import provenance

    p = cli.ArgumentParser(
        prog="scripts/plot_runs.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("runs", nargs="*", help="run directories or directories of runs")
    p.add_argument("--wandb-project", default=None)
    p.add_argument("--wandb-group", default=None)
    p.add_argument("--wandb-entity", default=None)
    p.add_argument("--smooth", type=float, default=0.9, help="EMA weight of history (0 = raw)")
    p.add_argument("--out", default="figures")
    p.add_argument("--label", default="", help="appended to every figure's title (machine, budget)")
    args = p.parse_args(argv)
    if not 0 <= args.smooth < 1:
        p.error(f"argument --smooth: must be in [0, 1), got {args.smooth}")
    missing = [r for r in args.runs if not Path(r).exists()]
    if missing:
        raise cli.UsageError(f"no such run directory: {', '.join(missing)}")
    runs = runs_lib.find_runs(args.runs) if args.runs else []
    if args.wandb_project:
        runs += runs_lib.load_wandb_runs(args.wandb_project, args.wandb_group, args.wandb_entity)
    if not runs:
        raise cli.UsageError(
            f"no runs found in {' '.join(args.runs) or '(nothing given)'}: give run directories "
            "(each holding config.yaml and metrics.jsonl) or --wandb-project"
        )
    out = Path(args.out)
    for size in dict.fromkeys(r.size for r in runs):
        group = [r for r in runs if r.size == size]
        path = plots.plot_learning_curves(
            group,
            out / f"learning_curves_{size}.png",
            smooth=args.smooth,
            title=f"GPT-2 {size}: linear (solid) vs softmax (dashed), by context{args.label}",
        )
        print(f"wrote {path} ({len(group)} runs)")
        path = plots.plot_final_loss_vs_context(
            group,
            out / f"final_loss_vs_context_{size}.png",
            title=f"{size}: final held-out loss vs context{args.label}",
        )
        print(f"wrote {path}")
        path = plots.plot_curves_by_context(
            group,
            out / f"curves_by_context_{size}.png",
            smooth=args.smooth,
            title=f"{size}{args.label}",
        )
        print(f"wrote {path}")
    print(f"wrote {plots.plot_final_loss_vs_params(runs, out / 'final_loss_vs_params.png')}")
    ctx_rows = runs_lib.context_table(runs)
    with (out / "context_table.csv").open("w", newline="") as f:
        fields = [
            "size",
            "variant",
            "context",
            "seed",
            "steps",
            "val",
            "train",
            "gap",
            "train_s",
            "spikes",
            "name",
            "label",
            "step_ms",
        ]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(ctx_rows)
    # Where the table came from (reports read it as context_cpu.meta.json): each run's starts as
    # its run_info.jsonl records them (device, versions, commit; none for runs older than it).
    starts = {r.name: r.starts for r in runs}
    commits = sorted({c for r in runs for c in r.commits})
    kinds = sorted({s.get("device_kind") for v in starts.values() for s in v} - {None})
    jaxes = sorted({s.get("jax_version") for v in starts.values() for s in v} - {None})
    meta = {
        "how": "measured",
        "raw": "context_table.csv",
        "environment": {
            "device_kind": ", ".join(kinds) or None,
            "jax_version": ", ".join(jaxes) or None,
            "git_commit": ", ".join(commits) or None,
        },
        "note": None
        if all(starts.values())
        else ("some runs predate run_info.jsonl: their device, versions and commit are unknown"),
        "report_environment": provenance.environment(),
        "runs": [r.name for r in runs],
        "starts": starts,
    }
    (out / "context_table.meta.json").write_text(json.dumps({"meta": meta}, indent=1) + "\n")
    table = runs_lib.context_table_markdown(ctx_rows)
    (out / "context_table.md").write_text(
        "Final held-out loss per run (rows: the attention variant and what else differs) and "
        "context (columns); in parentheses the gap to the softmax baseline at that context, "
        "then the median step time.\n\n" + table
    )
    print(table)
    rows = runs_lib.final_loss_table(runs)
    lines = [
        "| run | label | size | context | steps | hours | final loss | median step (ms) |",
        "|---" * 8 + "|",
    ]
    for r in rows:
        hours = f"{r['hours']:.1f}" if r["hours"] is not None else ""
        loss = f"{r['final_loss']:.4f}" if r["final_loss"] is not None else ""
        ms = f"{r['step_ms']:.1f}" if r["step_ms"] is not None else ""
        lines.append(
            f"| {r['name']} | {r['label']} | {r['size']} | {r['context']} | {r['steps']} | "
            f"{hours} | {loss} | {ms} |"
        )
    (out / "final_loss.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
