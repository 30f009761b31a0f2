"""Parity with nanoGPT itself (karpathy/nanoGPT's ``model.py``, torch, CPU, float32): logits,
loss and every gradient for bias on and off, ``to_nanogpt`` loading strictly into ``GPT``, and
AdamW steps with nanoGPT's own ``configure_optimizers``.

nanoGPT is not a package and is never copied here: set ``NANOGPT_DIR`` to a checkout (any
directory holding its ``model.py``) to run these, e.g.
``NANOGPT_DIR=~/src/nanoGPT pytest tests/test_parity_nanogpt.py``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from linear_gpt2.model import count_params, forward, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.interop import from_nanogpt, to_nanogpt
from tests.helpers import rel_err

SKIP_REASON = "set NANOGPT_DIR to a karpathy/nanoGPT checkout to run"
_dir = os.environ.get("NANOGPT_DIR")
if not _dir:
    pytest.skip(SKIP_REASON, allow_module_level=True)
torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -e '.[parity]')")

TOL = 1e-5
V, T, L, H, C, B = 97, 32, 2, 4, 64, 3
LR, BETAS, WD, CLIP = 1e-3, (0.9, 0.95), 0.1, 1.0


def _load_nanogpt():
    path = Path(_dir).expanduser() / "model.py"
    if not path.is_file():
        pytest.fail(f"NANOGPT_DIR={_dir!r} has no model.py; point it at a nanoGPT checkout")
    spec = importlib.util.spec_from_file_location("nanogpt_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


nanogpt = _load_nanogpt()


def _config(bias: bool) -> ModelConfig:
    return ModelConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, bias=bias)


def _gpt(bias: bool, seed: int = 0):
    """nanoGPT's GPT with every parameter random (LayerNorm weights around 1, biases too)."""
    torch.manual_seed(seed)
    cfg = nanogpt.GPTConfig(
        block_size=T, vocab_size=V, n_layer=L, n_head=H, n_embd=C, dropout=0.0, bias=bias
    )
    with contextlib.redirect_stdout(io.StringIO()):  # it prints its parameter count
        model = nanogpt.GPT(cfg).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if p.ndim == 1 and not name.endswith(".bias"):
                p.copy_(1.0 + 0.1 * noise)  # LayerNorm weight
            else:
                p.copy_(0.1 * noise)
    return model


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, T))
    targets = rng.integers(0, V, size=(B, T))
    targets[rng.random((B, T)) < 0.2] = -1  # nanoGPT's ignore_index
    return tokens, targets


def _state_dict(model) -> dict:
    return {k: v.detach().numpy() for k, v in model.state_dict().items()}


_value_and_grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
_forward = jax.jit(forward, static_argnums=2)


