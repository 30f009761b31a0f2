#!/usr/bin/env python
"""``model.scan_layers``: what unrolling the blocks costs in compile time, and how well the
memory plan estimates the unrolled step, compiled for the H100.

    nice -n 10 python benchmarks/scan_compile.py            # compile what the raw file lacks
    nice -n 10 python benchmarks/scan_compile.py --restart  # compile every point again

``auto`` unrolls the blocks on a GPU (``linear_gpt2/model/gpt.py``, ``scans_layers``) since a GPU
timed the unrolled step faster (``glue_ab_h200_measured.md``); the price is compile time,
which grows with depth. At each point the trainer's step (``jit_train_step``: clip + AdamW,
state donated; batch 1; the glue kernels at ``auto``, so the Pallas kernels a GPU run uses) is
compiled for the H100 on this machine (deviceless XLA) scanned and unrolled, each in a fresh
process as a run compiles it (nothing cached from another compile), one at a time: the wall
and CPU seconds (the process's and its ptxas children's) of trace + lower + compile, the memory
of XLA's buffer assignment, and beside it the memory plan's estimate of the same setting
(``training.memory_plan.estimate``, traced for the H100) with its error. The compile seconds
are this shared 2-core machine's (other jobs ran beside it): read the ratio of a point's two.
Then each of :data:`PLANS` is planned and compiled as ``scripts/compile.py`` does (``auto``
unrolling the blocks for the target): every candidate's estimate, what was compiled and to how
much.
Writes ``scan_compile_h100_compiled.{json,md}`` under ``--out`` (resumable).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
STEM = "scan_compile_h100_compiled"
ATTENTION = "LT_chunked"
# (size, context, chunk_size, remat, loss_chunk): every size at 1k (12 to 48 layers; the glue
# A/B's chunk at 1k), the 124M 64k step as the GPU ran it, and 124M at 256k with auto's
# setting on the H100 (the memory frontier's), where the plan's estimate decides what compiles.
POINTS = (
    ("124M", 1024, 128, "none", 0),
    ("355M", 1024, 128, "none", 0),
    ("774M", 1024, 128, "none", 0),
    ("1.6B", 1024, 128, "none", 0),
    ("124M", 65536, 64, "none", 4096),
    ("124M", 262144, 64, "dots", 4096),
)
SETTINGS = {"scanned": True, "unrolled": False}
# (config, target): shipped runs whose plan auto now makes with the blocks unrolled, planned and
# compiled as ``scripts/compile.py CONFIG --target TARGET`` does (``compile_step.compile_config``):
# which candidates the estimate let through, and what each compiled to.
PLANS = (("configs/long/124M_LT_chunked_8M_cp8.yaml", "h100x8"),)


def _cpu_seconds() -> float:
    """CPU seconds of this process's threads and of its finished children (ptxas, which XLA
    runs for each Pallas kernel): less sensitive to other jobs on the machine than wall time."""
    own, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def key(size: str, context: int, setting: str) -> str:
    return f"{size}:{context}:{setting}"


def compile_point(size: str, context: int, chunk: int, remat: str, loss_chunk: int,
                  scan: bool) -> dict:  # fmt: skip
    from linear_gpt2.experiments.compile_step import mesh, step_shape
    from linear_gpt2.platform.target import compile_program, get, traced_for
    from linear_gpt2.training import memory_plan
    from linear_gpt2.training.config import TrainConfig
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.train_step import jit_train_step
    from studies.train_step.step_time import model_config

    t = get("h100")
    cfg = model_config(size, ATTENTION, context, chunk_size=chunk, remat=remat,
                       loss_chunk=loss_chunk, scan_layers=scan)  # fmt: skip
    wall, cpu = time.perf_counter(), _cpu_seconds()
    program = jit_train_step(cfg, optimizer(TrainConfig()), mesh(t), accum=1, batch=1)
    report = compile_program(program.step, program.args, t,
                             what=f"{ATTENTION} {size} {context} scan_layers={scan}")  # fmt: skip
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    with traced_for(t):
        est = memory_plan.estimate(cfg, step_shape(t, 1, context))
    compiled = report.memory.total
    return {
        "compile_seconds": wall, "compile_cpu_seconds": cpu,
        "memory_bytes": compiled, "memory": report.memory.as_dict(),
        "estimate_bytes": est.memory, "error": est.memory / compiled - 1,
        "n_layer": cfg.n_layer,
    }  # fmt: skip


def _scans(cfg, t) -> bool:
    """Whether ``cfg``'s step runs the blocks scanned when traced for ``t`` (auto resolved)."""
    from linear_gpt2.model.gpt import scans_layers
    from linear_gpt2.platform.target import traced_for

    with traced_for(t):
        return scans_layers(cfg)


def _margin(cfg, t) -> float:
    """The plan's margin for ``cfg`` traced for ``t`` (auto's blocks are the target's)."""
    from linear_gpt2.platform.target import traced_for
    from linear_gpt2.training import memory_plan

    with traced_for(t):
        return memory_plan.estimate_margin(cfg)


