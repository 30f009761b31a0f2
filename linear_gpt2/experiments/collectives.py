"""The collectives of a compiled program: what each moves per step, by kind and mesh axis, and
what context parallelism is expected to move (the model beside the count).

Read from the optimised HLO text (``compiled.as_text()``) of a program compiled for a GPU
target: every all-reduce, all-gather, reduce-scatter, all-to-all and collective-permute, each
counted as often as its enclosing loops run (the accumulation and layer scans). Bytes *sent per
device* follow the ring algorithms NCCL uses for each: an all-reduce of ``b`` bytes over ``n``
devices sends ``2 (n - 1) / n * b``, an all-gather of a ``b``-byte slice ``(n - 1) * b``, a
reduce-scatter of ``b`` bytes ``(n - 1) / n * b``, a permute its buffer. That is a count of the
program, not a timing: how fast the links carry it is the GPU's to measure.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Iterator

from linear_gpt2.experiments.hlo_text import Module, parse_module

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_GROUPS = re.compile(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}")
_PAIRS = re.compile(r"source_target_pairs=\{((?:\{\d+,\d+\},?)*)\}")
_CALLS = re.compile(r"\b(to_apply|calls|branch_computations)=(\{[^}]*\}|%[\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective in the program: its kind, the mesh axes it spans, and per run the bytes
    of its operands (one device's buffer) and the bytes each device sends."""

    name: str
    kind: str
    axes: tuple[str, ...]  # mesh axes of its groups; ("all",) when the groups are every device
    devices: int  # devices per group
    operand_bytes: float
    count: int  # runs per step (enclosing loops' trip counts multiplied)
    backward: bool
    attention: bool  # inside the attention (its shard_map over seq)

    @property
    def sent_bytes(self) -> float:
        """Bytes one device sends per run (ring algorithms)."""
        n, b = self.devices, self.operand_bytes
        if n <= 1:
            return 0.0
        return {
            "all-reduce": 2 * (n - 1) / n * b,
            "all-gather": (n - 1) * b,
            "reduce-scatter": (n - 1) / n * b,
            "all-to-all": (n - 1) / n * b,
            "collective-permute": b,
        }[self.kind]


def _axes(attrs: str, total: int) -> tuple[tuple[str, ...], int]:
    m = _GROUPS.search(attrs)
    if m:
        sizes = {k.strip("' "): int(v) for k, v in re.findall(r"'?([\w]+)'?=(\d+)", m[1])}
        axes = tuple(a.strip("' ") for a in m[2].split(",") if a.strip("' "))
        n = math.prod(sizes[a] for a in axes)
        named = tuple("all" if a.startswith("axis_") else a for a in axes)
        return ("all",) if n == total and "all" in named else named, n
    return ("all",), total


def _walk(module: Module, name: str, count: int, total: int) -> Iterator[Collective]:
    comp = module.computations[name]
    for ins in comp.instrs:
        if ins.opcode == "while":
            m = _TRIP.search(ins.attrs)
            n = int(m[1]) if m else 1
            yield from _walk(module, ins.attr("body"), count * n, total)
            continue
        if ins.opcode in ("call", "async-start", "conditional"):
            for _, called in _CALLS.findall(ins.attrs):
                for sub in re.findall(r"%([\w.\-]+)", called):
                    if sub in module.computations:
                        yield from _walk(module, sub, count, total)
            continue
        kind = ins.opcode.removesuffix("-start")
        if kind not in KINDS:
            continue
        if kind == "collective-permute":  # pairs, not groups: a ring over the devices it names
            pairs = _PAIRS.search(ins.attrs)
            ids = {int(x) for x in re.findall(r"\d+", pairs[1])} if pairs else set()
            axes, n = ("seq",) if "/shard_map/" in ins.op_name else ("permute",), max(2, len(ids))
        else:
            axes, n = _axes(ins.attrs, total)
        # XLA combines collectives of one kind into one launch (the attention's state gather with
        # FSDP's weight gathers): each operand is attributed by the op that produced it.
        parts: dict[bool, float] = {}
        for name in ins.operands:
            src = comp.by_name.get(name)
            if src is not None:
                inside = _in_attention(src.op_name) or _in_attention(ins.op_name)
                parts[inside] = parts.get(inside, 0.0) + sum(a.bytes for a in src.shape)
        for inside, nbytes in parts.items():
            yield Collective(
                ins.name, kind, axes, n, nbytes, count,
                backward="transpose(" in ins.op_name, attention=inside,
            )  # fmt: skip


def _in_attention(op_name: str) -> bool:
    """Inside an attention's ``shard_map`` over ``seq`` (the model names its attention ``attn``;
    the loss has a ``shard_map`` of its own)."""
    return "/shard_map/" in op_name and "/attn/" in op_name


