"""``LT_attention_parallel`` as a Pallas kernel: flash-style tiles with running sums.

================  =====================================================================
module            kernel (grid)
================  =====================================================================
``naive``         the pure-JAX oracle (``attention.lt_attention_parallel``)
``blocked``       forward (T/c, B, H): one query block per program, a loop over key blocks;
                  backward (T/c, B, H): key block j's dphi(k), dv and query block j's dphi(q)
================  =====================================================================

Interface: :func:`blocked_attention` ``(phi(q), phi(k), v, c, eps) -> y``, differentiable; with
document resets and decay gates :func:`blocked_forget_attention`
``(phi(q), phi(k), v, L, seg, c, eps) -> y``, differentiable in L too.
"""

from linear_gpt2.kernels.lt_attention_parallel.blocked import (
    blocked_attention,
    blocked_forget_attention,
)

__all__ = ["blocked_attention", "blocked_forget_attention"]
