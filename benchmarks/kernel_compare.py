"""``bench_kernels.py --compare`` and ``--peer fla``: LT_chunked's kernels against cuDNN flash
and, on the same card and the same inputs, flash-linear-attention's Triton chunk kernels.

Inputs are drawn by numpy from a seed per (B, T, H, D), so the JAX process (``--compare``) and
the PyTorch one (``--peer fla``; the two frameworks are not given one GPU's memory at once) see
the same numbers: q, k, v and the output cotangent in bfloat16, with ``resets+gate`` a document
start in each row at a quarter, a half and three quarters plus one, and per-head log-gates
log U(0.9, 1). Both compute y_i = phi(q_i) S_i / (phi(q_i) . z_i + eps) with phi = softplus
(LT_chunked's default, applied outside fla's kernels): ``chunk_linear_attn`` (normalize=True,
scale 1) is that function without gates; ``chunk_simple_gla`` (scale 1) gives its numerator with
the gates, and the check divides by its run on v = 1. Resets are fla's ``cu_seqlens`` (the rows
and documents flattened to one sequence). Before a peer is timed its output at the first T is
checked against ours (``check_rel_err``, ||fla - ours|| / ||ours||); above the bfloat16
tolerance it is recorded and not timed. TFLOP/s use LT_chunked's FLOP count for every linear
implementation (``linear_gpt2.model.flops``), flash's for flash.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

BF16_TOL = 2e-2
EPS = 1e-6


def draw(B: int, T: int, H: int, D: int, forget: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([B, T, H, D])
    q, k, v, dy = (rng.standard_normal((B, T, H, D)).astype(np.float32) for _ in range(4))
    out = {"q": q, "k": k, "v": v, "dy": dy}
    if "resets" in forget:
        resets = np.zeros((B, T), bool)
        resets[:, [T // 4, T // 2, 3 * T // 4 + 1]] = True
        out["resets"] = resets
    if "gate" in forget:
        out["log_gate"] = np.log(rng.uniform(0.9, 1.0, (B, T, H))).astype(np.float32)
    return out


def _times(fn, warmup: int, repeats: int, sync) -> list[float]:
    for _ in range(warmup):
        sync(fn())
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sync(fn())
        ts.append((time.perf_counter() - t0) * 1e3)
    return ts


def _row(shape, forget, impl, T, mode, ts, flop, **extra) -> dict[str, Any]:
    B, H, D = shape
    ms = statistics.median(ts)
    return {"B": B, "H": H, "D": D, "forget": forget, "impl": impl, "T": T, "mode": mode,
            "status": "ok", "ms": ms, "min_ms": min(ts), "max_ms": max(ts), "times_ms": ts,
            "tflops": flop * (1 if mode == "fwd" else 3) / (ms / 1e3) / 1e12, **extra}  # fmt: skip


def flops(name: str, B: int, T: int, H: int, D: int, c: int = 64) -> float:
    from linear_gpt2.model import flops as model_flops
    from linear_gpt2.model.config import ModelConfig

    cfg = ModelConfig(n_layer=1, n_head=H, n_embd=H * D, attention=name, chunk_size=c)
    return B * T * model_flops.attention_forward_flops_per_token(cfg, T)


def ours(args) -> dict[str, Any]:
    """LT_chunked (``pallas`` on a GPU) under each forgetting, cuDNN flash where no gate."""
    from concurrent.futures import ThreadPoolExecutor

    import jax
    import jax.numpy as jnp

    from linear_gpt2 import attention, kernels
    from linear_gpt2.platform.provenance import allocator, environment

    gpu = kernels.on_gpu()
    lin_kernel, flash_kernel = ("pallas", "cudnn") if gpu else ("xla", "xla")
    shape, notes = (args.B, args.H, args.D), []
    if not gpu:
        notes.append("no GPU: the XLA paths, for checking the pipeline, not a speed")
    programs = []  # (forget, impl, T, mode, fn, arg names)
    for forget in args.forget:
        impls = [("LT_chunked", f"LT_chunked ({lin_kernel})", lin_kernel)]
        if "gate" not in forget:
            impls.append(("flash", f"flash ({flash_kernel})", flash_kernel))
        for name, label, kernel in impls:
            opts = {"chunk_size": args.chunk_size, "eps": EPS} if name == impls[0][0] else {}
            f = attention.get(name, kernel=kernel, **opts)
            for T in args.Ts:
                names = ["q", "k", "v", *(["resets"] if "resets" in forget else []),
                         *(["log_gate"] if "gate" in forget else [])]  # fmt: skip

                def fwd(q, k, v, *extra, f=f, names=tuple(names)):
                    kw = dict(zip(names[3:], extra))
                    return f(q, k, v, **kw)

                def fb(q, k, v, dy, *extra, fwd=fwd):
                    return jax.vjp(lambda a, b, c: fwd(a, b, c, *extra), q, k, v)[1](dy)

                programs.append((forget, label, name, T, "fwd", fwd, names))
                programs.append(
                    (forget, label, name, T, "fwd+bwd", fb, [*names[:3], "dy", *names[3:]])
                )

    def spec(name, B, T):
        H, D = args.H, args.D
        return {"q": (B, T, H, D, jnp.bfloat16), "k": (B, T, H, D, jnp.bfloat16),
                "v": (B, T, H, D, jnp.bfloat16), "dy": (B, T, H, D, jnp.bfloat16),
                "resets": (B, T, jnp.bool_), "log_gate": (B, T, H, jnp.float32)}[name]  # fmt: skip

    def compile_one(p):
        forget, label, name, T, mode, fn, names = p
        structs = [
            jax.ShapeDtypeStruct(spec(n, args.B, T)[:-1], spec(n, args.B, T)[-1]) for n in names
        ]
        try:
            return jax.jit(fn).lower(*structs).compile()
        except Exception as e:  # noqa: BLE001 - recorded as the row's status
            return e

    with ThreadPoolExecutor(max(1, args.compile_threads)) as pool:
        compiled = list(pool.map(compile_one, programs))
    rows = []
    for p, exe in zip(programs, compiled):
        forget, label, name, T, mode, fn, names = p
        if isinstance(exe, Exception):
            rows.append({"B": args.B, "H": args.H, "D": args.D, "forget": forget, "impl": label,
                         "T": T, "mode": mode, "status": f"error: {str(exe)[:200]}"})  # fmt: skip
            continue
        data = draw(args.B, T, args.H, args.D, forget)
        dev = [jnp.asarray(data[n], jnp.bfloat16 if n in "qkvdy" else None) for n in names]
        ts = _times(
            lambda exe=exe, dev=dev: exe(*dev), args.warmup, args.repeats, jax.block_until_ready
        )
        rows.append(
            _row(
                shape,
                forget,
                label,
                T,
                mode,
                ts,
                flops(name, args.B, T, args.H, args.D, args.chunk_size),
            )
        )
        if mode == "fwd" and name == "LT_chunked" and T == args.Ts[0]:
            y = np.asarray(exe(*dev), np.float32)
            np.savez(args.out / f"check_{forget.replace('+', '_')}.npz", y=y)
        del dev
    meta = {"how": "measured", "environment": environment(), "settings": {
        "B": args.B, "H": args.H, "D": args.D, "Ts": args.Ts, "forget": args.forget,
        "chunk_size": args.chunk_size, "eps": EPS, "warmup": args.warmup,
        "repeats": args.repeats, "dtype": "bfloat16", **allocator()}}  # fmt: skip
    return {"meta": meta, "rows": rows, "notes": notes}


def fla(args) -> dict[str, Any]:
    """flash-linear-attention on the same inputs, checked against ours first."""
    shape = (args.B, args.H, args.D)
    try:
        import torch
        import torch.nn.functional as F
        from fla.ops.linear_attn import chunk_linear_attn
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError as e:
        return {
            "meta": {"how": "measured"},
            "rows": [],
            "notes": [f"flash-linear-attention not run: {e} (its wheels: make gpu-wheels)"],
        }
    if not torch.cuda.is_available():
        return {
            "meta": {"how": "measured"},
            "rows": [],
            "notes": ["flash-linear-attention not run: no CUDA device for torch"],
        }
    from importlib import metadata

    rows, notes = [], []
    ref_dir = Path(args.reference) if args.reference else None
    for forget in args.forget:
        impls = ["chunk_simple_gla"] + ([] if "gate" in forget else ["chunk_linear_attn"])
        for impl in impls:
            check = None
            for T in args.Ts:
                d = draw(args.B, T, args.H, args.D, forget)
                bf = lambda x: torch.tensor(x, device="cuda").to(torch.bfloat16)  # noqa: E731
                q, k, v, dy = (bf(d[n]) for n in ("q", "k", "v", "dy"))
                g = torch.tensor(d["log_gate"], device="cuda") if "log_gate" in d else None
                cu = None
                if "resets" in d:  # rows and documents as one sequence
                    starts = sorted({b * T + t for b in range(args.B)
                                     for t in [0, *np.flatnonzero(d["resets"][b])]} | {args.B * T})  # fmt: skip
                    cu = torch.tensor(starts, device="cuda", dtype=torch.long)
                    q, k, v, dy = (x.reshape(1, args.B * T, args.H, args.D) for x in (q, k, v, dy))
                    g = None if g is None else g.reshape(1, args.B * T, args.H)

                def run(q=q, k=k, v=v, g=g, cu=cu, impl=impl):
                    fq, fk = F.softplus(q.float()).to(q.dtype), F.softplus(k.float()).to(k.dtype)
                    if impl == "chunk_linear_attn":
                        return chunk_linear_attn(
                            fq, fk, v, scale=1.0, normalize=True, cu_seqlens=cu
                        )[0]
                    return chunk_simple_gla(fq, fk, v, g=g, scale=1.0, cu_seqlens=cu)[0]

                if T == args.Ts[0]:
                    check = _check(run, v, forget, ref_dir, args, impl)
                    notes += [] if check is None else []
                if check is None or check > BF16_TOL:
                    status = (
                        "no reference from ours"
                        if check is None
                        else f"not equal to ours ({check:.1e})"
                    )
                    for mode in ("fwd", "fwd+bwd"):
                        rows.append({"B": args.B, "H": args.H, "D": args.D, "forget": forget,
                                     "impl": impl, "T": T, "mode": mode, "status": status,
                                     "check_rel_err": check})  # fmt: skip
                    continue
                for x in (q, k, v):
                    x.requires_grad_(True)

                def fb(run=run, dy=dy, q=q, k=k, v=v):
                    run().backward(dy)

                sync = lambda _: torch.cuda.synchronize()  # noqa: E731
                flop = flops("LT_chunked", args.B, T, args.H, args.D, args.chunk_size)
                with torch.no_grad():
                    rows.append(_row(shape, forget, impl, T, "fwd",
                                     _times(run, args.warmup, args.repeats, sync), flop,
                                     check_rel_err=check))  # fmt: skip
                rows.append(_row(shape, forget, impl, T, "fwd+bwd",
                                 _times(fb, args.warmup, args.repeats, sync), flop,
                                 check_rel_err=check))  # fmt: skip
    versions = {n: metadata.version(n) for n in ("torch", "triton", "fla-core")}
    meta = {"how": "measured", "settings": {"versions": versions, "check_T": args.Ts[0],
                                            "tolerance": BF16_TOL}}  # fmt: skip
    return {"meta": meta, "rows": rows, "notes": notes}


def _check(run, v, forget, ref_dir, args, impl) -> float | None:
    """||fla - ours|| / ||ours|| at the first T, with ours from the JAX unit's file."""
    import torch

    path = None if ref_dir is None else ref_dir / f"check_{forget.replace('+', '_')}.npz"
    if path is None or not path.is_file():
        return None
    ours_y = np.load(path)["y"].reshape(-1)
    with torch.no_grad():
        y = run().float()
        if impl == "chunk_simple_gla":  # its numerator; the normaliser is its run on v = 1
            den = run(v=torch.ones_like(v)).float()[..., :1]
            y = y / (den + EPS)
    y = y.cpu().numpy().reshape(-1)
    return float(np.linalg.norm(y - ours_y) / np.linalg.norm(ours_y))


def main(args) -> int:
    args.out.mkdir(parents=True, exist_ok=True)
    result = fla(args) if args.peer else ours(args)
    (args.out / "kernels.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    for r in result["rows"]:
        ms = f"{r['ms']:.3f} ms {r['tflops']:.1f} TFLOP/s" if r.get("ms") else r["status"]
        print(f"{r['impl']:<22} {r['forget']:<12} T={r['T']:<7} {r['mode']:<8} {ms}")
    for n in result["notes"]:
        print(f"note: {n}")
    return 0
