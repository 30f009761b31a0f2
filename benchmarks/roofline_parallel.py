"""The roofline MODEL of the ``LT_attention_parallel`` kernels on the H100: not a measurement.

The old flash-style kernels (``blocked``: one query block per program, shortest first, a
two-loop backward) against the tiled ones (``tiled``: resident 128-row blocks, longest first,
one backward kernel with atomic dq; ``tiled_dq``: the same forward with FlashAttention 2's two
backward kernels, no atomics), at B=1, H=12, D=64 and 128, T = 1k ... 512k, block size 64,
forward + backward in bfloat16, from ``linear_gpt2.kernels.lt_attention_parallel.cost``: the
bound with the loop steps' operand traffic from L2 (at an assumed L2 bandwidth) and without it,
the programs, the design ``kernel=pallas`` picks (``cost.choose``: the model's, a tiled one run
with the two-kernel backward, which an H200 measured faster), and per length the L2 bandwidth
above which the old bound would be below the atomic tiled one's; registers, shared
memory, spills and program counts compiled for the H100 at T = 16k (deviceless), every design,
with and without resets and gates; and the alternatives of the tiled design (resident block
size, launch order, dq by atomics or by a second kernel, key segments / split-K), priced by the
same model.

Run through ``benchmarks/roofline.py`` (``--op LT_attention_parallel``), which starts the
ptxas log before JAX; writes ``kernel_roofline_parallel_h100_model.{json,csv,md}``.
"""

from __future__ import annotations

import csv
import json
import re
from pathlib import Path

from linear_gpt2.experiments import compile_step
from linear_gpt2.kernels.lt_attention_parallel import cost as pcost
from linear_gpt2.kernels.lt_attention_parallel import plan as pplan
from linear_gpt2.platform.provenance import environment

B, H, S = 1, 12, 2  # bfloat16

PAR_DS = (64, 128)
PAR_C = 64
PAR_COMPILE_T = 16384
PAR_DESIGNS = ("blocked", "tiled", "tiled_dq")
PAR_KERNELS = {"blocked": pcost.BLOCKED, "tiled": pcost.TILED, "tiled_dq": pcost.TILED_DQ}


def parallel_kernels_of(design: str, T: int, D: int, c: int = PAR_C, l2=pcost.L2_BYTES, **kw):
    """The design's launches at B, T, H, D (a tiled one at its best tiling, T padded to its
    resident blocks), and that tiling (None for the old kernels)."""
    if design == "blocked":
        return pcost.blocked_kernels(B, T, H, D, S, pcost.blocked_tile(c, D), True, l2), None
    if design == "tiled_dq":
        tilings, kw = pplan.dq_candidates(c, D), {**kw, "dq": "kernel"}
    else:
        tilings = pplan.candidates(c, D)
    best = None
    for t in tilings:
        Tp = pplan.padded_length(T, t)
        ks = pcost.tiled_kernels(B, Tp, H, D, S, t, True, l2, **kw)
        if best is None or pcost.design_seconds(ks) < pcost.design_seconds(best[0]):
            best = (ks, t)
    return best


def crossover_l2(T: int, D: int) -> float | None:
    """The L2 bandwidth (bytes/s) above which the old kernels' modelled total would be below the
    tiled ones' at this length, or None where the tiled total is lower at any bandwidth
    (including unbounded: the plain model)."""

    def gap(l2):
        old = pcost.design_seconds(parallel_kernels_of("blocked", T, D, l2=l2)[0])
        return pcost.design_seconds(parallel_kernels_of("tiled", T, D, l2=l2)[0]) - old

    if gap(1e30) < 0:
        return None
    lo, hi = 1e11, 1e15  # tiled lower at lo (L2-bound), not at hi
    if gap(lo) >= 0:
        return 0.0
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if gap(mid) < 0 else (lo, mid)
    return lo


def parallel_resources(D: int, forget: bool) -> dict[str, dict[str, dict]]:
    """{design: {kernel: registers, shared memory, spills, programs, threads}} compiled for the
    H100 at B, PAR_COMPILE_T, H, D (deviceless)."""
    out = {}
    for design, kernel in PAR_KERNELS.items():
        r = compile_step.compile_attention(
            "LT_attention_parallel", (B, PAR_COMPILE_T, H, D), "bfloat16", "h100",
            chunk_size=PAR_C, kernel=kernel, resets=forget, log_gate=forget,
        )  # fmt: skip
        out[design] = {
            re.sub(r"__\d+$", "", k.name).removeprefix("lt_attention_parallel_"): {
                "registers": k.registers, "shared_memory": k.shared_memory,
                "spill_stores": k.spill_stores, "programs": k.programs, "threads": k.threads[0],
            }
            for k in r.kernels
        }  # fmt: skip
    return out