def plan_config(config: str, target: str) -> dict:
    from linear_gpt2.experiments import compile_step
    from linear_gpt2.platform.target import get
    from linear_gpt2.training import memory_plan
    from linear_gpt2.training.config import load_config

    t = get(target)
    wall, cpu = time.perf_counter(), _cpu_seconds()
    report = compile_step.compile_config(load_config(str(REPO / config)), t)
    wall, cpu = time.perf_counter() - wall, _cpu_seconds() - cpu
    plan = report.plan
    compiled = {name: m.total for name, m in plan.tried}
    return {
        "scan_layers": _scans(report.config, t), "chosen": memory_plan.label(report.config),
        "fits": plan.fits, "budget_bytes": plan.budget,
        "margin": _margin(report.config, t),
        "candidates": [{"setting": name, "estimate_bytes": e.memory,
                        "compiled_bytes": compiled.get(name)} for name, e in plan.estimates],
        "compile_seconds": wall, "compile_cpu_seconds": cpu,
    }  # fmt: skip


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--restart", action="store_true")
    ap.add_argument("--one", nargs=2, metavar=("POINT", "SETTING"), help=argparse.SUPPRESS)
    ap.add_argument("--plan", type=int, metavar="I", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    # A child: one compile (or one plan), its record as JSON on the last line of stdout.
    if args.one:
        size, context, chunk, remat, loss_chunk = POINTS[int(args.one[0])]
        out = compile_point(size, context, chunk, remat, loss_chunk, SETTINGS[args.one[1]])
        print(json.dumps(out))
        return 0
    if args.plan is not None:
        print(json.dumps(plan_config(*PLANS[args.plan])))
        return 0
    from linear_gpt2.platform.provenance import environment

    path = args.out / f"{STEM}.json"
    cache = {} if args.restart or not path.exists() else json.loads(path.read_text())["compiled"]
    env = environment()
    for i, (size, context, *_) in enumerate(POINTS):
        for setting in SETTINGS:
            k = key(size, context, setting)
            if k in cache:
                continue
            cache[k] = {**_child("--one", str(i), setting), "git_commit": env["git_commit"]}
            c = cache[k]
            print(f"{k}: compiled in {c['compile_seconds']:.0f} s ({c['compile_cpu_seconds']:.0f}"
                  f" s CPU), {c['memory_bytes'] / 2**30:.2f} GiB, estimate "
                  f"{c['error']:+.1%}", flush=True)  # fmt: skip
            _write(path, args.out, cache, env)
    for i, (config, target) in enumerate(PLANS):
        k = f"plan:{config}:{target}"
        if k not in cache:
            cache[k] = {**_child("--plan", str(i)), "git_commit": env["git_commit"]}
            print(f"{k}: {cache[k]['chosen']}, compiled {[c['setting'] for c in cache[k]['candidates'] if c['compiled_bytes']]}", flush=True)  # fmt: skip
            _write(path, args.out, cache, env)
    _write(path, args.out, cache, env)


def _child(*argv: str) -> dict:
    child = subprocess.run([sys.executable, __file__, *argv], check=True, stdout=subprocess.PIPE,
                           text=True)  # fmt: skip
    return json.loads(child.stdout.strip().splitlines()[-1])
    return 0


def _write(path: Path, out: Path, cache: dict, env: dict) -> None:
    from linear_gpt2.platform.target import get
    from linear_gpt2.training import memory_plan

    points = []
    for size, context, chunk, remat, loss_chunk in POINTS:
        for setting in SETTINGS:
            k = key(size, context, setting)
            if k in cache:
                points.append({"size": size, "context": context, "chunk_size": chunk,
                               "remat": remat, "loss_chunk": loss_chunk, "setting": setting,
                               "scan_layers": SETTINGS[setting], **cache[k]})  # fmt: skip
    # Every plan on file, earlier commits' too (key plan:CONFIG:TARGET[:COMMIT]).
    plans = [{"config": k.split(":")[1], "target": k.split(":")[2], **v}
             for k, v in sorted(cache.items()) if k.startswith("plan:")]  # fmt: skip
    meta = {
        "how": "compiled",
        "what": "the trainer's step for LT_chunked (batch 1, the glue kernels at auto), compiled "
        "for the H100 (deviceless XLA) with the blocks scanned and unrolled: compile seconds on "
        "this machine, memory of XLA's buffer assignment, the memory plan's estimate beside it",
        "script": "benchmarks/scan_compile.py",
        "environment": {**env, "device_kind": "NVIDIA H100 SXM (compiled for, deviceless)"},
        "settings": {"attention": ATTENTION, "batch": 1, "dtype": "bfloat16",
                     "points": [list(p) for p in POINTS], "glue_kernels": "auto",
                     "budget_bytes": get("h100").budget_bytes,
                     "margins": {"scanned": memory_plan.ESTIMATE_MARGIN,
                                 "unrolled": memory_plan.UNROLLED_ESTIMATE_MARGIN},
                     "compile_host": "the shared 2-core CPU machine, under nice -n 10, each "
                     "compile in a fresh process, one at a time, other jobs beside them"},
    }  # fmt: skip
    raw = {"meta": meta, "points": points, "plans": plans, "compiled": cache}
    path.write_text(json.dumps(raw, indent=1)
                    + "\n")  # fmt: skip
    from studies import common as reports

    reports.page(out / f"{STEM}.md", reports.block("scan_compile.page", f"{STEM}.json"))


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
