"""Kernel-level speed of every attention (and every kernel it has): forward and forward+backward.

For each registered attention name and each kernel it can run here (``xla``, ``pallas``,
``pallas_chunk``, ``pallas_fused_chunk``, ``triton``, ``cudnn``; names without a ``kernel``
option run once as ``default``; for ``LT_chunked`` with ``pallas`` the design it chose at each
shape is recorded as ``design``, and shown in the table), at B=1, H=12,
D=64 in bfloat16 and T = 1024, 2048, ... up to ``--T-max`` or the memory limit (an
out-of-memory / RESOURCE_EXHAUSTED error is recorded as that configuration's limit and the run
goes on), measure:

- ``fwd``: ``jit(attention)(q, k, v)``;
- ``fwd+bwd``: ``jit(lambda q, k, v, dy: vjp(attention, q, k, v)[1](dy))``;

median wall time of ``--repeats`` runs after ``--warmup`` runs, each ``block_until_ready``, and
TFLOP/s from the work causal attention needs (:data:`FLOP_COUNT`, :func:`fwd_flops`: the
variant's matmul FLOPs from ``linear_gpt2.model.flops``, with the quadratic forms' scores and
weighted sums over the causal half only, x3 for forward+backward). The MFU numbers count all T
keys per query, as nanoGPT does; here that would put a fused kernel, which skips the masked half,
above the card's peak. ``--recount FILE`` rewrites a results file's TFLOP/s with this count (its
times stay as measured). cuDNN flash attention (``flash`` with
``kernel=cudnn``) is in the same run on a GPU. A configuration slower than ``--max-seconds`` is
not run at longer T (``LT_attention`` and ``LT_state`` loop over positions).

flash-linear-attention (``fla``, PyTorch + Triton) is timed on the same shapes when ``torch`` and
``fla`` import and CUDA is available; otherwise the run notes that it was skipped.

Output: a printed table, and ``bench_kernels-<device>-<time>.json`` / ``.csv`` under ``--out``
(default benchmarks/results/) with device kind, git commit, jax version and the raw timings.

    python benchmarks/bench_kernels.py                 # GPU: the full sweep
    python benchmarks/bench_kernels.py --tiny          # CPU smoke run, a few seconds

``--compare`` / ``--peer fla`` (``make gpu-check``'s kernels stage, ``benchmarks/kernel_compare.py``):
LT_chunked against cuDNN flash at ``--B --H --D``, each of ``--Ts``, with and without resets and
gates (``--forget none resets+gate``), and flash-linear-attention on the same inputs, checked
against ours first (``--reference``: the folder of the ``--compare`` run); writes
``OUT/kernels.json``.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2 import attention, kernels
from linear_gpt2.attention.options import declared  # noqa: E402
from linear_gpt2.attention.spec import quadratic_flops  # noqa: E402
from linear_gpt2.model import flops  # noqa: E402
from linear_gpt2.model.config import ModelConfig  # noqa: E402
from linear_gpt2.platform.memory import is_oom  # noqa: E402
from linear_gpt2.platform.provenance import environment  # noqa: E402

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32}


def configurations(names, chunk_size: int, include_interpret: bool):
    """(name, kernel, fn) for every attention and every kernel it can run on this backend."""
    out = []
    for name in names:
        spec = attention.spec(name)
        if "kernel" not in declared(spec.options):
            out.append((name, "default", attention.get(name)))
            continue
        # Every kernel the variant names (LT_chunked's "pallas" chooses between its designs by
        # shape, recorded per row as ``design``; the explicit names time each design).
        for kernel in (k for k in spec.kernels if k != "auto"):
            if kernel != "xla" and not (kernels.on_gpu() or include_interpret):
                continue  # interpret mode, or a GPU-only kernel: no speed to measure here
            try:
                fn = attention.get(name, kernel=kernel, chunk_size=chunk_size)
            except (NotImplementedError, ValueError, kernels.KernelUnavailableError):
                continue
            out.append((name, kernel, fn))
    return out


def time_fn(f, args, warmup: int, repeats: int) -> float:
    for _ in range(warmup):
        jax.block_until_ready(f(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def design(name: str, kernel: str, B: int, T: int, H: int, D: int, c: int, dtype) -> str:
    """The implementation that runs (the spec's ``kernel_design``: for LT_chunked's ``pallas``
    the design it chose by shape), or '' where the variant names none."""
    spec = attention.spec(name)
    if spec.kernel_design is None or kernel == "default":
        return ""
    return spec.kernel_design((B, T, H, D), dtype, spec.options(kernel=kernel, chunk_size=c))


FLOP_COUNT = (
    "matmul FLOPs of causal attention: the quadratic forms' scores and weighted sums over the "
    "T (T + 1) / 2 causal pairs (the masked half not counted), the others as model.flops counts "
    "them; fwd+bwd x3"
)


def fwd_flops(name: str, B: int, T: int, H: int, D: int, c: int) -> float:
    """The forward's FLOPs the TFLOP/s columns divide by (:data:`FLOP_COUNT`)."""
    cfg = ModelConfig(n_layer=1, n_head=H, n_embd=H * D, attention=name, chunk_size=c)
    full = B * T * flops.attention_forward_flops_per_token(cfg, T)
    if attention.spec(name).flops is quadratic_flops:  # every query against all T keys
        return full * (T + 1) / (2 * T)
    return full


