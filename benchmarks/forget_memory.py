"""Issue 14's memory acceptance: the 124M training step (batch 1, bf16) with ``LT_chunked``,
``attention.doc_reset: true`` and ``attention.decay: gate`` against the plain ``LT_chunked``
step, both compiled for the H100 on this (CPU) machine with the auto memory settings.

Nothing runs: XLA's buffer assignment of the H100 program (``compile_step.compile_train_step``). With
forgetting, ``kernel=auto`` compiles to the chunk-parallel Pallas kernels with resets and gates.

    python benchmarks/forget_memory.py --context 1048576 65536 --start-rung 4 0

Writes ``forget_memory_h100_compiled.json`` and renders ``.md`` from it (``--out``, ``--stem``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.experiments import compile_step  # noqa: E402
from linear_gpt2.model.config import ModelConfig  # noqa: E402
from linear_gpt2.platform import provenance
from linear_gpt2.platform.memory import GiB  # noqa: E402
from studies import common as reports  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
VARIANTS = {
    "plain": dict(),
    "doc_reset + decay gate": dict(doc_reset=True, decay="gate"),
}


def measure(context: int, start_rung: int = 0) -> dict[str, compile_step.StepReport]:
    out = {}
    for name, extra in VARIANTS.items():
        cfg = ModelConfig.preset(
            "124M", attention="LT_chunked", block_size=context, dtype="bfloat16", **extra
        )
        t0 = time.perf_counter()
        out[name] = compile_step.compile_train_step(cfg, "h100", batch=1, start_rung=start_rung)
        r = out[name]
        print(
            f"T={context} {name}: {r.compile.memory.total / GiB:.2f} GiB, fits={r.fits}, "
            f"{r.plan.describe()} ({time.perf_counter() - t0:.0f} s)",
            flush=True,
        )
    return out


def label(r: compile_step.StepReport) -> str:
    from linear_gpt2.training import memory_plan

    return memory_plan.label(r.config)


def record(plain: compile_step.StepReport, forget: compile_step.StepReport, T: int) -> dict:
    def one(r: compile_step.StepReport) -> dict:
        return {
            "memory_bytes": r.compile.memory.total,
            "setting": label(r),
            "fits": r.fits,
            "tried": [[name, m.total] for name, m in r.plan.tried],
        }

    return {"context": T, "plain": one(plain), "forget": one(forget)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[65536, 1048576])
    ap.add_argument(
        "--start-rung", type=int, nargs="+", default=None,
        help="per context: the memory_plan.LADDER rung to start from (skip settings known not "
        "to fit, e.g. 4 = offload at 1M tokens)",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the .json and .md")
    ap.add_argument("--stem", default="forget_memory_h100_compiled")
    args = ap.parse_args(argv)
    rows = []
    rungs = args.start_rung or [0] * len(args.context)
    for T, start in zip(args.context, rungs):
        r = measure(T, start)
        rows.append(record(r["plain"], r["doc_reset + decay gate"], T))
    env = provenance.environment()
    env["device_kind"] = "NVIDIA H100 (compiled for, deviceless; no GPU here)"
    meta = {
        "how": "compiled",
        "environment": env,
        "settings": {
            "size": "124M", "attention": "LT_chunked", "kernel": "auto", "batch": 1,
            "dtype": "bfloat16", "budget_gib": 72, "forget": VARIANTS["doc_reset + decay gate"],
            "start_rung": {str(T): n for T, n in zip(args.context, rungs)},
            "kernel_design": "the chunk-parallel Pallas kernels (with forgetting kernel=pallas "
            "always is; docs/attention.md)",
            "command": "benchmarks/forget_memory.py " + " ".join(argv or sys.argv[1:]),
        },
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.stem}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    md = reports.page(args.out / f"{args.stem}.md", reports.block("forget_memory.page", path.name))
    print(md.read_text())
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
