"""The oracle of the fused LayerNorm kernels: the residual add and nanoGPT's LayerNorm in plain JAX.

``s = x + h`` (the residual stream after a branch; ``h`` None: ``s = x``) and
``y = LayerNorm(s) = (s - mean) * (rsqrt(var + eps) * scale) + bias`` per row, with torch's (and
Flax's ``use_fast_variance=False``) two-pass variance ``var = mean((s - mean)^2)``, statistics in
float32 whatever the input dtype, eps 1e-5: the arithmetic of Flax's ``nn.LayerNorm`` as
``model/layers.py`` configures it, in the same order. The backward, with ``xhat = (s - mean) *
rstd`` and ``g = dy * scale``:

    ds_total = ds + (g - xhat * mean(g * xhat) - mean(g)) * rstd      (per row)
    dscale   = sum over rows of dy * xhat,   dbias = sum over rows of dy

where ``ds`` is the cotangent that reaches s from its other use (the residual stream). Every
kernel in :mod:`.fused` equals these two functions; :func:`add_layer_norm` (autodiff of
:func:`forward`) is the plain path of :mod:`.ops`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32
EPS = 1e-5  # nanoGPT's (torch's default)


def residual_dtype(x: jax.Array, h: jax.Array | None):
    """The dtype of ``s = x + h``: JAX's promotion of the two (x alone: x's)."""
    return x.dtype if h is None else jnp.result_type(x.dtype, h.dtype)


def forward(x, h, scale, bias, eps: float = EPS, out_dtype=None):
    """``(s, y, mean, rstd)`` for rows ``[..., C]``: s in :func:`residual_dtype`, y in
    ``out_dtype`` (default float32), mean and rstd float32 ``[...]``. ``h`` and ``bias`` may be
    None."""
    s = x if h is None else x + h
    s32 = s.astype(F32)
    mean = jnp.mean(s32, axis=-1)
    d = s32 - mean[..., None]
    var = jnp.mean(d * d, axis=-1)
    rstd = jax.lax.rsqrt(var + eps)
    y = d * (rstd[..., None] * scale.astype(F32))
    if bias is not None:
        y = y + bias.astype(F32)
    return s, y.astype(out_dtype or F32), mean, rstd


def backward(s, mean, rstd, scale, dy, ds=None):
    """``(dx, dscale, dbias)`` float32: the cotangent of x (and of h: the same) given dy (of y)
    and ds (of s, or None), and the scale and bias gradients summed over rows."""
    C = s.shape[-1]
    xhat = (s.astype(F32) - mean[..., None]) * rstd[..., None]
    dy = dy.astype(F32)
    g = dy * scale.astype(F32)
    c1 = jnp.sum(g * xhat, axis=-1, keepdims=True) / C
    c2 = jnp.sum(g, axis=-1, keepdims=True) / C
    dx = (g - (xhat * c1 + c2)) * rstd[..., None]
    if ds is not None:
        dx = dx + ds.astype(F32)
    rows = tuple(range(s.ndim - 1))
    return dx, jnp.sum(dy * xhat, axis=rows), jnp.sum(dy, axis=rows)


def add_layer_norm(x, h, scale, bias, eps: float = EPS, out_dtype=None):
    """``(s, y)`` of :func:`forward`, differentiable by autodiff: the plain XLA path."""
    s, y, _, _ = forward(x, h, scale, bias, eps, out_dtype)
    return s, y
