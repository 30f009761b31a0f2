"""How the step's row-wise glue kernels are launched (LayerNorm, bias + GELU, the bias
gradient, the cross-entropy): warps per program, Triton's software-pipelining stages, the floats
one tile holds and, for the kernels whose programs walk row tiles, how many programs per SM.

One :class:`Launch` per kernel name (:data:`DEFAULTS`, picked from a GPU's timings of
:data:`CANDIDATES` by ``studies/gpu_check/glue_launch.py``), read when the kernel is traced;
:func:`override` sets others for a block of code, which is how ``benchmarks/bench_glue.py``
times candidates side by side on a GPU. A launch changes no result: each computes the same
arithmetic on the same rows, in the same order within a row (tests/test_kernels_launch.py).
Only a function traced inside the block sees an override: ``jax.jit`` caches by function, so
trace a new one per launch.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Iterator, Mapping

from linear_gpt2.platform.cards import H100


@dataclasses.dataclass(frozen=True)
class Launch:
    """``warps`` per program; ``stages`` of Triton's software pipelining (1: none; more lets a
    walking kernel load its next tile while it computes this one); ``tile``: floats (elements)
    per tile, its rows the tile over the row's padded width; ``programs_per_sm``: for a kernel
    whose programs walk row tiles, programs per SM (None: one program per tile)."""

    warps: int
    stages: int = 1
    tile: int = 4096
    programs_per_sm: int | None = None

    def label(self) -> str:
        """The launch in words, for tables: warps, stages, tile and programs per SM."""
        per_sm = "" if self.programs_per_sm is None else f", {self.programs_per_sm} per SM"
        return f"{self.warps} warps, {self.stages} stages, tile {self.tile}{per_sm}"

    def programs(self, tiles: int) -> int:
        """Programs along the rows for ``tiles`` row tiles."""
        if self.programs_per_sm is None:
            return tiles
        return max(1, min(tiles, self.programs_per_sm * H100.sms))


# The launches the kernels run: what studies/gpu_check/glue_launch.py's rule picks from the
# glue kernels timed one by one on an H200 (benchmarks/results/glue_kernels_h200_measured.json,
# rendered in gpu_check_h200_measured.md); tests/test_glue_launch.py fails when they differ.
# Where the rule keeps the launch a kernel was written with, no candidate beat it by more than
# the file's noise.
DEFAULTS: dict[str, Launch] = {
    "layernorm_fwd": Launch(warps=8),
    "layernorm_bwd": Launch(warps=8, programs_per_sm=2),
    "bias_gelu_fwd": Launch(warps=8, programs_per_sm=4),
    "bias_gelu_bwd": Launch(warps=4, tile=2048, programs_per_sm=8),
    "bias_add_bwd": Launch(warps=4, programs_per_sm=2),
    "cross_entropy": Launch(warps=8),
}


def _walking(warps: int, programs: int) -> tuple[Launch, ...]:
    """A walking kernel's candidates around the launch it was written with (first): more and
    fewer programs per SM, smaller tiles over more programs, larger tiles, the other warp count.
    Not Triton's pipelining: compiled for the H100 at ``num_stages`` 3 these loops hold no
    staging buffers (the same shared memory as at 1), so a stage count would time the same
    program twice."""
    other = 8 if warps == 4 else 4
    return (
        Launch(warps, programs_per_sm=programs),
        Launch(warps, programs_per_sm=2 * programs),
        Launch(warps, programs_per_sm=max(1, programs // 2)),
        Launch(4, tile=2048, programs_per_sm=4 * programs),
        Launch(8, tile=8192, programs_per_sm=programs),
        Launch(other, programs_per_sm=2 * programs),
    )


def _one_tile(warps: int) -> tuple[Launch, ...]:
    """A one-tile-per-program kernel's candidates around the launch it was written with
    (first)."""
    other = 8 if warps == 4 else 4
    return (Launch(warps), Launch(other), Launch(warps, tile=2048), Launch(warps, tile=8192),
            Launch(4, tile=2048), Launch(16, tile=8192))  # fmt: skip


def _default_first(name: str, around: tuple[Launch, ...]) -> tuple[Launch, ...]:
    """``around`` with kernel ``name``'s default moved to the front (added if absent)."""
    return (DEFAULTS[name], *(c for c in around if c != DEFAULTS[name]))


# What a GPU times against each default (``benchmarks/bench_glue.py``), the default first: the
# candidates around the launches the kernels were written with, the set the H200 timed
# (benchmarks/results/glue_kernels_h200_measured.json), so the next measurement retimes the
# same launches with the one picked as the baseline.
CANDIDATES: dict[str, tuple[Launch, ...]] = {
    "layernorm_fwd": _default_first("layernorm_fwd", _one_tile(8)),
    "layernorm_bwd": _default_first("layernorm_bwd", _walking(8, 4)),
    "bias_gelu_fwd": _default_first("bias_gelu_fwd", _walking(8, 2)),
    "bias_gelu_bwd": _default_first("bias_gelu_bwd", _walking(8, 2)),
    "bias_add_bwd": _default_first("bias_add_bwd", _walking(4, 2)),
    "cross_entropy": _default_first("cross_entropy", _one_tile(8)),
}
_OVERRIDES: contextvars.ContextVar[Mapping[str, Launch] | None] = contextvars.ContextVar(
    "glue_launch_overrides", default=None
)


def of(name: str) -> Launch:
    """The launch of kernel ``name`` in the code being traced."""
    return (_OVERRIDES.get() or {}).get(name) or DEFAULTS[name]


@contextlib.contextmanager
def override(launches: Mapping[str, Launch]) -> Iterator[None]:
    """Kernels named in ``launches`` launch so while the block traces."""
    unknown = sorted(set(launches) - set(DEFAULTS))
    if unknown:
        raise ValueError(f"no glue kernel named {', '.join(unknown)}; one of {', '.join(DEFAULTS)}")
    for name, launch in launches.items():
        if launch.warps & (launch.warps - 1) or min(launch.warps, launch.stages, launch.tile) < 1:
            raise ValueError(f"{name}: {launch} needs warps a power of two, stages and tile >= 1")
        if (launch.programs_per_sm is None) != (DEFAULTS[name].programs_per_sm is None):
            walks = DEFAULTS[name].programs_per_sm is not None
            raise ValueError(
                f"{name}: its programs {'walk row tiles: give' if walks else 'each take one tile: drop'} programs_per_sm"
            )
    token = _OVERRIDES.set({**(_OVERRIDES.get() or {}), **launches})
    try:
        yield
    finally:
        _OVERRIDES.reset(token)
