"""Per-kernel FLOPs and HBM bytes of an optimized XLA GPU program, read from its HLO text.

The deviceless H100 compile (:mod:`linear_gpt2.platform.target`) reports no per-program cost
(``cost_analysis()`` is None without a device), so this module reads the optimized module
(``compiled.as_text()``) and prices every instruction that launches work, the way XLA's
``HloCostAnalysis`` prices a fusion from outside:

- **bytes**: what the launch reads and writes in HBM: each operand once and each output once,
  except an operand the fused computation only slices (the slice's bytes), and an in-place
  ``dynamic-update-slice`` (the update's bytes, read and written; the buffer it updates is
  neither read nor rewritten);
- **FLOPs**: ``2 x prod(output dims) x prod(contracting dims)`` per ``dot`` inside a fusion or a
  cuBLAS call; the closed form of cuDNN's flash attention (:func:`flash_flops`); none for a
  Pallas kernel (its FLOPs come from that kernel's own cost model, ``step_model``);
- **count**: how often it runs: while loops multiply their body by XLA's ``known_trip_count``.

Each launch is one :class:`Op` with a ``kind`` (the op class: ``matmul``, ``flash``,
``pallas``, ``memory``, ``copy``, ``host``, ``other``), a ``part`` of the model read from its
``op_name`` metadata (attention core, projections, MLP, head and loss, layernorm, optimizer)
and whether it belongs to the ``forward`` or ``backward`` pass. Nothing here imports JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from linear_gpt2.experiments.hlo_text import (
    HOST_SPACE,
    Array,
    Computation,
    Instr,
    Module,
    parse_module,
    parse_shape,
)

__all__ = ["HOST_SPACE", "Array", "Computation", "Instr", "Module", "Op", "parse_module",
           "parse_shape", "program_ops", "walk"]  # fmt: skip

# Instructions that launch nothing: views, tuples, parameters, the ``-done`` half of async pairs.
FREE = {
    "parameter", "constant", "get-tuple-element", "tuple", "bitcast", "after-all",
    "opt-barrier", "partition-id", "replica-id", "copy-done", "fusion-done", "async-done",
    "send-done", "recv-done", "all-reduce-done", "all-gather-done", "add-dependency",
}  # fmt: skip
SLICING = {"slice", "dynamic-slice", "gather"}
TRITON = "__gpu$xla.gpu.triton"  # Pallas (and jax-triton) kernels: custom calls to this target
CUDNN_FMHA = "__cudnn$fmha"  # cuDNN's fused attention, forward and backward
# The op classes: GEMMs, cuDNN attention, custom (Pallas) kernels, data movement, host transfers.
KINDS = ("matmul", "fmha", "kernel", "memory", "copy", "host", "other")


@dataclasses.dataclass
class Op:
    """One launch site: its class, cost per run and how many times the step runs it."""

    name: str
    kind: str
    flops: float
    bytes: float
    count: int
    part: str
    backward: bool
    detail: dict = dataclasses.field(default_factory=dict)


PARTS = (
    "attention core",
    "projections",
    "mlp",
    "layernorm",
    "residual",
    "saved activations",
    "head and loss",
    "optimizer",
    "unattributed",
)


def part_of(op_name: str) -> str:
    """The part of the model (:data:`PARTS`) an instruction's ``op_name`` metadata places it in.
    ``saved activations``: the layer scan's stacking of what the backward reads (and reading it
    back); ``unattributed``: no source (buffers XLA initialises, layout changes it inserted)."""
    p = op_name.lower()
    if not p:
        return "unattributed"
    if "jvp(" not in p:
        return "optimizer"
    if "dynamic_update_slice" in p or "dynamic_slice" in p:
        return "saved activations"
    if re.search(r"/attn/c_(attn|proj)/", p):
        return "projections"
    if "/attn/" in p:
        return "attention core"
    if "/mlp/" in p:
        return "mlp"
    if re.search(r"/ln_\w*/", p):
        return "layernorm"
    if re.search(r"/body/(eval_jaxpr/h/)?add", p):
        return "residual"
    return "head and loss"  # outside the blocks: embeddings, the tied head, the loss


def _dot_flops(ins: Instr, comp: Computation) -> float:
    lhs = comp.by_name.get(ins.operands[0]) if ins.operands else None
    dims = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
    if lhs is None or not lhs.shape or dims is None:
        return 0.0
    k = math.prod(lhs.shape[0].dims[int(d)] for d in dims[1].split(",") if d)
    return 2.0 * ins.shape[0].size * k


def _called(ins: Instr, key: str = "calls") -> list[str]:
    m = re.search(rf"\b{key}=\{{?([^,}}]+(?:,\s*%[\w.\-]+)*)\}}?", ins.attrs)
    return re.findall(r"%?([\w.\-]+)", m[1]) if m else []


def _fused_flops(module: Module, name: str) -> float:
    comp = module.computations.get(name)
    if comp is None:
        return 0.0
    flops = 0.0
    for i in comp.instrs:
        if i.opcode in ("dot", "convolution"):
            flops += _dot_flops(i, comp)
        for sub in _called(i):
            flops += _fused_flops(module, sub)
    return flops


def _read_bytes(comp: Computation, param: Instr, full: float) -> float:
    """Bytes a fusion reads of one operand: all of it, only what it slices, or nothing for the
    buffer an in-place dynamic-update-slice writes into."""
    users = [(u, param.name) for u in comp.users.get(param.name, [])]
    total = 0.0
    while users:
        u, via = users.pop()
        if u.opcode in ("bitcast", "reshape"):
            users += [(x, u.name) for x in comp.users.get(u.name, [])]
        elif u.opcode in SLICING and u.operands[0] == via:
            total += u.out_bytes
        elif u.opcode == "dynamic-update-slice" and u.operands[0] == via:
            continue
        else:
            return full
    return total


def _written_bytes(comp: Computation) -> float | None:
    """Bytes an in-place fusion writes: its dynamic-update-slices' updates (None: not one)."""
    root = comp.root
    roots = [comp.by_name[o] for o in root.operands] if root.opcode == "tuple" else [root]
    if not all(r.opcode == "dynamic-update-slice" for r in roots):
        return None
    return sum(comp.by_name[r.operands[1]].out_bytes for r in roots)


