#!/usr/bin/env python
"""Check and time everything on a lent GPU in one resumable command (``make gpu-check``).

    make gpu-check --dry-run           # here, on the CPU machine: stages, work, estimated GPU time
    make gpu-check                     # on the GPU machine: runs them, resuming what is done
    make gpu-check ARGS="--only tests kernels --time-limit 540 --pack $OUT/gpu_check.tar.gz"
    python scripts/gpu_check.py --tiny # every stage's CPU path on tiny shapes (the tests)

Stages, in the order of their value (``--dry-run`` lists their units and estimates): ``tests``
(every gpu test against float64 references), ``kernels`` (LT_chunked against cuDNN flash and
flash-linear-attention), ``step`` (the training step), ``profile`` (the 124M step at 64k
traced), ``sample``, ``memory``; then the learning cells, ``mqar`` and ``context`` (a second
pass: ``--only learning``). ``--only`` / ``--skip`` take stage names or ``checks`` /
``learning``.

Each unit (a test file, a benchmark invocation, a training run) runs as a subprocess into
``--run-dir`` (default ``runs/gpu_check/<device>/``); one that finished is not run again, so the
same command resumes. ``--time-limit S`` stops starting units whose estimate would end past S
seconds, and stops one still running at S (one device command may run 10 minutes). After the
units, what they wrote is merged into ``benchmarks/results/*_<device>_measured.*`` with
provenance and the page ``gpu_check_<device>_measured.md`` is rendered; ``--pack FILE.tar.gz``
then packs the run folder (no checkpoints, no compilation cache) and those files, to bring back
from a machine that will be given back. Wheels in ``.whl/`` (``make gpu-wheels``) are installed
into the run folder first, for the packages the GPU machine's image lacks.

Without a CUDA GPU (and without ``--tiny`` / ``--dry-run``) it says so in one line and exits 1.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    from linear_gpt2.platform.provenance import REPO

    p = cli.ArgumentParser(
        prog="scripts/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="list stages, work and estimates")
    p.add_argument("--only", nargs="+", default=[], metavar="STAGE")
    p.add_argument("--skip", nargs="+", default=[], metavar="STAGE")
    p.add_argument("--time-limit", type=cli.positive_float, default=None, metavar="SECONDS")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on whatever device (CPU)")
    p.add_argument("--run-dir", type=Path, default=None, help="default runs/gpu_check/<device>")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--retry-failed", action="store_true", help="run failed units again")
    p.add_argument("--pack", type=Path, default=None, metavar="FILE.tar.gz")
    p.add_argument("--no-progress", action="store_true", help="a line per unit, no bars")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from linear_gpt2.experiments.gpu_check import collect, host, runner, stages
    from linear_gpt2.experiments.gpu_check.plan import dry_run_text
    from linear_gpt2.platform.provenance import REPO

    args = parse_args(argv)
    host.install_wheels()  # before the plan: its configs need omegaconf, which the image lacks
    plan = stages.build(args.results, tiny=args.tiny).select(args.only, args.skip)
    run_dir = args.run_dir or REPO / "runs" / "gpu_check" / plan.device
    if args.dry_run:
        print(dry_run_text(plan, runner.done_units(run_dir, plan)))
        return 0
    if not args.tiny:
        host.require_gpu()  # one line and exit 1, before anything is written
    run_dir.mkdir(parents=True, exist_ok=True)
    env = host.probe(run_dir)
    print(f"{plan.device}: {env.get('device_kind')} | jax {env.get('jax_version')} | commit "
          f"{env.get('git_commit')} | run folder {run_dir}")  # fmt: skip
    outcomes = host.run_with_progress(plan, run_dir, args)
    written = collect.collect_all(plan, run_dir, args.results, env)
    for path in written:
        print(f"wrote {path}")
    if args.pack:
        print(f"packed {host.pack(run_dir, written, args.pack)}")
    failed = [o for o in outcomes if o.status == "failed"]
    left = [o for o in outcomes if o.status in ("stopped", "skipped")]
    if left:
        print(f"stopped at the time limit with {len(left)} units to go: run the same command "
              "again to resume")  # fmt: skip
    if failed:
        names = ", ".join(f"{o.stage}/{o.unit}" for o in failed)
        print(f"error: {len(failed)} units failed ({names}); their logs are in {run_dir}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
