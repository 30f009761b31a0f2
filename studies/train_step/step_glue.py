"""The glue of the training step (issue 37): bytes moved and launches by op class and part of the
model, before and after the fused kernels, compiled for the H100, with the step-time MODEL.

The points (:data:`POINTS`) are compiled by ``benchmarks/step_glue.py`` (the "before" program with
main's own code, the "after" one with this tree's), each launch of the optimized program read by
:mod:`hlo_costs` into the cost rows of :mod:`step_costs`. :func:`summarise` totals them: bytes,
FLOPs and launches are what the compiled program holds (exact); milliseconds are
:mod:`step_model`'s roofline at the fitted constants of ``train_step_h100_model.json`` (a MODEL).
``glue`` is the data-moving traffic: XLA's elementwise kernels (loop fusions, copies, the layer
scan's stacking) and its reductions and transposes (input fusions).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from linear_gpt2.experiments import hlo_costs
from linear_gpt2.kernels.head_loss import cost as head_loss_cost
from studies.train_step import step_costs
from studies.train_step import step_model as sm

K = 1024


@dataclasses.dataclass(frozen=True)
class GluePoint:
    """One compiled step: what runs and its memory setting (``remat``, ``loss_chunk`` as the
    measured step ran it, or ``auto``'s choice on the H100 where none was measured)."""

    attention: str
    size: str
    context: int
    batch: int = 1
    chunk_size: int | None = None
    remat: str = "none"
    loss_chunk: int = 0

    @property
    def key(self) -> str:
        b = f"{self.batch}x" if self.batch > 1 else ""
        return f"{self.attention}:{self.size}:{b}{self.context}"

    @property
    def measured_key(self) -> str | None:
        """The point of ``train_step_h100_model.json`` timed on the lent H100 at the same
        setting, if any."""
        if self.batch != 1:
            return None
        if self.context > 64 * K:
            return f"{self.attention}:{self.size}:{self.context}:{self.remat}:{self.loss_chunk}"
        return f"{self.attention}:{self.size}:{self.context}"


def _pair(size: str, context: int, batch: int = 1, chunk: int = 128, **kw) -> list[GluePoint]:
    return [GluePoint("LT_chunked", size, context, batch, chunk, **kw),
            GluePoint("flash", size, context, batch, None, **kw)]  # fmt: skip


# The settings are the measured steps' (train_step_h100_model.json: chunk sizes and memory
# settings as they ran); 16 x 1k is the post's 124M training micro-step (configs/post/).
POINTS: list[GluePoint] = [
    *_pair("124M", 64 * K, chunk=64, loss_chunk=4096),
    *_pair("124M", 1 * K),
    *_pair("124M", 1 * K, batch=16),
    *_pair("355M", 1 * K),
    *_pair("774M", 1 * K),
    *_pair("1.6B", 1 * K),
    GluePoint("LT_chunked", "124M", 1024 * K, 1, 64, "offload", 4096),
]


# "after": every glue kernel asked for by name (``auto`` keeps XLA's program until a GPU has
# run them: kernels/choice.py); "before" is an older tree, which has no such options.
AFTER_KERNELS = {f"{k}_kernel": "pallas" for k in ("layernorm", "mlp", "loss", "bias")}
# Issue 37's two switches (item 4), each label "after" with some of them on, compiled at the
# points of the targets that the kernels alone did not reach: "unrolled", the blocks
# unrolled (no stacking of per-layer activations; the same function, nanoGPT's numerics), and
# "switches", those and the residual stream in bfloat16 as well (half its bytes; not nanoGPT's).
UNROLLED = {"scan_layers": False}
# The labels read as the scanned step ("after", the fused head) name the scan: model.scan_layers'
# auto unrolls the blocks for a GPU target now, and their compiles on file were scanned.
SCANNED = {"scan_layers": True}
SWITCHES = {**UNROLLED, "residual_dtype": "bfloat16"}
SWITCH_LABELS = ("unrolled", "switches")
_TARGETS_124M = ("LT_chunked:124M:65536", "flash:124M:65536", "LT_chunked:124M:16x1024",
                 "flash:124M:16x1024")  # fmt: skip
# The points each switch label is compiled at: the 124M targets for both; for "unrolled" also
# both attentions at 1k, batch 1, for every size (the target LT_chunked <= flash at 1k, read
# with the blocks unrolled too, and 124M beside it).
LABEL_POINTS: dict[str, tuple[str, ...]] = {
    "unrolled": (*_TARGETS_124M, *(f"{a}:{s}:1024" for s in ("124M", "355M", "774M", "1.6B")
                                   for a in ("LT_chunked", "flash"))),
    "switches": _TARGETS_124M,
}  # fmt: skip
LABELS = ("before", "after", *SWITCH_LABELS)
# The head and loss priced by the real fused kernel pair (kernels/head_loss/): "after" with
# model.loss_kernel=pallas_fused, compiled at the long-context points only.
FUSED_HEAD = "fused_head"
FUSED_HEAD_KERNELS = {**AFTER_KERNELS, "loss_kernel": "pallas_fused"}
OVERRIDES: dict[str, dict[str, Any]] = {
    "before": {}, "after": {**AFTER_KERNELS, **SCANNED}, "unrolled": {**AFTER_KERNELS, **UNROLLED},
    "switches": {**AFTER_KERNELS, **SWITCHES}, FUSED_HEAD: {**FUSED_HEAD_KERNELS, **SCANNED},
}  # fmt: skip
# phi' in LT_chunked's gradient kernels (an elementwise feature map's raw q, k into the Pallas
# op: docs/design.md): "unrolled"'s options compiled by the tree that has it, at its LT_chunked
# points; its "before" is "unrolled" itself, compiled by a tree without it.
PHI_GRAD = "phi_grad"
PHI_GRAD_POINTS = ("LT_chunked:124M:65536", "LT_chunked:124M:16x1024")
OVERRIDES[PHI_GRAD] = OVERRIDES["unrolled"]
LABEL_POINTS[PHI_GRAD] = PHI_GRAD_POINTS
# LT_chunked's single-pass design forced at 1k, batch 1 (``kernels/lt_chunked/ops.py``: one
# program per (batch, head) walking all chunks, 4 Pallas launches and one XLA fusion per layer
# against the chunk-parallel design's many): "unrolled"'s options with
# ``kernel=pallas_fused_chunk`` at LT_chunked's 1k points, read against "unrolled"'s flash.
FUSED_1K = "fused_1k"
OVERRIDES[FUSED_1K] = {**OVERRIDES["unrolled"], "kernel": "pallas_fused_chunk"}
LABEL_POINTS[FUSED_1K] = tuple(f"LT_chunked:{s}:1024" for s in ("124M", "355M", "774M", "1.6B"))


def spec(point: GluePoint, label: str) -> dict[str, Any]:
    """What the compile worker builds: the model options of ``point`` and those of ``label``
    (:data:`OVERRIDES`: none for "before", the glue kernels for "after", those and switches for
    the :data:`SWITCH_LABELS`)."""
    overrides = {"remat": point.remat, "loss_chunk": point.loss_chunk, **OVERRIDES[label]}
    return {
        "attention": point.attention, "size": point.size, "context": point.context,
        "batch": point.batch, "chunk_size": point.chunk_size, "overrides": overrides,
    }  # fmt: skip


def cost_point(point: GluePoint) -> step_costs.Point:
    """The :class:`step_costs.Point` whose shape prices ``point``'s Pallas kernels."""
    return step_costs.Point(point.attention, point.size, point.context, point.chunk_size, 0.0, 0,
                            "compiled", point.remat, point.loss_chunk, batch=point.batch)  # fmt: skip


GLUE = ("elementwise", "reduction")
ATTENTION = "attention core"


def _what(op: hlo_costs.Op, op_name: str) -> str:
    """What a launch of the attention core runs: the Pallas kernel's name, cuDNN's flash
    attention, an XLA GEMM, or an XLA fusion named by its kind (XLA's name for it, its number
    dropped) and the JAX primitive its ``op_name`` ends in."""
    if op.kind == "kernel":
        return op.detail.get("kernel") or "Pallas kernel"
    if op.kind == "fmha":
        return "cuDNN flash attention"
    if op.kind == "matmul":
        return "XLA GEMM"
    stem = re.sub(r"\.\d+$", "", op.name)
    return f"XLA {stem} ({op_name.rsplit('/', 1)[-1] or '?'})"


def attention_rows(text: str, point: GluePoint) -> list[dict[str, Any]]:
    """The attention core's launches of an optimized program, as cost rows (``step_costs``)
    grouped by what runs (:func:`_what`) and pass, each with ``what``: the finer view that
    :func:`price`'s part "attention core" sums."""
    module = hlo_costs.parse_module(text)
    names = {i.name: i.op_name for c in module.computations.values() for i in c.instrs}
    groups: dict[tuple[str, bool], list[hlo_costs.Op]] = {}
    for op in hlo_costs.walk(module):
        if op.part == ATTENTION:
            groups.setdefault((_what(op, names.get(op.name, "")), op.backward), []).append(op)
    return [{"what": what, **row}
            for (what, _), ops in groups.items()
            for row in step_costs.cost_rows(ops, cost_point(point))]  # fmt: skip


def price_attention(rows: list[dict[str, Any]], params: sm.Params) -> list[dict[str, Any]]:
    """:func:`attention_rows` priced: per (what, pass) the launches, bytes and MODEL ms (its
    launches' overhead apart, ``launch_ms``), in program order of first appearance."""
    out: dict[tuple[str, bool], dict[str, Any]] = {}
    for r in rows:
        o = out.setdefault((r["what"], r["backward"]), {
            "what": r["what"], "backward": r["backward"], "class": sm.class_of(r),
            "launches": 0, "bytes": 0.0, "ms": 0.0, "launch_ms": 0.0})  # fmt: skip
        o["launches"] += r["count"]
        o["bytes"] += r["count"] * r["bytes"]
        o["ms"] += r["count"] * sm.row_seconds(r, params) * 1e3
        o["launch_ms"] += r["count"] * params.launch_us * 1e-3
    return list(out.values())


def price(rows: list[dict[str, Any]], params: sm.Params) -> dict[str, Any]:
    """Exact totals of one compiled step and its MODEL time: by op class and by part of the
    model (bytes, launches; MODEL ms with each launch's overhead in its part)."""
    by_class = {k: dict(v) for k, v in sm.totals(rows).items()}
    for k, ms in sm.breakdown(rows, params).items():
        by_class.setdefault(k, {"flops": 0.0, "bytes": 0.0, "launches": 0})["ms"] = ms * 1e3
    by_part: dict[str, dict[str, float]] = {}
    for r in rows:
        p = by_part.setdefault(r["part"], {"bytes": 0.0, "launches": 0, "glue_bytes": 0.0})
        p["bytes"] += r["count"] * r["bytes"]
        p["launches"] += r["count"]
        if sm.class_of(r) in GLUE:
            p["glue_bytes"] += r["count"] * r["bytes"]
    for k, ms in sm.breakdown(rows, params, by="part").items():
        by_part[k]["ms"] = ms * 1e3
    return {
        "ms": sm.predict(rows, params) * 1e3,
        "launches": sm.launches(rows),
        "bytes": sum(v["bytes"] for v in by_class.values()),
        "glue_bytes": sum(by_class.get(k, {}).get("bytes", 0.0) for k in GLUE),
        "by_class": by_class,
        "by_part": by_part,
    }


def _target(name: str, now: dict, goal: str, met: bool | None, **extra) -> dict[str, Any]:
    return {"target": name, "goal": goal, "met": met, "met_scaled": None, **now, **extra}


def _bound(t: dict[str, Any], limit: float) -> dict[str, Any]:
    """``t`` with ``met_scaled``: the measured time scaled by the MODEL's ratio within
    ``limit`` (None where the point was not timed)."""
    if t.get("scaled_ms") is not None:
        t["met_scaled"] = t["scaled_ms"] <= limit
    return t


def targets(points: dict[str, dict[str, Any]], measured: dict[str, float]) -> list[dict]:
    """Issue 37's targets, each read from the "after" MODEL (and, where the point was timed,
    the measured time scaled by the MODEL's after / before ratio)."""

    def row(key: str) -> dict[str, Any] | None:
        p = points.get(key)
        if not p or "after" not in p or "before" not in p:
            return None
        after, before = p["after"]["ms"], p["before"]["ms"]
        m = measured.get(p["measured_key"] or "")
        out = {"key": key, "before_ms": before, "after_ms": after,
               "measured_ms": m, "scaled_ms": None if m is None else m * after / before,
               "after_glue_gb": p["after"]["glue_bytes"] / 1e9,
               "before_glue_gb": p["before"]["glue_bytes"] / 1e9}  # fmt: skip
        for label in SWITCH_LABELS:  # the kernels and a switch or two (OVERRIDES)
            if label in p:
                sw = p[label]["ms"]
                out |= {f"{label}_ms": sw, f"{label}_glue_gb": p[label]["glue_bytes"] / 1e9,
                        f"scaled_{label}_ms": None if m is None else m * sw / before}  # fmt: skip
        if FUSED_1K in p:
            out[f"{FUSED_1K}_ms"] = p[FUSED_1K]["ms"]
        return out

    def switched(t: dict[str, Any], ok) -> dict[str, Any]:
        """``t`` with ``met_<label>`` for each of the :data:`SWITCH_LABELS` compiled at its
        point: whether ``ok(t, label)``, the target read from that label's MODEL."""
        for label in SWITCH_LABELS:
            if f"{label}_ms" in t:
                t[f"met_{label}"] = bool(ok(t, label))
        return t

    out = []
    r = row("LT_chunked:124M:65536")
    if r:
        out.append(switched(_bound(_target("LT_chunked 124M at 64k <= 150 ms", r, "150 ms",
                                           r["after_ms"] <= 150), 150),
                            lambda t, l: t[f"{l}_ms"] <= 150))  # fmt: skip
        out.append(switched(_target("LT_chunked 124M at 64k: glue <= 220 GB", r, "220 GB",
                                    r["after_glue_gb"] <= 220),
                            lambda t, l: t[f"{l}_glue_gb"] <= 220))  # fmt: skip
    for size in ("355M", "774M", "1.6B"):
        a, b = row(f"LT_chunked:{size}:1024"), row(f"flash:{size}:1024")
        if a and b:
            # Both timed: compare the measured times scaled by each one's MODEL ratio (the
            # MODEL's own error on each point, a few percent, exceeds the measured gaps).
            t = _target(f"LT_chunked <= flash at 1k, {size}", a, "<= flash's",
                        a["after_ms"] <= b["after_ms"], baseline=b)  # fmt: skip
            if a["scaled_ms"] is not None and b["scaled_ms"] is not None:
                t["met_scaled"] = a["scaled_ms"] <= b["scaled_ms"]
            for label in SWITCH_LABELS:  # both attentions compiled with the label: compared
                if f"{label}_ms" in a and f"{label}_ms" in b:
                    t[f"met_{label}"] = a[f"{label}_ms"] <= b[f"{label}_ms"]
                    sa, sb = a[f"scaled_{label}_ms"], b[f"scaled_{label}_ms"]
                    if sa is not None and sb is not None:
                        t[f"met_scaled_{label}"] = sa <= sb
            # LT_chunked's single pass forced (FUSED_1K: "unrolled" with its kernel), read
            # against flash compiled with "unrolled", the same options.
            if f"{FUSED_1K}_ms" in a and "unrolled_ms" in b:
                t[f"met_{FUSED_1K}"] = a[f"{FUSED_1K}_ms"] <= b["unrolled_ms"]
            out.append(t)
    r = row("flash:124M:65536")
    if r:
        out.append(switched(_bound(_target("flash 124M at 64k <= 700 ms", r, "700 ms",
                                           r["after_ms"] <= 700), 700),
                            lambda t, l: t[f"{l}_ms"] <= 700))  # fmt: skip
    r = row(f"LT_chunked:124M:{1024 * K}")
    if r:
        out.append(_bound(_target("LT_chunked 124M at 1M tokens <= 4.4 s", r, "4,400 ms",
                                  r["after_ms"] <= 4400), 4400))  # fmt: skip
    for att in ("LT_chunked", "flash"):
        r = row(f"{att}:124M:16x1024")
        if r:
            tps = 16 * K / (r["after_ms"] / 1e3)
            t = _target(f"{att} 124M 16 x 1k (the post's training micro-step) >= 470k "
                        "tokens/s per H100", r, "470,000 tokens/s", tps >= 470e3,
                        tokens_per_s=tps, before_tokens_per_s=16 * K /
                        (r["before_ms"] / 1e3))  # fmt: skip
            for label in SWITCH_LABELS:
                if f"{label}_ms" in r:
                    t[f"{label}_tokens_per_s"] = 16 * K / (r[f"{label}_ms"] / 1e3)
            out.append(switched(t, lambda t, l: t[f"{l}_tokens_per_s"] >= 470e3))
    return out


def fused_head(point: GluePoint, as_built: dict[str, Any], fused: dict[str, Any]) -> dict:
    """The head and loss as built ("after": XLA's three GEMMs per chunk of ``loss_chunk``
    tokens, the cross-entropy kernel between them) against the fused kernel pair that never
    writes logits (``model.loss_kernel=pallas_fused``), both priced from their compiled steps:
    the part "head and loss" (MODEL ms, bytes, launches), the whole step's MODEL ms, bytes,
    launches and compiled memory, and the fused kernels' FLOPs as the cost model counts them
    (the logits computed twice: 8 N V C)."""
    N = point.batch * point.context
    dims = step_costs.SIZES[point.size]
    flops = head_loss_cost.flops(N, dims["vocab_size"], dims["n_embd"])

    def side(p: dict[str, Any]) -> dict[str, Any]:
        return {"head": p["by_part"].get("head and loss", {}), "ms": p["ms"],
                "bytes": p["bytes"], "launches": p["launches"],
                "memory_bytes": p["memory_bytes"]}  # fmt: skip

    return {"as_built": side(as_built), "fused": side(fused), "fused_flops": flops}


def summarise(costs: dict[str, Any], model: dict[str, Any], params: sm.Params | None = None
              ) -> dict[str, Any]:  # fmt: skip
    """The priced summary of the cached costs (``benchmarks/step_glue.py``'s raw file) at the
    fitted constants of the step-time MODEL (``train_step_h100_model.json``), or at ``params``
    (its measured points still from ``model``)."""
    params = params or sm.Params(**model["params"])
    measured = {p["key"]: p["measured_ms"] for p in model["points"]}
    points: dict[str, dict[str, Any]] = {}
    for p in POINTS:
        entry: dict[str, Any] = {"point": dataclasses.asdict(p), "measured_key": p.measured_key}
        for label, done in costs["points"].items():
            if label != FUSED_HEAD and p.key in done:
                c = done[p.key]
                entry[label] = {**price(c["rows"], params), "memory_bytes": c["memory_bytes"],
                                "compile_seconds": c["compile_seconds"],
                                "commit": c.get("git_commit")}  # fmt: skip
                if "attention_rows" in c:  # per layer on the page: n_layer beside
                    entry[label]["attention"] = price_attention(c["attention_rows"], params)
                    entry[label]["n_layer"] = step_costs.SIZES[p.size]["n_layer"]
        if len(entry) > 2:
            points[p.key] = entry
    alternatives = {}
    for p in POINTS:
        c = costs["points"].get(FUSED_HEAD, {}).get(p.key)
        if p.key in points and "after" in points[p.key] and c:
            fused = {**price(c["rows"], params), "memory_bytes": c["memory_bytes"]}
            commits = {"as_built": points[p.key]["after"].get("commit"),
                       "fused": c.get("git_commit")}  # fmt: skip
            alternatives[p.key] = {**fused_head(p, points[p.key]["after"], fused),
                                   "commits": commits}  # fmt: skip
    return {"points": points, "targets": targets(points, measured),
            "head_alternatives": alternatives,
            "measured": {k: measured[v["measured_key"]] for k, v in points.items()
                         if v["measured_key"] in measured}}  # fmt: skip
