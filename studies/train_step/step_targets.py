"""The measured gaps issue 30 sets as targets for the next GPU, and what the step MODEL predicts
concrete changes would do to each (:mod:`step_model`; nothing here is measured).

A change is an edit of a point's cost rows or of the model's parameters (:class:`step_model.
Change`): data a change removes or halves, a kernel priced at another kernel's efficiency,
host transfers overlapped with the computation. :func:`evaluate` prices every change of every
target on the point it concerns, alone and all together, beside the target.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from studies.train_step import step_model as sm
from studies.train_step.step_model import Change, Params

Rows = list[dict[str, Any]]


def _in(*parts: str, host: bool = False) -> Callable[[dict], bool]:
    """Data-moving rows (and host transfers with ``host``) of the given parts of the model."""
    return lambda r: r["part"] in parts and (sm.is_memory(r) or host and r["kind"] == "host")


def _halve_f32(where: Callable[[dict], bool]) -> Callable[[Rows], Rows]:
    """Float32 arrays of the matching rows in bfloat16: their f32 share of the bytes halved."""

    def edit(rows: Rows) -> Rows:
        return [dict(r, bytes=r["bytes"] * (1 - r.get("f32", 0.0) / 2)) if where(r) else r
                for r in rows]  # fmt: skip

    return edit


def _drop(where: Callable[[dict], bool]) -> Callable[[Rows], Rows]:
    return lambda rows: [r for r in rows if not where(r)]


def _overlap_host(rows: Rows) -> Rows:
    """Host transfers hidden behind the computation (priced apart by :func:`price`)."""
    return [dict(r, overlapped=True) if r["kind"] == "host" else r for r in rows]


def price(rows: Rows, p: Params) -> float:
    """:func:`step_model.predict`, except that rows marked ``overlapped`` (host transfers a
    change moved off the critical path) cost max(their time - the rest, 0)."""
    hidden = [r for r in rows if r.get("overlapped")]
    rest = sm.predict([r for r in rows if not r.get("overlapped")], p)
    return rest + max(0.0, sm.predict(hidden, p) - rest)


ACTIVATION_PARTS = ("saved activations", "layernorm", "residual", "unattributed")
BF16_ACTIVATIONS = Change(
    "bf16 residual stream",
    "the float32 activations the step moves (the residual stream, LayerNorm's inputs and "
    "outputs, what is saved for the backward and offloaded) in bfloat16: their bytes halved "
    "(a numerics trade-off: nanoGPT keeps the residual stream in float32 too)",
    rows=_halve_f32(_in(*ACTIVATION_PARTS, host=True)),
)
NO_SCAN_STACKING = Change(
    "no scan stacking",
    "the blocks unrolled instead of one nn.scan: no [n_layer, ...] buffers to zero-fill, no "
    "copies of each block's activations into them and back out (the kernels that only copy or "
    "fill are dropped; those that compute what they store stay)",
    rows=_drop(lambda r: sm.is_memory(r) and (
        r.get("role") == "fill" or r.get("role") == "copy" and r["part"] == "saved activations")),
)  # fmt: skip
FUSED_NORMS = Change(
    "LayerNorm and residual fused",
    "LayerNorm's forward and backward and the residual adds each one pass over the data "
    "(their traffic down to a third)",
    rows=lambda rows: sm.scale(rows, _in("layernorm", "residual"), bytes=1 / 3),
)
FAST_REDUCTIONS = Change(
    "reductions at elementwise bandwidth",
    "XLA's reduction and transpose kernels (bias and LayerNorm gradients, the loss, layout "
    "changes) at the bandwidth its elementwise kernels reach (the fitted elementwise fraction)",
    params=lambda p: dataclasses.replace(p, reduction=max(p.reduction, p.memory)),
)
PALLAS_AS_CUDNN = Change(
    "LT kernels' FLOPs as efficient as cuDNN's",
    "the Pallas kernels' FLOPs at the fraction of the peak cuDNN's flash attention reaches "
    "(the fitted flash fraction)",
    params=lambda p: dataclasses.replace(p, kernel=max(p.kernel, p.fmha)),
)
HOST_OVERLAPPED = Change(
    "offload overlapped",
    "the host transfers of remat=offload fully overlapped with the computation",
    rows=_overlap_host,
)
COMMON = [BF16_ACTIVATIONS, NO_SCAN_STACKING, FUSED_NORMS, FAST_REDUCTIONS]


def like_flash(flash: Rows) -> Change:
    """LT_chunked's attention glue (pads, slices, the feature map, layout changes around the
    kernels) no more than flash's: its attention-core data-moving rows replaced by flash's."""
    return Change(
        "attention glue as flash's",
        "the XLA kernels around the LT kernels (feature map, pads, slices, layout changes) "
        "no more traffic and launches than those around cuDNN's flash attention",
        rows=lambda rows: (
            [r for r in rows if not _in("attention core")(r)]
            + [dict(r) for r in flash if _in("attention core")(r)]
        ),
    )


def cudnn_at(fraction: float) -> Change:
    return Change(
        f"flash attention at {fraction:.0%} of peak",
        f"cuDNN's flash attention at {fraction:.0%} of the bf16 peak (FlashAttention-3's "
        "Hopper kernels report 60-75% at long sequences)",
        params=lambda p: dataclasses.replace(p, fmha=max(p.fmha, fraction)),
    )


def swap_pallas(donor: Rows) -> Change:
    return Change(
        "chunk-parallel kernel",
        "LT_attention_parallel's single-pass kernels replaced by the chunk-parallel kernels of "
        "LT_chunked at the same shape (the same function; issue 30 item 3)",
        rows=lambda rows: (
            [r for r in rows if r["kind"] != "kernel"]
            + [dict(r) for r in donor if r["kind"] == "kernel"]
        ),
    )


def apply_all(changes: list[Change], rows: Rows, p: Params) -> float:
    for c in changes:
        rows, p = c.rows([dict(r) for r in rows]), c.params(p)
    return price(rows, p)


@dataclasses.dataclass
class Target:
    name: str
    point: str  # the key of the point it concerns
    goal_ms: float
    now: str  # the measured figure, as the issue states it
    changes: list[Change]
    baseline: str | None = None  # "no slower than" this point's modelled time


def targets(rows_of: dict[str, Rows]) -> list[Target]:
    """Issue 30's five targets, with the changes priced on each (those whose points exist)."""
    common = COMMON
    glue = {size: [like_flash(rows_of[f"flash:{size}:1024"])]
            if f"flash:{size}:1024" in rows_of else [] for size in ("774M", "1.6B")}  # fmt: skip
    out = [
        Target("LT_chunked 124M at 64k <= 150 ms", "LT_chunked:124M:65536", 150.0,
               "260 ms (the post 289)", [PALLAS_AS_CUDNN, *common]),
        Target("LT_chunked no slower than flash at 1k, 774M", "LT_chunked:774M:1024", 0.0,
               "0.8% slower", [PALLAS_AS_CUDNN, *glue["774M"]], baseline="flash:774M:1024"),
        Target("LT_chunked no slower than flash at 1k, 1.6B", "LT_chunked:1.6B:1024", 0.0,
               "1.8% slower", [PALLAS_AS_CUDNN, *glue["1.6B"]], baseline="flash:1.6B:1024"),
        Target("LT_attention_parallel 124M at 16k <= 148 ms", "LT_attention_parallel:124M:16384",
               148.1, "206 ms", [*( [swap_pallas(rows_of["LT_chunked:124M:16384"])]
                                   if "LT_chunked:124M:16384" in rows_of else []),
                                 PALLAS_AS_CUDNN, *common]),
        Target("1M tokens <= 4.4 s", "LT_chunked:124M:1048576:offload:4096", 4400.0,
               "5.58 s with offload", [HOST_OVERLAPPED, PALLAS_AS_CUDNN, *common]),
        Target("flash 124M at 64k <= 700 ms", "flash:124M:65536", 700.0, "864 ms",
               [cudnn_at(0.6), *common]),
    ]  # fmt: skip
    return [t for t in out if t.point in rows_of and (t.baseline is None or t.baseline in rows_of)]


