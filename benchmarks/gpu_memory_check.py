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

    from linear_gpt2.platform import provenance
    from linear_gpt2.platform.memory import compiled_memory
    from studies.train_step import step_time as bench

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
    shape = (1, cfg.block_size, cfg.n_head, cfg.head_dim)
    spec = cfg.spec
    return {
        **point,
        "status": "ok",
        "environment": provenance.environment(),
        "allocator": provenance.allocator(),
        "kernel_design": None
        if spec.kernel_design is None
        else spec.kernel_design(shape, "bfloat16", cfg.attention_options),
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


def page_template(stem: str) -> str:
    from studies import common as reports

    return "\n".join([
        "# Compiled memory vs the real GPU's peak (measured on the device)",
        "",
        reports.block("memory_check.about", f"{stem}.json"),
        reports.block("memory_check.table", f"{stem}.json"),
    ])  # fmt: skip


def write(out: Path, stem: str, rows: list[dict], repeats: int) -> None:
    """``STEM.json`` (``meta``: how, the first point's environment and allocator, the steps
    timed; ``rows``) and ``STEM.md`` rendered from it."""
    from studies import common as reports

    # Every point's process reports them; they are the same machine, so the file keeps one.
    envs = [r.pop("environment", None) for r in rows]
    allocs = [r.pop("allocator", None) for r in rows]
    env = next((e for e in envs if e), None)
    alloc = next((a for a in allocs if a), {})
    meta = {
        "how": "measured",
        "environment": env,
        "settings": {
            "batch": 1,
            "dtype": "bfloat16",
            "warmup": 1,
            "steps_timed": repeats,
            **alloc,
            "peak": "the allocator's peak_bytes_in_use over the warm-up and the timed steps, "
            "one process per point",
            "remat, loss_chunk": "given per point (attention:size:context:remat:loss_chunk), not auto",
        },
    }
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    reports.page(out / f"{stem}.md", page_template(stem))


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
        write(out, args.stem, [dict(r) for r in rows], args.repeats)  # after each point
    print((out / f"{args.stem}.md").read_text())
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