def parallel_rows(Ts, Ds) -> tuple[list[dict], list[dict]]:
    """Per-kernel rows and per-(D, T) summary rows."""
    rows, summary = [], []
    for D in Ds:
        for T in Ts:
            totals, tilings = {}, {}
            for design in PAR_DESIGNS:
                ks, tilings[design] = parallel_kernels_of(design, T, D)
                for k in ks:
                    rows.append(
                        dict(
                            D=D, T=T, design=design, kernel=k.name, programs=k.programs,
                            steps=k.steps, flops=k.flops, bytes=k.bytes, l2_bytes=k.l2_bytes,
                            intensity=round(k.intensity, 2), busy=round(k.busy, 3),
                            bound_us=k.seconds * 1e6, plain_bound_us=k.seconds_plain * 1e6,
                        )
                    )  # fmt: skip
                totals[design] = dict(
                    us=pcost.design_seconds(ks) * 1e6,
                    plain_us=pcost.design_seconds(ks, plain=True) * 1e6,
                    launches=len(ks),
                    min_programs=min(k.programs for k in ks if not k.name.startswith("xla")),
                )
            choice = pcost.choose(B, T, H, D, PAR_C, S)
            cross = crossover_l2(T, D) if T <= 65536 else None
            summary.append(
                dict(
                    D=D, T=T, c=PAR_C,
                    **{f"{d}_{k}": v for d in PAR_DESIGNS for k, v in totals[d].items()},
                    tiles=tilings["tiled"].describe(),
                    tiled_dq_tiles=tilings["tiled_dq"].describe(),
                    auto=choice.kernel + (f" {choice.tiles.describe()}" if choice.tiles else ""),
                    crossover_l2_tb_per_s=None if cross is None else cross / 1e12,
                )
            )  # fmt: skip
    return rows, summary


def parallel_choices(Ts=(4096, 16384, 131072), D=64) -> list[dict]:
    """The alternatives behind the tiled design, priced by the same model (fwd + bwd with
    launches; only the resident block sizes are built)."""
    out = []
    chosen = {T: parallel_kernels_of("tiled", T, D)[1] for T in Ts}
    for T in Ts:

        def row(choice, value, is_chosen, ks, note, T=T):
            out.append(
                dict(T=T, choice=choice, value=value, chosen=is_chosen,
                     bound_us=pcost.design_seconds(ks) * 1e6,
                     plain_bound_us=pcost.design_seconds(ks, plain=True) * 1e6, note=note)
            )  # fmt: skip

        for t in pplan.candidates(PAR_C, D):
            Tp = pplan.padded_length(T, t)
            ks = pcost.tiled_kernels(B, Tp, H, D, S, t, True)
            progs = min(k.programs for k in ks if not k.name.startswith("xla"))
            row("resident blocks", f"bq={t.bq}, bk={t.bk}", t == chosen[T], ks,
                f"{progs:,} programs; {t.describe()}")  # fmt: skip
        t = chosen[T]
        for order in ("longest first", "in order"):
            ks = pcost.tiled_kernels(B, T, H, D, S, t, True, order=order)
            fwd = next(k for k in ks if k.name == "tiled_fwd")
            row("launch order", order, order == "longest first", ks,
                f"forward SMs busy {fwd.busy:.0%}")  # fmt: skip
        for dq in ("atomic", "kernel"):
            ks = pcost.tiled_kernels(B, T, H, D, S, t, True, dq=dq)
            note = ("5 dots per tile pair, float32 atomics (pallas_tiled)" if dq == "atomic"
                    else "6 dots per tile pair, a second kernel (pallas_tiled_dq, at these "
                    "tiles): measured faster on an H200, " + pcost.MEASURED)  # fmt: skip
            row("dphi(q)", dq, dq == "kernel", ks, note)
        for seg in (1, 2, 4):
            ks = pcost.tiled_kernels(B, T, H, D, S, t, True, segments=seg)
            fwd = next(k for k in ks if k.name == "tiled_fwd")
            row(
                "key segments (forward split-K)",
                seg,
                seg == 1,
                ks,
                f"{fwd.programs:,} forward programs" + ("" if seg == 1 else "; not built"),
            )
    return out


