"""The differentiable MLP activation and projection, ``y = gelu(z + b) @ W``, over the kernels of
:mod:`.fused` (``pallas``) or the oracle (:mod:`.naive`, ``xla``).

Residuals: z (the c_fc matmul's output, which the forward read anyway), b and W; not GELU's
output, nor what autodiff of ``nn.gelu`` keeps (its intermediates, three ``[N, F]`` arrays). The
backward recomputes g in the same pass that writes dz and the bias gradient
(``bias_gelu_bwd``), then the two matmuls: dg = dy W^T before it, dW = g^T dy after it. So no
``[N, F]`` activation of the MLP but z is kept for the backward, and none is stacked by the
layer scan. Under a mesh of several devices the kernels run per device on their own rows
(:mod:`..rows`); the bias gradient is summed over the devices.
"""

from __future__ import annotations

from functools import partial

import jax
from jax.sharding import PartitionSpec as P

from linear_gpt2.kernels import rows
from linear_gpt2.kernels.bias_gelu import naive

KERNELS = ("xla", "pallas")


def _rowwise(fn, z, *args, psum_last: bool = False):
    """``fn(z, *args)`` on z's rows, per device under a mesh (:mod:`..rows`); args are
    ``[..., F]`` like z (the same split) or ``[F]`` (replicated)."""
    split = rows.split(z)
    if split is None:
        return fn(z, *args)
    spec, axes = split
    specs = (spec, *(spec if a.ndim == z.ndim else P() for a in args))

    def local(*a):
        out = fn(*a)
        if psum_last:
            out = (*out[:-1], jax.lax.psum(out[-1], tuple(axes)))
        return out

    out_specs = (spec, spec, P()) if psum_last else spec
    return rows.per_device(local, (z, *args), specs, out_specs, axes)


def _flat(fn):
    """``fn`` on ``[N, F]`` views of ``[..., F]`` arrays (the first and every same-rank one)."""

    def call(z, *args):
        F, shape = z.shape[-1], z.shape
        out = fn(z.reshape(-1, F), *(a.reshape(-1, F) if a.ndim == z.ndim else a for a in args))
        if isinstance(out, tuple):
            return tuple(o.reshape(shape) if o.ndim == 2 else o for o in out)
        return out.reshape(shape)

    return call


def _gelu(z, b, kernel):
    if kernel == "xla":
        return naive.forward(z, b)
    from linear_gpt2.kernels.bias_gelu import fused  # Pallas: imported when picked

    return _rowwise(_flat(fused.bias_gelu_fwd), z, b)


def _gelu_bwd(z, b, dg, kernel):
    if kernel == "xla":
        return naive.backward(z, b, dg)
    from linear_gpt2.kernels.bias_gelu import fused

    def bwd(z, dg, b):
        return fused.bias_gelu_bwd(z, b, dg)

    return _rowwise(_flat(bwd), z, dg, b, psum_last=True)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _gelu_matmul(z, b, w, kernel: str):
    return naive._dot(_gelu(z, b, kernel), w.astype(z.dtype))


def _fwd(z, b, w, kernel):
    return _gelu_matmul(z, b, w, kernel), (z, b, w)


def _bwd(kernel, res, dy):
    z, b, w = res
    wc = w.astype(z.dtype)
    dy = dy.astype(z.dtype)
    dg = jax.lax.dot_general(dy, wc, (((dy.ndim - 1,), (1,)), ((), ())))  # dy W^T
    dz, g, db = _gelu_bwd(z, b, dg, kernel)
    lead = tuple(range(z.ndim - 1))
    dw = jax.lax.dot_general(g, dy, ((lead, lead), ((), ())))  # g^T dy
    return dz, db.astype(b.dtype), dw.astype(w.dtype)


_gelu_matmul.defvjp(_fwd, _bwd)


def gelu_matmul(z: jax.Array, b: jax.Array, w: jax.Array, *, kernel: str = "pallas") -> jax.Array:
    """``gelu(z + b) @ w`` (exact GELU; in z's dtype, w cast to it), differentiable in z, b and
    w: z ``[..., F]``, b ``[F]``, w ``[F, C]`` -> ``[..., C]``. ``kernel``: ``pallas`` (the fused
    kernels) or ``xla`` (the oracle's forward and backward, by hand)."""
    if kernel not in KERNELS:
        raise ValueError(f"gelu_matmul kernel {kernel!r} is not one of {', '.join(KERNELS)}")
    return _gelu_matmul(z, b, w, kernel)
