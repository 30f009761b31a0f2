"""Per-kernel roofline MODELS of the LT_chunked and LT_attention_parallel kernels on the H100:
not measurements.

**LT_chunked** (``kernel_roofline_h100_model.*``). For every kernel of three designs at B=1,
H=12, D=64 (the post's timing setting), T = 1k ... 512k and c = 64, 128, 256, forward + backward
in bfloat16:

- ``old``: the single-pass kernels as they were before the chunk-parallel rewrite (grid (B, H),
  one [c, c] score tile per chunk, one backward kernel with both loops);
- ``chunk``: the chunk-parallel kernels (``kernel=pallas_chunk``);
- ``fused``: the single pass as it is now (``kernel=pallas_fused_chunk``);

the table gives FLOPs, bytes to and from HBM, programs launched, chunks walked in sequence per
program, and the lower-bound time from ``linear_gpt2.kernels.lt_chunked.cost``: the roofline at
the H100's peaks (``linear_gpt2.platform.cards.H100``: dense bf16 FLOP/s, HBM bytes/s) divided
by the share of its SMs the launch can occupy. Totals add ``cost.LAUNCH_SECONDS`` per launch (the
card's launch overhead, fitted by the step-time model to measured H100 steps). The registers,
shared memory and spill columns are compile measurements (deviceless, ``linear_gpt2.platform.target``) of
the same kernels at T = 4096; the old kernel's come from compiling it at commit 5d0586d (it is
no longer in the tree). ``kernel=pallas`` picks the design with the lower modelled total, the
``auto`` column. A second section prices the alternatives behind the block sizes chosen in
``kernels/lt_chunked/plan.py`` (docs/design.md quotes it).

**LT_attention_parallel** (``kernel_roofline_parallel_h100_model.*``): its old flash-style
kernels against the tiled ones, D = 64 and 128, with compiled resources and the alternatives
behind the tiled design; the model and its files in ``roofline_parallel.py`` beside this script.

    python benchmarks/roofline.py              # compiles (registers, shared memory): minutes
    python benchmarks/roofline.py --no-compile # the models alone
    python benchmarks/roofline.py --reprice    # the models again, the compiled resources kept
                                               # from the raw files under --out (no compile)
    python benchmarks/roofline.py --op LT_attention_parallel   # one op's files only
    python benchmarks/roofline.py --tiny       # two lengths, one chunk size, no compile (tests)

Writes ``kernel_roofline_h100_model.{json,csv,md}`` and
``kernel_roofline_parallel_h100_model.{json,csv,md}`` under ``--out`` (default
benchmarks/results/).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.experiments import compile_step  # noqa: E402
from linear_gpt2.platform import kernel_report  # noqa: E402

if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    kernel_report.enable_ptxas_log()  # before JAX starts: registers and spills from ptxas

import roofline_parallel  # noqa: E402  (benchmarks/, beside this script)

from linear_gpt2.kernels.lt_chunked import cost, plan  # noqa: E402
from linear_gpt2.platform.provenance import environment  # noqa: E402

B, H, D, S = 1, 12, 64, 2  # bfloat16
TS = tuple(1024 * 2**i for i in range(10))  # 1k ... 512k
CS = (64, 128, 256)
DESIGNS = ("old", "chunk", "fused")

# The old kernels compiled for the H100 (deviceless, jax 0.11.2, ptxas 13) at commit 5d0586d:
# {c: {kernel: (registers, shared memory bytes, spill stores bytes)}}, or the compile error.
OLD_MEASURED = {
    64: {"old_fwd": (252, 49152, 0), "old_bwd": (255, 90368, 800)},
    128: {"old_fwd": (255, 81920, 1152), "old_bwd": (255, 213504, 5648)},
    256: "does not compile: 558,080 B of shared memory requested, 232,448 available",
}
COMPILE_T = 4096


def kernels_of(design: str, T: int, c: int) -> list[cost.KernelCost]:
    if design == "old":
        return cost.old_fused_kernels(B, T, H, D, S, c, True)
    if design == "chunk":
        return cost.chunk_kernels(B, T, H, D, S, cost.plan_blocks(B, T, H, D, c), True)
    return cost.fused_kernels(B, T, H, D, S, plan.fused_blocks(B, T, H, D, c), True)


def compiled_resources(design: str, c: int) -> dict[str, tuple[int | None, int, int | None]]:
    """{kernel: (registers, shared memory, spill stores)} of the design compiled for the H100."""
    if design == "old":
        old = OLD_MEASURED[c]
        return old if isinstance(old, dict) else {}
    kernel = {"chunk": "pallas_chunk", "fused": "pallas_fused_chunk"}[design]
    r = compile_step.compile_attention(
        "LT_chunked", (B, COMPILE_T, H, D), "bfloat16", "h100", chunk_size=c, kernel=kernel
    )
    out = {}
    for k in r.kernels:
        name = re.sub(r"__\d+$", "", k.name).removeprefix("lt_chunked_")
        out[name] = (k.registers, k.shared_memory, k.spill_stores)
    return out


def model_rows(Ts, Cs, resources) -> tuple[list[dict], list[dict]]:
    """Per-kernel rows and per-(T, c) summary rows."""
    rows, summary = [], []
    for c in Cs:
        for T in Ts:
            totals = {}
            for design in DESIGNS:
                ks = kernels_of(design, T, c)
                res = resources.get((design, c), {})
                for k in ks:
                    regs, smem, spill = res.get(k.name.replace(" (recomputed)", ""), (None,) * 3)
                    rows.append(
                        dict(
                            design=design, T=T, c=c, kernel=k.name, programs=k.programs,
                            steps=k.steps, flops=k.flops, bytes=k.bytes,
                            intensity=round(k.intensity, 2), sm_share=round(k.sm_share, 3),
                            bound_us=k.seconds * 1e6, registers=regs, shared_memory=smem,
                            spill_stores=spill,
                        )
                    )  # fmt: skip
                totals[design] = (
                    sum(k.seconds for k in ks) * 1e6,
                    cost.design_seconds(ks) * 1e6,
                    len(ks),
                    min(k.programs for k in ks if not k.name.startswith("xla")),
                )
            choice = cost.choose(B, T, H, D, c, S).kernel
            summary.append(
                dict(
                    T=T, c=c,
                    **{f"{d}_bound_us": totals[d][0] for d in DESIGNS},
                    **{f"{d}_with_launches_us": totals[d][1] for d in DESIGNS},
                    **{f"{d}_launches": totals[d][2] for d in DESIGNS},
                    **{f"{d}_min_programs": totals[d][3] for d in DESIGNS},
                    auto=choice,
                )
            )  # fmt: skip
    return rows, summary


# --------------------------------------------------------------------------------------------
# The alternatives behind the block sizes (plan.py), priced by the same model


def _sum(ks, names=None) -> float:
    return sum(k.seconds for k in ks if names is None or k.name.split(" ")[0] in names) * 1e6


def choices(Ts=(16384, 131072)) -> list[dict]:
    out = []
    for T in Ts:
        base = cost.plan_blocks(B, T, H, D, 64)
        N = T // 64
        for G in sorted({1, 4, 16, base.segments, 4 * base.segments, N}):
            b = dataclasses.replace(base, segments=G)
            ks = cost.chunk_kernels(B, T, H, D, S, b, True)
            out.append(
                dict(T=T, choice="segments G (state passes)", value=G,
                     chosen=G == base.segments,
                     bound_us=_sum(ks, {"fwd_h", "bwd_dh", "xla:"}),
                     note=f"{B * H * G} programs, {N // G} chunks each")
            )  # fmt: skip
        for bv in (64, 32, 16):
            b = dataclasses.replace(base, bv=bv)
            ks = cost.chunk_kernels(B, T, H, D, S, b, True)
            out.append(
                dict(T=T, choice="value block bv (fwd_h, fwd_o)", value=bv, chosen=bv == base.bv,
                     bound_us=_sum(ks, {"fwd_h", "fwd_o", "bwd_dh", "xla:"}),
                     note="scores recomputed per value block")
            )  # fmt: skip
        for grads in ((("dq", "dk", "dv"),), (("dq",), ("dk", "dv")), (("dq",), ("dk",), ("dv",))):
            b = dataclasses.replace(base, grad_kernels=grads)
            ks = cost.chunk_kernels(B, T, H, D, S, b, True)
            label = " + ".join("d" + "".join(x[1] for x in g) for g in grads)
            out.append(
                dict(T=T, choice="gradient kernels", value=label,
                     chosen=grads == base.grad_kernels,
                     bound_us=_sum(ks, {"bwd_dqkv", "bwd_dq", "bwd_dkv", "bwd_dk", "bwd_dv"}),
                     note="each kernel re-reads the chunk's inputs")
            )  # fmt: skip
        big = cost.plan_blocks(B, T, H, D, 256)
        for bt in (256, 128, 64, 32):
            b = dataclasses.replace(big, bt=bt)
            ks = cost.chunk_kernels(B, T, H, D, S, b, True)
            out.append(
                dict(T=T, choice="row tile bt at c=256", value=bt, chosen=bt == big.bt,
                     bound_us=_sum(ks),
                     note=f"{sum(k.flops for k in ks) / 1e9:.1f} GFLOP fwd+bwd")
            )  # fmt: skip
    return out


# --------------------------------------------------------------------------------------------
# Output


def model_json(summary, picks, env, resources, compiled: bool, kept: dict | None = None) -> dict:
    """The raw file of the model: ``meta`` (how, environment, the peaks and assumptions),
    ``summary`` per (T, c), ``resources`` per design, c and kernel, ``choices``; ``kept``: where
    resources compiled by an earlier run came from (``--reprice``)."""
    res: dict[str, dict[str, object]] = {}
    for (design, c), kernels in resources.items():
        if design == "old" and not isinstance(OLD_MEASURED[c], dict):
            res.setdefault(design, {})[str(c)] = OLD_MEASURED[c]
            continue
        res.setdefault(design, {})[str(c)] = {
            name: {"registers": r, "shared_memory": m, "spill_stores": sp}
            for name, (r, m, sp) in kernels.items()
        }
    return {
        "meta": {
            "how": "modelled",
            "environment": {
                **env,
                "device_kind": roofline_parallel.MODELLED_DEVICE,
            },
            "settings": {
                "B": B, "H": H, "D": D, "dtype": "bfloat16", "pass": "forward + backward",
                "peak_tflops": cost.PEAK_FLOPS / 1e12, "peak_tb_per_s": cost.PEAK_BYTES / 1e12,
                "sms": cost.SMS, "launch_us": cost.LAUNCH_SECONDS * 1e6,
                "launch_origin": roofline_parallel.LAUNCH_ORIGIN, "compile_T": COMPILE_T,
                "compiled": compiled, **({"resources_from": kept} if kept else {}),
                "old_kernel_resources": "compiled at commit 5d0586d (no longer in the tree)",
            },
        },
        "summary": summary,
        "resources": res,
        "choices": picks,
    }  # fmt: skip


def write(out: Path, rows, model: dict) -> tuple[Path, ...]:
    return roofline_parallel.write_results(
        out, "kernel_roofline_h100_model", "roofline.page", rows, model
    )


def kept_resources(out: Path) -> tuple[dict, dict]:
    """The compiled resources of the raw file under ``out`` as :func:`compiled_resources` gives
    them, and where they came from (``--reprice``)."""
    old, kept = roofline_parallel.kept_model(out, "kernel_roofline_h100_model")
    resources = {}
    for design, per_c in old["resources"].items():
        for c, kernels in per_c.items():
            resources[(design, int(c))] = (
                {n: (k["registers"], k["shared_memory"], k["spill_stores"]) for n, k in kernels.items()}
                if isinstance(kernels, dict)
                else {}
            )  # fmt: skip
    return resources, kept


def main_chunked(args, Ts, Cs, compiled: bool):
    resources, kept = {}, None
    if args.reprice:
        resources, kept = kept_resources(args.out)
    elif compiled:
        for c in Cs:
            for design in DESIGNS:
                resources[(design, c)] = compiled_resources(design, c)
    rows, summary = model_rows(Ts, Cs, resources)
    picks = [] if args.tiny else choices()
    model = model_json(summary, picks, environment(), resources, compiled or args.reprice, kept)
    return write(args.out, rows, model)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument("--no-compile", action="store_true", help="the models alone, no resources")
    p.add_argument("--tiny", action="store_true", help="T = 1k, 4k; c = 64; no compile")
    p.add_argument(
        "--reprice", action="store_true",
        help="price the models again, keeping the compiled resources of the raw files under "
        "--out (no compile; after a change of the model's constants)",
    )  # fmt: skip
    p.add_argument(
        "--op", choices=("all", "LT_chunked", "LT_attention_parallel"), default="all",
        help="which op's files to write",
    )  # fmt: skip
    args = p.parse_args(argv)
    Ts, Cs = ((1024, 4096), (64,)) if args.tiny else (TS, CS)
    if args.reprice and (args.tiny or args.no_compile):
        p.error("--reprice keeps the compiled resources of the full tables: without --tiny or "
                "--no-compile")  # fmt: skip
    compiled = not (args.tiny or args.no_compile or args.reprice)
    written = []
    if args.op in ("all", "LT_chunked"):
        written += main_chunked(args, Ts, Cs, compiled)
    if args.op in ("all", "LT_attention_parallel"):
        written += roofline_parallel.main_parallel(args, Ts, compiled)
    for md in written[2::3]:
        print(md.read_text())
    print("wrote " + ", ".join(str(x) for x in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
