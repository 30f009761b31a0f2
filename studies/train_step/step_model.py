"""A MODEL of the training step's time on the H100, priced per kernel of the compiled program.

Not a measurement. The step compiled for the H100 on the CPU machine (``step_costs``) is a list
of launches, each with its op class (:data:`hlo_costs.KINDS`), FLOPs, HBM bytes and how many
times the step runs it. Each launch is priced by a roofline at an achieved fraction of the H100's
peaks (:data:`linear_gpt2.platform.cards.H100`: dense bf16 FLOP/s, HBM bytes/s), plus a fixed
overhead per launch, and the launches are summed (one stream: XLA runs a step's kernels in
sequence):

- ``matmul`` (XLA's GEMM fusions, cuBLAS): ``max(F / (e_mm P), B / (e_bw W))``;
- ``flash`` (cuDNN's flash attention, FLOPs in closed form): ``max(F / (e_fa P), B / (e_bw W))``;
- ``pallas`` (our kernels): the kernel cost model's bound (``lt_chunked/cost.py``: the roofline
  over the share of the 132 SMs the grid occupies) with its FLOPs at ``e_pl`` of the peak and
  its bytes at ``e_bw`` of the bandwidth;
  The data-moving Pallas kernels of the step's glue (:data:`GLUE_KERNELS`: LayerNorm, bias,
  GELU, cross-entropy; no FLOPs counted) move their bytes at ``e_glue`` of the bandwidth where
  :attr:`Params.glue` is set, else at ``e_bw``: no H100 step time the fit ran holds them, and
  a GPU's glue A/B implies their own fraction (``report_model_vs_gpu.recalibrate``);
- ``elementwise`` (XLA's loop fusions, copies, the layer scan's stacking):
  ``B / (e_bw W)``; ``reduction`` (XLA's input fusions: reductions and transposes):
  ``B / (e_red W)``;
- ``host`` (offload to pinned host memory and back): ``B / HOST_BYTES_PER_S``, assumed, not
  fitted (no point of the fit offloads);
- every launch: ``launch_us``. Its fit is the H100's launch overhead the library prices with
  (``linear_gpt2.platform.cards.H100.launch_seconds``, rounded; ``tests/test_cards.py`` fails
  when the fit in ``benchmarks/results/train_step_h100_model.json`` moves away from it), and
  the fit starts from it.

The six fitted numbers (:data:`FITTED`) are fitted to the measured step times by least squares
on the logarithm of the ratio (:func:`fit`); everything else is read from the compiled program or
is an H100 datasheet constant.

The peaks the fractions are of are fields of :class:`Params` too, not fitted (the H100's by
default): :meth:`Params.on` prices the same compiled rows at the same fitted fractions on another
card's datasheet peaks (the H200's, whose glue A/B ``report_model_vs_gpu.py`` checks the MODEL
against). That is a MODEL of a MODEL: the fractions were fitted on the H100.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from linear_gpt2.kernels.lt_chunked import cost as lt_cost
from linear_gpt2.platform.cards import H100, Card

PEAK_FLOPS = H100.peak_bf16_flops
PEAK_BYTES = H100.hbm_bytes_per_s
HOST_BYTES_PER_S = H100.host_bytes_per_s  # assumed (cards.py)
FITTED = ("matmul", "fmha", "kernel", "memory", "reduction", "launch_us")
# The op classes a breakdown reports, in order ("launch" is the per-launch overhead).
CLASSES = ("matmul", "fmha", "kernel", "elementwise", "reduction", "host", "launch")
_MEMORY_KINDS = {"memory", "copy", "other"}
# The Pallas kernels of the step's glue, by the names their pallas_calls give them
# (linear_gpt2/kernels/{layernorm,bias_add,bias_gelu,cross_entropy}): they move bytes and count
# no FLOPs (tests/test_model_vs_gpu.py holds every kernel on file to one side or the other).
GLUE_KERNELS = ("layernorm_fwd", "layernorm_bwd", "bias_add_bwd", "bias_gelu_fwd",
                "bias_gelu_bwd", "cross_entropy")  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Params:
    """Achieved fractions of the H100's peaks per op class, and the overhead per launch (the
    defaults: the fit's starting point); the peaks they are fractions of (not fitted: the H100's
    unless :meth:`on` another card)."""

    matmul: float = 0.6
    fmha: float = 0.4  # cuDNN's flash attention
    kernel: float = 0.5  # the Pallas kernels
    memory: float = 0.8
    reduction: float = 0.5
    launch_us: float = H100.launch_seconds * 1e6
    # The glue kernels' fraction of the bandwidth (None: ``memory``'s, the assumption before a
    # GPU timed them); set from a GPU's glue A/B, not by :func:`fit`.
    glue: float | None = None
    host_bytes_per_s: float = HOST_BYTES_PER_S
    peak_flops: float = PEAK_FLOPS
    peak_bytes: float = PEAK_BYTES

    def on(self, card: Card) -> Params:
        """The same fitted fractions priced on ``card``'s datasheet peaks (dense bf16 FLOP/s,
        HBM bytes/s). The launch overhead stays this one's (the H100's fit: no other card's is
        measured), the host bandwidth too where the card records none; the Pallas kernels' SM
        shares are over the kernel cost model's SMs, so a card with another count is refused
        rather than priced wrong."""
        if not card.hbm_bytes_per_s:
            raise ValueError(f"{card.name}: no HBM bandwidth in cards.py; add its datasheet figure")
        if card.sms != lt_cost.SMS:
            raise ValueError(f"{card.name}: {card.sms} SMs, the kernel cost model prices "
                             f"{lt_cost.SMS}; price Pallas launches over its SMs first")  # fmt: skip
        return dataclasses.replace(
            self,
            peak_flops=card.peak_bf16_flops,
            peak_bytes=card.hbm_bytes_per_s,
            host_bytes_per_s=card.host_bytes_per_s or self.host_bytes_per_s,
        )

    def vector(self) -> list[float]:
        return [getattr(self, k) for k in FITTED]

    @classmethod
    def from_vector(cls, v: Sequence[float], **fixed: Any) -> Params:
        return cls(**dict(zip(FITTED, (float(x) for x in v))), **fixed)


def pallas_seconds(row: dict[str, Any], compute: float, memory: float) -> float:
    """Seconds of a Pallas launch: the kernel cost model's roofline (``lt_chunked/cost.py``:
    over the share of the SMs its grid occupies) with the FLOPs at ``compute`` of the peak and
    the bytes at ``memory`` of the bandwidth."""
    k = lt_cost.KernelCost(row.get("kernel", ""), int(row.get("programs") or lt_cost.SMS), 1,
                           row["flops"] / compute, row["bytes"] / memory)  # fmt: skip
    return k.seconds


def row_seconds(row: dict[str, Any], p: Params) -> float:
    """Modelled seconds of one run of a cost row's launch, without the launch overhead."""
    kind, f, b = row["kind"], row["flops"], row["bytes"]
    P, W = p.peak_flops, p.peak_bytes
    if kind == "matmul":
        return max(f / (p.matmul * P), b / (p.memory * W))
    if kind == "fmha":
        return max(f / (p.fmha * P), b / (p.memory * W))
    if kind == "kernel":
        memory = p.glue if p.glue is not None and is_glue_kernel(row) else p.memory
        # The kernel cost model prices at the H100's peaks: another card's are its fractions
        # scaled (by exactly 1 on the H100, so its prices are unchanged to the bit).
        return pallas_seconds(row, p.kernel * (P / lt_cost.PEAK_FLOPS),
                              memory * (W / lt_cost.PEAK_BYTES))  # fmt: skip
    if kind == "host":
        return b / p.host_bytes_per_s
    if row.get("fusion") == "input":
        return b / (p.reduction * W)
    return b / (p.memory * W)


