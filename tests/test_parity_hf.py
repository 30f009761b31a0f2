"""Parity with Hugging Face's GPT-2 (torch, CPU, float32): logits, loss, every gradient, and
three AdamW steps with nanoGPT's optimizer settings, for bias on and off.

The HF model is configured to be nanoGPT's function: exact-erf GELU (``activation_function=
"gelu"``; HF's default ``gelu_new`` is the tanh approximation), LayerNorm eps 1e-5, no dropout,
eager attention. All its weights are random, LayerNorm weights and all biases included, so that a
transposed kernel, a swapped LayerNorm scale/bias or a dropped bias shows up as an O(1) error.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from linear_gpt2.model import count_params, forward, loss_fn, param_shapes
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.interop import UnexpectedKeysError, from_hf, load_params, to_hf
from tests.helpers import rel_err

torch = pytest.importorskip("torch", reason="parity tests need torch (pip install -e '.[parity]')")
transformers = pytest.importorskip(
    "transformers", reason="parity tests need transformers (pip install -e '.[parity]')"
)

TOL = 1e-5
V, T, L, H, C, B = 97, 32, 2, 4, 64, 3  # odd vocab, so that a [V, C] / [C, V] mix-up cannot fit
LR, BETAS, EPS, WD, CLIP = 1e-3, (0.9, 0.95), 1e-8, 0.1, 1.0


def _config(bias: bool) -> ModelConfig:
    return ModelConfig(vocab_size=V, block_size=T, n_layer=L, n_head=H, n_embd=C, bias=bias)


def _hf_model(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(
        vocab_size=V,
        n_positions=T,
        n_embd=C,
        n_layer=L,
        n_head=H,
        activation_function="gelu",  # exact erf, as nanoGPT's nn.GELU()
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-5,
        attn_implementation="eager",
    )
    model = transformers.GPT2LMHeadModel(cfg).float().eval()
    assert model.lm_head.weight is model.transformer.wte.weight  # tied, as nanoGPT
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            if name.endswith(".bias"):
                # HF has no bias=False: zero the biases (Dense and LayerNorm) and freeze them, so
                # the function is the bias-free model's and they stay out of the optimizer/clip.
                p.copy_(0.1 * noise if bias else torch.zeros_like(p))
                p.requires_grad_(bias)
            elif p.ndim == 1:  # LayerNorm weight: random around 1
                p.copy_(1.0 + 0.1 * noise)
            else:
                p.copy_(0.1 * noise)
    return model


def _hf_state_dict(model, bias: bool) -> dict:
    """The HF state dict restricted to the parameters our model has for ``bias``."""
    return {k: v for k, v in model.state_dict().items() if bias or not k.endswith(".bias")}


def _batch(seed: int):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, size=(B, T))
    targets = rng.integers(0, V, size=(B, T))
    targets[rng.random((B, T)) < 0.2] = -1  # ignored positions
    return tokens, targets


def _torch_loss(model, tokens, targets):
    logits = model(torch.from_numpy(tokens)).logits  # [B, T, V]
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), torch.from_numpy(targets).reshape(-1), ignore_index=-1
    )
    return logits, loss


def _torch_grads(model) -> dict:
    # named_parameters() lists the tied wte/lm_head once; its .grad is the sum of both uses.
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" not in grads
    return grads


_value_and_grad = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
_forward = jax.jit(forward, static_argnums=2)


def _leaf_errors(ours, ref) -> dict[str, float]:
    ours_flat = dict(jax.tree_util.tree_leaves_with_path(ours))
    ref_flat = dict(jax.tree_util.tree_leaves_with_path(ref))
    assert ours_flat.keys() == ref_flat.keys()
    return {jax.tree_util.keystr(k): rel_err(ours_flat[k], ref_flat[k]) for k in ref_flat}


@pytest.fixture(scope="module", params=[True, False], ids=["bias", "nobias"])
def case(request):
    bias = request.param
    model = _hf_model(bias)
    cfg = _config(bias)
    params = from_hf(_hf_state_dict(model, bias), cfg)
    tokens, targets = _batch(1)
    logits_t, loss_t = _torch_loss(model, tokens, targets)
    loss_t.backward()
    # torch's gradients mapped into our layout by the converter under test
    grads_t = from_hf({n: g.detach() for n, g in _torch_grads(model).items()}, cfg)
    with jax.default_matmul_precision("highest"):
        logits_j = _forward(params, tokens, cfg)
        loss_j, grads_j = _value_and_grad(params, tokens, targets, cfg)
    return dict(
        bias=bias,
        cfg=cfg,
        model=model,
        params=params,
        tokens=tokens,
        logits_t=logits_t.detach().numpy(),
        loss_t=loss_t.item(),
        grads_t=grads_t,
        logits_j=np.asarray(logits_j),
        loss_j=float(loss_j),
        grads_j=grads_j,
    )


def test_logits_and_loss_match_hf(case):
    assert case["logits_j"].shape == (B, T, V)
    err_logits = rel_err(case["logits_j"], case["logits_t"])
    err_loss = rel_err(case["loss_j"], case["loss_t"])
    print(f"bias={case['bias']}: logits rel err {err_logits:.2e}, loss rel err {err_loss:.2e}")
    assert err_logits <= TOL
    assert err_loss <= TOL


def test_every_gradient_matches_hf(case):
    errs = _leaf_errors(case["grads_j"], case["grads_t"])
    print(f"bias={case['bias']}: grad rel err max {max(errs.values()):.2e}", errs)
    n_expected = 16 if case["bias"] else 9  # wte, wpe, ln_f (+b), and per block 4 (+8 biases)
    assert len(errs) == n_expected
    bad = {k: e for k, e in errs.items() if not e <= TOL}
    assert not bad, bad
    # Every gradient is non-trivial (a dead parameter would pass any comparison).
    for leaf in jax.tree.leaves(case["grads_j"]):
        assert float(jnp.linalg.norm(leaf)) > 0
    if case["bias"]:
        # Adding b_k to every key adds q . b_k to all of a query's scores, which softmax ignores:
        # the key bias's true gradient is 0, and both frameworks give only round-off (which is
        # why test_adamw_steps_match_torch leaves those entries out).
        for grads in (case["grads_j"], case["grads_t"]):
            g = np.asarray(grads["h"]["attn"]["c_attn"]["bias"])
            assert np.linalg.norm(g[:, C : 2 * C]) <= 1e-5 * np.linalg.norm(g)


def _zero_key_bias(params):
    """``params`` with the key third of ``h/attn/c_attn/bias`` ``[L, 3C]`` set to zero."""
    params = jax.tree.map(lambda x: x, params)  # a new tree, same leaves
    b = params["h"]["attn"]["c_attn"]["bias"]
    params["h"]["attn"]["c_attn"]["bias"] = b.at[:, C : 2 * C].set(0.0)
    return params


def test_parity_detects_a_transposed_kernel(case):
    """The comparison is sensitive: transposing the square ``attn.c_proj`` kernel (which no
    shape check can catch) gives an O(1) logit error."""
    params = jax.tree.map(lambda x: x, case["params"])
    params["h"]["attn"]["c_proj"]["kernel"] = jnp.swapaxes(
        params["h"]["attn"]["c_proj"]["kernel"], -1, -2
    )
    with jax.default_matmul_precision("highest"):
        logits = _forward(params, case["tokens"], case["cfg"])
    assert rel_err(logits, case["logits_t"]) > 1e-2


def test_hf_round_trip_and_param_count(case):
    bias, cfg, model = case["bias"], case["cfg"], case["model"]
    sd = {k: v.numpy() for k, v in _hf_state_dict(model, bias).items()}
    back = to_hf(case["params"], cfg)
    assert back.keys() == sd.keys()
    for k in sd:
        np.testing.assert_array_equal(back[k], sd[k], err_msg=k)
    n_hf = sum(p.numel() for p in model.parameters() if bias or p.requires_grad)
    assert count_params(case["params"], non_embedding=False) == n_hf


def test_to_hf_loads_into_transformers(case):
    """Other params (ours, perturbed), exported with ``to_hf``, load strictly into a fresh
    GPT2LMHeadModel and give our logits; with bias=False the HF biases are zeros."""
    cfg = case["cfg"]
    params = jax.tree.map(lambda x: 1.1 * x + 0.01, case["params"])
    model = _hf_model(True, seed=7)
    sd = {k: torch.from_numpy(v) for k, v in to_hf(params, cfg).items()}
    if not case["bias"]:
        zeros = {
            k: torch.zeros_like(v) for k, v in model.state_dict().items() if k.endswith(".bias")
        }
        sd.update(zeros)
    model.load_state_dict(sd, strict=True)
    with torch.no_grad():
        ref = model(torch.from_numpy(case["tokens"])).logits.numpy()
    with jax.default_matmul_precision("highest"):
        ours = _forward(params, case["tokens"], cfg)
    assert rel_err(ours, ref) <= TOL


def test_save_pretrained_file_loads(case, tmp_path):
    """``save_pretrained``'s model.safetensors (lm_head left out, being tied) loads with
    ``load_params``; the bias-free model's zeroed HF biases are refused with the hint."""
    case["model"].save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    if case["bias"]:
        params = load_params(path, case["cfg"])
        for path_, leaf in jax.tree_util.tree_leaves_with_path(case["params"]):
            np.testing.assert_array_equal(
                _get(params, path_), leaf, err_msg=jax.tree_util.keystr(path_)
            )
    else:
        with pytest.raises(UnexpectedKeysError, match="set bias=True"):
            load_params(path, case["cfg"])


