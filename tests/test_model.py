"""GPT-2 model: nanoGPT's init, causality, dropout sites, dtypes and errors.

Numerical parity with Hugging Face / nanoGPT is in test_parity_*.py."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.model import count_params, forward, init_params, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.loss import cross_entropy
from tests.helpers import SLOW, rel_err

TINY = dict(vocab_size=97, block_size=32, n_layer=2, n_head=2, n_embd=32)


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(**TINY)
    return cfg, init_params(cfg, seed=0)


def test_init_follows_nanogpt():
    cfg = ModelConfig(vocab_size=512, block_size=64, n_layer=4, n_head=4, n_embd=128)
    p = init_params(cfg, seed=1)
    assert np.std(p["wte"]["embedding"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(p["wpe"]["embedding"]) == pytest.approx(0.02, rel=0.1)
    assert np.std(p["h"]["attn"]["c_attn"]["kernel"]) == pytest.approx(0.02, rel=0.05)
    assert np.std(p["h"]["mlp"]["c_fc"]["kernel"]) == pytest.approx(0.02, rel=0.05)
    proj_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert np.std(p["h"]["attn"]["c_proj"]["kernel"]) == pytest.approx(proj_std, rel=0.05)
    assert np.std(p["h"]["mlp"]["c_proj"]["kernel"]) == pytest.approx(proj_std, rel=0.05)
    for leaf in (p["h"]["attn"]["c_attn"]["bias"], p["h"]["ln_1"]["bias"], p["ln_f"]["bias"]):
        assert not np.any(leaf)
    assert np.all(p["h"]["ln_1"]["scale"] == 1) and np.all(p["ln_f"]["scale"] == 1)
    # Each scanned layer gets its own draw.
    k = p["h"]["attn"]["c_attn"]["kernel"]
    assert k.shape == (4, 128, 384) and not np.allclose(k[0], k[1])
    assert all(leaf.dtype == jnp.float32 for leaf in jax.tree.leaves(p))


def test_init_is_reproducible_per_seed():
    cfg = ModelConfig(**TINY)
    a, b, c = init_params(cfg, 3), init_params(cfg, 3), init_params(cfg, 4)
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))
    assert not np.array_equal(a["wte"]["embedding"], c["wte"]["embedding"])


def test_bias_flag_removes_every_bias():
    cfg = ModelConfig(**TINY, bias=False)
    p = init_params(cfg)
    paths = [jax.tree_util.keystr(k) for k, _ in jax.tree_util.tree_leaves_with_path(p)]
    assert not any("bias" in path for path in paths)
    with_bias = count_params(init_params(ModelConfig(**TINY)), non_embedding=False)
    C, L = TINY["n_embd"], TINY["n_layer"]
    # Per block: 2 LayerNorm biases, c_attn (3C), c_proj (C), c_fc (4C), mlp c_proj (C); plus ln_f.
    assert (
        with_bias - count_params(p, non_embedding=False) == L * (2 * C + 3 * C + C + 4 * C + C) + C
    )


def test_forward_shape_dtype_and_causality(tiny):
    cfg, p = tiny
    tokens = jax.random.randint(jax.random.key(0), (2, 16), 0, cfg.vocab_size)
    logits = forward(p, tokens, cfg)
    assert logits.shape == (2, 16, cfg.vocab_size) and logits.dtype == jnp.float32
    changed = tokens.at[:, 10].set((tokens[:, 10] + 1) % cfg.vocab_size)
    logits2 = forward(p, changed, cfg)
    np.testing.assert_array_equal(logits[:, :10], logits2[:, :10])
    assert not np.allclose(logits[:, 10:], logits2[:, 10:])


def test_head_is_tied_to_token_embedding(tiny):
    cfg, p = tiny
    tokens = jnp.arange(8)[None] % cfg.vocab_size
    p2 = jax.tree.map(lambda a: a, p)
    # A random change, not a constant: adding c to every entry of the row changes its logit by
    # c * sum(h), and the final layer norm's output sums to ~0 (the test then measured rounding).
    change = jax.random.normal(jax.random.key(7), p["wte"]["embedding"].shape[1:])
    p2["wte"] = {"embedding": p["wte"]["embedding"].at[5].add(change)}
    # Changing one row of wte changes the logit of that token even at positions that never saw it.
    delta = forward(p2, jnp.zeros_like(tokens), cfg) - forward(p, jnp.zeros_like(tokens), cfg)
    assert np.all(np.abs(delta[..., 5]) > 1e-3) and np.allclose(delta[..., 6], 0, atol=1e-6)


def test_sequence_longer_than_block_size_is_an_error(tiny):
    cfg, p = tiny
    with pytest.raises(ValueError, match=r"length 33.*block_size is only 32"):
        forward(p, jnp.zeros((1, 33), jnp.int32), cfg)


def test_dropout_only_in_training_and_reproducible():
    cfg = ModelConfig(**TINY, dropout=0.2)
    p = init_params(cfg)
    tokens = jnp.arange(16)[None] % cfg.vocab_size
    eval_a, eval_b = forward(p, tokens, cfg), forward(p, tokens, cfg)
    np.testing.assert_array_equal(eval_a, eval_b)
    tr1 = forward(p, tokens, cfg, train=True, rng=jax.random.key(1))
    tr1b = forward(p, tokens, cfg, train=True, rng=jax.random.key(1))
    tr2 = forward(p, tokens, cfg, train=True, rng=jax.random.key(2))
    np.testing.assert_array_equal(tr1, tr1b)
    assert not np.allclose(tr1, tr2) and not np.allclose(tr1, eval_a)
    no_drop = ModelConfig(**TINY, dropout=0.0)
    np.testing.assert_array_equal(
        forward(p, tokens, no_drop, train=True, rng=jax.random.key(1)), forward(p, tokens, no_drop)
    )


def test_cross_entropy_ignores_minus_one_like_torch():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 5, 11)).astype(np.float32)
    targets = rng.integers(0, 11, size=(3, 5))
    targets[0, :2] = -1
    targets[2, 4] = -1
    logz = np.log(np.exp(logits.astype(np.float64)).sum(-1))
    valid = targets != -1
    nll = logz - np.take_along_axis(logits, np.where(valid, targets, 0)[..., None], -1)[..., 0]
    expected = nll[valid].mean()
    assert float(cross_entropy(jnp.asarray(logits), jnp.asarray(targets))) == pytest.approx(
        expected, rel=1e-6
    )


def test_bfloat16_compute_is_close_to_float32_and_returns_float32(tiny):
    cfg, p = tiny
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, cfg.vocab_size)
    f32 = forward(p, tokens, cfg)
    bf16 = forward(p, tokens, cfg.replace(dtype="bfloat16"))
    assert bf16.dtype == jnp.float32
    assert rel_err(bf16, f32) < 2e-2


@SLOW
def test_remat_changes_memory_not_values(tiny):
    cfg, p = tiny
    tokens = jax.random.randint(jax.random.key(2), (2, 16), 0, cfg.vocab_size)
    g = jax.grad(loss_fn)(p, tokens[:, :-1], tokens[:, 1:], cfg)
    g_remat = jax.grad(loss_fn)(p, tokens[:, :-1], tokens[:, 1:], cfg.replace(remat=True))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_remat)):
        assert rel_err(b, a) < 1e-6


def test_untrained_loss_is_near_log_vocab(tiny):
    cfg, p = tiny
    tokens = jax.random.randint(jax.random.key(3), (4, 32), 0, cfg.vocab_size)
    loss = float(loss_fn(p, tokens[:, :-1], tokens[:, 1:], cfg))
    assert abs(loss - math.log(cfg.vocab_size)) < 0.1


@pytest.mark.parametrize("name", ["softmax", "flash", "LT_chunked", "LT_state"])
def test_decode_prefill_then_steps_equals_full_forward(name):
    from linear_gpt2.model import decode, decode_init

    cfg = ModelConfig(**TINY, attention=name, chunk_size=4)
    p = init_params(cfg, seed=5)
    tokens = jax.random.randint(jax.random.key(4), (2, 20), 0, cfg.vocab_size)
    full = forward(p, tokens, cfg)
    step = jax.jit(decode, static_argnums=3)
    cache = decode_init(cfg, batch=2, max_len=24)
    logits, cache = step(p, tokens[:, :7], cache, cfg)  # prefill (7: not a multiple of chunk 4)
    outs = [logits]
    for t in range(7, 20):
        logits, cache = step(p, tokens[:, t : t + 1], cache, cfg)
        outs.append(logits)
    assert int(cache["pos"]) == 20
    assert rel_err(jnp.concatenate(outs, axis=1), full) < 1e-5


def test_decode_refuses_to_run_past_block_size():
    from linear_gpt2.model import decode, decode_init

    cfg = ModelConfig(**TINY, attention="LT_state")
    p = init_params(cfg)
    with pytest.raises(ValueError, match="exceeds block_size=32"):
        decode_init(cfg, batch=1, max_len=33)
    cache = decode_init(cfg, batch=1)
    _, cache = decode(p, jnp.zeros((1, 30), jnp.int32), cache, cfg)
    with pytest.raises(ValueError, match="cache holds 30 tokens and 3 more"):
        decode(p, jnp.zeros((1, 3), jnp.int32), cache, cfg)