def is_glue_kernel(row: dict[str, Any]) -> bool:
    """A launch of one of the glue's Pallas kernels (:data:`GLUE_KERNELS`)."""
    return row["kind"] == "kernel" and row.get("kernel") in GLUE_KERNELS


def class_of(row: dict[str, Any]) -> str:
    """The op class of a row (:data:`CLASSES`)."""
    if row["kind"] in _MEMORY_KINDS:
        return "reduction" if row.get("fusion") == "input" else "elementwise"
    return row["kind"]


def is_memory(row: dict[str, Any]) -> bool:
    """A data-moving launch (elementwise or reduction)."""
    return row["kind"] in _MEMORY_KINDS


def breakdown(rows: Sequence[dict[str, Any]], p: Params, by: str = "class") -> dict[str, float]:
    """Modelled seconds per op class (``by="class"``, launches apart as ``launch``) or per part
    of the model (``by="part"``, each launch's overhead with its part)."""
    out: dict[str, float] = {}
    for r in rows:
        n, t = r["count"], row_seconds(r, p)
        if by == "class":
            out[class_of(r)] = out.get(class_of(r), 0.0) + n * t
            out["launch"] = out.get("launch", 0.0) + n * p.launch_us * 1e-6
        else:
            key = r[by] if by != "pass" else ("backward" if r["backward"] else "forward")
            out[key] = out.get(key, 0.0) + n * (t + p.launch_us * 1e-6)
    return out


def predict(rows: Sequence[dict[str, Any]], p: Params) -> float:
    """Modelled seconds of one step."""
    return sum(r["count"] * (row_seconds(r, p) + p.launch_us * 1e-6) for r in rows)


def launches(rows: Sequence[dict[str, Any]]) -> int:
    return sum(r["count"] for r in rows)


