"""A roofline MODEL of the ``LT_chunked`` kernels on the H100 (not a measurement).

For every kernel of a design (``chunk``: the chunk-parallel kernels; ``fused``: the single
pass) at a shape, :func:`kernels_of` gives

- ``flops``: the matmul FLOPs the kernel executes (2 m n k per dot, masked score tiles above the
  diagonal skipped, recomputation included: the backward's second state pass, the scores each
  value block recomputes);
- ``bytes``: compulsory HBM traffic, each array the kernel reads counted once and each it
  writes once (perfect reuse inside a kernel: the lower bound);
- ``programs``: the launch size (the grid's product), and ``steps``: the chunks each program
  walks in sequence.

Its lower-bound time (:attr:`KernelCost.seconds`) is ``waves x max(flops, bytes / intensity
ridge)`` of one program at 1/132 of the H100's peaks (dense bf16 FLOP/s and HBM bytes/s, from
:data:`linear_gpt2.platform.cards.H100`): a launch of 12 programs can use at most 12 of the 132
SMs, so its bound is 11x the whole-GPU one; a sequential pass pays for its steps in sequence
because they are one program's work. :func:`design_seconds` adds ``LAUNCH_SECONDS`` per kernel
launched (the card's launch overhead: launch plus ramp-up of a dependent kernel, fitted by the
step-time model to step times measured on an H100; ``platform/cards.py`` says where), which is
what makes the single pass win at short sequences with enough (batch x heads) programs.

Registers and shared memory are compile measurements, not modelled: ``benchmarks/roofline.py``
joins them in. Until a GPU measures the kernels, :func:`choose` is what ``kernel=pallas``
decides with.
"""

from __future__ import annotations

import dataclasses
import math

from linear_gpt2.kernels.lt_chunked import CHUNK, FUSED
from linear_gpt2.kernels.lt_chunked import plan as plan_lib
from linear_gpt2.platform.cards import H100

PEAK_FLOPS = H100.peak_bf16_flops
PEAK_BYTES = H100.hbm_bytes_per_s
SMS = H100.sms
LAUNCH_SECONDS = H100.launch_seconds
F32_BYTES = 4


@dataclasses.dataclass(frozen=True)
class KernelCost:
    name: str
    programs: int
    steps: int  # chunks walked in sequence by one program (1: fully parallel)
    flops: float
    bytes: float

    @property
    def waves(self) -> int:
        return math.ceil(self.programs / SMS)

    @property
    def sm_share(self) -> float:
        """The fraction of the 132 SMs the launch can keep busy on average."""
        return self.programs / (self.waves * SMS)

    @property
    def seconds(self) -> float:
        """Lower bound: the whole-GPU roofline time divided by the SM share."""
        return max(self.flops / PEAK_FLOPS, self.bytes / PEAK_BYTES) / self.sm_share

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else math.inf


def _pairs(P: int) -> int:
    """Score tiles computed per chunk: the P (P + 1) / 2 on or below the diagonal."""
    return P * (P + 1) // 2


def _xla(name: str, nbytes: float) -> KernelCost:
    """An XLA fusion (elementwise or a short reduction over a small axis): parallel over its
    elements, so modelled as filling the GPU."""
    return KernelCost(name, SMS, 1, 0, nbytes)