def _get(tree, path):
    for k in path:
        tree = tree[k.key]
    return tree


# --------------------------------------------------------------------------------------------
# AdamW: torch (nanoGPT's configure_optimizers) vs optax


def _torch_adamw(model):
    """nanoGPT's ``configure_optimizers``: decay the tensors of rank >= 2 (matmul weights and
    embeddings), not biases or LayerNorm weights. The tied wte/lm_head is one parameter."""
    named = {n: p for n, p in model.named_parameters() if p.requires_grad}
    groups = [
        {"params": [p for p in named.values() if p.dim() >= 2], "weight_decay": WD},
        {"params": [p for p in named.values() if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS), list(named.values())


def _decay_mask(params):
    """Weight decay on the tensors that are rank >= 2 *per layer*. Our blocks are stacked under
    ``h`` with a leading ``[n_layer]`` axis, so a stacked bias ``[L, C]`` or LayerNorm scale is
    rank 2 but must not be decayed: the plain ``x.ndim >= 2`` mask would decay them."""
    return {
        k: jax.tree.map(lambda x, stacked=(k == "h"): x.ndim - stacked >= 2, v)
        for k, v in params.items()
    }


def _optax_adamw(mask=_decay_mask, clip=True):
    # Same update as torch.optim.AdamW, by construction (optax.adamw docstring vs torch.optim.AdamW
    # docs, both read for optax 0.2.8 / torch 2.15):
    #   m_hat = m_t / (1 - b1^t), v_hat = v_t / (1 - b2^t)
    #   torch: theta <- theta * (1 - lr*wd); theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)
    #   optax: theta <- theta - lr * (m_hat / (sqrt(v_hat + eps_root) + eps) + wd * theta)
    # i.e. eps outside the square root of the bias-corrected v (optax's eps_root=0 default), and
    # the decay lr*wd*theta uses the pre-step theta in both ("decoupled", scaled by lr in both).
    # The clip differs by torch's 1e-6: torch scales by max_norm / (norm + 1e-6), optax by
    # max_norm / norm, a relative 1e-6/norm <= 1e-6 difference, below the tolerance.
    tx = optax.adamw(LR, b1=BETAS[0], b2=BETAS[1], eps=EPS, weight_decay=WD, mask=mask)
    return optax.chain(optax.clip_by_global_norm(CLIP), tx) if clip else tx


# Loss multipliers per step: large enough that the global grad norm exceeds the clip (1.0) at
# every step, and different, so that the clip changes the ratio of successive gradients (Adam is
# invariant to one common scale, so a clip that is always the same factor would test nothing).
LOSS_SCALES = (10.0, 200.0, 40.0)


def _run_optax(params, cfg, batches, tx):
    update = jax.jit(tx.update)
    state = tx.init(params)
    norms = []
    with jax.default_matmul_precision("highest"):
        for (tokens, targets), s in zip(batches, LOSS_SCALES):
            _, grads = _value_and_grad(params, tokens, targets, cfg)  # compiled by `case`
            grads = jax.tree.map(lambda g, s=s: s * g, grads)  # d(s * loss) = s * d(loss)
            norms.append(float(optax.tree.norm(grads)))
            updates, state = update(grads, state, params)
            params = optax.apply_updates(params, updates)
    return params, norms


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_adamw_steps_match_torch(bias):
    cfg = _config(bias)
    model = _hf_model(bias, seed=5)
    params0 = from_hf(_hf_state_dict(model, bias), cfg)
    batches = [_batch(10 + i) for i in range(len(LOSS_SCALES))]

    opt, trainable = _torch_adamw(model)
    # The tied wte/lm_head is one torch parameter (one Adam state, one decay, counted once by
    # the clip), as it is one leaf of ours: the element counts agree only if it is not doubled.
    assert sum(p.numel() for p in trainable) == count_params(params0, non_embedding=False)
    norms_t = []
    for (tokens, targets), s in zip(batches, LOSS_SCALES):
        opt.zero_grad()
        _, loss = _torch_loss(model, tokens, targets)
        (s * loss).backward()
        norms_t.append(float(torch.nn.utils.clip_grad_norm_(trainable, CLIP)))
        opt.step()
    params_t = from_hf(_hf_state_dict(model, bias), cfg)

    params_j, norms_j = _run_optax(params0, cfg, batches, _optax_adamw())
    assert all(n > CLIP for n in norms_t), norms_t  # the clip was active at every step
    assert rel_err(norms_j, norms_t) <= TOL
    if bias:
        # The key part of the c_attn bias gets an analytically zero gradient (q . b_k is the
        # same for every key, and softmax ignores a constant), so its computed gradient is
        # float32 round-off, which Adam normalises into +-lr steps of arbitrary sign in each
        # framework. Compare everything else; those 2*C entries cannot be compared by anyone.
        # (test_every_gradient_matches_hf checks that premise.)
        params0, params_j, params_t = (_zero_key_bias(p) for p in (params0, params_j, params_t))
    errs = _leaf_errors(params_j, params_t)
    # The updates themselves (params_t - params0), a stricter comparison than the parameters.
    delta_j = jax.tree.map(lambda a, b: a - b, params_j, params0)
    delta_t = jax.tree.map(lambda a, b: a - b, params_t, params0)
    delta_errs = _leaf_errors(delta_j, delta_t)
    print(
        f"bias={bias}: grad norms {norms_t}; AdamW param rel err max {max(errs.values()):.2e}, "
        f"update rel err max {max(delta_errs.values()):.2e}"
    )
    assert max(errs.values()) <= TOL, errs
    # Looser for the updates: float32 params ~0.1-1 carry ~1e-7 absolute round-off against
    # updates ~1e-3, and an element whose first gradient is ~0 (e.g. 2e-6 against a median of
    # 4e-2) has its round-off amplified by Adam's normalisation. A missing or wrongly scaled decay
    # (1% of the update at these settings) or a wrong eps placement would still show.
    assert max(delta_errs.values()) <= 1e-3, delta_errs

    # Controls, so that a wrong optimizer cannot pass: the naive rank mask on our stacked tree
    # (decays the stacked LayerNorm scales [L, C]) and dropping the clip both give visible errors.
    if bias:  # once is enough; the bias-free tree is the cheaper one to compile for
        return
    naive, _ = _run_optax(
        params0, cfg, batches, _optax_adamw(mask=lambda p: jax.tree.map(lambda x: x.ndim >= 2, p))
    )
    assert max(_leaf_errors(naive, params_t).values()) > 10 * TOL
    unclipped, _ = _run_optax(params0, cfg, batches, _optax_adamw(clip=False))
    assert max(_leaf_errors(unclipped, params_t).values()) > 10 * TOL


# --------------------------------------------------------------------------------------------
# Parameter counts


@pytest.mark.parametrize(
    "name, total",
    [("124M", 124_439_808), ("355M", 354_823_168), ("774M", 774_030_080), ("1.6B", 1_557_611_200)],
)
def test_preset_param_counts_match_gpt2(name, total):
    """GPT-2's published sizes (nanoGPT's and HF's counts, wpe included), without allocating."""
    cfg = ModelConfig.preset(name, vocab_size=50257)
    shapes = param_shapes(cfg)
    assert count_params(shapes, non_embedding=False) == total
    # nanoGPT's get_num_params() default leaves the position embeddings out.
    assert count_params(shapes) == total - cfg.block_size * cfg.n_embd
