#!/usr/bin/env python
"""``model.residual_dtype`` and ``model.scan_layers`` measured in the step compiled for the H100.

    python benchmarks/model_switches.py            # compile what the raw file lacks (~30 min)
    python benchmarks/model_switches.py --restart  # compile every variant again

For 124M ``LT_chunked`` (batch 1) at 1k and 64k, the trainer's step (``jit_train_step``: clip +
AdamW, state donated) is compiled for the H100 on this machine (deviceless XLA) with each
switch: today's program (one ``nn.scan`` over the blocks, a float32 residual stream), a bfloat16
residual stream, the blocks unrolled, and both. Per variant: the memory XLA's buffer assignment
gives, the compile time here, the HBM bytes and launches of the optimized program by op class
(``experiments/hlo_costs.py``; the scan's stacking copies and zero fills apart), and the step
time the step-time MODEL prices it at (``train_step_h100_model.json``'s fitted constants). No
GPU ran anything: memory, bytes and launches are compile measurements, the time a MODEL.
Writes ``model_switches_h100_compiled.{json,md}`` under ``--out`` (resumable).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
STEM = "model_switches_h100_compiled"
MODEL = "train_step_h100_model.json"
# (context, loss_chunk, remat): the settings the H100 ran these steps with (auto's choice).
POINTS = ((1024, 0, "none"), (65536, 4096, "none"))
VARIANTS = {
    # The scan named: model.scan_layers' auto unrolls for a GPU target now (the name is the
    # raw file's key; "default" was the default when it was compiled).
    "scan, float32 stream (default)": {"scan_layers": True},
    "scan, bfloat16 stream": {"scan_layers": True, "residual_dtype": "bfloat16"},
    "unrolled, float32 stream": {"scan_layers": False},
    "unrolled, bfloat16 stream": {"scan_layers": False, "residual_dtype": "bfloat16"},
}
SIZE, ATTENTION, CHUNK = "124M", "LT_chunked", 64


def stacking(rows: list[dict]) -> dict[str, float]:
    """Bytes and launches of the kernels that only fill or copy the scan's stacked buffers
    (``step_targets.NO_SCAN_STACKING``'s rows)."""
    from studies.train_step import step_model as sm

    picked = [r for r in rows if sm.is_memory(r) and (
        r.get("role") == "fill" or r.get("role") == "copy" and r["part"] == "saved activations")]  # fmt: skip
    return {"bytes": sum(r["count"] * r["bytes"] for r in picked),
            "launches": sum(r["count"] for r in picked)}  # fmt: skip


def compile_variant(context: int, loss_chunk: int, remat: str, switches: dict) -> dict:
    from linear_gpt2.experiments import hlo_costs
    from linear_gpt2.experiments.compile_step import mesh
    from linear_gpt2.platform.target import compile_program, get
    from linear_gpt2.training.config import TrainConfig
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.train_step import jit_train_step
    from studies.train_step import step_costs
    from studies.train_step.step_time import model_config

    t = get("h100")
    cfg = model_config(SIZE, ATTENTION, context, chunk_size=CHUNK, remat=remat,
                       loss_chunk=loss_chunk, **switches)  # fmt: skip
    program = jit_train_step(cfg, optimizer(TrainConfig()), mesh(t), accum=1, batch=1)
    t0 = time.perf_counter()
    report, compiled = compile_program(program.step, program.args, t, keep_executable=True,
                                       what=f"{ATTENTION} {SIZE} {context} {switches}")  # fmt: skip
    seconds = time.perf_counter() - t0
    point = step_costs.Point(ATTENTION, SIZE, context, CHUNK, 0.0, 0, "compiled", remat,
                             loss_chunk)  # fmt: skip
    rows = step_costs.cost_rows(hlo_costs.program_ops(compiled.as_text()), point)
    return {"memory_bytes": report.memory.total, "memory": report.memory.as_dict(),
            "compile_seconds": seconds, "rows": rows}  # fmt: skip


def summarize(entry: dict, params) -> dict:
    from studies.train_step import step_model as sm

    rows = entry["rows"]
    return {
        "memory_bytes": entry["memory_bytes"],
        "compile_seconds": entry["compile_seconds"],
        "bytes": sum(r["count"] * r["bytes"] for r in rows),
        "launches": sm.launches(rows),
        "by_class": sm.totals(rows),
        "stacking": stacking(rows),
        "modelled_ms": sm.predict(rows, params) * 1e3,
        "modelled_by_class_ms": {k: v * 1e3 for k, v in sm.breakdown(rows, params).items()},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--restart", action="store_true")
    args = ap.parse_args(argv)
    from linear_gpt2.platform.provenance import environment
    from studies.train_step import step_model as sm

    path = args.out / f"{STEM}.json"
    cache = {} if args.restart or not path.exists() else json.loads(path.read_text())["compiled"]
    model = json.loads((RESULTS / MODEL).read_text())
    params = sm.Params(**{k: model["params"][k] for k in (*sm.FITTED, "host_bytes_per_s")})
    env = environment()
    for context, loss_chunk, remat in POINTS:  # smallest first
        for name, switches in VARIANTS.items():
            key = f"{context}:{name}"
            if key in cache:
                continue
            cache[key] = {**compile_variant(context, loss_chunk, remat, switches),
                          "git_commit": env["git_commit"]}  # fmt: skip
            print(f"{key}: {cache[key]['memory_bytes'] / 2**30:.2f} GiB, compiled in "
                  f"{cache[key]['compile_seconds']:.0f} s", flush=True)  # fmt: skip
            _write(path, args.out, cache, params, model, env)
    _write(path, args.out, cache, params, model, env)
    return 0


def _write(path: Path, out: Path, cache: dict, params, model: dict, env: dict) -> None:
    points = []
    for context, loss_chunk, remat in POINTS:
        for name, switches in VARIANTS.items():
            key = f"{context}:{name}"
            if key in cache:
                points.append({"context": context, "variant": name, "switches": switches,
                               "loss_chunk": loss_chunk, "remat": remat,
                               "git_commit": cache[key]["git_commit"],
                               **summarize(cache[key], params)})  # fmt: skip
    meta = {
        "how": "compiled",
        "what": "the trainer's step for 124M LT_chunked, batch 1, compiled for the H100 "
        "(deviceless XLA) with each model switch: memory, HBM bytes and launches of the "
        "optimized program, compile time on this machine; step time MODELLED",
        "script": "benchmarks/model_switches.py",
        "environment": {**env, "device_kind": "NVIDIA H100 SXM (compiled for, deviceless)"},
        "settings": {"size": SIZE, "attention": ATTENTION, "chunk_size": CHUNK, "batch": 1,
                     "dtype": "bfloat16", "points": [list(p) for p in POINTS],
                     "model": MODEL, "model_commit": model["meta"]["environment"]["git_commit"],
                     "compile_host": "the shared 2-core CPU machine, under nice"},
    }  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "points": points, "compiled": cache}, indent=1)
                    + "\n")  # fmt: skip
    from studies import common as reports

    reports.page(out / f"{STEM}.md", reports.block("model_switches.page", f"{STEM}.json"))


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
