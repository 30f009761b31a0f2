"""Block sizes and launch shapes of the ``LT_chunked`` kernels, chosen from the shape.

:class:`Blocks` fixes, for one call, everything static about the launch:

- ``c``: the chunk size, the spacing of the stored states (the user's ``chunk_size``);
- ``bt``: the row tile, ``min(c, MAX_TILE)``. Scores are computed as [bt, bt] tiles of the
  chunk's [c, c] matrix, so c = 256 costs [64, 64] register tiles, not [256, 256], and the
  tiles above the diagonal are skipped;
- ``bv``: the value block of the state pass and output kernel (the [D, D] state split by value
  columns across programs);
- ``bd``: the column block of the gradient kernels (dphi(q), dphi(k), dv computed 64 columns of
  D per program, the states' rows / columns loaded or carried accordingly);
- ``segments``: G, the split of the sequence for the state passes (``fwd_h`` / ``bwd_dh``);
- ``bs``: the value block of the state passes alone (``state_block``; None: ``bv``), where
  splitting their [D, D] states finer fills the GPU's waves better than the output kernel needs.

Which values: see :func:`blocks` and the design notes (docs/design.md, "LT_chunked kernels"),
where the roofline model (``cost.py``, ``benchmarks/roofline.py``) and the compiled register
counts that drove them are quoted.
"""

from __future__ import annotations

import dataclasses
import math

from linear_gpt2.platform.cards import H100

# Rows of a score tile at most: [64, 64] float32 scores (``tile``).
MAX_TILE = 64
# The H100's SMs: the launch size a pass needs to occupy the whole GPU.
SMS = H100.sms


@dataclasses.dataclass(frozen=True)
class Blocks:
    c: int
    bt: int
    bv: int
    bd: int
    segments: int
    # The backward gradient kernels, each the tuple of the gradients it computes.
    grad_kernels: tuple[tuple[str, ...], ...] = (("dq", "dk", "dv"),)
    bs: int | None = None

    @property
    def state_block(self) -> int:
        """The value block of the state passes' [D, D] states (``fwd_h``, ``bwd_dh``)."""
        return self.bs or self.bv

    def describe(self) -> str:
        kernels = "+".join("d" + "".join(x[1] for x in k) for k in self.grad_kernels)
        bs = f" bs={self.bs}" if self.bs and self.bs != self.bv else ""
        return (
            f"c={self.c} bt={self.bt} bv={self.bv} bd={self.bd}{bs} G={self.segments} "
            f"grads={kernels}"
        )


def value_block(D: int) -> int:
    """bv (and bd): all of D up to 64 columns, 64-column blocks above (D = 128: two programs,
    each with a [128, 64] float32 state slice instead of [128, 128])."""
    return min(D, 64)


def segments(B: int, H: int, N: int, nv: int, sms: int = SMS) -> int:
    """G: the fewest segments (a power of two dividing the N chunks) that give the state passes
    at least two programs per SM (B H nv G >= 2 sms), or N if even one chunk per segment does not.
    Each segment costs one [D, D] total and a term of the XLA prefix; two waves rather than one
    halve the tail when the programs do not divide evenly over the SMs."""
    G = 1
    while B * H * nv * G < 2 * sms and N % (2 * G) == 0:
        G *= 2
    return G


# The most chunks for which, with one chunk per segment, the kernels sum the chunks' totals
# themselves (:func:`own_prefix`): each output / gradient program then reads up to N - 1
# [D, D] totals (from L2), against the two (state, segment base) of the general path. 8: 1k
# tokens in chunks of 128; at c = 64 the general path (both compile-tested at 1k). Forming the
# states from phi(K), V instead (no forward state pass) was priced by the step-time MODEL and
# lost: the recomputed dots cost more than the launch (docs/design.md).
OWN_PREFIX_CHUNKS = 8


def own_prefix(blocks: Blocks, N: int) -> bool:
    """Whether the N chunks are N segments (G = N) few enough (:data:`OWN_PREFIX_CHUNKS`) that
    the kernels form every state from the chunks' totals themselves, with no XLA prefix and the
    totals kept for the backward (``ops.own_prefix``, which also asks for no initial / final
    state and no forgetting)."""
    return blocks.segments == N <= OWN_PREFIX_CHUNKS


