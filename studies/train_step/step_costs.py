"""The measured H100 step times, and each one's step compiled for the H100 here, priced per kernel.

:func:`measured_points` reads the step times a lent H100 measured
(``benchmarks/results/step_time_h100_*.json``, and the one-process-per-point memory check,
``memory_check_h100.json``, whose memory settings were given rather than chosen by ``auto``).
:func:`compile_point` compiles the trainer's step (``training.train_step.jit_train_step``: clip +
AdamW, state donated) for the H100 as that point ran it: the same attention, size, context and
chunk size, and, where the file did not record what ``model.remat`` / ``model.loss_chunk``
``auto`` resolved to, the first setting of ``memory_plan.LADDER`` whose compiled memory matches the
memory the device reported for the timed step (to :data:`MEMORY_MATCH`). :func:`cost_rows` turns
the optimized program (:mod:`hlo_costs`) into the rows :mod:`step_model` prices: one row per
distinct matmul, attention or Pallas launch, one per (op class, part, pass) for the launches that
only move data. Pallas kernels are priced by their own cost model (:func:`pallas_costs`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from linear_gpt2.experiments import hlo_costs
from linear_gpt2.kernels.head_loss import cost as head_loss_cost
from linear_gpt2.kernels.lt_attention_parallel import cost as parallel_cost
from linear_gpt2.kernels.lt_attention_parallel import plan as parallel_plan
from linear_gpt2.kernels.lt_chunked import cost as lt_cost
from linear_gpt2.kernels.lt_chunked import plan as lt_plan
from studies.train_step.step_time import SIZES

STEP_FILES = "step_time_h100_*.json"
CHECK_FILE = "memory_check_h100.json"
# A ladder setting "is" the timed one when its compiled memory is this close to the device's.
MEMORY_MATCH = 0.02
BF16 = 2


@dataclasses.dataclass(frozen=True)
class Point:
    """One measured step: what ran, its median time and the memory the device compiled it to."""

    attention: str
    size: str
    context: int
    chunk_size: int | None
    measured_ms: float
    memory_bytes: int
    source: str  # the raw file
    remat: str | None = None  # None: not recorded (``auto``'s choice: matched by memory)
    loss_chunk: int | None = None
    held_out: bool = False  # not used to fit the model
    batch: int = 1  # sequences per step (the measured steps: 1)
    # Blocks of the key features per head (``kernels.key_blocks``: an expanding feature map's
    # keys folded into the heads of the Pallas kernels); 1 for keys of the head dim.
    key_blocks: int = 1

    @property
    def key(self) -> str:
        return f"{self.attention}:{self.size}:{self.context}" + (
            f":{self.remat}:{self.loss_chunk}" if self.held_out else ""
        )


def measured_points(results: str | Path) -> list[Point]:
    """Every timed step on the H100: the step-time files' ``ok`` rows (fitted), then the memory
    check's rows (held out: other processes, settings given)."""
    results = Path(results)
    points = []
    for f in sorted(results.glob(STEP_FILES)):
        if f.name == CHECK_FILE:
            continue
        for r in json.loads(f.read_text()).get("results", []):
            if r.get("status") == "ok" and r.get("median_ms"):
                points.append(Point(r["attention"], r["size"], r["context"], r.get("chunk_size"),
                                    r["median_ms"], r["memory_bytes"], f.name,
                                    r.get("remat"), r.get("loss_chunk")))  # fmt: skip
    check = results / CHECK_FILE
    if check.exists():
        for r in json.loads(check.read_text()).get("rows", []):
            if r.get("status") == "ok" and r.get("median_ms"):
                points.append(Point(r["attention"], r["size"], r["context"], r.get("chunk_size"),
                                    r["median_ms"], r["compiled_bytes"], check.name, r["remat"],
                                    r["loss_chunk"], held_out=True))  # fmt: skip
    return points


# --------------------------------------------------------------------------------------------
# Pallas kernels: their own cost model


def _attention_parallel_costs(B: int, T: int, H: int, D: int, c: int) -> list[lt_cost.KernelCost]:
    """``LT_attention_parallel``'s single-pass kernels (``kernels/lt_attention_parallel/
    blocked.py``): grid (T/c, B, H); program n walks key blocks 0..n. Per [c, c] tile pair
    2 dots forward (scores, A V) and 6 backward (scores, dA, dV, dphi(K); dA, dphi(Q)); bytes
    compulsory (each input once, each output once)."""
    N, BH = T // c, B * H
    pairs = BH * N * (N + 1) // 2
    seq, rows = BH * T * D * BF16, BH * T * 4
    return [
        lt_cost.KernelCost("forward", N * BH, N, pairs * 4 * c * c * D, 4 * seq + rows),
        lt_cost.KernelCost("backward", N * BH, N + 1, pairs * 12 * c * c * D, 8 * seq + rows),
    ]


