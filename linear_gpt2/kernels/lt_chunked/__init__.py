"""``LT_chunked`` as Pallas kernels (Triton-lowered on GPU, interpret mode elsewhere).

One op, its kernels side by side (flash-linear-attention's ``fla/ops/<op>/`` layout):

================  ==================================================================  ==========
module            kernel (grid)                                                       carries
================  ==================================================================  ==========
``naive``         the pure-JAX oracle, the XLA path (``kernel=xla``)                   -
``fwd_h``         state pass: states entering each chunk, (G, B, H, D/bv)              S, z
``fwd_o``         outputs of every row tile, (T/bt, B, H, D/bv)                        nothing
``bwd_dh``        reverse state pass: cotangents of the states, (G, B, H, D/bv)        dS, dz
``bwd_dqkv``      dq, dk (through phi'), dv of every row tile, (T/bt, B, H, D/bd)     nothing
``fused_chunk``   the single-pass kernels: forward (B, H, D/bv) and backward           S, z / dS, dz
                  (B, H, D/bd) x 3, each walking all T/c chunks in order
``tiles``         the tile math every kernel shares (the one place of the score mask)
``plan``          block sizes, segments, warps (:class:`plan.Blocks`)
``cost``          the roofline model: FLOPs, bytes, programs per kernel; ``kernel=pallas``
                  chooses between the two designs with it
``ops``           the differentiable ops: :func:`ops.chunked_attention` (custom_vjp)
``triton_fused``  the single pass in jax-triton (GPU only, optional)
================  ==================================================================  ==========

This package's ``__init__`` only names the kernels: importing :mod:`.naive` (the XLA path) never
imports Pallas.
"""

# The Pallas kernels of LT_chunked: "pallas" chooses by shape between the two designs.
CHUNK = "pallas_chunk"
FUSED = "pallas_fused_chunk"
NAMES = ("pallas", CHUNK, FUSED)
