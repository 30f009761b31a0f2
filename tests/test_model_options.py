"""Model options for the synthetic tasks, off by default: attention-only blocks, the short
convolution before the attention, the head at the labelled positions only, and accuracy."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.model import correct, decode_init, forward, init_params, interop, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.layers import ShortConv
from tests.helpers import SLOW

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


@SLOW
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


def test_identity_state_mixer_adds_ln2_of_the_stream_as_zoology_blocks_do():
    """Zoology's TransformerBlock with state_mixer=Identity returns ln_2(x) and the next block
    (or ln_f) adds it to the residual: x = x + attn(ln_1(x)); x = x + ln_2(x). Checked against
    that written out in numpy, with ln_2's scale away from 1 so the term cannot hide."""
    cfg = ModelConfig(**SMALL, mlp=False, bias=False, identity_state_mixer=True)
    p = init_params(cfg, 0)
    p["h"]["ln_2"]["scale"] = 1.0 + 0.5 * jax.random.normal(jax.random.key(3), (2, 16))
    tokens = jax.random.randint(jax.random.key(4), (2, 16), 0, 64)

    def ln(x, g):
        x = x - x.mean(-1, keepdims=True)
        return g * x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-5)

    q = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    h, H, D = q["h"], cfg.n_head, cfg.n_embd // cfg.n_head
    x = q["wte"]["embedding"][np.asarray(tokens)] + q["wpe"]["embedding"][None, :16]
    mask = np.tril(np.ones((16, 16), bool))
    for i in range(cfg.n_layer):
        qkv = ln(x, h["ln_1"]["scale"][i]) @ h["attn"]["c_attn"]["kernel"][i]
        qh, kh, vh = (a.reshape(2, 16, H, D) for a in np.split(qkv, 3, axis=-1))
        s = np.einsum("bthd,bshd->bhts", qh, kh) / np.sqrt(D)
        s = np.where(mask, s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        y = np.einsum("bhts,bshd->bthd", a, vh).reshape(2, 16, H * D)
        x = x + y @ h["attn"]["c_proj"]["kernel"][i]
        x = x + ln(x, h["ln_2"]["scale"][i])
    want = ln(x, q["ln_f"]["scale"]) @ q["wte"]["embedding"].T
    got = np.asarray(forward_jit(p, tokens, cfg), np.float64)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 1e-5
    # Without the option the same parameters (less ln_2) give another function.
    plain = cfg.replace(identity_state_mixer=False)
    p2 = dict(p, h={k: v for k, v in p["h"].items() if k != "ln_2"})
    assert not np.allclose(forward_jit(p2, tokens, plain), got, atol=1e-3)
    with pytest.raises(ValueError, match="model.identity_state_mixer.*mlp: false"):
        ModelConfig(**SMALL, identity_state_mixer=True)
