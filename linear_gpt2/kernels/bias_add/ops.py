"""Differentiable bias adds with the fused backward (:mod:`.fused`, ``pallas``) or the oracle's
(:mod:`.naive`, ``xla``): the forwards are XLA's (they fuse with their neighbours), the backward
writes the projection's cotangent and the bias gradient in one pass.

- :func:`split_qkv`: ``c_attn``'s bias and the split into heads; the three head gradients go
  into one ``[B, T, 3C]`` cotangent (XLA's concatenation) with the bias gradient (a reduction
  over tokens).
- :func:`add_residual`: the MLP's ``c_proj`` bias added to the residual stream; the stream's
  cotangent passes to x unchanged and, cast, to the matmul's output, with the bias gradient.

Residuals: none but dtypes. Under a mesh of several devices the kernel runs per device on its own
rows (:mod:`..rows`); the bias gradient is summed over the devices.
"""

from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from linear_gpt2.kernels import rows
from linear_gpt2.kernels.bias_add import naive

KERNELS = ("xla", "pallas")


def _check(kernel: str) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"bias_add kernel {kernel!r} is not one of {', '.join(KERNELS)}")


def _backward(cotangents, dtype, kernel: str):
    """``(dz [B, T, k C], db [k C])`` of k cotangents ``[B, T, ...]``, per device under a mesh."""

    def local(*cts):
        if kernel == "xla":
            return naive.backward(cts, dtype)
        from linear_gpt2.kernels.bias_add import fused  # Pallas: imported when picked

        B, T = cts[0].shape[:2]
        dz, db = fused.bias_add_bwd([c.reshape(B * T, -1) for c in cts], dtype)
        return dz.reshape(B, T, -1), db

    split = rows.split(cotangents[0]) if kernel == "pallas" else None
    if split is None:
        return local(*cotangents)
    spec, axes = split

    def per_device(*cts):
        dz, db = local(*cts)
        return dz, jax.lax.psum(db, tuple(axes))

    return rows.per_device(per_device, tuple(cotangents), (spec,) * len(cotangents),
                           (spec, P()), axes)  # fmt: skip


def _marks(*arrays):
    # Zero-size arrays carry the dtypes to the backward (residuals must be arrays).
    return tuple(jnp.zeros((0,), a.dtype) for a in arrays)


@partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def _split(z, b, n_head: int, kernel: str):
    return naive.split_qkv(z, b, n_head)


def _split_fwd(z, b, n_head, kernel):
    return naive.split_qkv(z, b, n_head), _marks(z, b)


def _split_bwd(n_head, kernel, res, ct):
    z_mark, b_mark = res
    dz, db = _backward(ct, z_mark.dtype, kernel)
    return dz, db.astype(b_mark.dtype)


_split.defvjp(_split_fwd, _split_bwd)


def split_qkv(z: jax.Array, b: jax.Array, n_head: int, *, kernel: str = "pallas"):
    """q, k, v ``[B, T, H, D]`` = the split of ``z + b`` (z ``[B, T, 3C]`` in the compute dtype,
    b ``[3C]``), differentiable in z and b."""
    _check(kernel)
    return _split(z, b, n_head, kernel)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _residual(x, z, b, kernel: str):
    return naive.add_residual(x, z, b)


def _residual_fwd(x, z, b, kernel):
    return naive.add_residual(x, z, b), _marks(x, z, b)


def _residual_bwd(kernel, res, ds):
    x_mark, z_mark, b_mark = res
    dz, db = _backward((ds,), z_mark.dtype, kernel)
    return ds.astype(x_mark.dtype), dz, db.astype(b_mark.dtype)


_residual.defvjp(_residual_fwd, _residual_bwd)


def add_residual(x: jax.Array, z: jax.Array, b: jax.Array, *, kernel: str = "pallas"):
    """``x + (z + b)``: x ``[B, T, C]`` the residual stream, z ``[B, T, C]`` a projection's
    matmul output (compute dtype), b ``[C]`` its bias; differentiable in x, z and b."""
    _check(kernel)
    return _residual(x, z, b, kernel)
