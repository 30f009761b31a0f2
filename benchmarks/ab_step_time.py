"""CPU step time of one config at two commits, side by side: did a change make the step slower?

    python benchmarks/ab_step_time.py --base 315cdb8            # the default run (minutes)
    python benchmarks/ab_step_time.py --base REF --config configs/default.yaml --rounds 3

Checks out ``--base`` into a temporary git worktree (removed afterwards), then runs
``scripts/train.py CONFIG`` from the base tree and from this one, alternating (base, this, base,
this, ...) so both see the same machine load, each run for ``--steps`` steps with checkpoints,
evaluation and wandb off and its run directory in a temporary folder. The per-step
``step_time_s`` of ``metrics.jsonl`` after ``--skip`` steps (compilation, warm-up) are pooled per
commit; the table gives the median, the quartiles, and the ratio this / base of the medians with
the spread of the per-round ratios. Writes ``ab_step_time_<stem>.{json,md}`` into ``--out``.
Times on a shared machine are noisy: read the ratio, not the milliseconds.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def git(*args: str, cwd: Path = REPO) -> str:
    return subprocess.run(
        ["git", *args], cwd=cwd, check=True, capture_output=True, text=True
    ).stdout.strip()


def run_once(tree: Path, config: str, steps: int, run_dir: Path) -> list[float]:
    """Per-step seconds of one training run of ``config`` with the code of ``tree``."""
    cmd = [
        sys.executable, str(tree / "scripts" / "train.py"), str(REPO / config),
        f"train.max_steps={steps}", f"log.run_dir={run_dir}", "log.wandb=disabled",
        f"log.eval_every={10 * steps}", f"checkpoint.every={10 * steps}",
    ]  # fmt: skip
    env = dict(os.environ, WANDB_MODE="disabled")
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:]
        raise SystemExit(f"error: training at {tree} failed: {tail}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [row["step_time_s"] for row in rows if "step_time_s" in row]


def quartiles(xs: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(xs, n=4)
    return q[0], statistics.median(xs), q[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--base", required=True, help="git ref to compare against")
    p.add_argument("--config", default="configs/default.yaml")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--skip", type=int, default=5, help="first steps left out (compilation)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--stem", default=None, help="default: the config's name")
    args = p.parse_args(argv)
    if args.steps <= args.skip + 1:
        p.error(f"--steps ({args.steps}) must exceed --skip ({args.skip}) by at least 2")

    base = git("rev-parse", args.base)
    head = git("rev-parse", "HEAD")
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    times: dict[str, list[float]] = {"base": [], "this": []}
    ratios: list[float] = []
    with tempfile.TemporaryDirectory(prefix="ab_step_") as tmp:
        wt = Path(tmp) / "base"
        git("worktree", "add", "--detach", str(wt), base)
        try:
            for i in range(args.rounds):
                med = {}
                for side, tree in (("base", wt), ("this", REPO)):
                    t = run_once(tree, args.config, args.steps, Path(tmp) / f"run_{side}_{i}")
                    times[side] += t[args.skip :]
                    med[side] = statistics.median(t[args.skip :])
                    print(f"round {i + 1} {side}: median {1e3 * med[side]:.2f} ms/step", flush=True)
                ratios.append(med["this"] / med["base"])
        finally:
            git("worktree", "remove", "--force", str(wt))

    qb, qt = quartiles(times["base"]), quartiles(times["this"])
    ratio = qt[1] / qb[1]
    stem = args.stem or Path(args.config).stem
    this = head + ("+dirty" if dirty else "")
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    result = {
        "meta": {
            "how": "measured",
            "environment": {
                "device_kind": "cpu", "platform": "cpu", "jax_version": _version("jax"),
                "git_commit": this, "host": platform.node(), "time_utc": now,
            },
            "settings": {"remat, loss_chunk": "the config's (auto: the plain step on the CPU)"},
        },
        "how": "measured on this CPU machine: scripts/train.py run alternately at two commits",
        "config": args.config,
        "base_commit": base,
        "this_commit": this,
        "steps": args.steps,
        "skip": args.skip,
        "rounds": args.rounds,
        "base_ms": [1e3 * x for x in qb],
        "this_ms": [1e3 * x for x in qt],
        "ratio_of_medians": ratio,
        "round_ratios": ratios,
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
        "time_utc": now,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"ab_step_time_{stem}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    sys.path.insert(0, str(REPO))
    from studies import common as reports

    md = reports.page(
        out / f"ab_step_time_{stem}.md", reports.block("ab_step_time.page", path.name)
    )
    print(md.read_text())
    return 0


def _version(name: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