def recount(data: dict) -> dict:
    """A results file (this script's, or gpu_check's ``kernel_sweep_*`` with its ``meta``) with
    every timed row's TFLOP/s recomputed by :func:`fwd_flops`; the times are not touched."""
    settings = data.get("meta", {}).get("settings", data)
    shape, c = settings["shape"], settings["chunk_size"]
    names = set(attention.names())
    for row in data["rows"]:
        if row.get("seconds") and row.get("tflops") is not None and row["name"] in names:
            f = fwd_flops(row["name"], shape["B"], row["T"], shape["H"], shape["D"], c)
            row["tflops"] = f * (1 if row["mode"] == "fwd" else 3) / row["seconds"] / 1e12
    settings["flop_count"] = FLOP_COUNT  # beside the settings, where gpu_check's collect keeps it
    return data


def fla_rows(B, H, D, Ts, dtype_name, warmup, repeats):
    """flash-linear-attention's chunked linear attention on the same shapes, if installed."""
    try:
        import torch
        from fla.ops.linear_attn import chunk_linear_attn
    except ImportError as e:
        return [], f"flash-linear-attention not compared: {e} (optional: torch + fla)"
    if not torch.cuda.is_available():
        return [], "flash-linear-attention not compared: no CUDA device for torch"
    rows = []
    tdtype = getattr(torch, dtype_name)
    for T in Ts:
        q, k, v = (torch.randn(B, T, H, D, device="cuda", dtype=tdtype) for _ in range(3))
        for x in (q, k, v):
            x.requires_grad_(True)

        # Same [B, T, H, D] layout; fla's own feature map/normaliser conventions (a speed
        # reference, not the same function).
        def fwd(q=q, k=k, v=v):
            return chunk_linear_attn(q, k, v, normalize=True)[0]

        def fwdbwd(fwd=fwd):
            fwd().sum().backward()

        for mode, f in (("fwd", fwd), ("fwd+bwd", fwdbwd)):
            for _ in range(warmup):
                f()
            torch.cuda.synchronize()
            ts = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                f()
                torch.cuda.synchronize()
                ts.append(time.perf_counter() - t0)
            rows.append(dict(name="fla.chunk_linear_attn", kernel="fla", T=T, mode=mode,
                             seconds=statistics.median(ts), tflops=None, status="ok",
                             design=""))  # fmt: skip
    return rows, None


def run(args) -> dict:
    dtype = DTYPES[args.dtype]
    B, H, D, c = args.B, args.H, args.D, args.chunk_size
    Ts = []
    T = args.T_start
    while T <= args.T_max:
        Ts.append(T)
        T *= 2
    names = args.names or attention.names()
    rows = []
    for name, kernel, fn in configurations(names, c, args.interpret):
        fwd = jax.jit(fn)
        fwdbwd = jax.jit(lambda q, k, v, dy, fn=fn: jax.vjp(fn, q, k, v)[1](dy))
        limit = None
        for T in Ts:
            for mode in ("fwd", "fwd+bwd"):
                row = dict(name=name, kernel=kernel, T=T, mode=mode, seconds=None, tflops=None,
                           design=design(name, kernel, B, T, H, D, c, dtype))  # fmt: skip
                if limit is not None:
                    row["status"] = f"skipped ({limit})"
                    rows.append(row)
                    continue
                keys = jax.random.split(jax.random.key(T), 4)
                x = [jax.random.normal(kk, (B, T, H, D), dtype) for kk in keys]
                f, a = (fwd, x[:3]) if mode == "fwd" else (fwdbwd, x)
                try:
                    s = time_fn(f, a, args.warmup, args.repeats)
                except Exception as e:  # noqa: BLE001
                    if is_oom(e):
                        limit = f"out of memory at T={T}"
                    elif isinstance(e, kernels.KernelUnavailableError):
                        limit = "unavailable"
                    else:
                        raise
                    row["status"] = limit
                    rows.append(row)
                    continue
                flop = fwd_flops(name, B, T, H, D, c) * (1 if mode == "fwd" else 3)
                row.update(seconds=s, tflops=flop / s / 1e12, status="ok")
                rows.append(row)
                if s > args.max_seconds:
                    limit = f"slower than {args.max_seconds}s at T={T}"
                del x
    extra, note = ([], None)
    if not args.tiny:
        extra, note = fla_rows(B, H, D, Ts, args.dtype, args.warmup, args.repeats)
    else:
        note = "flash-linear-attention not compared in --tiny runs"
    return dict(
        **environment(),
        shape=dict(B=B, H=H, D=D, T=Ts),
        dtype=args.dtype,
        chunk_size=c,
        warmup=args.warmup,
        repeats=args.repeats,
        interpret_mode=not kernels.on_gpu(),
        flop_count=FLOP_COUNT,
        notes=[n for n in (note,) if n],
        rows=rows + extra,
    )