class _Shape:
    """Sizes shared by the formulas: per-array bytes and the tile counts of a launch."""

    def __init__(self, B, T, H, D, s, blocks: plan_lib.Blocks):
        self.BH, self.T, self.D, self.s = B * H, T, D, s
        self.c, self.bt, self.bv, self.bd = blocks.c, blocks.bt, blocks.bv, blocks.bd
        self.N, self.P, self.NT = T // blocks.c, blocks.c // blocks.bt, T // blocks.bt
        self.G = blocks.segments
        self.NV, self.ND = D // blocks.bv, D // blocks.bd
        self.NS = D // blocks.state_block  # the state passes' value blocks
        self.seq = self.BH * T * D * s  # one [B, T, H, D] array
        self.rows = self.BH * T * F32_BYTES  # one [B, H, T] float32 array
        self.states = self.BH * self.N * (D * D + D) * F32_BYTES  # a state per chunk (h, z)
        self.totals = self.BH * self.G * (D * D + D) * F32_BYTES  # a state per segment
        self.pairs = self.BH * self.N * _pairs(self.P)  # score tiles computed

    def tile_dots(self, n: int, recomputed: int = 0) -> float:
        """n [bt, bt] x [bt, D]-sized dots over every score tile, ``recomputed`` of them (the
        scores A, dA contracting over all of D) repeated by every column block."""
        return self.pairs * 2 * self.bt * self.bt * self.D * (n + recomputed * (self.ND - 1))

    def state_dots(self, n: int) -> float:
        """n [bt, D] x [D, D] dots per row tile (with a state, or its update)."""
        return self.BH * self.NT * n * 2 * self.bt * self.D * self.D


# What each gradient part reads besides the row cotangents' r ([B, H, T] float32): the
# sequence arrays, whether it needs delta, which state it reads (chunk-parallel) or carries.
_GRAD_READS = {
    "dq": ({"k", "v", "dy"}, True, "h"),
    "dk": ({"q", "v", "dy"}, True, "dh"),
    "dv": ({"q", "k", "dy"}, False, "dh"),
}
# Score tiles per pair (fresh dots, recomputed-per-column-block dots): dq: dA, dA K; dk: dA,
# dA^T Q; dv: A, A^T g.
_GRAD_TILE_DOTS = {"dq": (1, 1), "dk": (1, 1), "dv": (1, 1)}


def _grad_kernel(
    sh: _Shape, parts, fused: bool, through_phi: bool = True, own: bool = False
) -> KernelCost:
    """``through_phi``: the kernel applies an elementwise feature map's phi' to dq, dk
    (``tiles.through_phi``), reading phi(q) for dq even where dq alone needs no phi(q);
    ``own``: the chunks' totals read in place of the states and bases (``plan.own_prefix``)."""
    reads, delta, states = set(), False, set()
    flops = 0.0
    for part in parts:
        arrays, needs_delta, state = _GRAD_READS[part]
        reads |= arrays
        delta |= needs_delta
        states.add(state)
        fresh, recomputed = _GRAD_TILE_DOTS[part]
        flops += sh.tile_dots(fresh, recomputed) + sh.state_dots(1)
    if through_phi and "dq" in parts:
        reads.add("q")
    nbytes = len(reads) * sh.seq + (1 + delta) * sh.rows + len(parts) * sh.seq
    name = ("fused_bwd_d" if fused else "bwd_d") + "".join(x[1] for x in parts)
    if fused:  # the state is carried (and updated), not read
        flops += sh.BH * sh.N * 2 * sh.c * sh.D * sh.D * len(states)
        return KernelCost(name, sh.BH * sh.ND, sh.N, flops, nbytes)
    nbytes += len(states) * (sh.totals if own else sh.states + sh.totals * (sh.G > 1))
    return KernelCost(name, sh.NT * sh.BH * sh.ND, 1, flops, nbytes)


