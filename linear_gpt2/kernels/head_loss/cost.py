"""The fused head + loss kernels' FLOPs and HBM bytes (for the step-time MODEL), at the tiles
:func:`.fused.plan` picks. Every tile's work is counted, masked lanes too.

- forward: ``2 N V C`` for the logits (token and vocabulary tiles padded), reading h once and w
  once per token tile over the grid's concurrent programs (counted once: the programs running
  at once walk the same vocabulary tiles, which L2 serves), writing the ``[S, N]`` partials;
- backward: ``6 N V C`` (the logits again, dh, dw) and each block's float32 atomic adds into dh
  and dw, ``(bt + bv) C`` floats per block, counted as HBM bytes (they resolve in L2, but dw at
  V C floats does not fit it), plus the operands once.
"""

from __future__ import annotations

import math

from jax.experimental import pallas as pl

from linear_gpt2.kernels.lt_chunked.cost import KernelCost

F32 = 4


def kernel_costs(N: int, V: int, C: int, itemsize: int = 2) -> list[KernelCost]:
    """``head_loss_fwd`` and ``head_loss_bwd`` at N tokens, vocabulary V, width C, operands of
    ``itemsize`` bytes (2: bfloat16)."""
    from linear_gpt2.kernels.head_loss import fused  # the tiles; Pallas is imported already

    bt, bv, bk, Cp = fused.plan(N, V, C)
    S, per = fused.vocab_split(N, V, bt, bv)
    nt, vt = pl.cdiv(N, bt), pl.cdiv(V, bv)
    logits = 2.0 * (nt * bt) * (vt * bv) * Cp
    operands = (N + V) * C * itemsize
    fwd = KernelCost("head_loss_fwd", nt * S, per, logits, operands + N * 4 + 2 * S * N * F32)
    atomics = nt * vt * (bt + bv) * Cp * F32
    bwd = KernelCost("head_loss_bwd", nt * vt, 1, 3 * logits,
                     operands + 3 * N * 4 + atomics + (nt * bt + vt * bv) * Cp * F32)  # fmt: skip
    return [fwd, bwd]


def flops(N: int, V: int, C: int) -> float:
    """Both kernels' FLOPs: 8 N V C (padded tiles)."""
    return math.fsum(k.flops for k in kernel_costs(N, V, C))