def table(result: dict) -> str:
    head = "| name | kernel | T | fwd ms | fwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |"
    lines = [head, "|---|---|---:|---:|---:|---:|---:|"]
    by = {}
    for r in result["rows"]:
        by.setdefault((r["name"], r["kernel"], r["T"]), {})[r["mode"]] = r

    def cell(r, key, scale, fmt):
        if r is None:
            return "-"
        if r.get("seconds") is None:
            return r.get("status", "-")
        # flash-linear-attention's rows carry no FLOP rate (its own function, not ours counted).
        v = r.get(key)
        return fmt.format(v * scale) if v is not None else "-"

    for (name, kernel, T), modes in by.items():
        f, fb = modes.get("fwd"), modes.get("fwd+bwd")
        chosen = (f or fb or {}).get("design") or ""
        if chosen and chosen != kernel:
            kernel = f"{kernel} ({chosen})"
        lines.append(
            f"| {name} | {kernel} | {T} | {cell(f, 'seconds', 1e3, '{:.3f}')} | "
            f"{cell(f, 'tflops', 1, '{:.3f}')} | {cell(fb, 'seconds', 1e3, '{:.3f}')} | "
            f"{cell(fb, 'tflops', 1, '{:.3f}')} |"
        )
    return "\n".join(lines)


def write(result: dict, out: Path) -> tuple[Path, Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    kind = "".join(ch if ch.isalnum() else "-" for ch in result["device_kind"]).strip("-")
    stem = out / f"bench_kernels-{kind}-{time.strftime('%Y%m%d-%H%M%S')}"
    json_path, csv_path, md_path = (stem.with_suffix(s) for s in (".json", ".csv", ".md"))
    json_path.write_text(json.dumps(result, indent=1))
    with open(csv_path, "w", newline="") as f:
        fields = ["name", "kernel", "T", "mode", "seconds", "tflops", "status", "design"]
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(result["rows"])
    header = (
        f"device {result['device_kind']}, jax {result['jax_version']}, commit "
        f"{result['git_commit'][:12]}, {result['dtype']}, B={result['shape']['B']} "
        f"H={result['shape']['H']} D={result['shape']['D']} c={result['chunk_size']}, median of "
        f"{result['repeats']} after {result['warmup']} warm-up"
        + (
            " (no GPU: Pallas kernels, when run, are in interpret mode)"
            if result["interpret_mode"]
            else ""
        )
    )
    notes = "".join(f"\n- {n}" for n in result["notes"])
    md_path.write_text(f"{header}\n\n{table(result)}\n{notes}\n")
    return json_path, csv_path, md_path


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny shapes, 1 repeat")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--names", nargs="*", default=None, help="attention names (default: all)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=12)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--T-start", type=int, default=1024)
    p.add_argument("--T-max", type=int, default=131072)
    p.add_argument("--chunk-size", type=int, default=64)
    p.add_argument("--dtype", choices=list(DTYPES), default="bfloat16")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--max-seconds", type=float, default=2.0)
    p.add_argument(
        "--interpret",
        action="store_true",
        help="off a GPU, also run the Pallas kernels (interpret mode; slow, not a speed)",
    )
    p.add_argument("--compare", action="store_true", help="LT_chunked vs cuDNN flash (below)")
    p.add_argument("--peer", choices=["fla"], help="flash-linear-attention on the same inputs")
    p.add_argument("--Ts", nargs="+", type=int, default=[1024, 4096, 16384, 65536])
    p.add_argument("--forget", nargs="+", default=["none", "resets+gate"],
                   choices=["none", "resets", "gate", "resets+gate"])  # fmt: skip
    p.add_argument("--reference", default=None, help="with --peer: the --compare run's --out")
    p.add_argument("--compile-threads", type=int, default=4)
    p.add_argument(
        "--recount",
        type=Path,
        default=None,
        help="rewrite this results file's TFLOP/s with the causal count (times unchanged)",
    )
    args = p.parse_args(argv)
    if args.tiny:
        args.B, args.H, args.D = 1, 2, 16
        args.T_start, args.T_max = 64, 64
        args.chunk_size = 16
        args.warmup, args.repeats = 1, 1
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.recount:
        data = recount(json.loads(args.recount.read_text()))
        args.recount.write_text(json.dumps(data, indent=1) + "\n")
        print(f"recounted the TFLOP/s of {args.recount}: {FLOP_COUNT}")
        return 0
    if args.compare or args.peer:
        import kernel_compare

        return kernel_compare.main(args)
    result = run(args)
    paths = write(result, args.out)
    print(paths[2].read_text())
    print("wrote " + ", ".join(str(p) for p in paths))
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
