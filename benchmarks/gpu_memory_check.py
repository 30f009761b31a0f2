"""Compiled memory against the memory a real GPU uses, for chosen training steps.

    python benchmarks/gpu_memory_check.py LT_chunked:124M:1048576:offload:4096:64 \
        flash:124M:65536:none:0 --out benchmarks/results --stem memory_check_h100

Each point is ``attention:size:context:remat:loss_chunk[:chunk_size]`` (the setting
``model.remat`` / ``model.loss_chunk`` resolved, as ``memory_frontier_h100_compiled.json`` records
it), and runs in its own process, so that the device's peak (``memory_stats()['peak_bytes_in_use']``,
which never goes down within a process) belongs to that point alone. For each point: the compiled
step's memory as XLA's buffer assignment reports it (what ``scripts/compile.py`` and the frontier
report when compiling for the H100 without one), the peak the device's allocator saw over
``--repeats`` steps after one warm-up, and the step times. Needs a GPU (the CPU reports no peak).

Writes ``STEM.json`` and ``STEM.md`` into ``--out``; a point that fails (out of memory, a crash) is
recorded with its error and the run goes on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

GiB = 2**30


def parse_point(text: str) -> dict:
    parts = text.split(":")
    if len(parts) not in (5, 6):
        raise SystemExit(
            f"bad point {text!r}: expected attention:size:context:remat:loss_chunk[:chunk_size]"
        )
    attention, size, context, remat, loss_chunk = parts[:5]
    point = dict(
        attention=attention, size=size, context=int(context), remat=remat,
        loss_chunk=int(loss_chunk),
    )  # fmt: skip
    if len(parts) == 6:
        point["chunk_size"] = int(parts[5])
    return point


def measure(point: dict, repeats: int) -> dict:
    """Compile, run and measure one point in this process."""
    import jax
    import numpy as np

    from linear_gpt2.experiments import step_time as bench
    from linear_gpt2.platform.memory import compiled_memory

    overrides = {"remat": point["remat"], "loss_chunk": point["loss_chunk"]}
    cfg = bench.model_config(
        point["size"], point["attention"], point["context"],
        chunk_size=point.get("chunk_size"), **overrides,
    )  # fmt: skip
    t0 = time.perf_counter()
    compiled, tx, _ = bench.compile_step(cfg)
    compile_s = time.perf_counter() - t0
    mem = compiled_memory(compiled)
    state = jax.device_put(bench.initial_state(cfg, tx))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 1, cfg.block_size + 1))
    x, y = (
        jax.device_put(tokens[..., :-1].astype(np.int32)),
        jax.device_put(tokens[..., 1:].astype(np.int32)),
    )
    key = jax.random.key(0)
    times = []
    loss = None
    for i in range(1 + repeats):
        t = time.perf_counter()
        state, metrics = compiled(state, x, y, key)
        jax.block_until_ready((state, metrics))
        if i:
            times.append(time.perf_counter() - t)
        loss = float(metrics["loss"]) if "loss" in metrics else None
    stats = jax.local_devices()[0].memory_stats() or {}
    return {
        **point,
        "status": "ok",
        "device_kind": jax.devices()[0].device_kind,
        "compiled_bytes": mem.total if mem else None,
        "compiled": mem.as_dict() if mem else None,
        "peak_bytes_in_use": stats.get("peak_bytes_in_use"),
        "bytes_limit": stats.get("bytes_limit"),
        "compile_seconds": compile_s,
        "step_ms": [t * 1e3 for t in times],
        "median_ms": statistics.median(times) * 1e3,
        "loss": loss,
    }


def markdown(rows: list[dict]) -> str:
    lines = [
        "# Compiled memory vs the real GPU's peak (measured on the device)",
        "",
        "Batch 1, bf16, AdamW; `compiled`: XLA's buffer assignment (arguments + outputs + "
        "temporaries - donated aliases), the figure that compiling for the H100 without one "
        "reports; `peak`: the allocator's `peak_bytes_in_use` over the steps, one process per "
        "point. Times are the median step after one warm-up.",
        "",
        "| attention | size | context | remat | loss_chunk | chunk | compiled GiB | peak GiB | "
        "peak/compiled | step ms | loss |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(
                f"| {r['attention']} | {r['size']} | {r['context']} | {r['remat']} | "
                f"{r['loss_chunk']} | {r.get('chunk_size', '')} | | | | {r.get('status')}: "
                f"{str(r.get('error', ''))[:80]} | |"
            )
            continue
        comp, peak = r["compiled_bytes"], r["peak_bytes_in_use"]
        ratio = f"{peak / comp:.3f}" if comp and peak else ""
        lines.append(
            f"| {r['attention']} | {r['size']} | {r['context']} | {r['remat']} | "
            f"{r['loss_chunk']} | {r.get('chunk_size', '')} | "
            f"{comp / GiB:.2f} | {(peak or 0) / GiB:.2f} | {ratio} | {r['median_ms']:.1f} | "
            f"{r['loss'] if r['loss'] is None else round(r['loss'], 3)} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("points", nargs="*", help="attention:size:context:remat:loss_chunk[:chunk]")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    ap.add_argument("--stem", default="memory_check_gpu")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per point")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # the child process: one point, JSON out
    args = ap.parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(measure(parse_point(args.one), args.repeats)), flush=True)
        return 0
    points = [parse_point(p) for p in args.points]  # every point checked before any runs
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for text, point in zip(args.points, points):
        cmd = [sys.executable, __file__, "--one", text, "--repeats", str(args.repeats)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            found = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            if found:
                row = json.loads(found[-1][len("RESULT ") :])
            else:
                row = {**point, "status": "error", "error": proc.stderr.strip()[-400:]}
        except subprocess.TimeoutExpired:
            row = {**point, "status": "timeout", "error": f"over {args.timeout:.0f} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
        (out / f"{args.stem}.json").write_text(json.dumps(rows, indent=1) + "\n")
        (out / f"{args.stem}.md").write_text(markdown(rows))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
