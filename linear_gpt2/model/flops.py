"""FLOPs per token and device peaks, for MFU.

MFU = achieved model FLOP/s / device peak, with model FLOPs counted as the PaLM paper and
nanoGPT's ``estimate_mfu`` do: 6 N for the parameter matmuls (forward + backward) plus the
attention's own matmuls, which depend on the algorithm. For attention we count the algorithm's
forward matmul FLOPs per token and multiply by 3 for forward + backward; like nanoGPT we do not
halve for causality, so numbers compare with nanoGPT's and llm.c's.
"""

from __future__ import annotations

import jax

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform import cards


def attention_forward_flops_per_token(cfg: ModelConfig, context: int) -> float:
    """Matmul FLOPs of one layer's attention per token, forward, summed over heads: what the
    variant's spec counts (``AttentionSpec.flops``)."""
    return cfg.spec.flops(context, cfg.n_head, cfg.head_dim, cfg.attention_options)


def flops_per_token(cfg: ModelConfig, n_params: int, context: int) -> float:
    """Training FLOPs per token: 6 N + 3 x attention forward, over all layers."""
    return 6 * n_params + 3 * cfg.n_layer * attention_forward_flops_per_token(cfg, context)


def device_peak_flops(device: jax.Device | None = None) -> float | None:
    """Dense bf16 peak FLOP/s of ``device`` (default: the first), from its card's facts
    (:mod:`linear_gpt2.platform.cards`), or None when unknown (e.g. CPU)."""
    device = device or jax.devices()[0]
    card = cards.of_device_kind(getattr(device, "device_kind", ""))
    return card.peak_bf16_flops if card else None
