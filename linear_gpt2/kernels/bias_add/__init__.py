"""Bias adds whose gradient, a sum over tokens, is fused into the pass that writes the cotangent
(Pallas, Triton on GPU, interpret mode elsewhere), with their plain-JAX oracle: ``c_attn``'s
bias and the split of its output into heads (q, k, v), and the MLP's ``c_proj`` bias added to
the residual stream.

================  ===========================================================================
module            what
================  ===========================================================================
``naive``         the oracle: the bias added in the compute dtype (as Flax's ``Dense``), the
                  split into heads or the residual add, and their backward
``fused``         ``bias_add_bwd``: one or more cotangents written, side by side and in the
                  compute dtype, into the projection's ``[N, k C]`` cotangent, with the bias
                  gradient as per-program partial sums
``ops``           the differentiable ops (custom_vjp; the forwards are XLA's)
================  ===========================================================================

This package's ``__init__`` names the kernels only: importing :mod:`.naive` never imports Pallas.
"""