def chunk_kernels(
    B, T, H, D, s, blocks: plan_lib.Blocks, backward: bool, through_phi: bool = True
) -> list[KernelCost]:
    """The chunk-parallel design: forward, or forward + backward (the backward recomputes the
    forward state pass). T a multiple of c, D the padded head dim, s bytes per element;
    ``through_phi``: the gradient kernels apply phi' (an elementwise feature map, the default;
    ``_grad_kernel``). With one chunk per segment (``plan.own_prefix``: no initial state, as
    in training) the state passes write only the chunks' totals, the output and gradient
    kernels read those (each array counted once: the sums stay in L2), no XLA prefix runs and
    the backward keeps the forward's totals instead of recomputing the pass. The reverse state
    pass forms the row cotangents r, delta (``bwd_dh``, ``rows_from``): no XLA pass."""
    sh = _Shape(B, T, H, D, s, blocks)
    own = plan_lib.own_prefix(blocks, sh.N)
    local = 0 if own else sh.states  # the segment-local states written / read
    state_pass = sh.BH * sh.N * 2 * sh.c * D * D
    fwd_h = KernelCost(
        "fwd_h", sh.BH * sh.NS * sh.G, sh.N // sh.G, state_pass,
        2 * sh.seq + local + sh.totals,
    )  # fmt: skip
    bases = [_xla("xla: segment prefix", 3 * sh.totals)] if sh.G > 1 and not own else []
    fwd_o = KernelCost(
        "fwd_o",
        sh.NT * sh.BH * sh.NV,
        1,
        sh.state_dots(1) + sh.tile_dots(1, 0) + sh.pairs * 2 * sh.bt**2 * D * sh.NV,
        4 * sh.seq + local + sh.totals * (sh.G > 1) + sh.rows,
    )
    out = [fwd_h, *bases, fwd_o]
    if not backward:
        return out
    out += [
        *([] if own else [dataclasses.replace(fwd_h, name="fwd_h (recomputed)")]),
        *bases,
        # bwd_dh forms the row cotangents r, delta (reads y, den; writes r, delta)
        KernelCost(
            "bwd_dh",
            sh.BH * sh.NS * sh.G,
            sh.N // sh.G,
            state_pass,
            3 * sh.seq + 3 * sh.rows + local + sh.totals,
        ),  # fmt: skip
        *[dataclasses.replace(b, name="xla: segment suffix") for b in bases],
        *[_grad_kernel(sh, parts, False, through_phi, own) for parts in blocks.grad_kernels],
    ]
    return out


def fused_kernels(
    B, T, H, D, s, blocks: plan_lib.Blocks, backward: bool, through_phi: bool = True
) -> list[KernelCost]:
    """The single-pass design (``fused_chunk``); ``through_phi`` as for :func:`chunk_kernels`."""
    sh = _Shape(B, T, H, D, s, blocks)
    out = [
        KernelCost(
            "fused_fwd",
            sh.BH * sh.NV,
            sh.N,
            sh.state_dots(1)
            + sh.tile_dots(1, 0)
            + sh.pairs * 2 * sh.bt**2 * D * sh.NV
            + sh.BH * sh.N * 2 * sh.c * D * D,
            4 * sh.seq + sh.rows,
        )  # fmt: skip
    ]
    if not backward:
        return out
    out.append(_xla("xla: r, delta", 2 * sh.seq + 3 * sh.rows))
    out += [_grad_kernel(sh, ("dq",), True, through_phi)]
    for parts in blocks.grad_kernels:
        parts = tuple(x for x in parts if x != "dq")
        if parts:
            out.append(_grad_kernel(sh, parts, True, through_phi))
    return out


def old_fused_kernels(B, T, H, D, s, c: int, backward: bool) -> list[KernelCost]:
    """The single-pass kernels as they were before the chunk-parallel rewrite (grid (B, H), one
    [c, c] tile per chunk, one backward kernel with both loops): the table's baseline."""
    N, BH = T // c, B * H
    seq = BH * T * D * s
    rows = BH * T * F32_BYTES
    out = [KernelCost("old_fwd", BH, N, BH * N * (4 * c * c * D + 4 * c * D * D), 4 * seq + rows)]
    if backward:
        out.append(
            KernelCost(
                "old_bwd",
                BH,
                2 * N,
                BH * N * (12 * c * c * D + 10 * c * D * D),
                # loop 1 reads phi(K), V, Y, dY, den and writes dphi(Q); loop 2 reads phi(Q),
                # phi(K), V, Y, dY, den and writes dphi(K), dV
                12 * seq + 2 * rows,
            )
        )
    return out


