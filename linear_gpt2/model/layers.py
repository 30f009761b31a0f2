"""The building blocks of the GPT-2 modules beyond attention: nanoGPT's dense and LayerNorm
layers, the decay gate's projection (``attention.decay: gate``), ReBased's normalisation of q
and k (``attention.feature_map: rebased``) and the short convolution of the synthetic-task
models (``model.short_conv``)."""

from __future__ import annotations

import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from linear_gpt2.kernels.bias_add import ops as bias_add_ops
from linear_gpt2.kernels.bias_gelu import ops as bias_gelu_ops
from linear_gpt2.kernels.choice import use_pallas
from linear_gpt2.kernels.layernorm import ops as layernorm_ops
from linear_gpt2.model.config import ModelConfig


def dense(cfg: ModelConfig, features: int, name: str, stddev: float = 0.02) -> nn.Dense:
    return nn.Dense(
        features,
        use_bias=cfg.bias,
        dtype=jnp.dtype(cfg.dtype),
        param_dtype=jnp.float32,
        kernel_init=nn.initializers.normal(stddev=stddev),
        bias_init=nn.initializers.zeros,
        name=name,
    )


class DenseParams(nn.Module):
    """:func:`dense`'s parameters, ``kernel`` ``[in, out]`` and ``bias`` ``[out]`` (float32),
    created in the same order and so initialised the same as ``nn.Dense``'s, for an op that does
    the matmul and the bias itself (:func:`mlp`). ``in_features`` given."""

    in_features: int
    features: int
    stddev: float = 0.02

    @nn.compact
    def __call__(self) -> tuple[jax.Array, jax.Array]:
        init = nn.initializers.normal(stddev=self.stddev)
        kernel = self.param("kernel", init, (self.in_features, self.features), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (self.features,), jnp.float32)
        return kernel, bias


def fused_mlp(cfg: ModelConfig) -> bool:
    """Whether the MLP runs the fused activation (``model.mlp_kernel``; ``auto``: when the
    program is traced for a GPU). Only with biases (GPT-2's)."""
    return cfg.bias and use_pallas(cfg.mlp_kernel, "model.mlp_kernel")


def mlp(cfg: ModelConfig, x: jax.Array, fc: tuple, proj: tuple, add_bias: bool = True):
    """nanoGPT's MLP ``c_proj(gelu(c_fc(x)))`` with the fused activation (kernels/bias_gelu/):
    x ``[..., C]`` -> ``[..., C]`` in the compute dtype; ``fc``, ``proj`` the (kernel, bias)
    of c_fc and c_proj (:class:`DenseParams`). The matmuls and bias adds as ``nn.Dense`` does
    them (operands and results in the compute dtype); without ``add_bias`` c_proj's bias is
    left to the caller (:func:`add_residual`)."""
    dt = jnp.dtype(cfg.dtype)
    (w1, b1), (w2, b2) = fc, proj
    z = jax.lax.dot_general(x.astype(dt), w1.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))
    y = bias_gelu_ops.gelu_matmul(z, b1, w2, kernel="pallas")
    return y + b2.astype(dt) if add_bias else y


def fused_bias(cfg: ModelConfig) -> bool:
    """Whether ``c_attn``'s and the MLP's ``c_proj`` biases take the fused backward
    (``model.bias_kernel``; ``auto``: when the program is traced for a GPU). Only with biases
    (GPT-2's)."""
    return cfg.bias and use_pallas(cfg.bias_kernel, "model.bias_kernel")


def qkv_heads(cfg: ModelConfig, x: jax.Array, w: jax.Array, b: jax.Array):
    """q, k, v ``[B, T, H, D]`` of ``c_attn`` (kernel w ``[C, 3C]``, bias b) on x ``[B, T, C]``:
    the matmul as ``nn.Dense`` does it, the bias and the split by the fused op
    (kernels/bias_add/)."""
    dt = jnp.dtype(cfg.dtype)
    z = jax.lax.dot_general(x.astype(dt), w.astype(dt), (((x.ndim - 1,), (0,)), ((), ())))
    return bias_add_ops.split_qkv(z, b, cfg.n_head, kernel="pallas")


def add_residual(x: jax.Array, z: jax.Array, b: jax.Array) -> jax.Array:
    """The residual stream x plus a projection's output z and its bias b, the bias gradient
    fused (kernels/bias_add/)."""
    return bias_add_ops.add_residual(x, z, b, kernel="pallas")


def layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
    # Two-pass variance, as torch computes it; statistics in float32 whatever the input dtype.
    return nn.LayerNorm(
        epsilon=1e-5,
        use_bias=cfg.bias,
        use_fast_variance=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        name=name,
    )


def fused_layer_norm(cfg: ModelConfig) -> bool:
    """Whether the blocks' and the final LayerNorms run the fused kernels
    (``model.layernorm_kernel``; ``auto``: when the program is traced for a GPU)."""
    return use_pallas(cfg.layernorm_kernel, "model.layernorm_kernel")


class FusedLayerNorm(nn.Module):
    """:func:`layer_norm` (its parameters ``scale`` and ``bias``, its numerics) over the fused
    kernels (``kernels/layernorm/``): ``(s, y)`` with s = x + h (x when h is None) the residual
    stream and y = LayerNorm(s) in the compute dtype, the dtype the next projection reads it in
    (the same rounding as its cast of a float32 y). Only y with ``residual_out=False``. Returning
    s lets the backward kernel add the residual's gradient in the same pass."""

    config: ModelConfig
    residual_out: bool = True

    @nn.compact
    def __call__(self, x: jax.Array, h: jax.Array | None = None):
        cfg = self.config
        C = x.shape[-1]
        scale = self.param("scale", nn.initializers.ones, (C,), jnp.float32)
        bias = self.param("bias", nn.initializers.zeros, (C,), jnp.float32) if cfg.bias else None
        return layernorm_ops.add_layer_norm(
            x, h, scale, bias, eps=1e-5, out_dtype=cfg.dtype, kernel="pallas",
            residual_out=self.residual_out,
        )  # fmt: skip


