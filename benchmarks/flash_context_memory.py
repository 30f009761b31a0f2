"""Issue 29's memory acceptance for ``flash`` under context parallelism: one layer's attention,
forward + backward, of the 124M model (12 heads of 64, bfloat16, batch 1) with the sequence split
over the 8 GPUs of one H100 node (mesh data=1 x seq=8), compiled on this (CPU) machine for the
``h100x8`` target (deviceless XLA; nothing runs).

``kernel=auto`` resolves, for the target's GPUs, to ring attention with cuDNN blocks
(kernels/flash/ring.py). Per context and ring layout (``zigzag``, the balanced default, and
``contiguous``): the per-device memory XLA's buffer assignment gives, the collective-permutes of
the compiled program (their per-hop bytes, from its HLO), the MODEL of the bytes one device sends
per layer, and the MODEL of the attention work on the ring's critical path.

    python benchmarks/flash_context_memory.py --context 65536 2097152

Writes ``flash_context_h100x8_compiled.json`` (``--out``, ``--stem``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from linear_gpt2 import attention  # noqa: E402
from linear_gpt2.kernels.flash import ring as flash_context  # noqa: E402
from linear_gpt2.platform import provenance, target  # noqa: E402
from linear_gpt2.platform.memory import GiB  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
TARGET = "h100x8"
B, H, D = 1, 12, 64
_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "pred": 1}


def permutes(hlo: str) -> list[dict]:
    """The collective-permutes of the optimised HLO: per hop the operands' types and shapes and
    their bytes, and whether the hop is inside a loop (the ring's N - 1 steps) or not."""
    out = []
    # A hop is a synchronous collective-permute or an asynchronous start/done pair (its done
    # gives the received arrays).
    for line in hlo.splitlines():
        m = re.search(r" = (.*?) collective-permute(?:-done)?\(", line)
        if not m:
            continue
        arrays = [
            (dtype, [int(x) for x in dims.split(",") if x])
            for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", m[1])
        ]
        out.append({
            "operands": [f"{d}{shape}" for d, shape in arrays],
            "bytes": sum(int(np.prod(shape)) * _BYTES[d] for d, shape in arrays),
            "in_loop": "/while/body/" in line,
            "in_backward": "transpose(" in line,
        })  # fmt: skip
    return out


def ring_bytes(hops: list[dict], n: int) -> dict:
    """Bytes one device sends per layer by the compiled program's hops: those in the ring's loop
    run N - 1 times (its trip count, ``flash_context.ring_attention``), the others once."""
    out = {"forward": 0, "backward": 0}
    for h in hops:
        out["backward" if h["in_backward"] else "forward"] += h["bytes"] * (
            n - 1 if h["in_loop"] else 1
        )
    return out


def compile_one(T: int, kernel: str, resets: bool, ring: str = "zigzag") -> dict:
    devs = np.array(target.devices(TARGET)).reshape(1, 8)
    mesh = Mesh(devs, ("data", "seq"))
    split = NamedSharding(mesh, P(None, "seq"))
    x = jax.ShapeDtypeStruct((B, T, H, D), jnp.bfloat16, sharding=split)
    fn = attention.get("flash", kernel=kernel, ring=ring)
    extra = (jax.ShapeDtypeStruct((B, T), jnp.bool_, sharding=split),) if resets else ()

    def f(q, k, v, dy, *r):
        y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, resets=r[0] if r else None), q, k, v)
        return y, vjp(dy)

    what = f"flash kernel={kernel} ring={ring} fwd+bwd [{B}, {T}, {H}, {D}] bf16 over seq=8"
    report, compiled = target.compile_program(
        jax.jit(f, out_shardings=(split, (split,) * 3)), (x, x, x, x, *extra), TARGET,
        what=what, keep_executable=True,
    )  # fmt: skip
    hlo = compiled.as_text()
    hops = permutes(hlo)
    row = {
        "context": T,
        "per_device_tokens": T // 8,
        "kernel": kernel,
        "ring": ring,
        "resets": resets,
        "cudnn_calls_in_hlo": len(re.findall(r'custom_call_target="__cudnn\$fmha', hlo)),
        "memory": report.memory.as_dict(),
        "memory_bytes": report.memory.total,
        "budget_bytes": report.target.budget_bytes,
        "fits": report.fits,
        "collective_permutes": hops,
        "modelled_ring_bytes": flash_context.modelled_ring_bytes(B, T, H, D, 8, 2, ring),
        "modelled_critical_blocks": flash_context.modelled_critical_blocks(8, ring),
        "compiled_ring_bytes": ring_bytes(hops, 8),
        "compile_seconds": report.seconds,
    }
    print(
        f"T={T} kernel={kernel} ring={ring} resets={resets}: "
        f"{report.memory.total / GiB:.2f} GiB per device, "
        f"cuDNN calls {row['cudnn_calls_in_hlo']}, permutes {row['collective_permutes']}",
        flush=True,
    )
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--context", type=int, nargs="+", default=[65536, 2097152])
    ap.add_argument("--kernel", default="auto")
    ap.add_argument("--ring", nargs="+", default=list(flash_context.RINGS))
    ap.add_argument("--out", type=Path, default=RESULTS, help="folder of the .json")
    ap.add_argument("--stem", default="flash_context_h100x8_compiled")
    args = ap.parse_args(argv)
    rows = [compile_one(T, args.kernel, False, ring) for T in args.context for ring in args.ring]
    env = provenance.environment()
    env["device_kind"] = "NVIDIA H100 x8 (compiled for, deviceless; no GPU here)"
    meta = {
        "how": "compiled",
        "environment": env,
        "settings": {
            "size": "124M (one layer's attention)", "attention": "flash", "kernel": args.kernel,
            "kernel_resolved": "ring attention, cuDNN blocks (kernels/flash/ring.py)",
            "batch": B, "heads": H, "head_dim": D, "dtype": "bfloat16", "mesh": "data=1 x seq=8",
            "what": "forward + backward (a VJP with a cotangent), inputs and outputs split over seq",
            "modelled_ring_bytes": "a MODEL: flash_context.modelled_ring_bytes (bytes one device "
            "sends per layer: forward (N-1)/N of K and V; backward K, V and float32 dK, dV; the "
            "balanced ring adds q, k, v and y to its layout and back)",
            "modelled_critical_blocks": "a MODEL: flash_context.modelled_critical_blocks (the "
            "busiest device's attention per layer, in [T/N, T/N] blocks; a causal block is half)",
            "command": "benchmarks/flash_context_memory.py " + " ".join(argv or sys.argv[1:]),
        },
    }  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"{args.stem}.json"
    path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(path)
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
