"""LayerNorm fused with the residual add, as Pallas kernels (Triton-lowered on GPU, interpret
mode elsewhere), with their plain-JAX oracle.

================  ===========================================================================
module            what
================  ===========================================================================
``naive``         the oracle: ``s = x + h``, ``y = LayerNorm(s)`` with nanoGPT's numerics
                  (eps 1e-5, two-pass variance, float32 statistics), and its backward
``fused``         the kernels: ``layernorm_fwd`` (one pass: s, y, mean, rstd per row tile) and
                  ``layernorm_bwd`` (one pass: dx = ds + LayerNorm's backward, dh, and the
                  scale and bias gradients as per-program partial sums)
``ops``           the differentiable op (custom_vjp) and the choice of implementation
================  ===========================================================================

This package's ``__init__`` names the kernels only: importing :mod:`.naive` never imports Pallas.
"""