def collectives(hlo_text: str, devices: int) -> list[Collective]:
    """Every collective of the program ``hlo_text`` (compiled for ``devices`` devices)."""
    module = parse_module(hlo_text)
    return list(_walk(module, module.entry, 1, devices))


def summary(found: list[Collective]) -> list[dict]:
    """Per (kind, axes, where): launches per step, operand bytes and bytes sent per device per
    step, largest first."""
    rows: dict[tuple, dict] = {}
    for c in found:
        key = (c.kind, "x".join(c.axes), "attention" if c.attention else "rest")
        row = rows.setdefault(
            key, {"kind": key[0], "axes": key[1], "where": key[2], "launches": 0,
                  "operand_bytes": 0.0, "sent_bytes": 0.0},
        )  # fmt: skip
        row["launches"] += c.count
        row["operand_bytes"] += c.count * c.operand_bytes
        row["sent_bytes"] += c.count * c.sent_bytes
    return sorted(rows.values(), key=lambda r: -r["sent_bytes"])


# --------------------------------------------------------------------------------------------
# The model: what context parallelism is expected to move


def linear_state_bytes(B: int, H: int, D: int, seq: int, gate: bool = False) -> float:
    """Bytes one device sends per layer and pass of the linear family's state exchange: the
    all-gather of each slice's totals (S ``[B, H, D, D]``, z ``[B, H, D]`` and, with a decay
    gate, the slice's total log-gate ``[B, H]``; float32) over ``seq`` devices. The backward's
    reduce-scatter of their cotangents sends ``(n - 1) / n`` of the gathered array: the same."""
    per_slice = 4 * B * H * (D * D + D + (1 if gate else 0))
    return (seq - 1) * per_slice


def ring_kv_bytes(B: int, T: int, H: int, D: int, seq: int, itemsize: int = 2) -> float:
    """Bytes one device sends per layer in ring attention's forward: its slice's K and V passed
    on ``seq - 1`` times, (N - 1) / N of the whole sequence's K and V."""
    return (seq - 1) / seq * 2 * B * T * H * D * itemsize


def gradient_bytes(params: int, devices: int, itemsize: float = 4) -> float:
    """Bytes one device sends to sum the replicated parameters' gradients over every device
    (data and seq alike): one ring all-reduce of the gradient."""
    return 2 * (devices - 1) / devices * params * itemsize


# --------------------------------------------------------------------------------------------
# The order of a device's collectives on the host runtime

_HOLDERS = ("while", "conditional", "call", "async-start")
_CONTROL = re.compile(r"control-predecessors=\{([^}]*)\}")


def _called(ins) -> list[str]:
    found = [name for key in ("body", "condition") if (name := ins.attr(key)) is not None]
    for _, called in _CALLS.findall(ins.attrs):
        found += re.findall(r"%([\w.\-]+)", called)
    return found


def unordered_collectives(hlo_text: str) -> list[tuple[str, str, str]]:
    """Collectives one device may have in flight at once: ``(computation, loop, later)`` for
    each loop, conditional or call holding collectives and each later collective (or holder)
    of the same computation that does not depend on its result. Empty: every device runs its
    collectives one at a time, in the program's order.

    XLA:CPU's thunk runtime orders a device's collectives by *scheduling* edges only
    (``xla/runtime/execution_graph.h``): a collective blocks its thread until it completes, so
    the next starts after it; but a loop whose body handed work to the thread pool returns
    before it ends, and a collective after it that does not need its result starts at once.
    Each waiting collective holds a thread of the pool all host devices share until every
    participant arrives; with two in flight per device, a device whose loop could not get a
    thread to go on left the others waiting, and the run aborted (issue 38: ``Expected 8
    threads to join the rendezvous, but only 6 of them arrived``)."""
    module = parse_module(hlo_text)
    holds: dict[str, bool] = {}

    def has(name: str) -> bool:
        if name not in holds:
            holds[name] = False
            comp = module.computations.get(name)
            holds[name] = comp is not None and any(
                ins.opcode.removesuffix("-start") in KINDS or any(has(c) for c in _called(ins))
                for ins in comp.instrs
            )
        return holds[name]

    out: list[tuple[str, str, str]] = []
    for name, comp in module.computations.items():
        if not has(name):
            continue
        deps: dict[str, set[str]] = {}
        holders: list[str] = []
        for ins in comp.instrs:
            preds = list(ins.operands)
            if m := _CONTROL.search(ins.attrs):
                preds += re.findall(r"%([\w.\-]+)", m[1])
            deps[ins.name] = set(preds).union(*(deps.get(p, set()) for p in preds))
            holder = ins.opcode in _HOLDERS and any(has(c) for c in _called(ins))
            if holder or ins.opcode.removesuffix("-start") in KINDS:
                out += [(name, h, ins.name) for h in holders if h not in deps[ins.name]]
            if holder:
                holders.append(ins.name)
    return out