# The tiled designs' launches in ``lt_attention_parallel.cost`` -> the names their Pallas kernels
# are launched with (``tiled.py``, ``tiled_dq.py``).
_TILED_NAMES = {
    "tiled_fwd": "tiled_fwd",
    "tiled_bwd": "tiled_bwd",
    "tiled_bwd_dkv": "tiled_dkv",
    "tiled_bwd_dq": "tiled_dq",
}


def _attention_parallel_tiled_costs(
    B: int, T: int, H: int, D: int, c: int
) -> list[lt_cost.KernelCost]:
    """``LT_attention_parallel``'s tiled kernels, named as launched: ``pallas_tiled``'s forward
    and atomic backward, ``pallas_tiled_dq``'s key and query kernels (what ``kernel=pallas`` runs
    with the tiled forward), each design at the tiling ``cost.choose`` gives it, T padded to
    its resident blocks; FLOPs and compulsory bytes from ``kernels/lt_attention_parallel/
    cost.py`` (its steps: the longest program's loop steps)."""
    out = []
    for kernel, dq in ((parallel_cost.TILED, "atomic"), (parallel_cost.TILED_DQ, "kernel")):
        t = parallel_cost.choose(B, T, H, D, c, BF16, kernel).tiles
        Tp = parallel_plan.padded_length(T, t)
        for k in parallel_cost.tiled_kernels(B, Tp, H, D, BF16, t, True, dq=dq):
            if k.name in _TILED_NAMES:
                out.append(lt_cost.KernelCost(_TILED_NAMES[k.name], k.programs, k.steps,
                                              k.flops, k.bytes))  # fmt: skip
    return out


def pallas_costs(point: Point) -> dict[str, lt_cost.KernelCost]:
    """The cost models' kernels at ``point``'s shape, by the name their Pallas kernels are
    launched with (``LT_chunked``'s both designs, ``LT_attention_parallel``'s single pass, and
    at its points its tiled designs): a launch is priced by the entry of its name, whatever
    attention launched it."""
    dims = SIZES[point.size]
    B, T, H = point.batch, point.context, dims["n_head"] * point.key_blocks
    D = dims["n_embd"] // H
    Dp = max(16, 2 ** math.ceil(math.log2(D)))
    c = min(point.chunk_size or 64, T)
    ks = lt_cost.chunk_kernels(B, T, H, Dp, BF16, lt_cost.plan_blocks(B, T, H, Dp, c), True)
    ks += lt_cost.fused_kernels(B, T, H, Dp, BF16, lt_plan.fused_blocks(B, T, H, Dp, c), True)
    out = {"lt_chunked_" + k.name: k for k in ks if not k.name.startswith(("xla", "fwd_h ("))}
    parallel = _attention_parallel_costs(B, T, H, Dp, lt_plan.tile(c, Dp))
    if point.attention == "LT_attention_parallel":  # the only attention that launches them
        parallel += _attention_parallel_tiled_costs(B, T, H, Dp, c)
    for k in parallel:
        out["lt_attention_parallel_" + k.name] = k
    for k in head_loss_cost.kernel_costs(B * T, dims["vocab_size"], dims["n_embd"]):
        out[k.name] = k  # model.loss_kernel=pallas_fused (kernels/head_loss/)
    return out


# --------------------------------------------------------------------------------------------
# Cost rows

# Pallas kernels without a cost model of their own (issue 37's LayerNorm, bias + GELU and
# cross-entropy kernels: one pass over rows, no matmuls) move their operands once and their
# outputs once, as the HLO lists them; the cross-entropy kernel reads its logits twice (the
# online log-sum-exp, then the gradient: kernels/cross_entropy/fused.py), which the second read
# may find in L2 or not: counted as HBM.
_LOGITS_REREAD = ("cross_entropy",)


def _bytes(name: str, op: hlo_costs.Op) -> float:
    """HBM bytes of a Pallas launch that has no cost model: its operands and outputs, plus the
    logits' second read for the cross-entropy kernel (its input and output, the logits and their
    gradient, are the same size: half of what the HLO lists)."""
    return op.bytes * (1.5 if name in _LOGITS_REREAD else 1.0)


