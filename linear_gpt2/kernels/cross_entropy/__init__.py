"""The cross-entropy of a block of logits and its gradient in one kernel (Pallas, Triton on GPU,
interpret mode elsewhere), with its plain-JAX oracle: what ``model/loss.py``'s head + loss does
with each chunk of tokens' float32 logits between the head's matmuls.

================  ===========================================================================
module            what
================  ===========================================================================
``naive``         the oracle: nll and (softmax - onehot) / count per row, ignore index -1,
                  float32 log-sum-exp (what ``loss.py`` computes in XLA)
``fused``         ``cross_entropy``: one program per row tile, an online log-sum-exp over
                  vocabulary tiles, then the gradient written over the logits (in place)
``cost``          its bytes, for the step-time MODEL
================  ===========================================================================

This package's ``__init__`` names the kernels only: importing :mod:`.naive` never imports Pallas.
"""
