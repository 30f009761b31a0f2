#!/usr/bin/env python
"""Run a sweep of training runs: ``python scripts/sweep.py SWEEP.yaml [options] [key=value ...]``.

    python scripts/sweep.py configs/sweeps/post_learning_124M.yaml --dry-run
    python scripts/sweep.py configs/sweeps/tiny_cpu.yaml train.max_steps=5   # each point in turn
    python scripts/sweep.py --in-process configs/sweeps/tiny_cpu.yaml log.wandb=disabled
    python scripts/sweep.py SWEEP.yaml --slurm sweep.sh && sbatch sweep.sh
    python scripts/sweep.py SWEEP.yaml --point 3                         # one point (SLURM task)

The sweep file names a base config, fixed overrides, a grid (cartesian product over dotted keys)
and/or explicit points (see ``linear_gpt2/experiments/sweep.py``). ``key=value`` overrides, before or after
the options, apply to every point (e.g. ``train.max_steps=20 log.wandb=disabled`` for a smoke
run), also in each subprocess and in the SLURM array script. On a rerun, points that finished
with the same config are skipped, unfinished ones resume from their last checkpoint, finished
ones whose config changed in a key a resumed run may change (``train.max_steps``, logging) run
again and continue, and points whose run directory holds another experiment are reported as
stale and not run. Each point runs as a subprocess unless ``--in-process``.

Ctrl-C or SIGTERM (to the sweep or to its process group) reaches the point in training: it
checkpoints and stops, its run directory is marked INTERRUPTED, no other point starts, and the
sweep ends with one line ``error: sweep NAME interrupted ...``; running the same command again
resumes the point. A second Ctrl-C stops the point at once (its last checkpoint stands). No point
outlives the sweep, even one killed with ``kill -9`` (Linux).

Exit codes: 0 when every point finished or was skipped; 1 when a point failed; 2 for a bad sweep
file, override or option, or when points were not run because their run directories hold another
experiment (stale) and none failed; 130 / 143 when SIGINT / SIGTERM stopped it. Refused and failed
points are reported on stderr as they come, and the command ends with one line ``error: ...``
(``--debug`` for the traceback).
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = cli.ArgumentParser(
        prog="scripts/sweep.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("sweep", help="sweep YAML file")
    p.add_argument("overrides", nargs="*", help="key=value applied to every point")
    p.add_argument("--dry-run", action="store_true", help="print each point's command and status")
    p.add_argument("--slurm", metavar="OUT.sh", help="write an sbatch array script and exit")
    p.add_argument("--point", type=cli.nonnegative_int, help="run only this point, in this process")
    p.add_argument("--in-process", action="store_true", help="train points in this process")
    p.add_argument("--debug", action="store_true", help="print tracebacks (LINEAR_GPT2_DEBUG=1)")
    # Intermixed: options may come before, between or after the file and the overrides.
    args = p.parse_intermixed_args(argv)
    if args.slurm and not Path(args.slurm).absolute().parent.is_dir():
        p.error(f"--slurm {args.slurm}: its directory does not exist")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.point is not None:  # one process per node under srun: join before any JAX call
        from linear_gpt2.training import distributed

        distributed.initialize()
    from linear_gpt2.experiments import sweep as sweep_lib

    sweep = sweep_lib.load_sweep(args.sweep, args.overrides)
    if args.dry_run:
        for point, (status, detail), cmd in sweep_lib.dry_run(sweep):
            note = (
                f" ({detail})" if detail and status in ("changed", "stale", "interrupted") else ""
            )
            print(f"[{point.index}] {status} {point.name}{note}\n    {shlex.join(cmd)}")
        return 0
    if args.slurm:
        out = Path(args.slurm)
        out.write_text(sweep_lib.slurm_script(sweep, args.overrides))
        (sweep.out_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch --output
        print(f"wrote {out}: submit with sbatch {out}")
        return 0
    if args.point is not None:
        if not 0 <= args.point < len(sweep.points):
            raise cli.UsageError(
                f"--point {args.point} is not a point of {sweep.path} (0..{len(sweep.points) - 1})"
            )
        point = sweep.points[args.point]
        sweep_lib.follow_parent()  # a point its sweep started stops with it
        try:
            outcome = sweep_lib.run_point(sweep, point)
        except sweep_lib.SweepInterruptedError as e:
            if os.environ.get(sweep_lib.PARENT_ENV):  # the sweep says so, in its one line
                return e.exit_code
            raise
        except (KeyboardInterrupt, sweep_lib.StopSignal) as e:  # stopped before or at once
            code = 128 + getattr(e, "signum", 2)
            if os.environ.get(sweep_lib.PARENT_ENV):
                return code
            raise sweep_lib.SweepInterruptedError(
                f"sweep point {point.index} ({point.name}) interrupted", code - 128
            ) from None
        print(f"[{point.index}] {point.name}: {outcome}")
        return 0
    outcomes = sweep_lib.run_sweep(sweep, in_process=args.in_process, extra=args.overrides)
    failed = {k: v for k, v in outcomes.items() if v.startswith("failed")}
    stale = {k: v for k, v in outcomes.items() if v.startswith("stale")}
    print(
        f"sweep {sweep.name}: {len(outcomes)} points, {len(failed)} failed"
        + (f", {len(stale)} stale (not run)" if stale else "")
    )
    sweep_lib.raise_for_outcomes(sweep, outcomes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