def _leaf_errors(ours, ref) -> dict[str, float]:
    a = dict(jax.tree_util.tree_leaves_with_path(ours))
    b = dict(jax.tree_util.tree_leaves_with_path(ref))
    assert a.keys() == b.keys()
    return {jax.tree_util.keystr(k): rel_err(a[k], b[k]) for k in b}


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_logits_loss_grads_match_nanogpt(bias):
    cfg = _config(bias)
    model = _gpt(bias)
    sd = _state_dict(model)
    params = from_nanogpt(sd, cfg)
    assert count_params(params) == model.get_num_params()
    assert count_params(params, non_embedding=False) == model.get_num_params(False)

    tokens, targets = _batch(1)
    # With targets, nanoGPT returns the logits of every position (without, only the last).
    logits_t, loss_t = model(torch.from_numpy(tokens), torch.from_numpy(targets))
    loss_t.backward()
    # named_parameters() lists the tied wte/lm_head once; its grad is the sum of both uses.
    grads_t = from_nanogpt({n: p.grad for n, p in model.named_parameters()}, cfg)

    with jax.default_matmul_precision("highest"):
        logits_j = _forward(params, tokens, cfg)
        loss_j, grads_j = _value_and_grad(params, tokens, targets, cfg)
    err_logits = rel_err(logits_j, logits_t.detach().numpy())
    err_loss = rel_err(loss_j, loss_t.item())
    errs = _leaf_errors(grads_j, grads_t)
    print(
        f"nanoGPT bias={bias}: logits {err_logits:.2e}, loss {err_loss:.2e}, "
        f"grads max {max(errs.values()):.2e}"
    )
    assert err_logits <= TOL
    assert err_loss <= TOL
    assert max(errs.values()) <= TOL, errs

    # Other params, exported with to_nanogpt, load strictly into a fresh GPT and agree.
    params2 = jax.tree.map(lambda x: 1.1 * x + 0.01, params)
    model2 = _gpt(bias, seed=1)
    model2.load_state_dict({k: torch.from_numpy(v) for k, v in to_nanogpt(params2, cfg).items()})
    with torch.no_grad():
        ref, _ = model2(torch.from_numpy(tokens), torch.from_numpy(targets))
    with jax.default_matmul_precision("highest"):
        ours = _forward(params2, tokens, cfg)
    assert rel_err(ours, ref.numpy()) <= TOL
    # The exact round trip through nanoGPT's own state dict.
    back = to_nanogpt(from_nanogpt(_state_dict(model2), cfg), cfg)
    sd2 = _state_dict(model2)
    assert list(back) == list(sd2)
    for k in sd2:
        np.testing.assert_array_equal(back[k], sd2[k], err_msg=k)


def _decay_mask(params):
    # Rank >= 2 per layer (our blocks carry a leading [n_layer] axis), as nanoGPT's
    # configure_optimizers: matmul weights and embeddings decay, biases and LayerNorm don't.
    return {
        k: jax.tree.map(lambda x, stacked=(k == "h"): x.ndim - stacked >= 2, v)
        for k, v in params.items()
    }


def test_adamw_matches_nanogpt_configure_optimizers():
    """Three steps of nanoGPT's own optimizer (AdamW, its decay groups) after
    clip_grad_norm_(1.0), as in its train.py, against optax; see test_parity_hf.py for why the
    two AdamW formulas are the same."""
    bias = True
    cfg = _config(bias)
    model = _gpt(bias, seed=5)
    params = from_nanogpt(_state_dict(model), cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        opt = model.configure_optimizers(WD, LR, BETAS, "cpu")
    tx = optax.chain(
        optax.clip_by_global_norm(CLIP),
        optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=1e-8, weight_decay=WD, mask=_decay_mask),
    )
    state = tx.init(params)
    update = jax.jit(tx.update)
    for step, scale in enumerate((10.0, 200.0, 40.0)):  # grad norms > 1: the clip is active
        tokens, targets = _batch(10 + step)
        opt.zero_grad()
        _, loss = model(torch.from_numpy(tokens), torch.from_numpy(targets))
        (scale * loss).backward()
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP))
        opt.step()
        with jax.default_matmul_precision("highest"):
            _, grads = _value_and_grad(params, tokens, targets, cfg)
        grads = jax.tree.map(lambda g, s=scale: s * g, grads)
        assert norm > CLIP
        assert rel_err(optax.tree.norm(grads), norm) <= TOL
        updates, state = update(grads, state, params)
        params = optax.apply_updates(params, updates)
    ref = from_nanogpt(_state_dict(model), cfg)
    # The key third of c_attn's bias has an analytically zero gradient (softmax ignores the
    # constant q . b_k), so Adam turns each framework's round-off into +-lr steps: leave it out.
    for p in (params, ref):
        p["h"]["attn"]["c_attn"]["bias"] = p["h"]["attn"]["c_attn"]["bias"].at[:, C : 2 * C].set(0)
    errs = _leaf_errors(params, ref)
    print(f"nanoGPT AdamW: param rel err max {max(errs.values()):.2e}")
    assert max(errs.values()) <= TOL, errs
