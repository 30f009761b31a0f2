"""The step's glue kernels one by one: each launch candidate against XLA's fusion of the same op.

For each glue kernel (``linear_gpt2/kernels/launch.py``: LayerNorm with the residual forward and
backward, bias + GELU forward and backward, the bias gradient of the split into heads, the
cross-entropy) at the 124M step's widths (C = 768, F = 3072, V = 50304) and ``--rows`` rows,
time in one process, side by side:

- ``xla``: the kernel's plain-JAX oracle (``naive``), jitted: what ``*_kernel: xla`` runs;
- each candidate launch (``launch.CANDIDATES``, the default first), traced under
  ``launch.override``.

Every program returns all its outputs (nothing is dead code). The kernels that write an output
over an input (the cross-entropy over the logits, the LayerNorm backward over ds, the GELU
backward over dg) get a copy of that input first, since a jitted function may not overwrite its
argument; that copy is timed alone (``copy_ms``) and taken off (``net_ms``). Rounds alternate
the order of the programs; each round times ``--iters`` calls of each; medians over rounds.
``bytes`` is what one pass must move (every input read once, every output written once) and
``fraction``: those bytes per second over the card's HBM bandwidth (``platform/cards.py``).

    python benchmarks/bench_glue.py                # GPU: every kernel at 16k and 64k rows
    python benchmarks/bench_glue.py --tiny         # CPU smoke run: interpret mode, tiny rows

Output: a printed table and ``bench_glue.json`` under ``--out``. ``make gpu-check``'s
glue_kernels stage runs it; the page is ``glue_kernels_<device>_measured`` (gpu_check), and
``studies/gpu_check/glue_launch.py`` holds the rule that picks ``launch.DEFAULTS`` from the file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.kernels import launch  # noqa: E402
from linear_gpt2.platform import cards  # noqa: E402
from linear_gpt2.platform.provenance import environment  # noqa: E402

C, F, V = 768, 3072, 50304


def case(name: str, N: int, tiny: bool):
    """``(args, kernel, oracle, aliased)`` of one kernel at N rows: ``aliased``, the index of the
    argument the kernel writes over (None: none)."""
    from linear_gpt2.kernels.bias_add import fused as add_fused
    from linear_gpt2.kernels.bias_add import naive as add_naive
    from linear_gpt2.kernels.bias_gelu import fused as gelu_fused
    from linear_gpt2.kernels.bias_gelu import naive as gelu_naive
    from linear_gpt2.kernels.cross_entropy import fused as ce_fused
    from linear_gpt2.kernels.cross_entropy import naive as ce_naive
    from linear_gpt2.kernels.layernorm import fused as ln_fused
    from linear_gpt2.kernels.layernorm import naive as ln_naive

    c, f, v = (24, 40, 72) if tiny else (C, F, V)
    rng = np.random.default_rng(0)

    def n(*shape, dtype=jnp.float32):
        return jnp.asarray(rng.standard_normal(shape, np.float32), dtype)

    if name == "layernorm_fwd":  # the block's: float32 residual, bf16 branch, bf16 output
        args = (n(N, c), n(N, c, dtype=jnp.bfloat16), 1 + 0.1 * n(c), n(c))
        return (args, lambda *a: ln_fused.layernorm_fwd(*a, 1e-5, jnp.bfloat16),
                lambda *a: ln_naive.forward(*a, 1e-5, jnp.bfloat16), None)  # fmt: skip
    if name == "layernorm_bwd":
        s, scale = n(N, c), 1 + 0.1 * n(c)
        _, _, mean, rstd = ln_naive.forward(s, None, scale, None)
        args = (s, mean, rstd, scale, n(N, c, dtype=jnp.bfloat16), n(N, c))

        def oracle(*a):  # dx, and dh: dx for the branch in its dtype, as the kernel writes
            dx, dscale, dbias = ln_naive.backward(*a)
            return dx, dx.astype(jnp.bfloat16), dscale, dbias

        return (args, lambda *a: ln_fused.layernorm_bwd(*a, jnp.float32, jnp.bfloat16),
                oracle, 5)  # fmt: skip
    if name == "bias_gelu_fwd":
        return (
            (n(N, f, dtype=jnp.bfloat16), n(f)),
            gelu_fused.bias_gelu_fwd,
            gelu_naive.forward,
            None,
        )
    if name == "bias_gelu_bwd":
        args = (n(N, f, dtype=jnp.bfloat16), n(f), n(N, f, dtype=jnp.bfloat16))
        return args, gelu_fused.bias_gelu_bwd, gelu_naive.backward, 2
    if name == "bias_add_bwd":  # q, k, v's cotangents, [N, C] each
        args = tuple(n(N, c, dtype=jnp.bfloat16) for _ in range(3))
        return (args, lambda *a: add_fused.bias_add_bwd(list(a), jnp.bfloat16),
                lambda *a: add_naive.backward([x[None] for x in a], jnp.bfloat16), None)  # fmt: skip
    assert name == "cross_entropy"
    t = jnp.asarray(rng.integers(0, v, N), jnp.int32)
    return (n(N, v), t, jnp.float32(N)), ce_fused.cross_entropy, ce_naive.nll_and_grad, 0


def _bytes(args, out) -> int:
    return sum(int(x.size) * x.dtype.itemsize for x in jax.tree.leaves((args, out)))


def _compile(fn, args, name: str, run: launch.Launch | None):
    """A fresh jit of ``fn`` traced under ``run`` (a new function: jit caches by function)."""
    with launch.override({name: run} if run else {}):
        return jax.jit(lambda *a: fn(*a)).lower(*args).compile()


def _time(exe, args, iters: int) -> float:
    jax.block_until_ready(exe(*args))
    t0 = time.perf_counter()
    for _ in range(iters):
        out = exe(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / iters


def bench(name: str, N: int, rounds: int, iters: int, tiny: bool, threads: int = 1,
          candidates: int | None = None) -> list[dict]:  # fmt: skip
    """The rows of one kernel at N rows: XLA's oracle, then the first ``candidates`` launches
    (all by default)."""
    args, kernel, oracle, aliased = case(name, N, tiny)
    args = jax.device_put(args)
    runs = (None, *launch.CANDIDATES[name][:candidates])

    def build(run):
        try:
            return _compile(oracle if run is None else kernel, args, name, run), None
        except Exception as e:  # a candidate Triton refuses is a result, not the end of the run
            return None, f"compile failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"

    # Compiles side by side (XLA and Triton release the GIL); each thread traces under its own
    # override (a context variable is per thread).
    with ThreadPoolExecutor(max(1, threads)) as pool:
        built = list(pool.map(build, runs))
    nbytes = _bytes(args, jax.eval_shape(kernel, *args))
    programs: list[tuple[dict, object]] = []
    rows = []
    for run, (exe, error) in zip(runs, built):
        row = {"kernel": name, "rows": N, "impl": "xla" if run is None else "pallas",
               "launch": None if run is None else dataclasses.asdict(run),
               "default": run == launch.DEFAULTS[name]}  # fmt: skip
        rows.append(row)
        if exe is None:
            row["status"] = error
            continue
        row |= {"status": "ok", "bytes": nbytes, "copy_ms": None, "times_ms": []}
        programs.append((row, exe))
    copy = None
    if aliased is not None:
        copy = jax.jit(lambda x: x * jnp.ones((), x.dtype)).lower(args[aliased]).compile()
        programs.append(({"copy": True, "times_ms": []}, copy))
    for r in range(rounds):
        order = programs if r % 2 == 0 else programs[::-1]
        for row, exe in order:
            a = (args[aliased],) if row.get("copy") else args
            row["times_ms"].append(_time(exe, a, iters) * 1e3)
    copy_ms = statistics.median(programs[-1][0]["times_ms"]) if copy is not None else None
    card = cards.of_device_kind(jax.devices()[0].device_kind)
    bw = card.hbm_bytes_per_s if card and card.hbm_bytes_per_s else None
    for row in rows:
        if row["status"] != "ok":
            continue
        row["median_ms"] = statistics.median(row["times_ms"])
        # Only the kernels write over their input; XLA's oracle writes a new buffer.
        row["copy_ms"] = copy_ms if row["impl"] == "pallas" else None
        net = row["median_ms"] - (row["copy_ms"] or 0.0)
        row["net_ms"] = net
        row["gb_per_s"] = row["bytes"] / (net * 1e-3) / 1e9 if net > 0 else None
        row["fraction"] = row["gb_per_s"] * 1e9 / bw if bw and row["gb_per_s"] else None
    default = next((r for r in rows if r.get("default") and r["status"] == "ok"), None)
    for row in rows:
        if default and row["status"] == "ok":
            row["to_default"] = row["net_ms"] / default["net_ms"]
    return rows


def _launch(r: dict) -> str:
    return "xla" if r["launch"] is None else launch.Launch(**r["launch"]).label()


def table(rows: list[dict]) -> str:
    head = "| kernel | rows | launch | ms | net ms | GB/s | of HBM | / default |"
    out = [head, "|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if r["status"] != "ok":
            out.append(f"| {r['kernel']} | {r['rows']} | {_launch(r)} | {r['status']} |||||")
            continue
        fr = "" if r.get("fraction") is None else f"{r['fraction']:.2f}"
        gb = "" if r.get("gb_per_s") is None else f"{r['gb_per_s']:.0f}"
        out.append(f"| {r['kernel']} | {r['rows']} | {_launch(r)}{' (default)' if r['default'] else ''} "
                   f"| {r['median_ms']:.3f} | {r['net_ms']:.3f} | {gb} | {fr} "
                   f"| {r.get('to_default', float('nan')):.3f} |")  # fmt: skip
    return "\n".join(out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: interpret mode, tiny rows")
    p.add_argument("--kernels", nargs="*", default=list(launch.CANDIDATES))
    p.add_argument("--rows", nargs="*", type=int, default=None, help="default 16384 65536")
    p.add_argument("--rounds", type=int, default=None, help="default 5 (tiny: 1)")
    p.add_argument("--iters", type=int, default=None, help="default 10 (tiny: 1)")
    p.add_argument("--compile-threads", type=int, default=4)
    p.add_argument(
        "--candidates",
        type=int,
        default=None,
        help="the first N launches of each kernel (default: all; the default is first)",
    )
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args(argv)
    unknown = sorted(set(args.kernels) - set(launch.CANDIDATES))
    if unknown:
        p.error(
            f"--kernels: no glue kernel {', '.join(unknown)}; one of {', '.join(launch.CANDIDATES)}"
        )
    rows_n = args.rows or ([37] if args.tiny else [16384, 65536])
    rounds = args.rounds or (1 if args.tiny else 5)
    iters = args.iters or (1 if args.tiny else 10)
    rows = []
    for name in args.kernels:
        for N in rows_n:
            rows += bench(name, N, rounds, iters, args.tiny, args.compile_threads, args.candidates)
            print(table([r for r in rows if (r["kernel"], r["rows"]) == (name, N)]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "bench_glue.json"
    meta = {"how": "measured", "environment": environment(),
            "settings": {"rounds": rounds, "iters": iters, "rows": rows_n, "tiny": args.tiny,
                         "candidates": args.candidates,
                         "widths": {"C": 24, "F": 40, "V": 72} if args.tiny
                         else {"C": C, "F": F, "V": V}}}  # fmt: skip
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
