#!/usr/bin/env python
"""Compile run configs for a target and tabulate their per-device memory (no GPU needed).

    python benchmarks/compile_configs.py configs/post/[0-9]*.yaml --target h100x8

For each config, the step the trainer would run on the target's devices (tokens per update split
into micro-batches, ``model.remat`` / ``model.loss_chunk`` ``auto`` resolved against the
target's budget) is compiled with XLA's GPU compiler, deviceless, and its memory per device is
recorded, with the commit compiled and the step's ``auto`` choices for the target (blocks
scanned or unrolled, the glue kernels: ``compile_step.choices``). Writes ``<stem>.json`` and
``<stem>.md`` into ``--out`` (default ``benchmarks/results``); the stem defaults to
``configs_<target>_compiled``. Resumes: configs already in the JSON are not compiled again unless
``--restart``; ``--restart --before NOTE`` keeps the file's rows under ``before`` (NOTE says what
they were compiled with), which the page shows beside the new ones and later runs carry over.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("configs", nargs="+")
    p.add_argument("--target", default="h100x8")
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--stem", default=None)
    p.add_argument("--restart", action="store_true")
    p.add_argument("--before", default=None, metavar="NOTE",
                   help="with --restart: keep the file's rows as 'before', NOTE saying what "
                   "they were compiled with")  # fmt: skip
    args = p.parse_args(argv)
    if args.before and not args.restart:
        p.error("--before keeps the rows a --restart replaces: add --restart, or drop --before")

    from linear_gpt2.experiments import compile_step
    from linear_gpt2.platform import provenance, target
    from linear_gpt2.training.config import load_config
    from studies.train_step import frontier

    t = target.get(args.target)
    stem = args.stem or f"configs_{t.name}_compiled"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    rows: dict[str, dict] = {}
    old = json.loads(path.read_text()) if path.exists() else {}
    if old and not args.restart:
        rows = {r["config"]: r for r in old["rows"]}
    before = old.get("before")
    if args.before and old.get("rows"):
        before = {"note": args.before, "meta": old["meta"], "rows": old["rows"]}
    env = provenance.environment()
    env["device_kind"] = f"{t.device['name']} x {t.n_devices} (compiled for, deviceless)"
    for file in args.configs:
        f = Path(file)
        name = str(f.relative_to(REPO)) if f.is_absolute() and f.is_relative_to(REPO) else file
        if name in rows:
            continue
        cfg = load_config(file)
        try:
            r = compile_step.compile_config(cfg, t)
            row = {
                "config": name,
                "attention": cfg.attention.name,
                "n_layer": cfg.model.n_layer,
                "n_embd": cfg.model.n_embd,
                "context": cfg.data.context,
                "micro_batch": cfg.train.micro_batch,
                "accum": r.accum,
                "devices": t.n_devices,
                "remat": r.config.remat,
                "loss_chunk": r.config.loss_chunk,
                "memory_bytes": r.compile.memory.total,
                "memory": r.compile.memory.as_dict(),
                "fits": r.fits,
                "tried": [[n, m.total] for n, m in r.plan.tried],
                "compile_seconds": r.compile.seconds,
                "git_commit": env["git_commit"],
                "choices": r.choices,
                "kernel_design": frontier.kernel_design(
                    r.config, t.name, cfg.train.micro_batch, cfg.model.dtype, cfg.data.context
                ),
            }
        except target.CompileError as e:
            row = {"config": name, "error": str(e).splitlines()[0], "fits": False,
                   "git_commit": env["git_commit"]}  # fmt: skip
        rows[name] = row
        print(
            f"{name:<40} "
            + (
                f"{row['memory_bytes'] / 2**30:6.2f} GiB/device {row['remat']:<7} "
                f"loss_chunk={row['loss_chunk']} accum={row['accum']} "
                f"{'fits' if row['fits'] else 'DOES NOT FIT'}"
                if "error" not in row
                else row["error"]
            ),
            flush=True,
        )
        _write(out, stem, t, env, list(rows.values()), before)
    _write(out, stem, t, env, list(rows.values()), before)
    bad = [r["config"] for r in rows.values() if not r.get("fits")]
    print(f"{len(rows) - len(bad)} of {len(rows)} fit {t.budget_bytes / 2**30:.0f} GiB per device")
    return 1 if bad else 0


def _write(out: Path, stem: str, t, env: dict, rows: list[dict], before: dict | None) -> None:
    from studies import common as reports

    meta = {
        "how": "compiled",
        "environment": env,
        "target": t.describe(),
        "method": "compiled for the target with XLA's GPU compiler on a CPU-only machine; no run",
        "settings": {"kernel_design": "per row (the attention spec's, for the target)"},
    }
    data = {"meta": meta, "rows": rows, **({"before": before} if before else {})}
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    template = "\n".join([
        f"# Run configs compiled for {t.name}: memory per device",
        "",
        reports.block("configs.table", f"{stem}.json"),
    ])  # fmt: skip
    reports.page(out / f"{stem}.md", template)


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
