"""A roofline MODEL of the ``LT_attention_parallel`` kernels on the H100 (not a measurement).

Both designs are flash-style loops: a program keeps a block of rows and streams tiles of the
others, one loop step per tile. For every launch of a design at a shape, :func:`blocked_kernels`
and :func:`tiled_kernels` give

- ``flops``: the matmul FLOPs executed (2 m n k per dot; the masked halves of the diagonal
  tiles included: they are computed);
- ``bytes``: compulsory HBM traffic, each array read once and written once (as
  ``lt_chunked/cost.py``);
- ``l2_bytes``: the operand traffic from L2 into the SMs: every tile each loop step loads (the
  same key tiles are loaded by every query block that reaches them), the resident blocks, and
  the atomic float32 adds of the tiled backward. This is the traffic FlashAttention's IO
  analysis counts; on the H100 most of it hits the 50 MB L2 rather than HBM;
- ``programs`` and ``steps`` (the loop steps of the longest program).

The bound of a launch (:attr:`Launch.seconds`) is the largest of: its FLOPs at the peak
(dense bf16, :data:`linear_gpt2.platform.cards.H100`), its compulsory bytes at the HBM
bandwidth, and the makespan of its programs
on the 132 SMs: programs start in launch order (the grid's first axis fastest), each on the SM
that frees first, and a program of n steps takes n times the longer of its step's FLOPs at a
132th of the peak and its step's L2 bytes at a 132th of ``L2_BYTES``. The makespan is what
prices unequal programs (the old forward's query block n walks n + 1 tiles, and launches them
shortest first) and too few of them. ``seconds_plain`` is the same bound with the L2 term left
out (L2 bandwidth unbounded): the ``lt_chunked`` model's assumption, shown beside it.

``L2_BYTES`` is an ASSUMPTION, not a measurement of this card: 5,120 bytes per clock (the L2 read
bandwidth NVIDIA gives for the A100; none is published for the H100) at the clock the dense
bf16 peak implies (``CLOCK_HZ``: 1.83 GHz, 9.4 TB/s). A higher figure favours the old kernel
(its loop steps load twice the bytes per FLOP); ``benchmarks/roofline.py`` reports, per length,
the L2 bandwidth above which the old kernel's bound would be the lower one.

:func:`choose` is what ``kernel=pallas`` decides with (as ``lt_chunked.cost.choose``), the model
and one measurement: the design the model prices lowest, forward + backward with launches, of
``pallas_blocked``, ``pallas_tiled`` and ``pallas_tiled_dq`` (``tiled_dq.py``, FlashAttention 2's
backward: ``dq="kernel"`` below), and where that is a tiled design, the tiled forward with the
two-kernel backward (``pallas_tiled_dq``, at its best tiling), never the atomic one. The model
ranks the atomic backward first (a sixth dot per tile pair against an atomic float32 add), but
it prices every dot at the dense peak and an atomic add as its bytes, and compiled for the H100
the atomic kernel is what it does not see: its adds are ``acq_rel`` atomics (a GPU-wide memory
barrier and an L1 invalidation around each, in every loop step) and three of its five dots, on
32-row query tiles, take the ``mma.sync`` path instead of the warpgroup MMA (``tiled_dq.py``).
An H200 timed the designs side by side (:data:`MEASURED`, B = 1, H = 12, D = 64, c = 64, 4k to
64k): the two tiled designs' forwards alike, their forward + backward the two-kernel one's
lower at every length. Where nothing was timed (shorter T, other head dims and batches, wider
keys, resets and gates) the same holds by construction: the two tiled designs run one forward
kernel, so the swap changes the backward only, and what the atomic one pays (the barriers, the
``mma.sync`` dots) it pays at every shape. ``pallas_tiled`` and ``pallas_blocked`` stay
selectable by name.
"""

from __future__ import annotations

import dataclasses
import heapq
import math

from linear_gpt2.kernels.lt_attention_parallel import BLOCKED, TILED, TILED_DQ
from linear_gpt2.kernels.lt_attention_parallel import plan as plan_lib
from linear_gpt2.kernels.lt_chunked import plan as chunked_plan
from linear_gpt2.kernels.lt_chunked.cost import F32_BYTES
from linear_gpt2.platform.cards import H100

PEAK_FLOPS = H100.peak_bf16_flops
PEAK_BYTES = H100.hbm_bytes_per_s
SMS = H100.sms
LAUNCH_SECONDS = H100.launch_seconds
L2_BYTES_PER_CLOCK = 5120  # assumed (module docstring)
CLOCK_HZ = PEAK_FLOPS / (SMS * 4096)  # the clock the peak implies: 4096 dense bf16 FLOP/SM/clock
L2_BYTES = L2_BYTES_PER_CLOCK * CLOCK_HZ
# The timing behind kernel=pallas's tiled backward (module docstring; tests read it).
MEASURED = "benchmarks/results/kernel_sweep_h200_measured.json"