def fusion_cost(module: Module, ins: Instr, caller: Computation) -> tuple[float, float]:
    """(FLOPs, bytes) of one fusion launch."""
    name = (_called(ins) or [""])[0]
    comp = module.computations.get(name)
    shape = ins.shape
    if ins.opcode == "fusion-start" and len(shape) >= 2:  # ((operands), output, context)
        shape = [shape[-2]]
    out = sum(a.bytes for a in shape)
    if comp is None:
        return 0.0, out + sum(_operand_bytes(caller, o) for o in ins.operands)
    written = _written_bytes(comp)
    read = 0.0
    for idx, op_name in enumerate(ins.operands):
        full = _operand_bytes(caller, op_name)
        param = comp.params.get(idx)
        read += full if param is None else _read_bytes(comp, param, full)
    return _fused_flops(module, name), read + (out if written is None else written)


_VIEWS = {
    "parameter",
    "constant",
    "bitcast",
    "reshape",
    "tuple",
    "get-tuple-element",
    "dynamic-slice",
    "dynamic-update-slice",
    "slice",
    "broadcast",
}


def _role(module: Module, ins: Instr) -> str | None:
    """``fill``: a fusion of no operands (a buffer initialised to a constant); ``copy``: one
    that only moves data (slices and in-place updates, scalar index arithmetic); else None."""
    if not ins.operands:
        return "fill"
    comp = module.computations.get((_called(ins) or [""])[0])
    if comp is None:
        return None
    for i in comp.instrs:
        scalar = all(not a.dims for a in i.shape)
        if i.opcode not in _VIEWS and not scalar:
            return None
        if i.opcode == "broadcast" and not all(
            not a.dims for o in i.operands for a in comp.by_name[o].shape
        ):  # fmt: skip
            return None
    return "copy"


def _f32_share(ins: Instr, comp: Computation) -> float:
    """The share of float32 in the arrays an instruction reads and writes (by bytes)."""
    arrays = list(ins.shape) + [
        a for o in ins.operands for a in getattr(comp.by_name.get(o), "shape", [])
    ]
    total = sum(a.bytes for a in arrays)
    return sum(a.bytes for a in arrays if a.dtype == "f32") / total if total else 0.0


def _operand_bytes(comp: Computation, name: str) -> float:
    ins = comp.by_name.get(name)
    return ins.out_bytes if ins is not None else 0.0


def flash_flops(scores: tuple[int, ...], D: int, causal: bool, backward: bool) -> float:
    """FLOPs of cuDNN's flash attention whose score matrix is ``scores`` = [B, H, Tq, Tk] at head
    dim ``D``: 2 matmuls of 2 Tq Tk D per head forward (Q K^T, P V), 5 backward (the scores
    again, dP, dV, dQ, dK), half of them under a causal mask."""
    return (10 if backward else 4) * math.prod(scores) * D * (0.5 if causal else 1.0)


