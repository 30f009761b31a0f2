"""Where the training step's time goes: a few steps traced with ``jax.profiler``, the trace
parsed, the ops that take the most device time per step, with their share.

    python -m studies.gpu_check.profile --attention LT_chunked --size 124M \\
        --context 65536 --out DIR           # DIR/profile.json (and DIR/trace/, the raw trace)

On a GPU the ops are the kernels on the device's streams (``/device:GPU:*`` in the trace); on
a CPU, which has no device streams, the XLA ops the host ran (the tests' tiny path). An op's
share is its time over the sum of every op's time (ops on several streams at once are counted
each, so the shares are of the device's work, not of the wall time).
"""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path
from typing import Any

TOP = 15


def parse_trace(path: Path, steps: int, top: int = TOP) -> dict[str, Any]:
    """The ``top`` ops by time per step of a perfetto trace (``perfetto_trace.json.gz``)."""
    data = json.load(gzip.open(path))
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e["args"].get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}  # fmt: skip
    device = {pid for pid, n in names.items() if n.startswith("/device:GPU")}
    ops: dict[str, list[float]] = {}
    hlo: dict[str, str] = {}
    for e in events:
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if device:
            if e.get("pid") not in device:
                continue
        elif e["name"].startswith("$") or "::" in e["name"] or e["name"].startswith("end: "):
            continue  # the host's Python and runtime frames: not ops
        ops.setdefault(e["name"], []).append(float(e["dur"]) / 1e3)  # us -> ms
        op = (e.get("args") or {}).get("hlo_op")
        if op:  # the compiled program's instruction: joins the op to its cost row
            hlo[e["name"]] = op
    total = sum(sum(v) for v in ops.values())

    def row(n: str, v: list[float]) -> dict[str, Any]:
        return {"name": n, "count": len(v) / steps, "ms": sum(v) / steps,
                "share": sum(v) / total if total else 0.0, "hlo_op": hlo.get(n)}  # fmt: skip

    ranked = sorted(ops.items(), key=lambda kv: -sum(kv[1]))
    return {
        "where": "GPU" if device else "host (no device streams: a CPU)",
        "device_ms": total / steps,
        "top": [row(n, v) for n, v in ranked[:top]],
        # Every op, so that the time can be set beside the step-time MODEL's price of the same
        # instruction (the compiled program travels beside it: step.hlo.txt.gz).
        "ops": [row(n, v) for n, v in ranked],
    }


def _save_program(compiled, path: Path) -> str | None:
    """The compiled program's HLO text beside the trace (gzip), its file name; None when the
    executable cannot print it (one loaded from a store)."""
    try:
        text = compiled.as_text()
    except Exception:  # noqa: BLE001 - a profile without its program is still a profile
        return None
    if not text:
        return None
    with gzip.open(path, "wt") as f:
        f.write(text)
    return path.name


def measure(attention: str, size: str, context: int, warmup: int, steps: int, out: Path) -> dict:
    import jax
    import numpy as np

    from linear_gpt2.platform import provenance
    from studies.train_step import step_time as bench
    from studies.train_step.step_glue import AFTER_KERNELS

    cfg = bench.model_config(size, attention, context)
    compiled, tx, resolved = bench.compile_step(cfg)
    program = _save_program(compiled, out / "step.hlo.txt.gz")
    state = jax.device_put(bench.initial_state(cfg, tx))
    tokens = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 1, context + 1), np.int32)
    x, y = jax.device_put(tokens[..., :-1]), jax.device_put(tokens[..., 1:])
    key = jax.random.key(0)
    for _ in range(warmup):
        state, metrics = compiled(state, x, y, key)
        jax.block_until_ready((state, metrics))
    trace_dir = out / "trace"
    with jax.profiler.trace(str(trace_dir), create_perfetto_trace=True):
        for _ in range(steps):
            state, metrics = compiled(state, x, y, key)
            jax.block_until_ready((state, metrics))
    (path,) = sorted(trace_dir.rglob("perfetto_trace.json.gz"))[-1:]
    parsed = parse_trace(path, steps)
    env = provenance.environment()
    return {
        "meta": {"how": "measured", "environment": env, "settings": {
            "warmup": warmup, "steps_traced": steps, "top": TOP, **provenance.allocator(),
            "trace": "jax.profiler.trace, perfetto JSON; ops on the device's streams"}},
        "profile": {"attention": attention, "size": size, "context": context, "steps": steps,
                    "remat": resolved.remat, "loss_chunk": resolved.loss_chunk,
                    "glue_options": {k: getattr(resolved, k) for k in AFTER_KERNELS},
                    "program": program, **parsed},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from linear_gpt2.platform import cli

    def _main(args: list[str]) -> int:
        p = cli.ArgumentParser(prog="python -m studies.gpu_check.profile")
        p.add_argument("--attention", required=True)
        p.add_argument("--size", required=True)
        p.add_argument("--context", type=cli.positive_int, required=True)
        p.add_argument("--warmup", type=cli.nonnegative_int, default=2)
        p.add_argument("--steps", type=cli.positive_int, default=3)
        p.add_argument("--out", type=Path, required=True)
        a = p.parse_args(args)
        a.out.mkdir(parents=True, exist_ok=True)
        result = measure(a.attention, a.size, a.context, a.warmup, a.steps, a.out)
        (a.out / "profile.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
        for op in result["profile"]["top"]:
            print(f"{op['share']:6.1%} {op['ms']:9.3f} ms  {op['name'][:90]}")
        return 0

    return cli.run(_main, argv)


if __name__ == "__main__":
    raise SystemExit(main())