@dataclasses.dataclass(frozen=True)
class Loop:
    """``steps`` loop steps of ``flops`` FLOPs and ``l2`` operand bytes each."""

    steps: int
    flops: float
    l2: float


@dataclasses.dataclass(frozen=True)
class Program:
    """Programs of one kind, ``count`` of them in a row of the launch order: their loops in
    sequence, plus ``fixed_l2`` bytes once (the resident loads and the writes)."""

    count: int
    loops: tuple[Loop, ...]
    fixed_l2: float = 0.0

    @property
    def steps(self) -> int:
        return sum(loop.steps for loop in self.loops)

    @property
    def flops(self) -> float:
        return sum(loop.steps * loop.flops for loop in self.loops)

    @property
    def l2_bytes(self) -> float:
        return sum(loop.steps * loop.l2 for loop in self.loops) + self.fixed_l2

    def seconds(self, l2: float) -> float:
        """One program on one SM: each step the longer of its FLOPs at a 132th of the peak and
        its bytes at a 132th of the L2 bandwidth ``l2``."""
        per_flop, per_byte = SMS / PEAK_FLOPS, SMS / l2
        loops = sum(x.steps * max(x.flops * per_flop, x.l2 * per_byte) for x in self.loops)
        return loops + self.fixed_l2 * per_byte


def makespan(programs: list[Program], l2: float, sms: int = SMS) -> float:
    """List scheduling in launch order on ``sms`` SMs: each program starts on the SM that
    frees first."""
    free = [0.0] * sms
    for p in programs:
        d = p.seconds(l2)
        for _ in range(p.count):
            heapq.heapreplace(free, free[0] + d)
    return max(free)


@dataclasses.dataclass(frozen=True)
class Launch:
    name: str
    programs: int
    steps: int
    flops: float
    bytes: float
    l2_bytes: float
    seconds: float
    seconds_plain: float
    busy: float  # the SMs' mean busy share over the makespan (1: perfectly balanced)

    @property
    def intensity(self) -> float:
        """FLOPs per operand byte loaded from L2 (the loop's arithmetic intensity)."""
        return self.flops / self.l2_bytes if self.l2_bytes else math.inf


def _launch(name: str, programs: list[Program], nbytes: float, l2: float = L2_BYTES) -> Launch:
    flops = sum(p.count * p.flops for p in programs)
    l2_bytes = sum(p.count * p.l2_bytes for p in programs)
    floor = max(flops / PEAK_FLOPS, nbytes / PEAK_BYTES)
    span = makespan(programs, l2)
    busy = sum(p.count * p.seconds(l2) for p in programs) / (SMS * span) if span else 1.0
    return Launch(
        name=name,
        programs=sum(p.count for p in programs),
        steps=max(p.steps for p in programs),
        flops=flops,
        bytes=nbytes,
        l2_bytes=l2_bytes,
        seconds=max(span, floor),
        seconds_plain=max(makespan(programs, math.inf), floor),
        busy=min(busy, 1.0),
    )


def _xla(name: str, nbytes: float) -> Launch:
    """An XLA fusion (elementwise): parallel over its elements, at the HBM roofline."""
    t = nbytes / PEAK_BYTES
    return Launch(name, SMS, 1, 0.0, nbytes, 0.0, t, t, 1.0)


def _in_order(per_head: list[int], BH: int, blocks_fastest: bool) -> list[tuple[int, int]]:
    """(steps, count) runs in launch order: ``per_head`` lists the steps of each block in the
    order of the grid's block axis. With the block axis fastest (the old kernels' grid
    (T/c, B, H)) the heads follow one another; with it slowest (the tiled kernels'
    (H, B, T/b)) each block runs for every head before the next block."""
    if blocks_fastest:
        return [(st, 1) for _ in range(BH) for st in per_head]
    return [(st, BH) for st in per_head]