def _custom_call(ins: Instr, caller: Computation) -> tuple[str, float, float, dict]:
    target = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
    t = target[1] if target else ""
    ins_bytes = sum(_operand_bytes(caller, o) for o in ins.operands)
    if t == TRITON:
        name = re.search(r'\bname = "([^"]+)"', ins.attrs)
        grid = [int(g) for g in re.findall(r"grid_[xyz] = (\d+)", ins.attrs)]
        detail = {"kernel": name[1] if name else "", "grid": grid}
        return "kernel", 0.0, ins_bytes + ins.out_bytes, detail
    if t.startswith(CUDNN_FMHA):
        q = caller.by_name[ins.operands[0]].shape[0]
        scores = re.search(
            r'"intermediate_tensor_shape":[^]]*"dimensions":\s*\[([^]]*)\]', ins.attrs
        )
        bhqk = tuple(int(x) for x in re.findall(r"\d+", scores[1])) if scores else ()
        causal = bool(re.search(r'"mask_type":\s*"CAUSAL', ins.attrs))
        backward = "backward" in t.lower()
        out = [a for a in ins.shape if a.dtype != "u8"]  # the last leaf: cuDNN's workspace
        detail = {"target": t, "scores": list(bhqk), "D": q.dims[-1], "causal": causal}
        flops = flash_flops(bhqk, q.dims[-1], causal, backward) if bhqk else 0.0
        return "fmha", flops, ins_bytes + sum(a.bytes for a in out), detail
    if "cublas" in t:
        dims = re.search(r'"lhs_contracting_dimensions":\["?([\d"," ]*)\]', ins.attrs)
        lhs = caller.by_name[ins.operands[0]].shape[0]
        k = math.prod(lhs.dims[int(d)] for d in re.findall(r"\d+", dims[1])) if dims else 0
        flops = 2.0 * ins.shape[0].size * k
        return "matmul", flops, ins_bytes + ins.shape[0].bytes, {"target": t}
    return "other", 0.0, ins_bytes + ins.out_bytes, {"target": t}


def _trip_count(ins: Instr) -> int:
    m = re.search(r'"known_trip_count":\{"n":"(\d+)"', ins.attrs)
    return int(m[1]) if m else 1


def walk(module: Module, name: str | None = None, count: int = 1) -> Iterator[Op]:
    """Every launch of computation ``name`` (default the entry), loops unrolled by count."""
    comp = module.computations[name or module.entry]
    for ins in comp.instrs:
        opc = ins.opcode
        if opc in FREE:
            continue
        if opc == "while":
            n = _trip_count(ins)
            yield from walk(module, ins.attr("body"), count * n)
            yield from walk(module, ins.attr("condition"), count * (n + 1))
            continue
        if opc in ("call", "async-start"):
            for sub in _called(ins, "to_apply") + _called(ins, "calls"):
                for op in walk(module, sub, count):
                    if opc == "async-start":
                        op.detail["async"] = True
                    yield op
            continue
        if opc == "conditional":  # priced as its first branch (none in the training step)
            branches = _called(ins, "branch_computations")
            if branches:
                yield from walk(module, branches[0], count)
            continue
        where = dict(part=part_of(ins.op_name), backward="transpose(" in ins.op_name)
        spaces = {a.space for a in ins.shape} | {
            a.space for o in ins.operands for a in getattr(comp.by_name.get(o), "shape", [])
        }
        if opc in ("fusion", "fusion-start"):
            flops, nbytes = fusion_cost(module, ins, comp)
            kind = "matmul" if flops else ("host" if HOST_SPACE in spaces else "memory")
            if kind == "host":  # a slice to or from host memory: what crosses the link
                nbytes /= 2
            detail = {"fusion": (ins.attr("kind") or "kLoop")[1:].lower(),
                      "f32": _f32_share(ins, comp), "role": _role(module, ins)}  # fmt: skip
            if opc == "fusion-start":
                detail["async"] = True
            yield Op(ins.name, kind, flops, nbytes, count, **where, detail=detail)
        elif opc == "custom-call":
            if "AllocateBuffer" in ins.attrs:  # reserves memory, launches nothing
                continue
            kind, flops, nbytes, detail = _custom_call(ins, comp)
            yield Op(ins.name, kind, flops, nbytes, count, **where, detail=detail)
        elif opc in ("copy", "copy-start"):
            src = comp.by_name.get(ins.operands[0]) if ins.operands else None
            nbytes = src.shape[0].bytes if src is not None and src.shape else ins.out_bytes
            kind = "host" if HOST_SPACE in spaces else "copy"
            detail = {"async": True} if opc == "copy-start" else {}
            yield Op(ins.name, kind, 0.0, nbytes if kind == "host" else 2 * nbytes, count,
                     **where, detail=detail)  # fmt: skip
        elif opc in ("dynamic-update-slice",):
            upd = _operand_bytes(comp, ins.operands[1])
            kind = "host" if HOST_SPACE in spaces else "copy"
            yield Op(ins.name, kind, 0.0, 2 * upd, count, **where)
        else:
            nbytes = ins.out_bytes + sum(_operand_bytes(comp, o) for o in ins.operands)
            kind = "host" if HOST_SPACE in spaces else "other"
            yield Op(ins.name, kind, 0.0, nbytes, count, **where, detail={"opcode": opc})


def program_ops(text: str) -> list[Op]:
    """Every launch of an optimized HLO module's text, in program order."""
    return list(walk(parse_module(text)))
