#!/usr/bin/env python
"""What the card itself reaches: a dense bf16 matmul's FLOP/s and a streaming kernel's HBM
bytes/s, measured, so that the step-time model's fitted fractions of the datasheet peaks are
bounded by the card rather than by the datasheet (``benchmarks/step_model.py``).

    python benchmarks/card_ceilings.py            # on a GPU (seconds)
    python benchmarks/card_ceilings.py --tiny --out DIR   # small shapes on any backend (tests)

Writes ``card_ceilings_<device>.json`` under ``--out`` (default benchmarks/results/): ``h100``,
``h200``, ... by the device's name (an H200's ceilings never bound the H100's model), ``cpu``
with ``--tiny``. Each ceiling is the best of ``--repeats`` timed calls after a warm-up, each
call ``--inner`` back-to-back applications inside one jitted program (one dispatch).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RESULTS = Path(__file__).resolve().parent / "results"


def device_stem(kind: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``h100``; ``cpu`` for a CPU."""
    m = re.search(r"\b([A-Z]\d{2,4})\b", kind)
    return m[1].lower() if m else "cpu"


def best_seconds(fn, *args, repeats: int) -> float:
    import jax

    jax.block_until_ready(fn(*args))  # compile and warm up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        best = min(best, time.perf_counter() - t0)
    return best


def measure(n: int, elements: int, inner: int, repeats: int) -> dict:
    """``{"matmul_flops_per_s", "hbm_bytes_per_s", ...}``: ``inner`` products of two bf16
    ``[n, n]`` matrices (float32 accumulation, bf16 result) and ``inner`` passes of
    ``x * a + b`` over ``elements`` float32 (each reads and writes every element once)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)

    @jax.jit
    def matmuls(a, b):
        def body(_, x):  # each product depends on the last: nothing is hoisted or skipped
            return jnp.dot(x, b, preferred_element_type=jnp.float32).astype(jnp.bfloat16)

        return jax.lax.fori_loop(0, inner, body, a)

    x = jnp.ones((elements,), jnp.float32)

    @jax.jit
    def stream(x):
        return jax.lax.fori_loop(0, inner, lambda i, y: y * 0.5 + 1.0, x)

    t_mm = best_seconds(matmuls, a, b, repeats=repeats)
    t_bw = best_seconds(stream, x, repeats=repeats)
    return {
        "matmul_flops_per_s": inner * 2 * n**3 / t_mm,
        "hbm_bytes_per_s": inner * 2 * 4 * elements / t_bw,
        "matmul": {"shape": [n, n, n], "dtype": "bfloat16", "inner": inner, "seconds": t_mm},
        "stream": {"elements": elements, "dtype": "float32", "inner": inner, "seconds": t_bw},
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--tiny", action="store_true", help="small shapes on any backend (tests)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--inner", type=int, default=20)
    args = ap.parse_args(argv)
    import jax

    from linear_gpt2.platform.provenance import environment

    if jax.default_backend() != "gpu" and not args.tiny:
        print("error: no GPU here; card_ceilings.py measures a GPU (--tiny: any backend, tests)",
              file=sys.stderr)  # fmt: skip
        return 2
    n, elements = (256, 2**16) if args.tiny else (8192, 2**29)
    got = measure(n, elements, 2 if args.tiny else args.inner, 2 if args.tiny else args.repeats)
    env = environment()
    stem = "cpu" if args.tiny else device_stem(env.get("device_kind", ""))
    out = {
        "meta": {
            "how": "measured",
            "what": "the card's ceilings: the FLOP/s of chained dense bf16 matmuls and the "
            "bytes/s of a streaming float32 kernel, best of the timed calls",
            "script": "benchmarks/card_ceilings.py",
            "environment": env,
            "settings": {"tiny": args.tiny, "repeats": args.repeats},
        },
        "ceilings": {k: got[k] for k in ("matmul_flops_per_s", "hbm_bytes_per_s")},
        "runs": {k: got[k] for k in ("matmul", "stream")},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"card_ceilings_{stem}.json"
    path.write_text(json.dumps(out, indent=1) + "\n")
    print(f"matmul {got['matmul_flops_per_s'] / 1e12:,.1f} TFLOP/s, stream "
          f"{got['hbm_bytes_per_s'] / 1e9:,.0f} GB/s; wrote {path}")  # fmt: skip
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