def blocked_kernels(
    B: int, T: int, H: int, D: int, s: int, c: int, backward: bool, l2: float = L2_BYTES
) -> list[Launch]:
    """The old kernels (``blocked.py``) at ``[B, T, H, D]`` (T a multiple of the tile, D padded,
    s bytes per element): forward grid (T/c, B, H), query block n walking key blocks 0..n;
    backward, key block j walking query blocks j..N-1 (4 dots each) then key blocks 0..j for
    its query block (2 dots each). c is the kernel's tile (``blocked.tile``)."""
    BH, N = B * H, T // c
    seq, rows = BH * T * D * s, BH * T * F32_BYTES
    tile = c * D * s
    fwd = _launch(
        "blocked_fwd",
        [
            Program(k, (Loop(st, 4 * c * c * D, 2 * tile),), 2 * tile + 4 * c)
            for st, k in _in_order([n + 1 for n in range(N)], BH, True)
        ],
        4 * seq + rows,
        l2,
    )
    if not backward:
        return [fwd]
    # Key block j: N - j steps of its dK, dV loop (4 dots; phi(Q), Y, dY tiles and den), then
    # j + 1 of its query block's dQ loop (2 dots; phi(K), V tiles). Every program walks N + 1.
    key_loop, query_loop = (8 * c * c * D, 3 * tile + 4 * c), (4 * c * c * D, 2 * tile)
    bwd = _launch(
        "blocked_bwd",
        [
            Program(k, (Loop(N - j, *key_loop), Loop(j + 1, *query_loop)), 7 * tile + 4 * c)
            for j, k in _in_order(list(range(N)), BH, True)
        ],
        9 * seq + rows,
        l2,
    )
    return [fwd, bwd]


