"""Compiled memory of every attention formulation: XLA's buffer assignment, nothing is run.

For each registered attention, ``jax.jit(f).lower(...).compile().memory_analysis()`` of

- forward: ``f(q, k, v) = attention(q, k, v)``;
- forward+backward: ``f(q, k, v, dy) = vjp(attention, q, k, v)(dy)`` (the forward, its residuals
  and the backward in one program, as in a training step);

reporting ``temp_size_in_bytes``: the scratch memory XLA allocates beyond the arguments and
outputs (those are 4 resp. 3 ``[B, T, H, D]`` arrays for every variant). Measured on whatever
backend JAX picks (CPU unless a GPU is visible; the numbers in docs/attention.md are CPU).

    python benchmarks/attention_memory.py                       # B=1 H=12 D=64 T=1024 c=64
    python benchmarks/attention_memory.py --T 1024 2048 --markdown out.md
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2 import attention  # noqa: E402
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


def table(rows, B: int, Ts: list[int], H: int, D: int, c: int, scan: str) -> str:
    header = "| formulation | FLOPs per head | memory per head |"
    rule = "|---|---|---|"
    for T in Ts:
        header += f" fwd, T={T} | fwd+bwd, T={T} |"
        rule += "---:|---:|"
    lines = [header, rule]
    for name, sizes, note in rows:
        flops, mem = COST[name]
        cells = (
            [f"{b / 2**20:.1f}" for fb in sizes for b in fb] if sizes else [note] * (2 * len(Ts))
        )
        lines.append(f"| `{name}` | {flops} | {mem} | " + " | ".join(cells) + " |")
    lines.append("")
    T0 = Ts[0]
    lines.append(
        f"Compiled temp memory in MiB (`memory_analysis().temp_size_in_bytes`: scratch beyond "
        f"arguments and outputs) on {jax.default_backend()}, jax {jax.__version__}, float32, "
        f"B={B}, H={H}, D={D}, c={c}, LT_state_parallel scan={scan}. At T={T0} one "
        f"[B, T, H, D] array is {B * T0 * H * D * 4 / 2**20:.1f} MiB, a T x T score matrix for "
        f"all heads {B * H * T0 * T0 * 4 / 2**20:.1f} MiB and T D^2 floats for all heads "
        f"{B * T0 * H * D * D * 4 / 2**20:.1f} MiB."
    )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--T", type=int, nargs="+", default=[1024], help="one or more lengths")
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--scan", default="cumsum", help="LT_state_parallel's prefix sum")
    p.add_argument("--names", nargs="*", default=attention.names())
    p.add_argument("--markdown", type=Path, help="also write the table to this file")
    a = p.parse_args()
    rows = measure(a.B, a.T, a.H, a.D, a.chunk_size, a.names, a.scan)
    out = table(rows, a.B, a.T, a.H, a.D, a.chunk_size, a.scan)
    print(out)
    if a.markdown:
        a.markdown.parent.mkdir(parents=True, exist_ok=True)
        a.markdown.write_text(out + "\n")


if __name__ == "__main__":
    main()