def qk_norm(name: str) -> nn.LayerNorm:
    """ReBased's normalisation of q or k ``[B, T, H, Dk]`` before its feature map: LayerNorm over
    each head's Dk features (eps 1e-5, two-pass variance, float32) with a learned scale and
    shift per head and feature, ``[H, Dk]`` (torch's default init: 1 and 0)."""
    return nn.LayerNorm(
        epsilon=1e-5,
        reduction_axes=-1,
        feature_axes=(-2, -1),
        use_fast_variance=False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        name=name,
    )


def retnet_gammas(n_head: int) -> np.ndarray:
    """RetNet's fixed per-head decays gamma_h = 1 - 2^(-5 - h), h = 0 .. H-1 (float64): memory
    lengths 1/(1 - gamma) from 32 tokens (head 0) doubling per head."""
    return 1.0 - 2.0 ** (-5.0 - np.arange(n_head, dtype=np.float64))


def _split(a: jax.Array, dtype) -> tuple[jax.Array, jax.Array]:
    """a = hi + lo (to about 16 bits) with hi, lo in ``dtype`` (lo = 0 when dtype is a's)."""
    hi = a.astype(dtype)
    return hi, (a - hi.astype(a.dtype)).astype(dtype)


def _dot32(a, b, spec):
    return jnp.einsum(spec, a, b, preferred_element_type=jnp.float32)


@jax.custom_vjp
def gate_logits(x: jax.Array, w: jax.Array) -> jax.Array:
    """x ``[B, T, C]`` (any float dtype) times w ``[C, H]`` float32 -> float32 ``[B, T, H]``, with
    w split into two halves of x's dtype (:func:`_split`). Forward and backward keep x and dx in
    x's dtype: no [B, T, C] float32 array (the backward's float32 cotangent is split likewise)."""
    hi, lo = _split(w, x.dtype)
    return _dot32(x, hi, "btc,ch->bth") + _dot32(x, lo, "btc,ch->bth")


def _gate_fwd(x, w):
    return gate_logits(x, w), (x, w)


def _gate_bwd(res, g):
    x, w = res
    g_hi, g_lo = _split(g.astype(jnp.float32), x.dtype)
    hi, lo = _split(w, x.dtype)
    dx = _dot32(g_hi, hi, "bth,ch->btc") + _dot32(g_lo, hi, "bth,ch->btc")
    dx = dx + _dot32(g_hi, lo, "bth,ch->btc")
    dw = _dot32(x, g_hi, "btc,bth->ch") + _dot32(x, g_lo, "btc,bth->ch")
    return dx.astype(x.dtype), dw


gate_logits.defvjp(_gate_fwd, _gate_bwd)


class GateProjection(nn.Module):
    """``x [B, T, C] -> x W + b`` float32 ``[B, T, H]``, W ``[C, H]`` and b float32 (params
    ``kernel``, ``bias``: a ``Dense``'s). x stays in its dtype (the model passes the compute
    dtype, as ``c_attn`` reads it): a bfloat16 x is neither copied to float32 nor kept as float32
    for the backward ([B, T, C] float32 per layer cost the 124M step 14% more memory at 1M
    tokens, compiled for the H100); W (and the backward's cotangent) is split into two bfloat16
    halves, so x W keeps about 16 bits of W's precision, accumulated in float32. With a float32
    x: exact."""

    features: int
    bias_value: Any

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        f32 = jnp.float32
        w = self.param("kernel", nn.initializers.zeros, (x.shape[-1], self.features), f32)
        b = self.param("bias", lambda *_: self.bias_value, (self.features,), f32)
        return gate_logits(x, w) + b


def _conv_init(kernel: int):
    # torch's Conv1d default (kaiming uniform, a = sqrt(5)): U(-1/sqrt(fan_in), 1/sqrt(fan_in)),
    # fan_in = kernel for a depthwise convolution; Zoology's and ReBased's short convolutions.
    bound = 1.0 / math.sqrt(kernel)
    return lambda key, shape, dtype=jnp.float32: jax.random.uniform(
        key, shape, dtype, -bound, bound
    )


class ShortConv(nn.Module):
    """Depthwise causal convolution over time, ``y_t = b + sum_{i < k} w_i * x_{t-i}`` per channel
    (``model.short_conv`` = k), in float32. With ``resets`` (bool ``[B, T]``, document starts) a
    position sees no input from before its document's start."""

    kernel: int

    @nn.compact
    def __call__(self, x: jax.Array, resets: jax.Array | None = None) -> jax.Array:
        B, T, C = x.shape
        w = self.param("kernel", _conv_init(self.kernel), (self.kernel, C))
        b = self.param("bias", _conv_init(self.kernel), (C,))
        x = x.astype(jnp.float32)
        seg = None if resets is None else jnp.cumsum(resets.astype(jnp.int32), axis=1)
        y = b + w[0] * x
        for i in range(1, min(self.kernel, T)):
            shifted = jnp.pad(x, ((0, 0), (i, 0), (0, 0)))[:, :T]  # x_{t-i}, zeros before 0
            if seg is not None:
                same = jnp.pad(seg, ((0, 0), (i, 0)), constant_values=-1)[:, :T] == seg
                shifted = jnp.where(same[..., None], shifted, 0.0)
            y = y + w[i] * shifted
        return y