def tile(c: int, D: int) -> int:
    """bt, the row tile: 64 rows up to D = 64, 32 at D = 128 (bt D <= 4096 elements per operand
    tile). At D = 128 the backward kernels spill with 64-row tiles (compiled: 120-230 bytes per
    thread), and not with 32."""
    return min(c, MAX_TILE, max(16, 4096 // D))


def grad_kernels(
    D: int, design: str = "chunk", forget: bool = False
) -> tuple[tuple[str, ...], ...]:
    """How the backward splits dphi(q), dphi(k), dv over kernels (compiled register counts in
    docs/design.md). Chunk-parallel: one kernel up to D = 64 (every input read once), dq and
    (dk, dv) apart at D = 128, where one kernel spills. With forgetting (the [bt, bt] pair
    weights live besides the scores) dq, dk and dv apart at every D: together they spill.
    Single pass: dq walks forward, dk and dv walk in reverse, each carrying only the state slice
    it reads (together they spill)."""
    if design == "fused" or forget:
        return (("dq",), ("dk",), ("dv",))
    return (("dq", "dk", "dv"),) if D <= 64 else (("dq",), ("dk", "dv"))


def blocks(
    B: int, T: int, H: int, D: int, c: int, *, segments_override: int | None = None,
    forget: bool = False,
):  # fmt: skip
    """The launch shape of the chunk-parallel kernels for ``[B, T, H, D]`` inputs (T a multiple
    of c, D a power of two), with forgetting (resets / decay gates) or not, before the
    wave-filling splits (``cost.plan_blocks``, what the kernels run)."""
    bv = value_block(D)
    N = T // c
    G = segments(B, H, N, D // bv) if segments_override is None else segments_override
    if N % G:
        raise ValueError(f"segments={G} does not divide the {N} chunks")
    return Blocks(
        c=c, bt=tile(c, D), bv=bv, bd=bv, segments=G,
        grad_kernels=grad_kernels(D, forget=forget),
    )  # fmt: skip


def fused_blocks(B: int, T: int, H: int, D: int, c: int) -> Blocks:
    """The launch shape of the single-pass kernels (no segments)."""
    del B, T, H
    bv = value_block(D)
    return Blocks(
        c=c, bt=tile(c, D), bv=bv, bd=bv, segments=1, grad_kernels=grad_kernels(D, "fused")
    )


# num_warps per kernel, by padded head dim (compiled register counts in docs/design.md).
_WARPS = {
    "fwd_h": {16: 4, 32: 4, 64: 4, 128: 4},
    "fwd_o": {16: 4, 32: 4, 64: 4, 128: 4},
    "bwd_dh": {16: 4, 32: 4, 64: 4, 128: 8},
    "bwd_dqkv": {16: 8, 32: 8, 64: 8, 128: 8},
    "bwd_dq": {16: 8, 32: 8, 64: 8, 128: 8},
    "bwd_dkv": {16: 8, 32: 8, 64: 8, 128: 8},
    "bwd_dk": {16: 8, 32: 8, 64: 8, 128: 8},
    "bwd_dv": {16: 8, 32: 8, 64: 8, 128: 8},
    "fused_fwd": {16: 4, 32: 4, 64: 4, 128: 8},
    "fused_bwd_dq": {16: 8, 32: 8, 64: 8, 128: 8},
    "fused_bwd_dkv": {16: 8, 32: 8, 64: 8, 128: 8},
    "fused_bwd_dk": {16: 8, 32: 8, 64: 8, 128: 8},
    "fused_bwd_dv": {16: 8, 32: 8, 64: 8, 128: 8},
}


def num_warps(kernel: str, D: int) -> int:
    table = _WARPS[kernel]
    return table[min(table, key=lambda d: (d < D, abs(math.log2(d) - math.log2(D))))]


# Software-pipelining depth of the loops (Triton's num_stages) per kernel.
_STAGES = {k: 2 for k in _WARPS}


def compiler_params(kernel: str, D: int, blocks: Blocks):
    # Pallas's Triton backend: imported when a kernel is built, not with the block plan.
    from jax.experimental.pallas import triton as plgpu

    del blocks
    return plgpu.CompilerParams(num_warps=num_warps(kernel, D), num_stages=_STAGES[kernel])
