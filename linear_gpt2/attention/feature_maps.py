"""The feature maps phi of the linear family: elementwise ones, and ones that expand the key
dimension so that phi(q) . phi(k) is a polynomial kernel of q . k (issue 39).

A map takes ``x`` ``[..., d]`` (float32) to ``phi(x)`` ``[..., dim(d)]``. Every linear variant
computes

    y_i = sum_{j<=i} (phi(q_i) . phi(k_j)) v_j / (sum_{j<=i} phi(q_i) . phi(k_j) + eps)

with phi(q), phi(k) of dimension d' = ``dim(d)`` and v of its own dimension (the head dim), so
the state S = sum_j phi(k_j) v_j^T is ``[d', D]`` per head.

- Elementwise (d' = d; features >= 0): ``softplus`` (the post's), ``elu1`` (Katharopoulos et
  al.), ``relu``, ``exp``. Each is monotone, so its derivative is a function of its value
  (``slope``: phi'(x) = slope(phi(x)); sigmoid(x) = 1 - e^{-softplus(x)}), and each maps -inf
  to 0: the ``LT_chunked`` Pallas kernels take raw q, k with such a map, pad them with -inf
  (zero features) and apply phi' in their gradient kernels from the phi(q), phi(k) they read
  (``kernels/lt_chunked/ops.py``), so no separate XLA pass multiplies the gradients by phi'.
- ``taylor2``: Based's 2nd-order Taylor map (Arora et al. 2024; HazyResearch/zoology's Based
  mixer, ``TaylorExp.forward_mem_save``): features 1, x / d^(1/4), and the
  products x_a x_b for a <= b, scaled 1/sqrt(2 d) on the diagonal and 1/sqrt(d) off it, so that
  phi(q) . phi(k) = 1 + s + s^2 / 2 with s = q . k / sqrt(d): the Taylor polynomial of e^s.
  d' = 1 + d + d (d + 1) / 2 (153 at d = 16).
- ``power2``: the symmetric power of degree 2 (Buckman et al.'s power attention at p = 2): the
  d (d + 1) / 2 unique products x_a x_b, a <= b, scaled 1 on the diagonal and sqrt(2) off it,
  so that phi(q) . phi(k) = (q . k)^2 exactly (2,080 features at d = 64).
- ``rebased``: ReBased's kernel (Aksenov et al. 2024; corl-team/rebased's ReBased mixer
  with flash-linear-attention's ``parallel_rebased``): phi(q) . phi(k) = (q' . k')^2 / d on the
  inputs the *layer* has normalised and shifted, q' = gamma * LayerNorm(q) + beta with learned
  gamma, beta (``layer_norm`` below: the parameters belong to the attention layer, as the decay
  gate's projection does, ``model/gpt.py``); here the map is the ``power2`` features / sqrt(d).

The expanded maps' features are not all >= 0 but every score is: 1 + s + s^2/2 >= 1/2 and
s^2 >= 0, so the denominator is a sum of nonnegative terms as with the elementwise maps (for
``power2`` and ``rebased`` it can be 0, where ``eps`` keeps the division finite).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from linear_gpt2.platform.device import compiling_for_gpu

F32 = jnp.float32


@dataclasses.dataclass(frozen=True)
class FeatureMap:
    """One feature map: ``fn`` ``[..., d] -> [..., dim(d)]`` (float32 in, float32 out), the
    dimension it maps d to, and whether the attention layer applies a learned LayerNorm to q and
    k before it (``layer_norm``: ReBased's gamma * norm(x) + beta)."""

    name: str
    fn: Callable[[jax.Array], jax.Array]
    dim: Callable[[int], int] = lambda d: d
    layer_norm: bool = False
    description: str = ""
    # The fewest input dimensions the map makes sense of (ReBased's LayerNorm of one dimension
    # is 0 for every input: its features would be a constant).
    min_dim: int = 1
    # An elementwise map's derivative as a function of its value, phi'(x) = slope(phi(x))
    # (float32 in and out; the derivative autodiff takes), or None (the expanding maps). Only a
    # map with fn(-inf) = 0 has one (the kernels pad raw inputs with -inf: zero features).
    slope: Callable[[jax.Array], jax.Array] | None = None

    @property
    def expands(self) -> bool:
        return self.dim(2) != 2

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.fn(x)


def pairs(d: int) -> tuple[np.ndarray, np.ndarray]:
    """The index pairs (a, b), a <= b, of the d (d + 1) / 2 unique products x_a x_b, row-major
    over the upper triangle (the diagonal pair first in each row)."""
    a, b = np.triu_indices(d)
    return a, b


def _products(x: jax.Array, diag: float, off: float) -> jax.Array:
    """``[..., d (d + 1) / 2]``: x_a x_b for a <= b (in :func:`pairs`' order), times ``diag``
    where a = b and ``off`` elsewhere. Two constructions of the same values: on a GPU one
    gather of each pair's factors (its transpose a scatter-add: two launches); elsewhere row by
    row from slices, x_a x[a:], since the CPU's scatter made the map 1.6x slower forward and
    backward at Based's d = 16 (the slices cost the H100 step model 9% at 1k tokens)."""
    d = x.shape[-1]
    if compiling_for_gpu():
        a, b = pairs(d)
        w = np.where(a == b, diag, off)
        return x[..., a] * x[..., b] * jnp.asarray(w, x.dtype)
    rows = []
    for a in range(d):
        w = np.full(d - a, off)
        w[0] = diag
        rows.append(x[..., a : a + 1] * x[..., a:] * jnp.asarray(w, x.dtype))
    return jnp.concatenate(rows, axis=-1)


def taylor2(x: jax.Array) -> jax.Array:
    """Based's map: phi(q) . phi(k) = 1 + s + s^2 / 2, s = q . k / sqrt(d)."""
    d = x.shape[-1]
    one = jnp.ones((*x.shape[:-1], 1), x.dtype)
    second = _products(x, 1.0 / math.sqrt(2.0 * d), 1.0 / math.sqrt(d))
    return jnp.concatenate([one, x / d**0.25, second], axis=-1)


def power2(x: jax.Array) -> jax.Array:
    """The symmetric power of degree 2: phi(q) . phi(k) = (q . k)^2."""
    return _products(x, 1.0, math.sqrt(2.0))


def rebased(x: jax.Array) -> jax.Array:
    """ReBased's kernel on the layer-normalised inputs: phi(q) . phi(k) = (q . k)^2 / d."""
    d = x.shape[-1]
    return _products(x, 1.0 / math.sqrt(d), math.sqrt(2.0 / d))


def _elu1(x: jax.Array) -> jax.Array:
    return jax.nn.elu(x) + 1.0


# phi'(x) from y = phi(x) for the elementwise maps, equal to what autodiff gives at x:
# softplus' = sigmoid = 1 - e^{-y} (as -expm1(-y): exact for small y); elu1' = e^x = y below 0,
# 1 above (y > 1); relu' = [x > 0] = [y > 0] (0 at 0, as jax.nn.relu's); exp' = y.
def _softplus_slope(y: jax.Array) -> jax.Array:
    return -jnp.expm1(-y)


def _elu1_slope(y: jax.Array) -> jax.Array:
    return jnp.minimum(y, 1.0)


def _relu_slope(y: jax.Array) -> jax.Array:
    return jnp.where(y > 0, 1.0, 0.0).astype(y.dtype)


def _exp_slope(y: jax.Array) -> jax.Array:
    return y


def _half_square(d: int) -> int:
    return d * (d + 1) // 2


FEATURE_MAPS: dict[str, FeatureMap] = {
    m.name: m
    for m in (
        # log(1 + e^x) > 0: the post's choice; smooth, ~x for large x, ~e^x for very negative x.
        FeatureMap("softplus", jax.nn.softplus, description="log(1 + e^x), elementwise",
                   slope=_softplus_slope),
        # elu(x) + 1 > 0 (Katharopoulos et al. 2020): e^x for x < 0, x + 1 for x >= 0.
        FeatureMap("elu1", _elu1, description="elu(x) + 1, elementwise", slope=_elu1_slope),
        # max(x, 0) >= 0: can be exactly zero, then eps keeps the division finite (y_i = 0).
        FeatureMap("relu", jax.nn.relu, description="max(x, 0), elementwise", slope=_relu_slope),
        # e^x > 0: unbounded, overflows float32 for x > 88.
        FeatureMap("exp", jnp.exp, description="e^x, elementwise", slope=_exp_slope),
        FeatureMap(
            "taylor2", taylor2, lambda d: 1 + d + _half_square(d),
            description="Based's 2nd-order Taylor map: 1 + s + s^2/2, s = q.k/sqrt(d)",
        ),
        FeatureMap(
            "power2", power2, _half_square,
            description="the symmetric power of degree 2: (q.k)^2",
        ),
        FeatureMap(
            "rebased", rebased, _half_square, layer_norm=True, min_dim=2,
            description="ReBased: (q'.k')^2/d, q' = gamma LayerNorm(q) + beta (the layer's)",
        ),
    )
}  # fmt: skip


def get(name: str | FeatureMap) -> FeatureMap:
    """The map called ``name`` (a :class:`FeatureMap` is returned as it is); an unknown name is
    a ``ValueError`` listing the valid ones."""
    if isinstance(name, FeatureMap):
        return name
    if name not in FEATURE_MAPS:
        raise ValueError(
            f"unknown feature_map {name!r}; valid feature maps: {', '.join(FEATURE_MAPS)}"
        )
    return FEATURE_MAPS[name]


def key_dim(feature_map: str, d: int) -> int:
    """d': the dimension of phi(q), phi(k) for inputs of dimension d."""
    return get(feature_map).dim(d)


def dim_problem(feature_map: str, feature_dim: int) -> str | None:
    """Why ``feature_map`` cannot make features of ``feature_dim`` projected dimensions (0: the
    head dim, checked where it is known), or None."""
    phi = get(feature_map)
    if feature_dim and feature_dim < phi.min_dim:
        return (
            f"{feature_map} needs q and k of at least {phi.min_dim} dimensions, got "
            f"feature_dim={feature_dim}; use feature_dim >= {phi.min_dim} (Based's 16), or 0"
        )
    return None


def key_features(D: int, options) -> int:
    """d' of a variant's ``options`` (an options instance or a mapping) at head dim D: its
    feature map's features of q, k of ``feature_dim`` (or D) dimensions; D for a variant
    without a feature map (softmax)."""
    get_ = options.get if isinstance(options, dict) else lambda k, d=None: getattr(options, k, d)
    feature_map = get_("feature_map")
    if feature_map is None:
        return D
    return key_dim(feature_map, int(get_("feature_dim") or 0) or D)
