"""Stability diagnostics: per-layer statistics of the attention, and loss spikes.

The post's linear GPT-2 learns worse as the context grows, with loss spikes. These numbers let a
run show where it happens (``log.diagnostics: true``; off by default):

- ``den_min``, ``den_mean``: the linear normaliser phi(q_i) . z_i (z_i = sum_{j <= i} of the
  weighted phi(k_j), the denominator before ``eps``), min and mean over rows, positions and
  heads. A normaliser near 0 divides a small numerator by a small number: the output, and its
  gradient, blow up.
- ``state_norm``: the Frobenius norm of the state S = sum_j phi(k_j) v_j^T at the end of the row
  (after the last position; with resets, of the row's last document), mean over rows and heads.
  Without forgetting it grows with the context.
- ``out_rms``: the attention output's root mean square (every attention).
- ``gamma_mean``: the mean decay gamma_i (``attention.decay`` fixed or gate).

They are computed by :func:`layer_stats` inside each attention layer when the Flax collection
``diagnostics`` is mutable, which only :func:`linear_gpt2.model.diagnostics` makes it: the
training step never traces this code, so with diagnostics off (or on: the trainer runs them as a
separate jitted forward pass on one micro-batch every ``log.every`` steps) the compiled step is the
same program. The linear statistics are recomputed from q, k, v with the chunked form, which
every linear variant equals.

Loss spikes are counted on the host (:class:`SpikeCounter`), at no device cost.
"""

from __future__ import annotations

import collections
import math
import statistics
from typing import Any

import jax
import jax.numpy as jnp

from linear_gpt2.config import LINEAR_ATTENTIONS, ModelConfig

F32 = jnp.float32
COLLECTION = "diagnostics"
PREFIX = "diag/"
# Statistics per layer, in the order they are reported.
LAYER_STATS = ("den_min", "den_mean", "state_norm", "out_rms", "gamma_mean")


def _chunk(T: int, limit: int = 64) -> int:
    return max(d for d in range(1, min(T, limit) + 1) if T % d == 0)


def layer_stats(
    cfg: ModelConfig,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    y: jax.Array,
    resets: jax.Array | None = None,
    log_gate: jax.Array | None = None,
) -> dict[str, jax.Array]:
    """float32 scalars for one layer: q, k, v, y ``[B, T, H, D]`` (y the attention output before
    ``c_proj``), ``resets`` bool ``[B, T]``, ``log_gate`` ``[B, T, H]`` as the attention got
    them. The linear statistics only for the linear attentions, ``gamma_mean`` only with a
    decay."""
    stats = {"out_rms": jnp.sqrt(jnp.mean(jnp.square(y.astype(F32))))}
    if cfg.attention in LINEAR_ATTENTIONS:
        from linear_gpt2.attention import linear
        from linear_gpt2.attention.lt_chunked import chunked_linear_attention

        fq, fk = linear.features(q, k, cfg.feature_map)
        forget = linear.as_forget(log_gate, resets)
        (_, den), (S, _) = chunked_linear_attention(fq, fk, v, _chunk(q.shape[1]), forget=forget)
        stats["den_min"] = den.min()
        stats["den_mean"] = den.mean()
        stats["state_norm"] = jnp.sqrt(jnp.sum(jnp.square(S), axis=(-2, -1))).mean()
    if log_gate is not None:
        stats["gamma_mean"] = jnp.exp(log_gate.astype(F32)).mean()
    return stats


def flatten(stats: dict[str, Any]) -> dict[str, float]:
    """``{"diag/layer0/den_min": ..., ...}`` from the model's ``{name: [n_layer]}`` arrays."""
    out: dict[str, float] = {}
    for name in LAYER_STATS:
        if name not in stats:
            continue
        for i, value in enumerate(jax.device_get(stats[name]).reshape(-1)):
            out[f"{PREFIX}layer{i}/{name}"] = float(value)
    return out


class SpikeCounter:
    """Loss spikes: a step whose loss exceeds the baseline of the losses before it by more than
    ``margin`` (nats). The baseline is the lower of two: the running mean (an exponential moving
    average with weight ``1 - 1 / window`` on the history, started at the first loss, every
    step included: a lasting jump is absorbed after about ``window`` steps) and the median of
    the last ``RECENT`` losses. The mean alone lags a loss that is still falling fast (a rise
    from 6.9 to 10.4 while the mean sat near 10 went uncounted in the CPU context grid); the
    short median follows the descent and ignores one outlier. Consecutive steps above the line
    are one spike, reported at its first step; the first ``min(window, 10)`` steps only build
    the baseline. ``margin = 0`` turns counting off.

    ``update(step, loss) -> bool`` (True at the first step of a spike); ``count`` and ``steps``
    (the first step of each spike) so far; ``baseline`` the line's base before the next loss.
    Non-finite losses are ignored (the trainer reports those itself)."""

    RECENT = 5

    def __init__(self, margin: float, window: int):
        self.margin, self.window = float(margin), max(1, int(window))
        self.alpha = 1.0 - 1.0 / self.window
        self.warmup = min(self.window, 10)
        self.mean: float | None = None
        self.recent: collections.deque[float] = collections.deque(maxlen=self.RECENT)
        self.seen = 0
        self.inside = False
        self.steps: list[int] = []

    @property
    def enabled(self) -> bool:
        return self.margin > 0

    @property
    def count(self) -> int:
        return len(self.steps)

    @property
    def baseline(self) -> float | None:
        if self.mean is None:
            return None
        return min(self.mean, statistics.median(self.recent))

    def update(self, step: int, loss: float) -> bool:
        if not self.enabled or not math.isfinite(loss):
            return False
        spike = False
        if self.mean is not None and self.seen >= self.warmup:
            above = loss > self.baseline + self.margin
            spike = above and not self.inside
            self.inside = above
            if spike:
                self.steps.append(step)
        self.mean = loss if self.mean is None else self.alpha * self.mean + (1 - self.alpha) * loss
        self.recent.append(loss)
        self.seen += 1
        return spike
