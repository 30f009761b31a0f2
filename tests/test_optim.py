"""nanoGPT's schedule and AdamW grouping."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.model import param_shapes
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.training.config import TrainConfig
from linear_gpt2.training.optim import decay_mask, lr_at, schedule


def nanogpt_get_lr(it, learning_rate, min_lr, warmup_iters, lr_decay_iters):
    """nanoGPT train.py get_lr, transcribed as the specification."""
    if it < warmup_iters:
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > lr_decay_iters:
        return min_lr
    decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return min_lr + coeff * (learning_rate - min_lr)


@pytest.mark.parametrize("steps", [0, 1, 99, 100, 101, 500, 999, 1000, 1001, 5000])
def test_schedule_equals_nanogpt(steps):
    cfg = TrainConfig(lr=6e-4, min_lr=6e-5, warmup_steps=100, max_steps=2000, lr_decay_steps=1000)
    expected = nanogpt_get_lr(steps, 6e-4, 6e-5, 100, 1000)
    assert lr_at(steps, cfg) == pytest.approx(expected, rel=1e-12)
    assert float(schedule(cfg)(jnp.asarray(steps))) == pytest.approx(expected, rel=1e-5)


def test_decay_defaults_to_max_steps():
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=200)
    assert lr_at(200, cfg) == pytest.approx(1e-4) and lr_at(201, cfg) == 1e-4
    assert lr_at(105, cfg) == pytest.approx(nanogpt_get_lr(105, 1e-3, 1e-4, 10, 200))


def test_weight_decay_on_matmul_weights_and_embeddings_only():
    shapes = param_shapes(ModelConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, n_embd=16))
    mask = decay_mask(shapes)
    flat = {jax.tree_util.keystr(k): v for k, v in jax.tree_util.tree_leaves_with_path(mask)}
    decayed = {k for k, v in flat.items() if v}
    # nanoGPT: every tensor with dim >= 2 (in the unstacked model) decays, i.e. Linear weights and
    # the embeddings; biases and LayerNorm parameters do not, even though scan stacks them to 2-D.
    assert decayed == {
        "['h']['attn']['c_attn']['kernel']",
        "['h']['attn']['c_proj']['kernel']",
        "['h']['mlp']['c_fc']['kernel']",
        "['h']['mlp']['c_proj']['kernel']",
        "['wpe']['embedding']",
        "['wte']['embedding']",
    }
    assert np.all([not v for k, v in flat.items() if "bias" in k or "scale" in k])
