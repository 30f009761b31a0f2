"""Tile sizes and launch shapes of the ``LT_attention_parallel`` tiled kernels (``tiled.py``).

:class:`Tiles` fixes, for one call, everything static about the launches:

- ``bq``, ``tk``: the forward's resident query block, the rows one program keeps (phi(Q), the
  running numerator and denominator), and the key tile it streams (phi(K), V) up to the
  diagonal;
- ``bk``, ``tq``: the backward's resident key block (phi(K), V and their gradients) and the
  query tile it streams (phi(Q), g, delta) from the diagonal on;
- the warps of each kernel.

Each streamed tile is also the block of its kernel's block-local log-gate sums (forgetting). The
user's block size (``chunk_size``) caps every tile. A resident block of two key tiles (128 rows)
halves the loads per FLOP of every loop step against one (each loaded tile meets twice the
rows), the point of the design; 128 rows are the most the registers hold without spilling (the
backward's: 64 at D = 128, 32 at D <= 32), and its query tile 32 rows (compiled for the H100 in
tests/test_target.py; registers and shared memory per kernel in
benchmarks/results/kernel_roofline_parallel_h100_model.md). Which of the two tilings of
:func:`candidates` runs at a shape is the cost model's choice (``cost.choose``): the smaller one
where the larger leaves too few programs for the 132 SMs. The two-kernel backward
(``tiled_dq.py``, what ``kernel=pallas`` runs with the tiled forward) has its own tilings,
:func:`dq_candidates`, chosen the same way.
"""

from __future__ import annotations

import dataclasses

from linear_gpt2 import kernels

# Rows of a streamed tile at most: the forward's key tiles ([bq, 64] scores, the tensor-core
# shape) and the backward's query tiles (32: with 64 the backward spills, compiled for the H100).
MAX_KEY_TILE = 64
MAX_QUERY_TILE = 32
# Rows of a resident block at most, per padded head dim: forward (query block), backward (key
# block). The backward's resident block holds two float32 [bk, D] accumulators besides the
# [tq, bk] scores and score cotangents: 128 rows compile without spills at D = 64, 64 at
# D = 128, and at D <= 32 only 32 (Triton's layouts for the narrow dots spilled with 64 or 128,
# with resets and gates).
MAX_QUERY_BLOCK = {16: 128, 32: 128, 64: 128, 128: 128}
MAX_KEY_BLOCK = {16: 32, 32: 32, 64: 128, 128: 64}


@dataclasses.dataclass(frozen=True)
class Tiles:
    """Forward: query blocks of ``bq`` rows, key tiles of ``tk``; backward: key blocks of ``bk``
    rows, query tiles of ``tq``. Each streamed tile is one block of the block-local log-gate
    sums of its kernel (forgetting)."""

    bq: int
    tk: int
    bk: int
    tq: int

    @property
    def pad(self) -> int:
        """T is padded to a multiple of this: every resident block is whole."""
        return max(self.bq, self.bk)

    def describe(self) -> str:
        return f"bq={self.bq} tk={self.tk} bk={self.bk} tq={self.tq}"


def candidates(c: int, D: int) -> list[Tiles]:
    """The tilings the cost model chooses from for block size c (a power of two >= 16: it caps
    every tile) at padded head dim D: resident blocks of two streamed key tiles or of one,
    within the registers (``MAX_*``)."""
    tk, tq = min(c, MAX_KEY_TILE), min(c, MAX_QUERY_TILE)
    out = []
    for mult in (2, 1):
        bq = min(mult * tk, MAX_QUERY_BLOCK[D])
        bk = max(min(mult * tk, MAX_KEY_BLOCK[D]), tq)
        t = Tiles(bq=bq, tk=tk, bk=bk, tq=tq)
        if t not in out:
            out.append(t)
    return out


def largest(c: int, D: int) -> Tiles:
    """The tiling with the largest resident blocks."""
    return candidates(c, D)[0]


# The two-kernel backward (``tiled_dq.py``): its key kernel's resident key block at most, per
# padded head dim, and its query tile. The scores are formed transposed, so the key block is
# the M side of every dot (the warpgroup MMA's needs 64 rows or more); the block holds two
# float32 [bk, D] accumulators and the [bk, tq] scores and cotangents, but no dq rows: 128 rows
# compile without spills at every D (the atomic kernel's limit was 64 at D = 128 and 32 at
# D <= 32), with resets and gates too; at D = 128 a 64-row block would split each warpgroup
# MMA of the [bk, tq] scores to 16 columns for the same one program per SM. Query tiles of 32
# keep the D = 64 kernel within half the registers (two programs per SM, as the forward),
# where tiles of 64 took one.
MAX_DKV_BLOCK = {16: 128, 32: 128, 64: 128, 128: 128}
MAX_DKV_QUERY_TILE = 32


def dq_candidates(c: int, D: int) -> list[Tiles]:
    """The tilings of the two-kernel backward for block size c at padded head dim D: the
    forward's query blocks and key tiles (its dq kernel has the forward's shape and tiles), and
    the key kernel's blocks of two key tiles or one (at most :data:`MAX_DKV_BLOCK` rows)
    streaming query tiles of :data:`MAX_DKV_QUERY_TILE` (the block size caps every tile)."""
    tq = min(c, MAX_DKV_QUERY_TILE)
    out = []
    for mult, fwd in zip((2, 1), candidates(c, D) * 2):
        bk = max(min(mult * fwd.tk, MAX_DKV_BLOCK[D]), tq)
        t = Tiles(bq=fwd.bq, tk=fwd.tk, bk=bk, tq=tq)
        if t not in out:
            out.append(t)
    return out


def dq_largest(c: int, D: int) -> Tiles:
    """The two-kernel backward's tiling with the largest resident blocks."""
    return dq_candidates(c, D)[0]


def padded_length(T: int, t: Tiles) -> int:
    return -(-T // t.pad) * t.pad


# num_warps per kernel, by padded head dim (registers compiled with them:
# benchmarks/results/kernel_roofline_parallel_h100_model.md).
_WARPS = {
    "fwd": {16: 4, 32: 4, 64: 8, 128: 8},
    "bwd": {16: 4, 32: 8, 64: 8, 128: 8},
    # the two-kernel backward: dq has the forward's shape and warps
    "dkv": {16: 8, 32: 8, 64: 8, 128: 8},
    "dq": {16: 4, 32: 4, 64: 8, 128: 8},
}


def num_warps(kernel: str, D: int) -> int:
    return _WARPS[kernel][D]


def compiler_params(kernel: str, D: int):
    # Pallas's Triton backend: imported when a kernel is built, not with the plan.
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps(kernel, D), num_stages=2)


def check(c: int, D: int, what: str) -> None:
    """The one-line errors of a block size or head dim the kernels cannot take."""
    kernels.check_block_size(c, f"{what}: chunk_size")
    kernels.check_head_dim(D, what)
