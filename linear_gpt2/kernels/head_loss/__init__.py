"""The tied head and the cross-entropy fused, forward and backward, without ever writing the
``[N, V]`` logits (Pallas, Triton on GPU, interpret mode elsewhere), with its plain-JAX oracle:
``model.loss_kernel=pallas_fused`` (``model/loss.py``).

================  ===========================================================================
module            what
================  ===========================================================================
``naive``         the oracle: per-row nll and lse of ``h @ w^T``, and dh, dw from the saved lse
``fused``         ``head_loss_fwd`` (token tiles, online log-sum-exp over vocabulary tiles) and
                  ``head_loss_bwd`` (one program per block of logits, recomputed; dh and dw by
                  float32 atomic adds; its docstring says why not two deterministic kernels)
``ops``           ``head_nll``: the ``custom_vjp`` op over either
================  ===========================================================================

This package's ``__init__`` names the kernels only: importing :mod:`.naive` never imports Pallas.
"""
