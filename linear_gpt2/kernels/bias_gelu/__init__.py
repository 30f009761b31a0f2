"""The MLP's bias and exact GELU, ``g = gelu(z + b)``, with a fused backward (Pallas, Triton on GPU,
interpret mode elsewhere) and its plain-JAX oracle.

================  ===========================================================================
module            what
================  ===========================================================================
``naive``         the oracle: Flax's ``nn.gelu(approximate=False)`` of ``z + b`` in z's dtype,
                  and its backward in float32
``fused``         ``bias_gelu_bwd``: one pass over z and dg writing dz and the bias gradient
                  as per-program partial sums (no [N, F] product, no layout change for a
                  reduction over tokens)
``ops``           the differentiable op (custom_vjp: residuals z and b, the forward in XLA)
================  ===========================================================================

This package's ``__init__`` names the kernels only: importing :mod:`.naive` never imports Pallas.
"""
