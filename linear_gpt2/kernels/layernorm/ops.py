"""The differentiable fused LayerNorm: ``(s, y) = (x + h, LayerNorm(x + h))`` over the kernels of
:mod:`.fused` (``pallas``) or :mod:`.naive` by autodiff (``xla``).

``s`` is the residual stream after a branch's output ``h`` is added (``h`` None: ``s`` is ``x``
itself, passed through). Returning it from the op, rather than adding outside, is what lets the
backward fuse the residual gradient: the cotangent of ``s`` (from the rest of the residual
stream) enters the backward kernel with the cotangent of ``y``, and one pass writes
``dx = ds + LayerNorm'(dy)`` (and ``dh``, the same values in h's dtype). Residuals: s and the
row statistics mean, rstd (float32 ``[N]``), nothing else: y is recomputed by nobody, xhat is
rebuilt in the backward's registers.

Under a mesh of several devices the op runs per device on its own rows (:mod:`..rows`); the
scale and bias gradients are summed over the devices by the transpose of ``shard_map``.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linear_gpt2.kernels import rows
from linear_gpt2.kernels.choice import resolve
from linear_gpt2.kernels.layernorm import naive

F32 = jnp.float32


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _pallas(x, h, scale, bias, eps: float, out_dtype: str, residual_out: bool):
    from linear_gpt2.kernels.layernorm import fused  # Pallas: imported when picked

    s, y, _, _ = fused.layernorm_fwd(x, h, scale, bias, eps, out_dtype)
    if not residual_out:
        return y
    return (x if s is None else s), y


def _pallas_fwd(x, h, scale, bias, eps, out_dtype, residual_out):
    from linear_gpt2.kernels.layernorm import fused

    s, y, mean, rstd = fused.layernorm_fwd(x, h, scale, bias, eps, out_dtype)
    s = x if s is None else s
    # Zero-size markers carry the dtypes of x, h and bias (None where absent) to the backward.
    marks = tuple(None if a is None else jnp.zeros((0,), a.dtype) for a in (x, h, bias))
    return ((s, y) if residual_out else y), (s, mean, rstd, scale, marks)


def _pallas_bwd(eps, out_dtype, residual_out, res, ct):
    from linear_gpt2.kernels.layernorm import fused

    del eps, out_dtype
    s, mean, rstd, scale, (x_mark, h_mark, bias_mark) = res
    ds, dy = ct if residual_out else (None, ct)
    h_dtype = None if h_mark is None else h_mark.dtype
    dx, dh, dscale, dbias = fused.layernorm_bwd(s, mean, rstd, scale, dy, ds, x_mark.dtype, h_dtype)
    return dx, dh, dscale.astype(scale.dtype), (None if bias_mark is None else dbias)


_pallas.defvjp(_pallas_fwd, _pallas_bwd)


def _rows(a, C):
    return None if a is None else a.reshape(-1, C)


def _local(x, h, scale, bias, eps, out_dtype, kernel, residual_out):
    shape, C = x.shape, x.shape[-1]
    if kernel == "xla":
        s, y = naive.add_layer_norm(x, h, scale, bias, eps, out_dtype)
        return (s, y) if residual_out else y
    out = _pallas(_rows(x, C), _rows(h, C), scale, bias, eps, jnp.dtype(out_dtype).name,
                  residual_out)  # fmt: skip
    if not residual_out:
        return out.reshape(shape)
    return out[0].reshape(shape), out[1].reshape(shape)


def add_layer_norm(
    x: jax.Array,
    h: jax.Array | None,
    scale: jax.Array,
    bias: jax.Array | None,
    *,
    eps: float = naive.EPS,
    out_dtype=F32,
    kernel: str = "pallas",
    residual_out: bool = True,
):
    """``(s, y)``: s = x + h (x when h is None) in the promoted dtype, y = LayerNorm(s) in
    ``out_dtype``; only y with ``residual_out=False``. x, h ``[..., C]``; scale, bias ``[C]``
    (bias may be None). ``kernel``: ``pallas`` (the fused kernels), ``xla`` (autodiff of the
    oracle) or ``auto`` (``kernels.choice.resolve``). Differentiable in x, h, scale, bias."""
    kernel = resolve(kernel, "layernorm kernel")
    out_dtype = jnp.dtype(out_dtype).name
    call = partial(_local, eps=float(eps), out_dtype=out_dtype, kernel=kernel,
                   residual_out=residual_out)  # fmt: skip
    split = rows.split(x) if kernel == "pallas" else None
    if split is None:
        return call(x, h, scale, bias)
    spec, axes = split
    return rows.per_device(
        call, (x, h, scale, bias), (spec, P() if h is None else spec, P(), P()),
        (spec, spec) if residual_out else spec, axes,
    )  # fmt: skip