def cost_rows(ops: list[hlo_costs.Op], point: Point) -> list[dict[str, Any]]:
    """The rows :mod:`step_model` prices: each compute launch (matmul, flash, pallas) with its
    FLOPs, bytes and count (identical launches merged); the data-moving launches summed per
    (kind, part, pass), ``bytes`` their mean so that ``count x bytes`` is the total."""
    kernels = pallas_costs(point)
    merged: dict[tuple, dict[str, Any]] = {}
    for op in ops:
        base = {"kind": op.kind, "part": op.part, "backward": op.backward,
                "async": bool(op.detail.get("async"))}  # fmt: skip
        if op.kind == "kernel":
            name = op.detail.get("kernel", "")
            k = kernels.get(name)
            base.update(
                kernel=name,
                modelled=k is not None,
                programs=k.programs if k else math.prod(op.detail.get("grid") or [1]),
            )
            base.update(flops=k.flops if k else 0.0, bytes=k.bytes if k else _bytes(name, op))
        elif op.kind in ("matmul", "fmha"):
            base.update(flops=op.flops, bytes=op.bytes)
        if "flops" in base:
            key = tuple(sorted(base.items()))
            row = merged.setdefault(key, {**base, "count": 0})
            row["count"] += op.count
            continue
        base["fusion"] = op.detail.get("fusion")
        base["role"] = op.detail.get("role")
        key = tuple(base.values())
        row = merged.setdefault(key, {**base, "flops": 0.0, "bytes": 0.0, "count": 0, "f32": 0.0})
        row["bytes"] += op.bytes * op.count  # the totals until the means are taken below
        row["f32"] += op.bytes * op.count * op.detail.get("f32", 0.0)
        row["count"] += op.count
    out = []
    for key, row in merged.items():
        if isinstance(key[0], str) and row["count"]:  # a data-moving sum: bytes -> mean
            row["f32"] = row["f32"] / row["bytes"] if row["bytes"] else 0.0
            row["bytes"] /= row["count"]
        out.append(row)
    return out


# --------------------------------------------------------------------------------------------
# Compiling a point for the H100


def model_config(point: Point, remat: str, loss_chunk: int):
    from studies.train_step.step_time import model_config as cfg

    return cfg(point.size, point.attention, point.context, chunk_size=point.chunk_size,
               remat=remat, loss_chunk=loss_chunk)  # fmt: skip


def compile_setting(point: Point, remat: str, loss_chunk: int, target: str = "h100"):
    """(optimized HLO text, compiled memory in bytes, seconds) of ``point``'s step at one
    memory setting, compiled for ``target``."""
    import time

    from linear_gpt2.experiments.compile_step import mesh
    from linear_gpt2.platform.target import compile_program, get
    from linear_gpt2.training.config import TrainConfig
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.train_step import jit_train_step

    t = get(target)
    cfg = model_config(point, remat, loss_chunk)
    program = jit_train_step(cfg, optimizer(TrainConfig()), mesh(t), accum=1, batch=1)
    t0 = time.perf_counter()
    report, compiled = compile_program(
        program.step, program.args, t, keep_executable=True,
        what=f"{point.key} step (remat={remat}, loss_chunk={loss_chunk})",
    )  # fmt: skip
    return compiled.as_text(), report.memory.total, time.perf_counter() - t0


def ladder(point: Point) -> list[tuple[int, str]]:
    from linear_gpt2.training.memory_plan import LADDER

    if point.remat is not None and point.loss_chunk is not None:
        return [(point.loss_chunk, point.remat)]
    return list(LADDER)


def compile_point(point: Point, target: str = "h100", log=print) -> dict[str, Any]:
    """``point``'s step compiled for ``target`` at the memory setting it ran with, priced into
    cost rows: ``{"remat", "loss_chunk", "memory_bytes", "memory_match", "tried", "rows",
    "compile_seconds"}``."""
    tried, best = [], None
    for loss_chunk, remat in ladder(point):
        text, mem, seconds = compile_setting(point, remat, loss_chunk, target)
        match = mem / point.memory_bytes - 1
        tried.append({"remat": remat, "loss_chunk": loss_chunk, "memory_bytes": mem,
                      "match": match, "compile_seconds": seconds})  # fmt: skip
        log(f"{point.key} remat={remat} loss_chunk={loss_chunk}: {mem / 2**30:.2f} GiB, "
            f"device {point.memory_bytes / 2**30:.2f} GiB ({match:+.1%}), {seconds:.0f} s")  # fmt: skip
        if best is None or abs(match) < abs(best[0]["match"]):
            best = (tried[-1], text)
        if abs(match) <= MEMORY_MATCH:
            break
    assert best is not None
    chosen, text = best
    rows = cost_rows(hlo_costs.program_ops(text), point)
    return {
        "remat": chosen["remat"],
        "loss_chunk": chosen["loss_chunk"],
        "memory_bytes": chosen["memory_bytes"],
        "memory_match": chosen["match"],
        "settings_from": "given" if len(tried) == 1 and point.remat else "memory match",
        "tried": tried,
        "rows": rows,
    }
