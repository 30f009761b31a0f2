"""Optimized XLA HLO text, read into computations of instructions with their shapes.

What :mod:`linear_gpt2.experiments.hlo_costs` prices: ``compiled.as_text()`` of a program
compiled for a GPU target. Only what pricing needs is kept: each instruction's result arrays
(dtype, dims, memory space), opcode, operand names, the attributes as text (called
computations, backend configs, metadata) and, for a parameter, its index. Nothing here imports
JAX.
"""

from __future__ import annotations

import dataclasses
import math
import re

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1,
    "bf16": 2, "f16": 2, "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4,
    "f64": 8, "s64": 8, "u64": 8, "c64": 8, "c128": 16, "token": 0,
}  # fmt: skip
HOST_SPACE = 5  # XLA's memory space of pinned host memory (``S(5)`` in a layout)


@dataclasses.dataclass(frozen=True)
class Array:
    dtype: str
    dims: tuple[int, ...]
    space: int = 0  # memory space: 0 device, HOST_SPACE pinned host

    @property
    def size(self) -> int:
        return math.prod(self.dims)

    @property
    def bytes(self) -> float:
        return self.size * DTYPE_BYTES.get(self.dtype, 4)


_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\](\{[^}]*\})?")


def parse_shape(text: str) -> list[Array]:
    """The arrays of an HLO type: one, or a tuple's leaves in order."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype not in DTYPE_BYTES:
            continue
        space = re.search(r"S\((\d+)\)", layout or "")
        d = tuple(int(x) for x in dims.split(",") if x)
        out.append(Array(dtype, d, int(space[1]) if space else 0))
    return out


@dataclasses.dataclass
class Instr:
    name: str
    shape: list[Array]
    opcode: str
    operands: list[str]
    attrs: str
    root: bool = False
    args: str = ""

    @property
    def out_bytes(self) -> float:
        return sum(a.bytes for a in self.shape)

    def attr(self, key: str) -> str | None:
        m = re.search(rf"\b{re.escape(key)}=%?([\w.\-]+)", self.attrs)
        return m[1] if m else None

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m[1] if m else ""


@dataclasses.dataclass
class Computation:
    name: str
    instrs: list[Instr]

    def __post_init__(self) -> None:
        self.by_name = {i.name: i for i in self.instrs}
        self.root = next(
            (i for i in self.instrs if i.root), self.instrs[-1] if self.instrs else None
        )
        self.params = {int(i.args): i for i in self.instrs if i.opcode == "parameter"}
        self.users: dict[str, list[Instr]] = {}
        for i in self.instrs:
            for o in i.operands:
                self.users.setdefault(o, []).append(i)


@dataclasses.dataclass
class Module:
    computations: dict[str, Computation]
    entry: str


def _balanced(text: str, start: int) -> int:
    """Index just past the bracket group opening at ``text[start]``."""
    depth, pairs = 0, {"(": ")", "{": "}", "[": "]"}
    closing = set(pairs.values())
    for i in range(start, len(text)):
        c = text[i]
        if c in pairs:
            depth += 1
        elif c in closing:
            depth -= 1
            if depth == 0:
                return i + 1
        elif c == '"':  # skip strings
            j = i + 1
            while j < len(text) and text[j] != '"':
                j += 2 if text[j] == "\\" else 1
    return len(text)


_LINE = re.compile(r"^\s*(ROOT\s+)?%(\S+) = ")
_HEADER = re.compile(r"^(ENTRY\s+)?%(\S+)\s.*\{\s*$")


def _instr(line: str) -> Instr | None:
    m = _LINE.match(line)
    if not m:
        return None
    rest = line[m.end() :]
    if rest.startswith("("):
        end = _balanced(rest, 0)
    else:
        end = rest.index(" ")
    shape, rest = rest[:end], rest[end:].lstrip()
    op = re.match(r"([a-z][\w\-]*)\(", rest)
    if not op:
        return None
    close = _balanced(rest, op.end() - 1)
    args = rest[op.end() : close - 1]
    operands = re.findall(r"%([\w.\-]+)", args)
    return Instr(m[2], parse_shape(shape), op[1], operands, rest[close:], bool(m[1]), args)


def parse_module(text: str) -> Module:
    """The computations of an HLO module's text (``compiled.as_text()``)."""
    comps: dict[str, Computation] = {}
    entry, current, body = None, None, []
    for line in text.splitlines():
        if current is None:
            h = _HEADER.match(line)
            if h and not line.startswith((" ", "HloModule")):
                current, body = h[2], []
                if h[1]:
                    entry = current
            continue
        if line.strip() == "}":
            comps[current] = Computation(current, body)
            current = None
            continue
        ins = _instr(line)
        if ins is not None:
            body.append(ins)
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return Module(comps, entry)