def design_seconds(costs: list[KernelCost]) -> float:
    """Modelled time of a sequence of launches: their bounds plus a launch overhead each."""
    return sum(k.seconds + LAUNCH_SECONDS for k in costs)


# The smallest row tile and state-pass value block :func:`plan_blocks` splits to, and the
# modelled gain a split must buy: smaller tiles use the tensor cores less well than this model,
# which prices every Pallas FLOP alike, can see, so one is taken only where the grid's wave fill
# buys clearly more.
MIN_SPLIT_TILE = 32
MIN_STATE_BLOCK = 16
SPLIT_GAIN = 0.05


def plan_blocks(B: int, T: int, H: int, D: int, c: int, *, forget: bool = False):
    """``plan.blocks`` with the wave-filling splits this model pays for: what the chunk-parallel
    kernels run (``ops``) and :func:`choose` prices.

    Two splits are taken where the model (:func:`chunk_kernels`, forward + backward) prices the
    kernels they change at least :data:`SPLIT_GAIN` faster, each against the plan before it:
    the row tile ``plan.tile(c, D)`` halved (not under :data:`MIN_SPLIT_TILE`), and the state
    passes' value block ``bs`` at its fastest halving (not under :data:`MIN_STATE_BLOCK`). At
    few waves (1k tokens, 12, 20 or 25 heads) the output and gradient kernels' T / bt x B H x
    D / bv programs, and the state passes' G B H x D / bs, leave part of the last wave of the
    132 SMs idle, and more programs fill it better (docs/design.md, "`LT_chunked` against
    `flash` at 1k")."""
    out = plan_lib.blocks(B, T, H, D, c, forget=forget)

    def faster(a: plan_lib.Blocks, b: plan_lib.Blocks) -> bool:
        """Whether b's kernels that differ from a's are modelled SPLIT_GAIN faster."""
        ka, kb = (chunk_kernels(B, T, H, D, 2, x, True) for x in (a, b))
        changed = [(x, y) for x, y in zip(ka, kb) if x != y]
        before = sum(x.seconds for x, _ in changed)
        return sum(y.seconds for _, y in changed) < (1 - SPLIT_GAIN) * before

    if out.bt // 2 >= MIN_SPLIT_TILE:
        split = dataclasses.replace(out, bt=out.bt // 2)
        out = split if faster(out, split) else out
    splits = []
    bs = out.state_block // 2
    while bs >= MIN_STATE_BLOCK:
        splits.append(dataclasses.replace(out, bs=bs))
        bs //= 2
    if splits:  # the fastest halving of the state passes' value block, if it pays
        best = min(splits, key=lambda b: design_seconds(chunk_kernels(B, T, H, D, 2, b, True)))
        out = best if faster(out, best) else out
    return out


@dataclasses.dataclass(frozen=True)
class Choice:
    kernel: str
    reason: str
    seconds: dict[str, float]


def choose(B: int, T: int, H: int, D: int, c: int, s: int) -> Choice:
    """The design ``kernel=pallas`` runs at ``[B, T, H, D]`` (T a multiple of c, D padded) with
    s bytes per element: the one with the lower modelled forward + backward time."""
    # fused_chunk holds Pallas kernels: imported when the choice is made, not with the model.
    from linear_gpt2.kernels.lt_chunked import fused_chunk

    chunk = design_seconds(chunk_kernels(B, T, H, D, s, plan_blocks(B, T, H, D, c), True))
    fused = design_seconds(fused_kernels(B, T, H, D, s, fused_chunk.blocks(B, T, H, D, c), True))
    seconds = {CHUNK: chunk, FUSED: fused}
    kernel = min(seconds, key=seconds.get)
    reason = (
        f"modelled fwd+bwd {chunk * 1e6:.1f} us chunk-parallel vs {fused * 1e6:.1f} us single "
        f"pass ({B * H} single-pass programs on {SMS} SMs)"
    )
    return Choice(kernel, reason, seconds)
