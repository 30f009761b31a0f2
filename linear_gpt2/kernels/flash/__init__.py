"""``flash``: causal softmax attention as fused kernels, one device or a ring of them.

One op, its kernels side by side (as ``lt_chunked/``):

============  ==========================================================================
module        what
============  ==========================================================================
``naive``     the plain-JAX oracle, the XLA path (``kernel=xla``): the scores materialised
``cudnn``     cuDNN's fused attention through JAX (GPU, or compiling for one), documents
              as cuDNN's packed sequences
``pallas``    JAX's Pallas FlashAttention-2 kernel (Triton on GPU, interpret mode elsewhere)
``ring``      context parallelism: the ring over the mesh's ``seq`` axis and its per-block
              ops (the XLA block, the oracle; the tiled XLA block; the cuDNN block)
``ops``       the choice: what ``kernel`` (``auto`` included) runs for these inputs, on one
              device and per block of the ring
============  ==========================================================================

This package's ``__init__`` only names the kernels: importing :mod:`.naive` never imports
Pallas or cuDNN's internals.
"""

# The values of attention.kernel for flash (auto: cuDNN on a GPU, xla elsewhere).
KERNELS = ("auto", "xla", "pallas", "cudnn")
