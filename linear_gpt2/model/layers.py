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
