#!/usr/bin/env python
"""Run a sweep of training runs: ``python scripts/sweep.py SWEEP.yaml [options] [key=value ...]``.

    python scripts/sweep.py configs/sweeps/post_124M_context_attention.yaml --dry-run
    python scripts/sweep.py configs/sweeps/chunk_size.yaml               # each point in turn
    python scripts/sweep.py SWEEP.yaml --slurm sweep.sh && sbatch sweep.sh
    python scripts/sweep.py SWEEP.yaml --point 3                         # one point (SLURM task)

The sweep file names a base config, fixed overrides, a grid (cartesian product over dotted keys)
and/or explicit points (see ``linear_gpt2/sweep.py``). Trailing ``key=value`` overrides apply to
every point (e.g. ``train.max_steps=20 log.wandb=disabled`` for a smoke run). Points whose run
directory is done (``DONE`` marker or a checkpoint at ``train.max_steps``) are skipped; the others
resume from their last checkpoint. Each point runs as a subprocess unless ``--in-process``.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("sweep", help="sweep YAML file")
    p.add_argument("overrides", nargs="*", help="key=value applied to every point")
    p.add_argument("--dry-run", action="store_true", help="print each point's command and status")
    p.add_argument("--slurm", metavar="OUT.sh", help="write an sbatch array script and exit")
    p.add_argument("--point", type=int, help="run only this point, in this process")
    p.add_argument("--in-process", action="store_true", help="train points in this process")
    args = p.parse_args(argv)

    if args.point is not None:  # one process per node under srun: join before any JAX call
        from linear_gpt2 import distributed

        distributed.initialize()
    from linear_gpt2 import sweep as sweep_lib
    from linear_gpt2.config import ConfigError

    try:
        sweep = sweep_lib.load_sweep(args.sweep, args.overrides)
        if args.dry_run:
            for point, done, cmd in sweep_lib.dry_run(sweep):
                status = "done" if done else "todo"
                print(f"[{point.index}] {status} {point.name}\n    {shlex.join(cmd)}")
            return 0
        if args.slurm:
            out = Path(args.slurm)
            out.write_text(sweep_lib.slurm_script(sweep, args.overrides))
            (sweep.out_dir / "slurm").mkdir(parents=True, exist_ok=True)  # sbatch --output
            print(f"wrote {out}: submit with sbatch {out}")
            return 0
        if args.point is not None:
            if not 0 <= args.point < len(sweep.points):
                print(f"error: --point {args.point} not in 0..{len(sweep.points) - 1}")
                return 2
            point = sweep.points[args.point]
            outcome = sweep_lib.run_point(sweep, point)
            print(f"[{point.index}] {point.name}: {outcome}")
            return 0
        outcomes = sweep_lib.run_sweep(sweep, in_process=args.in_process, extra=args.overrides)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    failed = {k: v for k, v in outcomes.items() if v.startswith("failed")}
    print(f"sweep {sweep.name}: {len(outcomes)} points, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
