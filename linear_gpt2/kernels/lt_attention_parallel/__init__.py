"""``LT_attention_parallel`` as a Pallas kernel: flash-style tiles with running sums.

================  =====================================================================
module            kernel (grid)
================  =====================================================================
``naive``         the pure-JAX oracle, the XLA path (``kernel=xla``), with its backward
``blocked``       forward (T/c, B, H): one query block per program, a loop over key blocks;
                  backward (T/c, B, H): key block j's dphi(k), dv and query block j's dphi(q)
================  =====================================================================

Interface: ``blocked.blocked_attention`` ``(phi(q), phi(k), v, c, eps) -> y``, differentiable;
with document resets and decay gates ``blocked.blocked_forget_attention``
``(phi(q), phi(k), v, log_gate, seg, c, eps) -> y``, differentiable in the log-gates too. This
``__init__`` imports nothing: the oracle never imports Pallas.
"""
