#!/usr/bin/env python
"""MQAR on CPU: train each attention at the two published protocols, then report beside the papers.

    python scripts/mqar.py                                 # both protocols, then the report
    python scripts/mqar.py --protocol zoology              # Zoology's (L, N) = (256, 16) cell only
    python scripts/mqar.py --protocol rebased train.max_steps=300
    python scripts/mqar.py --report-only                   # rewrite the report from the runs
    python scripts/mqar.py --sweep my_mqar.yaml --out /tmp/mqar
    python scripts/mqar.py --report-only --keep benchmarks/results/mqar_cpu.json   # add new runs

The protocols are the sweeps ``configs/sweeps/mqar_zoology.yaml`` and ``mqar_rebased.yaml`` (one
run per attention: softmax, LT_chunked with softplus and elu+1, LT_chunked + decay gate; see
``studies/mqar/mqar.py``). They run through the sweep runner (each point a subprocess unless
``--in-process``; finished runs are skipped, so an interrupted call continues), then
``NAME.{csv,json,md,png}`` (default ``benchmarks/results/mqar_cpu``) are written from every run
directory of the sweeps: our final held-out accuracy per attention and length beside the
published numbers, with the steps, learning rate and batch of each run and the machine's load.
``--keep REPORT.json`` carries the rows of an earlier report whose run directories are not on
this machine (a run directory of the same protocol and name replaces its row); runs started with
``scripts/train.py configs/mqar/base.yaml ...`` under a sweep's ``out_dir`` are reported too, with
their departures from the base recipe.
``key=value`` overrides apply to every run.

Exit codes: 0 when every run finished (or was skipped), 1 when one failed, 2 for bad arguments
or when a run was not run because its directory holds another experiment (stale).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(
        prog="scripts/mqar.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("overrides", nargs="*", help="key=value applied to every run")
    p.add_argument("--protocol", choices=("zoology", "rebased", "all"), default="all")
    p.add_argument("--sweep", nargs="+", default=None, help="sweep files instead of --protocol")
    p.add_argument("--report-only", action="store_true", help="only write the report")
    p.add_argument("--in-process", action="store_true", help="train in this process")
    p.add_argument("--out", default=None, help="default benchmarks/results")
    p.add_argument("--name", default="mqar_cpu", help="file stem of the report")
    p.add_argument("--note", action="append", default=[], help="a note for the report (repeat)")
    p.add_argument("--keep", default=None, help="an earlier report's JSON: keep its rows")
    p.add_argument("--debug", action="store_true", help="print tracebacks (LINEAR_GPT2_DEBUG=1)")
    args = p.parse_intermixed_args(argv)
    if args.keep and not Path(args.keep).is_file():
        raise cli.UsageError(f"--keep {args.keep}: no such report; give a mqar_cpu.json")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from linear_gpt2.experiments import sweep as sweep_lib
    from linear_gpt2.platform import provenance
    from studies.mqar import mqar

    args = parse_args(argv)
    if args.sweep:
        files = [Path(f) for f in args.sweep]
    elif args.protocol == "all":
        files = list(mqar.SWEEPS.values())
    else:
        files = [mqar.SWEEPS[f"mqar-{args.protocol}"]]
    sweeps = [sweep_lib.load_sweep(f, args.overrides) for f in files]
    load_before = os.getloadavg()
    t0 = time.monotonic()
    outcomes: dict[str, str] = {}
    if not args.report_only:
        for sweep in sweeps:
            outcomes.update(
                sweep_lib.run_sweep(sweep, in_process=args.in_process, extra=args.overrides)
            )
    kept = mqar.read_report(args.keep)["rows"] if args.keep else []
    rows = mqar.merge(kept, mqar.collect([s.out_dir for s in sweeps if s.out_dir.exists()]))
    if not rows:
        raise cli.UsageError(
            f"no finished MQAR runs under {', '.join(str(s.out_dir) for s in sweeps)}; run "
            "without --report-only first"
        )
    env = provenance.environment()
    meta = {
        "machine": f"the {os.cpu_count()}-core {env['device_kind'].upper()} machine "
        f"({platform.processor() or platform.machine()}, jax {env['jax_version']})",
        "note": (
            f"report written from the run directories; load average {load_before[0]:.1f}"
            if args.report_only
            else f"load average {load_before[0]:.1f} when this call started, "
            f"{os.getloadavg()[0]:.1f} at its end; wall time of the runs in this call "
            f"{time.monotonic() - t0:.0f} s"
        ),
        "environment": env,
        # repo-relative, so the committed report names no one's checkout
        "sweeps": [_shown(s.path, provenance.REPO) for s in sweeps],
        "notes": list(args.note),
    }
    out = Path(args.out) if args.out else provenance.REPO / "benchmarks" / "results"
    paths = mqar.write_report(rows, out, meta, name=args.name)
    print(Path(paths["md"]).read_text())
    for p in paths.values():
        print(f"wrote {p}")
    sweep_lib.raise_for_outcomes("MQAR (" + ", ".join(s.name for s in sweeps) + ")", outcomes)
    return 0


def _shown(path: Path, repo: Path) -> str:
    """``path`` relative to the repository when it lies inside it, else as given."""
    try:
        return str(path.resolve().relative_to(repo.resolve()))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    raise SystemExit(main())