def _query_blocks(T: int, bq: int, tk: int, order: str) -> list[int]:
    """Key tiles each query block walks (query block n: (n + 1) bq / tk), in launch order."""
    steps = [(n + 1) * (bq // tk) for n in range(T // bq)]
    return steps[::-1] if order == "longest first" else steps


def _forward_launch(name, B, T, H, D, s, bq, tk, order, segments, l2) -> list[Launch]:
    """A resident-query-block loop (the tiled forward, or the dQ kernel of the two-kernel
    backward: both walk key tiles with 2 dots per step), optionally split into ``segments``
    key ranges per query block whose partial sums a combine pass adds (split-K)."""
    BH = B * H
    seq, rows = BH * T * D * s, BH * T * F32_BYTES
    per_block = _query_blocks(T, bq, tk, order)
    fixed = 2 * bq * D * s + 4 * bq
    if segments > 1:  # every block's key range in `segments` parts (empty parts not launched)
        per_block = [
            -(-st // segments) for st in per_block for i in range(segments)
            if i * -(-st // segments) < st
        ]  # fmt: skip
        fixed += 4 * bq * (D + 1)  # the partial numerator and denominator, float32
    runs = _in_order(per_block, BH, order == "in order")
    progs = [Program(k, (Loop(st, 4 * bq * tk * D, 2 * tk * D * s),), fixed) for st, k in runs]
    if segments == 1:
        return [_launch(name, progs, 4 * seq + rows, l2)]
    partials = sum(p.count for p in progs) * 4 * bq * (D + 1)
    return [
        _launch(name, progs, 3 * seq + partials, l2),
        _xla("xla: combine segments", partials + seq + rows),
    ]


def tiled_kernels(
    B: int, T: int, H: int, D: int, s: int, t: plan_lib.Tiles, backward: bool,
    l2: float = L2_BYTES, *, order: str = "longest first", dq: str = "atomic", segments: int = 1,
) -> list[Launch]:  # fmt: skip
    """The tiled kernels (``tiled.py``) at ``[B, T, H, D]`` (T a multiple of ``t.pad``, D
    padded), with the XLA around them: forward, grid (H, B, T/bq), query block n walking
    (n + 1) bq/tk key tiles; backward, XLA's g and delta, the zeroed dq accumulator, grid
    (H, B, T/bk), key block j walking T/tq - j bk/tq query tiles (5 dots, an atomic add of its
    dq rows), and dq rounded.

    The alternatives ``benchmarks/roofline.py`` prices: ``order="in order"``, the blocks
    launched shortest first with the heads in turn (the old kernels' grid; not built);
    ``dq="kernel"``, dphi(q) in a second kernel of resident query blocks instead of the atomic
    adds (6 dots per tile pair, as the old kernel and JAX's Pallas flash attention): built as
    ``pallas_tiled_dq``, its dkv launch key block j walking T/tq - j bk/tq query tiles with 4
    dots each, its dq launch the forward's shape with 2;
    ``segments``: each query block's key range split in parts whose partial sums XLA adds
    (split-K, as flash-decoding; not built)."""
    BH = B * H
    seq, rows, acc = BH * T * D * s, BH * T * F32_BYTES, BH * T * D * F32_BYTES
    out = _forward_launch("tiled_fwd", B, T, H, D, s, t.bq, t.tk, order, segments, l2)
    if not backward:
        return out
    nk, rk, nt = T // t.bk, t.bk // t.tq, T // t.tq
    qtile = t.tq * D * s
    per_block = [nt - j * rk for j in range(nk)]  # key block 0 walks the most: first
    if order == "in order":
        per_block = per_block[::-1]
    atomic = dq == "atomic"
    step = (
        (10 if atomic else 8) * t.bk * t.tq * D,
        2 * qtile + 4 * t.tq + (t.tq * D * F32_BYTES if atomic else 0),
    )
    bwd = _launch(
        "tiled_bwd" if atomic else "tiled_bwd_dkv",
        [
            Program(k, (Loop(st, *step),), 4 * t.bk * D * s)
            for st, k in _in_order(per_block, BH, order == "in order")
        ],
        # phi(q), phi(k), v, g, delta in; dk, dv out; the float32 accumulator in and out
        4 * seq + rows + 2 * seq + (2 * acc if atomic else 0),
        l2,
    )
    out.append(_xla("xla: g, delta", 3 * seq + 2 * rows))
    if atomic:
        return [*out, _xla("xla: dq zeros", acc), bwd, _xla("xla: dq rounded", acc + seq)]
    dq_kernel = _forward_launch("tiled_bwd_dq", B, T, H, D, s, t.bq, t.tk, order, 1, l2)
    return [*out, bwd, *dq_kernel]


def design_seconds(costs: list[Launch], plain: bool = False) -> float:
    """Modelled time of a sequence of launches: their bounds plus a launch overhead each."""
    return sum((k.seconds_plain if plain else k.seconds) + LAUNCH_SECONDS for k in costs)


def blocked_tile(c: int, D: int) -> int:
    """The old kernel's tile for block size c at padded head dim D (``blocked.tile``)."""
    return chunked_plan.tile(c, D)


@dataclasses.dataclass(frozen=True)
class Choice:
    kernel: str
    tiles: plan_lib.Tiles | None
    reason: str
    seconds: dict[str, float]


def options(B: int, T: int, H: int, D: int, c: int, s: int) -> dict[str, tuple[float, object]]:
    """{label: (modelled fwd+bwd seconds, tiles or None)} of every design and tiling at
    ``[B, T, H, D]`` (T a multiple of c, D padded): the old kernels at T, each tiling of the
    tiled kernels and of ``pallas_tiled_dq`` (:func:`tiled_kernels` with ``dq="kernel"``: its
    dkv and dq launches) at T padded to its resident blocks. A MODEL (module docstring)."""
    out: dict[str, tuple[float, object]] = {}
    ct = blocked_tile(c, D)
    out[BLOCKED] = (design_seconds(blocked_kernels(B, T, H, D, s, ct, True)), None)
    for t in plan_lib.candidates(c, D):
        Tp = plan_lib.padded_length(T, t)
        out[f"{TILED} {t.describe()}"] = (design_seconds(tiled_kernels(B, Tp, H, D, s, t, True)), t)
    for t in plan_lib.dq_candidates(c, D):
        Tp = plan_lib.padded_length(T, t)
        costs = tiled_kernels(B, Tp, H, D, s, t, True, dq="kernel")
        out[f"{TILED_DQ} {t.describe()}"] = (design_seconds(costs), t)
    return out


def choose(B: int, T: int, H: int, D: int, c: int, s: int, kernel: str = "pallas") -> Choice:
    """The design ``kernel`` runs at ``[B, T, H, D]`` (T a multiple of c, D padded) with s bytes
    per element: for ``pallas`` the model's lowest forward + backward time of the three designs,
    a tiled one run as ``pallas_tiled_dq`` (module docstring: the atomic backward measured
    slower, :data:`MEASURED`); for ``pallas_tiled`` and ``pallas_tiled_dq`` their best tiling;
    for ``pallas_blocked`` the old kernels."""
    opts = options(B, T, H, D, c, s)
    dq = [k for k in opts if k.startswith(TILED_DQ + " ")]
    allowed = {
        "pallas": list(opts),
        TILED: [k for k in opts if k.startswith(TILED + " ")],
        TILED_DQ: dq,
        BLOCKED: [BLOCKED],
    }[kernel]
    best = min(allowed, key=lambda k: opts[k][0])
    seconds = {k: v[0] for k, v in opts.items()}
    reason = "modelled fwd+bwd " + ", ".join(f"{k} {v * 1e6:.1f} us" for k, v in seconds.items())
    if kernel == "pallas" and best != BLOCKED:
        if not best.startswith(TILED_DQ):
            reason += f"; the tiled forward with {TILED_DQ}'s backward (measured: {MEASURED})"
        best = min(dq, key=lambda k: opts[k][0])
    tiles = opts[best][1]
    return Choice(best.split(" ")[0], tiles, reason, seconds)
