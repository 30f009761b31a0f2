"""``head_nll``: the per-row cross-entropy of the tied head's logits as one differentiable op
whose forward and backward never hold the ``[N, V]`` logits (``kernel="pallas"``), or the same
``custom_vjp`` over the oracle's formulas (``kernel="xla"``: the logits materialised; what the
kernels are tested against).

Residuals: h, w, targets and the float32 log-sum-exp ``[N]``; the backward recomputes the logits
block by block. dh and dw come back in h's and w's dtypes (float32 sums rounded once, as autodiff
of the plain head rounds its matmuls' results).
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

from linear_gpt2.kernels.head_loss import naive

KERNELS = ("xla", "pallas")


def _impl(kernel: str):
    if kernel not in KERNELS:
        raise ValueError(f"head_nll kernel={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "pallas":
        from linear_gpt2.kernels.head_loss import fused  # Pallas: imported when picked

        return fused.head_loss_fwd, fused.head_loss_bwd
    return naive.nll_and_lse, naive.backward


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _head_nll(h, w, targets, kernel):
    return _impl(kernel)[0](h, w, targets)[0]


def _fwd(h, w, targets, kernel):
    nll, lse = _impl(kernel)[0](h, w, targets)
    return nll, (h, w, targets, lse)


def _bwd(kernel, residuals, dnll):
    h, w, targets, lse = residuals
    dh, dw = _impl(kernel)[1](h, w, targets, lse, dnll)
    # Integer targets take a float0 cotangent (JAX's convention for non-differentiable inputs).
    return dh.astype(h.dtype), dw.astype(w.dtype), jnp.zeros(targets.shape, jax.dtypes.float0)


_head_nll.defvjp(_fwd, _bwd)


def head_nll(h: jax.Array, w: jax.Array, targets: jax.Array, *, kernel: str = "pallas"):
    """float32 ``[N]``: per-row cross-entropy of ``h @ w^T`` against ``targets`` (-1: ignored,
    0), differentiable in h and w. h ``[N, C]`` and w ``[V, C]`` in the compute dtype (one
    dtype), targets int ``[N]``."""
    if h.dtype != w.dtype:
        raise ValueError(f"head_nll: h is {h.dtype} and w {w.dtype}; cast both to the compute "
                         "dtype")  # fmt: skip
    _impl(kernel)
    return _head_nll(h, w, targets, kernel)
