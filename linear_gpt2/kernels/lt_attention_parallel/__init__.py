"""``LT_attention_parallel`` as Pallas kernels: the attention form, tiled, with running sums.

================  =====================================================================
module            kernel (grid)
================  =====================================================================
``naive``         the pure-JAX oracle, the XLA path (``kernel=xla``), with its backward
``tiled``         ``pallas_tiled``: forward (H, B, T/bq), one resident query block per
                  program, longest first, streaming key tiles; backward (H, B, T/bk), one
                  resident key block per program streaming query tiles: dphi(k), dv, and
                  dphi(q) by atomic float32 adds
``tiled_dq``      ``pallas_tiled_dq``: the tiled forward with FlashAttention 2's backward,
                  no atomics: key kernel (H, B, T/bk), dphi(k) and dv with the scores
                  transposed (the key block every dot's M side); query kernel (H, B,
                  T/bq), dphi(q), the forward's shape and tiles
``blocked``       ``pallas_blocked``, the first design: forward (T/c, B, H), one query block
                  per program; backward (T/c, B, H): key block j's dphi(k), dv and query
                  block j's dphi(q), two loops
``plan``          the tiled kernels' tiles and warps (:class:`plan.Tiles`)
``cost``          the roofline MODEL of the designs; ``kernel=pallas`` chooses with it
                  and an H200's timing: the model's first design, a tiled one run as
                  ``pallas_tiled_dq`` (its backward measured the faster; ``cost.MEASURED``)
``ops``           the choice by shape and the differentiable entry points
================  =====================================================================

Interface, every design: ``(phi(q), phi(k), v, c, eps) -> y``, differentiable; with document
resets and decay gates ``(phi(q), phi(k), v, log_gate, seg, c, eps) -> y``, differentiable in
the log-gates too (``ops.attention``, ``ops.forget_attention``). This ``__init__`` imports
nothing: the oracle never imports Pallas.
"""

# The Pallas kernels of LT_attention_parallel: "pallas" chooses by shape between pallas_tiled_dq
# and pallas_blocked (cost.choose); pallas_tiled (the atomic backward) runs when named.
TILED = "pallas_tiled"
TILED_DQ = "pallas_tiled_dq"
BLOCKED = "pallas_blocked"
NAMES = ("pallas", TILED, TILED_DQ, BLOCKED)
