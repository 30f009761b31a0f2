"""Model options for the synthetic tasks, off by default: attention-only blocks, the short
convolution before the attention, the head at the labelled positions only, and accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import interop
from linear_gpt2.config import ModelConfig
from linear_gpt2.model import ShortConv, correct, decode_init, forward, init_params, loss_fn

SMALL = dict(n_layer=2, n_head=2, n_embd=16, block_size=16, vocab_size=64)
# Jitted (the config is static): op-by-op Flax is slow on a loaded CPU.
forward_jit = jax.jit(forward, static_argnums=2)
correct_jit = jax.jit(correct, static_argnums=3)
grad_jit = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)


def test_attention_only_blocks_have_no_mlp_and_differ_from_gpt2():
    gpt2 = ModelConfig(**SMALL)
    bare = gpt2.replace(mlp=False)
    p, q = init_params(gpt2, 0), init_params(bare, 0)
    assert "mlp" in p["h"] and "ln_2" in p["h"]
    assert "mlp" not in q["h"] and "ln_2" not in q["h"]
    assert gpt2.is_gpt2 and not bare.is_gpt2 and not gpt2.replace(short_conv=3).is_gpt2
    # The same attention parameters give another function once the MLP is gone.
    shared = {k: v for k, v in p.items()}
    shared["h"] = {k: v for k, v in p["h"].items() if k not in ("mlp", "ln_2")}
    tokens = jnp.arange(16)[None] % 64
    assert not np.allclose(forward_jit(p, tokens, gpt2), forward_jit(shared, tokens, bare))
    with pytest.raises(interop.UnrepresentableError, match="model.mlp"):
        interop._check_representable(bare, "export")


def test_short_conv_is_a_causal_depthwise_convolution_within_documents():
    B, T, C, k = 2, 7, 3, 3
    x = np.asarray(jax.random.normal(jax.random.key(0), (B, T, C)))
    resets = np.zeros((B, T), bool)
    resets[1, 4] = True  # row 1: a document starts at position 4
    conv = ShortConv(k)
    params = conv.init(jax.random.key(1), jnp.asarray(x))
    w, b = np.asarray(params["params"]["kernel"]), np.asarray(params["params"]["bias"])
    assert np.abs(w).max() <= 1 / np.sqrt(k)  # torch's Conv1d initialisation
    y = np.asarray(jax.jit(conv.apply)(params, jnp.asarray(x), jnp.asarray(resets)))
    want = np.zeros_like(x)
    for r in range(B):
        start = np.flatnonzero(resets[r])
        for t in range(T):
            first = max([s for s in start if s <= t], default=0)
            want[r, t] = b + sum(w[i] * x[r, t - i] for i in range(k) if t - i >= first)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-6)
    cfg = ModelConfig(**SMALL, short_conv=3)
    assert init_params(cfg, 0)["h"]["attn"]["conv"]["kernel"].shape == (2, 3, 16)
    with pytest.raises(NotImplementedError, match="short_conv"):
        decode_init(cfg, 1)


@pytest.mark.parametrize("loss_chunk", [0, 5])
def test_loss_at_labelled_positions_equals_the_full_loss(loss_chunk):
    cfg = ModelConfig(**SMALL, attention="LT_chunked", chunk_size=4, mlp=False, short_conv=3)
    cfg = cfg.replace(loss_chunk=loss_chunk)
    params = init_params(cfg, 0)
    tokens = jax.random.randint(jax.random.key(0), (3, 16), 0, 64)
    targets = jnp.full((3, 16), -1)
    targets = targets.at[0, jnp.array([2, 5, 9])].set(jnp.array([1, 2, 3]))
    targets = targets.at[1, 15].set(7)  # row 2 has no label at all
    full, grads = grad_jit(params, tokens, targets, cfg)
    for k in (3, 8):
        sparse, g = grad_jit(params, tokens, targets, cfg.replace(loss_positions=k))
        assert sparse == pytest.approx(float(full), rel=1e-6)
        for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(g)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    # Accuracy: the argmax of the full logits, counted where targets != -1.
    logits = forward_jit(params, tokens, cfg)
    pred = np.asarray(logits.argmax(-1))
    targets = targets.at[0, 5].set(int(pred[0, 5]))  # make one of them right
    hits, counted = correct_jit(params, tokens, targets, cfg.replace(loss_positions=3))
    t = np.asarray(targets)
    assert int(counted) == 4 and int(hits) == int(((pred == t) & (t != -1)).sum()) >= 1
