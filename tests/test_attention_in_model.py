"""Every registered attention trains inside GPT-2, and formulations of one function agree in the
model: all linear variants give the same logits, and so do the softmax variants."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from linear_gpt2 import attention
from linear_gpt2.model import forward, init_params, loss_fn
from linear_gpt2.model.config import ModelConfig
from tests.helpers import SLOW, rel_err

BASE = dict(vocab_size=61, block_size=16, n_layer=2, n_head=2, n_embd=16, chunk_size=4)
SOFTMAX_FAMILY = ("softmax", "flash")
LINEAR_FAMILY = tuple(n for n in attention.names() if n.startswith("LT_"))


# One program per attention for the loss and its gradients, the same one in both tests below
# (same config, same shapes: the second test compiles nothing new), and one optimizer update
# for every attention (the parameters' shapes do not depend on it).
_value_and_grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
_OPT = optax.adamw(3e-3, b1=0.9, b2=0.95, weight_decay=0.1)


@jax.jit
def _update(grads, state, params):
    updates, state = _OPT.update(grads, state, params)
    return optax.apply_updates(params, updates), state


def batch():
    tokens = jax.random.randint(
        jax.random.key(0), (2, BASE["block_size"] + 1), 0, BASE["vocab_size"]
    )
    return tokens[:, :-1], tokens[:, 1:]


@pytest.mark.parametrize("name", attention.names())
def test_each_attention_trains_a_few_steps(name):
    cfg = ModelConfig(**BASE, attention=name)
    params = init_params(cfg, seed=0)
    state = _OPT.init(params)
    inputs, targets = batch()
    losses = []
    for _ in range(8):
        loss, grads = _value_and_grad(params, inputs, targets, cfg)
        params, state = _update(grads, state, params)
        losses.append(float(loss))
    assert all(np.isfinite(losses)), losses
    assert losses[-1] < losses[0] - 0.1, losses


@SLOW
@pytest.mark.parametrize("family", [SOFTMAX_FAMILY, LINEAR_FAMILY], ids=["softmax", "linear"])
def test_formulations_of_one_function_give_the_same_model(family):
    inputs, _ = batch()
    params = init_params(ModelConfig(**BASE), seed=1)
    outs = {n: forward(params, inputs, ModelConfig(**BASE, attention=n)) for n in family}
    ref = outs[family[0]]
    for name, out in outs.items():
        assert rel_err(out, ref) < 1e-5, name
    grads = {
        n: _value_and_grad(params, inputs, inputs, ModelConfig(**BASE, attention=n))[1]
        for n in family
    }
    for name, g in grads.items():
        assert (
            rel_err(
                jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)]),
                jnp.concatenate([x.ravel() for x in jax.tree.leaves(grads[family[0]])]),
            )
            < 1e-4
        ), name


def test_linear_and_softmax_are_different_functions():
    inputs, _ = batch()
    params = init_params(ModelConfig(**BASE), seed=1)
    a = forward(params, inputs, ModelConfig(**BASE, attention="softmax"))
    b = forward(params, inputs, ModelConfig(**BASE, attention="LT_chunked"))
    assert rel_err(b, a) > 1e-3