def totals(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """FLOPs, bytes and launches per op class (what the compiled program holds, no model)."""
    out: dict[str, dict[str, float]] = {}
    for r in rows:
        t = out.setdefault(class_of(r), {"flops": 0.0, "bytes": 0.0, "launches": 0})
        t["flops"] += r["count"] * r["flops"]
        t["bytes"] += r["count"] * r["bytes"]
        t["launches"] += r["count"]
    return out


# --------------------------------------------------------------------------------------------
# Fitting


def log_errors(points: Sequence[tuple[list[dict], float]], p: Params) -> list[float]:
    """log(modelled / measured) per (rows, measured seconds) point."""
    return [math.log(predict(rows, p) / measured) for rows, measured in points]


_BOUNDS = {"matmul": (0.05, 1.0), "fmha": (0.05, 1.0), "kernel": (0.02, 1.0),
           "memory": (0.1, 1.0), "reduction": (0.05, 1.0), "launch_us": (0.0, 20.0)}  # fmt: skip
# Which of the card's measured ceilings bounds each fitted fraction (``bounds``): no kernel
# multiplies faster than the card's dense bf16 matmul (cuDNN's attention and the Pallas kernels
# are matmuls too), and none moves bytes faster than the card's measured HBM bandwidth.
CEILING_OF = {"matmul": "matmul_flops_per_s", "fmha": "matmul_flops_per_s",
              "kernel": "matmul_flops_per_s", "memory": "hbm_bytes_per_s",
              "reduction": "hbm_bytes_per_s"}  # fmt: skip


def bounds(ceilings: dict[str, float] | None = None) -> dict[str, tuple[float, float]]:
    """Each fitted constant's range: a fraction of a datasheet peak is at most the card's
    measured ceiling over that peak (``ceilings``: ``matmul_flops_per_s``,
    ``hbm_bytes_per_s``; where one is not given, the peak itself)."""
    peak = {"matmul_flops_per_s": PEAK_FLOPS, "hbm_bytes_per_s": PEAK_BYTES}
    out = dict(_BOUNDS)
    for k, c in CEILING_OF.items():
        if ceilings and ceilings.get(c):
            out[k] = (_BOUNDS[k][0], min(_BOUNDS[k][1], ceilings[c] / peak[c]))
    return out


def fit(
    points: Sequence[tuple[list[dict], float]],
    start: Params | None = None,
    free: Sequence[str] | None = None,
    limits: dict[str, tuple[float, float]] | None = None,
) -> Params:
    """The parameters ``free`` (the others as in ``start``) minimising the sum of squared log
    errors over ``points`` (each: cost rows, measured seconds), within ``limits`` (default
    :func:`bounds` without ceilings: a fraction of a peak is at most 1)."""
    limits = limits or bounds()
    from scipy.optimize import least_squares  # the fit only: rendering needs no SciPy

    start = start or Params()
    free = [k for k in FITTED if free is None or k in free]
    if not free:
        return start

    def params(v) -> Params:
        return dataclasses.replace(start, **dict(zip(free, (float(x) for x in v))))

    lo, hi = zip(*(limits[k] for k in free))
    x0 = [min(max(getattr(start, k), a), b) for k, a, b in zip(free, lo, hi)]
    best = least_squares(
        lambda v: log_errors(points, params(v)),
        x0,
        bounds=(lo, hi),
        x_scale="jac",
        ftol=1e-12,
        xtol=1e-12,
        gtol=1e-12,
    )
    return params(best.x)


def errors(points: Sequence[tuple[list[dict], float]], p: Params) -> list[float]:
    """Relative error modelled / measured - 1 per point."""
    return [math.exp(e) - 1 for e in log_errors(points, p)]


def summary(errs: Sequence[float]) -> dict[str, float]:
    a = [abs(e) for e in errs]
    return {"median_abs": statistics.median(a), "max_abs": max(a), "n": len(a)}


def leave_one_out(
    points: Sequence[tuple[list[dict], float]],
    p: Params,
    limits: dict[str, tuple[float, float]] | None = None,
) -> list[float]:
    """Each point's error with the parameters fitted (within ``limits``) to the other points
    (out of sample)."""
    out = []
    for i in range(len(points)):
        rest = [pt for j, pt in enumerate(points) if j != i]
        q = fit(rest, p, limits=limits)
        out.append(errors([points[i]], q)[0])
    return out


# --------------------------------------------------------------------------------------------
# Changes: what-ifs priced on a point's rows


@dataclasses.dataclass(frozen=True)
class Change:
    """A concrete change to the step, as an edit of its cost rows and/or the parameters."""

    name: str
    what: str
    rows: Callable[[list[dict]], list[dict]] = lambda rows: rows
    params: Callable[[Params], Params] = lambda p: p


def apply(change: Change, rows: list[dict], p: Params) -> float:
    return predict(change.rows([dict(r) for r in rows]), change.params(p))


def scale(rows: list[dict], where: Callable[[dict], bool], **factors: float) -> list[dict]:
    """Rows with ``flops`` / ``bytes`` / ``count`` multiplied where ``where(row)`` holds."""
    out = []
    for r in rows:
        if where(r):
            r = dict(r)
            for k, f in factors.items():
                r[k] = r[k] * f if k != "count" else max(0, round(r[k] * f))
        out.append(r)
    return out