def evaluate(rows_of: dict[str, Rows], measured_ms: dict[str, float], p: Params) -> list[dict]:
    """Per target: measured and modelled now, each change's modelled time alone and all of them
    together, each also as the measured time scaled by the model's ratio (after / now), and
    whether that meets the goal (a "no slower than" target: the baseline's measured time)."""
    out = []
    for t in targets(rows_of):
        rows = rows_of[t.point]
        now = price(rows, p) * 1e3
        measured = measured_ms.get(t.point)
        goal = t.goal_ms if t.baseline is None else measured_ms.get(t.baseline)

        def scaled(ms: float, measured=measured, now=now) -> float | None:
            return None if measured is None else measured * ms / now

        changes = []
        for c in t.changes:
            ms = apply_all([c], rows, p) * 1e3
            changes.append({"name": c.name, "what": c.what, "ms": ms, "scaled_ms": scaled(ms)})
        together = apply_all(t.changes, rows, p) * 1e3
        best = scaled(together)
        out.append({
            "target": t.name, "point": t.point, "now": t.now, "goal_ms": goal,
            "baseline": t.baseline, "measured_ms": measured,
            "baseline_modelled_ms": price(rows_of[t.baseline], p) * 1e3 if t.baseline else None,
            "modelled_ms": now, "changes": changes, "all_changes_ms": together,
            "all_changes_scaled_ms": best,
            "met_by_all": None if best is None or goal is None else best <= goal,
            "breakdown_ms": {k: v * 1e3 for k, v in sm.breakdown(rows, p).items()},
            "model_error": None if measured is None else now / measured - 1,
            "baseline_model_error": (price(rows_of[t.baseline], p) * 1e3 / goal - 1)
            if t.baseline and goal else None,
            "baseline_breakdown_ms": {k: v * 1e3 for k, v in
                                      sm.breakdown(rows_of[t.baseline], p).items()}
            if t.baseline else None,
        })  # fmt: skip
    return out
