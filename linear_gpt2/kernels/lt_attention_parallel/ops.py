"""The differentiable ``LT_attention_parallel`` kernels, and the choice between the designs.

``kernel`` (``attention.kernel``): ``pallas_tiled`` (``tiled.py``: resident 128-row blocks,
programs longest first, one backward kernel with atomic dq), ``pallas_blocked`` (``blocked.py``:
the first design, one query block per program, a two-loop backward kernel), or ``pallas``, which
asks the roofline model (``cost.choose``) for the design and tiling with the lower modelled
forward + backward time at the shape, and notes the choice once per shape (logged at INFO,
printed by the trainer and ``scripts/compile.py``), as ``LT_chunked``'s ``kernel=pallas`` does.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from linear_gpt2 import kernels
from linear_gpt2.kernels.lt_attention_parallel import BLOCKED, NAMES, TILED, cost, plan

_LOGGED: set = set()


@functools.lru_cache(maxsize=256)
def _choose(kernel: str, B: int, T: int, H: int, D: int, c: int, itemsize: int) -> cost.Choice:
    return cost.choose(B, T, H, D, c, itemsize, kernel)


def choose(kernel: str, B: int, T: int, H: int, D: int, c: int, dtype) -> cost.Choice:
    """The design (and tiling) behind ``kernel`` at ``[B, T, H, D]`` (T a multiple of c, D the
    padded head dim): ``pallas`` asks the cost model and notes the choice once per shape."""
    if kernel not in NAMES:
        raise ValueError(
            f"LT_attention_parallel: unknown Pallas kernel {kernel!r}; valid: {', '.join(NAMES)}"
        )
    dtype = jnp.dtype(dtype)
    choice = _choose(kernel, B, T, H, D, c, dtype.itemsize)
    key = (kernel, B, T, H, D, c, dtype.name)
    if kernel == "pallas" and key not in _LOGGED:
        _LOGGED.add(key)
        what = choice.kernel + (f" {choice.tiles.describe()}" if choice.tiles else "")
        kernels.note_choice(
            f"LT_attention_parallel kernel=pallas at [B={B}, T={T}, H={H}, D={D}] c={c} "
            f"{dtype.name}: {what} ({choice.reason})",
            __name__,
        )
    return choice


def _design(fq, c: int, kernel: str) -> cost.Choice:
    B, T, H, D = fq.shape
    plan.check(c, D, f"LT_attention_parallel kernel={kernel}")
    return choose(kernel, B, T, H, kernels.padded_head_dim(D), c, fq.dtype)


def attention(fq, fk, v, c: int, eps: float, kernel: str = "pallas") -> jax.Array:
    """Normalised causal linear attention from features, fused; differentiable.

    fq = phi(q), fk = phi(k), v: ``[B, T, H, D]``, T a multiple of the block size c (a power of
    two >= 16), D <= 128. Returns y ``[B, T, H, D]`` in fq's dtype."""
    choice = _design(fq, c, kernel)
    if choice.kernel == BLOCKED:
        from linear_gpt2.kernels.lt_attention_parallel import blocked

        return blocked.blocked_attention(fq, fk, v, c, eps)
    from linear_gpt2.kernels.lt_attention_parallel import tiled

    return tiled.attention(fq, fk, v, c, eps, choice.tiles)


def forget_attention(fq, fk, v, log_gate, seg, c: int, eps: float, kernel: str = "pallas"):
    """:func:`attention` with document resets and decay gates: log_gate float32 ``[B, T, H]``
    (log gamma <= 0), seg int32 ``[B, T]`` the document id of each position; differentiable in
    fq, fk, v and log_gate."""
    choice = _design(fq, c, kernel)
    if choice.kernel == BLOCKED:
        from linear_gpt2.kernels.lt_attention_parallel import blocked

        return blocked.blocked_forget_attention(fq, fk, v, log_gate, seg, c, eps)
    from linear_gpt2.kernels.lt_attention_parallel import tiled

    return tiled.forget_attention(fq, fk, v, log_gate, seg, c, eps, choice.tiles)


def design(kernel: str, B: int, T: int, H: int, D: int, c: int, dtype) -> str:
    """What ``kernel`` runs at ``[B, T, H, D]`` (T a multiple of c, D padded): ``pallas_tiled``
    or ``pallas_blocked`` (for benchmarks' ``kernel_design``)."""
    return choose(kernel, B, T, H, D, c, dtype).kernel


__all__ = ["BLOCKED", "TILED", "attention", "choose", "design", "forget_attention"]