# Both roofline files' device: a model, with the kernels' resources compiled for the H100.
MODELLED_DEVICE = (
    "NVIDIA H100 SXM (modelled; registers and shared memory compiled for it, deviceless)"
)


# Where both models' launch overhead comes from (linear_gpt2/platform/cards.py).
LAUNCH_ORIGIN = (
    "the H100's launch overhead, fitted by the step-time model to step times measured on an H100 "
    "(train_step_h100_model.json)"
)


def kept_model(out: Path, stem: str) -> tuple[dict, dict]:
    """The raw file ``stem``.json under ``out`` whose compiled resources ``--reprice`` keeps, and
    where they came from (the file and the commit that compiled them)."""
    path = out / f"{stem}.json"
    if not path.exists():
        raise SystemExit(f"error: --reprice needs {path} (run without --reprice to compile it)")
    old = json.loads(path.read_text())
    if not old["meta"]["settings"].get("compiled", True):
        raise SystemExit(f"error: {path} holds no compiled resources; run without --reprice")
    prev = old["meta"]["settings"].get("resources_from")
    commit = prev["commit"] if prev else old["meta"]["environment"]["git_commit"]
    return old, {"file": path.name, "commit": commit}


def parallel_json(summary, picks, env, resources, compiled: bool, kept: dict | None = None) -> dict:
    return {
        "meta": {
            "how": "modelled",
            "environment": {
                **env,
                "device_kind": MODELLED_DEVICE,
            },
            "settings": {
                "B": B, "H": H, "Ds": list(PAR_DS), "c": PAR_C, "dtype": "bfloat16",
                "pass": "forward + backward", "peak_tflops": pcost.PEAK_FLOPS / 1e12,
                "peak_tb_per_s": pcost.PEAK_BYTES / 1e12, "sms": pcost.SMS,
                "launch_us": pcost.LAUNCH_SECONDS * 1e6, "launch_origin": LAUNCH_ORIGIN,
                "l2_tb_per_s": pcost.L2_BYTES / 1e12,
                "l2_assumption": f"assumed, not measured: {pcost.L2_BYTES_PER_CLOCK} bytes per "
                f"clock (NVIDIA's A100 L2 read bandwidth; none published for the H100) at "
                f"{pcost.CLOCK_HZ / 1e9:.2f} GHz",
                "compile_T": PAR_COMPILE_T, "compiled": compiled,
                "pallas_measured": pcost.MEASURED,
                **({"resources_from": kept} if kept else {}),
            },
        },
        "summary": summary,
        "resources": resources,
        "choices": picks,
    }  # fmt: skip


def write_results(out: Path, stem: str, renderer: str, rows, model: dict) -> tuple[Path, ...]:
    """``stem``.csv (the rows), ``stem``.json (the model) and the page ``renderer`` makes of
    them, under ``out``; the LT_chunked files too (``roofline.py``)."""
    from studies import common as reports

    out.mkdir(parents=True, exist_ok=True)
    csv_path, json_path = out / f"{stem}.csv", out / f"{stem}.json"
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    json_path.write_text(json.dumps(model, indent=1) + "\n")
    md = reports.page(out / f"{stem}.md", reports.block(renderer, json_path.name, csv_path.name))
    return csv_path, json_path, md


def write_parallel(out: Path, rows, model: dict) -> tuple[Path, ...]:
    return write_results(
        out, "kernel_roofline_parallel_h100_model", "roofline.parallel_page", rows, model
    )


def main_parallel(args, Ts, compiled: bool):
    resources: dict = {}
    kept = None
    if getattr(args, "reprice", False):
        old, kept = kept_model(args.out, "kernel_roofline_parallel_h100_model")
        resources = old["resources"]
    elif compiled:
        for D in PAR_DS:
            for forget in (False, True):
                for design, kernels in parallel_resources(D, forget).items():
                    key = "with resets and gates" if forget else "plain"
                    resources.setdefault(design, {}).setdefault(str(D), {})[key] = kernels
    Ds = (64,) if args.tiny else PAR_DS
    rows, summary = parallel_rows(Ts, Ds)
    picks = [] if args.tiny else parallel_choices()
    model = parallel_json(
        summary, picks, environment(), resources, compiled or kept is not None, kept
    )
    return write_parallel(args.out, rows, model)
