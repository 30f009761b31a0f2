"""Issue 14's memory acceptance: the 124M training step (batch 1, bf16) with ``LT_chunked``,
``attention.doc_reset: true`` and ``attention.decay: gate`` against the plain ``LT_chunked``
step, both compiled for the H100 on this (CPU) machine with the auto memory settings.

Nothing runs: XLA's buffer assignment of the H100 program (``compile_step.compile_train_step``). With
forgetting, ``kernel=auto`` compiles to the chunk-parallel Pallas kernels with resets and gates.

    python benchmarks/forget_memory.py --context 65536 1048576 \\
        --markdown benchmarks/results/forget_memory_h100_compiled.md
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import linear_gpt2  # noqa: E402, F401  (before JAX starts its backends)
from linear_gpt2.experiments import compile_step  # noqa: E402
from linear_gpt2.model.config import ModelConfig  # noqa: E402
from linear_gpt2.platform.memory import GiB  # noqa: E402

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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[65536, 1048576])
    ap.add_argument(
        "--start-rung", type=int, nargs="+", default=None,
        help="per context: the memory_plan.LADDER rung to start from (skip settings known not "
        "to fit, e.g. 4 = offload at 1M tokens)",
    )  # fmt: skip
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args(argv)
    rows = []
    rungs = args.start_rung or [0] * len(args.context)
    for T, start in zip(args.context, rungs):
        r = measure(T, start)
        plain, forget = r["plain"], r["doc_reset + decay gate"]
        a, b = plain.compile.memory.total, forget.compile.memory.total
        rows.append((T, plain, forget, (b - a) / a))
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    lines = [
        "# 124M training step with forgetting: compiled memory for the H100",
        "",
        "Compiled for the H100 on a CPU machine (deviceless, `compile_step.compile_train_step`: XLA's "
        "buffer assignment of the H100 program, nothing run), at commit "
        f"`{commit}` (the kernels' code; this file is committed after it). "
        "Batch 1, bfloat16, AdamW, `LT_chunked` with `kernel: auto` (the Pallas kernels), the "
        "auto memory settings (`remat`, `loss_chunk`) resolved against the 72 GiB budget. "
        "`benchmarks/forget_memory.py` writes this file.",
        "",
        "| context | plain LT_chunked | + doc_reset + decay gate | difference | settings "
        "(plain / forget) | fits 72 GiB |",
        "|---|---|---|---|---|---|",
    ]
    for T, plain, forget, rel in rows:
        lines.append(
            f"| {T:,} | {plain.compile.memory.total / GiB:.2f} GiB | "
            f"{forget.compile.memory.total / GiB:.2f} GiB | {rel:+.1%} | "
            f"{label(plain)} / {label(forget)} | "
            f"{'yes' if plain.fits else 'no'} / {'yes' if forget.fits else 'no'} |"
        )
    lines += [
        "",
        "Every setting compiled (the auto ladder, cheapest first, from the rung given):",
        "",
        "| context | setting | plain LT_chunked | + doc_reset + decay gate | difference |",
        "|---|---|---|---|---|",
    ]
    for T, plain, forget, _ in rows:
        fm = dict(forget.plan.tried)
        for name, m in plain.plan.tried:
            if name in fm:
                f = fm[name].total
                lines.append(
                    f"| {T:,} | {name} | {m.total / GiB:.2f} GiB | {f / GiB:.2f} GiB | "
                    f"{(f - m.total) / m.total:+.1%} |"
                )
    text = "\n".join(lines) + "\n"
    print(text)
    if args.markdown:
        args.markdown.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
