"""Compiled memory of every attention formulation: XLA's buffer assignment, nothing is run.

For each registered attention, ``jax.jit(f).lower(...).compile().memory_analysis()`` of

- forward: ``f(q, k, v) = attention(q, k, v)``;
- forward+backward: ``f(q, k, v, dy) = vjp(attention, q, k, v)(dy)`` (the forward, its residuals
  and the backward in one program, as in a training step);

reporting ``temp_size_in_bytes``: the scratch memory XLA allocates beyond the arguments and
outputs (those are 4 resp. 3 ``[B, T, H, D]`` arrays for every variant). Measured on whatever
backend JAX picks (CPU unless a GPU is visible; the numbers in docs/attention.md are CPU).

    python benchmarks/attention_memory.py                       # B=1 H=12 D=64 T=1024 c=64
    python benchmarks/attention_memory.py --T 1024 2048 --also-scan associative \\
        --out benchmarks/results/attention_memory_cpu     # .json, and .md rendered from it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2 import attention  # noqa: E402
from linear_gpt2.platform import provenance  # noqa: E402
from linear_gpt2.platform.memory import attention_temp_bytes  # noqa: E402

# Asymptotic cost per head, for the table (T: sequence length, D: head dim, c: chunk size).
COST = {
    "softmax": ("T^2 D", "T^2"),
    "flash": ("T^2 D", "T (kernel); T^2 on CPU (xla)"),
    "LT_attention": ("T^2 D (T sequential steps)", "T D fwd; T^2 fwd+bwd"),
    "LT_attention_parallel_no_flash": ("T^2 D", "T^2"),
    "LT_attention_parallel": ("T^2 D (T^2 D / 2 if masked blocks were skipped)", "T c + T D"),
    "LT_state": ("T D^2 (T sequential steps)", "D^2 + T D fwd; T D^2 fwd+bwd"),
    "LT_state_parallel": ("T D^2", "T D^2"),
    "LT_chunked": ("T D^2 + T c D", "(T/c) D^2 + T c + T D"),
}


def options_for(name: str, chunk_size: int) -> dict:
    opts = {"chunk_size": chunk_size}
    if name == "flash":
        opts["kernel"] = "auto"
    return opts


def measure(B: int, Ts: list[int], H: int, D: int, c: int, names: list[str], scan: str = "cumsum"):
    """``[(name, [(forward, forward+backward) temp bytes for each T], note)]``."""
    rows = []
    for name in names:
        try:
            fn = attention.get(name, scan=scan, **options_for(name, c))
        except ImportError as e:  # a variant still being written
            rows.append((name, None, f"not importable ({e}); see {name}.py"))
            continue
        sizes = []
        for T in Ts:
            fwd = attention_temp_bytes(fn, (B, T, H, D), backward=False)
            bwd = attention_temp_bytes(fn, (B, T, H, D), backward=True)
            sizes.append((fwd, bwd))
            print(
                f"  {name} T={T}: forward {fwd / 2**20:.1f} MiB, "
                f"forward+backward {bwd / 2**20:.1f} MiB",
                file=sys.stderr,
            )
        rows.append((name, sizes, ""))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, nargs="+", default=[1024], help="one or more lengths")
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--scan", default="cumsum", help="LT_state_parallel's prefix sum")
    p.add_argument(
        "--also-scan", nargs="*", default=[], help="LT_state_parallel again with these scans"
    )
    p.add_argument("--names", nargs="*", default=attention.names())
    p.add_argument("--out", type=Path, default=None, help="write OUT.json (and render OUT.md)")
    a = p.parse_args(argv)
    rows = measure(a.B, a.T, a.H, a.D, a.chunk_size, a.names, a.scan)
    extra = [
        (f"LT_state_parallel (scan={s})", r[1], r[2])
        for s in a.also_scan
        for r in measure(a.B, a.T, a.H, a.D, a.chunk_size, ["LT_state_parallel"], s)
    ]
    result = {
        "meta": {
            "how": "compiled",
            "environment": provenance.environment(),
            "settings": {
                "B": a.B, "T": a.T, "H": a.H, "D": a.D, "chunk_size": a.chunk_size,
                "scan": a.scan, "dtype": "float32", "backend": jax.default_backend(),
                "what": "memory_analysis().temp_size_in_bytes of the compiled program: scratch "
                "beyond arguments and outputs; forward, and forward+backward (vjp) as one program",
            },
        },
        "rows": [
            {
                "attention": name,
                "flops_per_head": COST.get(name.split(" ")[0], ("", ""))[0],
                "memory_per_head": COST.get(name.split(" ")[0], ("", ""))[1],
                "temp_bytes": None if sizes is None else {
                    str(T): {"forward": f, "forward_backward": b} for T, (f, b) in zip(a.T, sizes)
                },
                "note": note,
            }
            for name, sizes, note in rows + extra
        ],
    }  # fmt: skip
    print(json.dumps(result["rows"], indent=1))
    if a.out:
        from studies import common as reports

        a.out.parent.mkdir(parents=True, exist_ok=True)
        path = a.out.with_suffix(".json")
        path.write_text(json.dumps(result, indent=1) + "\n")
        reports.page(a.out.with_suffix(".md"), reports.block("attention_memory.page", path.name))
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
