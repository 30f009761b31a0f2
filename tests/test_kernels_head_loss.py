"""Issue 37's fused head + loss (``kernels/head_loss``, ``model.loss_kernel=pallas_fused``)
against its oracle, autodiff of the plain loss and float64, and compiled for the H100.

On CPU the Pallas kernels run in interpret mode. Shapes are small and odd: rows past the last
whole token tile, a vocabulary that is not a multiple of its tile, C not a multiple of the step
over C, ignored targets (-1), and the forward's vocabulary split across programs (one slice, a
ragged last slice, one tile per slice). Tolerances: float32 1e-5 relative (||out-ref||/||ref||);
bfloat16 inputs: the losses against the float32 oracle on the same rounded inputs 1e-5 (the
matmuls accumulate in float32 either way), the gradients 1e-2 (the gradient of the logits
rounded to bfloat16 before the backward's matmuls, and dh, dw rounded once: 2^-8 each).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.kernels import choice
from linear_gpt2.kernels.head_loss import fused, naive, ops
from linear_gpt2.model import api
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.loss import cross_entropy, head_cross_entropy
from linear_gpt2.platform import target
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import load_config
from tests.helpers import SLOW, rel_err

F32_TOL = 1e-5
BF16_TOL = 1e-2

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")


def inputs(N, V, C, dtype=jnp.float32, seed=0, ignored=5):
    rng = np.random.default_rng(seed)
    h = jnp.asarray(rng.standard_normal((N, C)), jnp.float32).astype(dtype)
    w = jnp.asarray(0.3 * rng.standard_normal((V, C)), jnp.float32).astype(dtype)
    t = np.asarray(rng.integers(0, V, N), np.int32)
    t[::ignored] = -1
    dn = jnp.asarray(rng.standard_normal(N), jnp.float32)
    return h, w, jnp.asarray(t), dn


def float64_reference(h, w, t, dn):
    """numpy float64: nll, lse, dh, dw (the gradient of sum(dn * nll))."""
    h, w, t, dn = (np.asarray(a, np.float64) if a.dtype != jnp.int32 else np.asarray(a)
                   for a in (h, w, t, dn))  # fmt: skip
    x = h @ w.T
    m = x.max(1, keepdims=True)
    lse = np.log(np.exp(x - m).sum(1)) + m[:, 0]
    valid = t != -1
    safe = np.maximum(t, 0)
    nll = np.where(valid, lse - x[np.arange(len(t)), safe], 0.0)
    p = np.exp(x - lse[:, None])
    p[np.arange(len(t)), safe] -= 1.0
    dl = np.where(valid[:, None], dn[:, None] * p, 0.0)
    return nll, lse, dl @ w, dl.T @ h


@pytest.mark.parametrize(
    "N, V, C, tiles, min_programs",
    [
        (37, 301, 48, (16, 64, 16), fused.MIN_PROGRAMS),  # vocabulary split 5 ways, 1 tile each
        (37, 301, 40, (16, 64, 16), 4),  # split 2 ways, the last slice ragged; C padded to 48
        (50, 130, 24, (32, 32, 16), 1),  # no split (one slice of 5 tiles)
    ],
)  # fmt: skip
def test_head_loss_kernels_equal_the_oracle_autodiff_and_float64(
    N, V, C, tiles, min_programs, monkeypatch
):
    monkeypatch.setattr(fused, "MIN_PROGRAMS", min_programs)
    h, w, t, dn = inputs(N, V, C, seed=N + V + C)

    @jax.jit
    def run(h, w, t, dn):
        nll, lse = fused.head_loss_fwd(h, w, t, tiles)
        dh, dw = fused.head_loss_bwd(h, w, t, lse, dn, tiles)
        want = naive.nll_and_lse(h, w, t)
        _, vjp = jax.vjp(lambda h, w: naive.nll(h, w, t), h, w)
        return (nll, lse, dh, dw), (*want, *naive.backward(h, w, t, want[1], dn)), vjp(dn)

    got, oracle, auto = run(h, w, t, dn)
    ref64 = float64_reference(h, w, t, dn)
    for g, o, r in zip(got, oracle, ref64):
        assert g.shape == o.shape == r.shape
        assert rel_err(g, o) < F32_TOL and rel_err(g, r) < F32_TOL
    for g, a in zip(got[2:], auto):  # dh, dw against autodiff of the plain loss
        assert rel_err(g, a) < F32_TOL
    ignored = np.asarray(t) == -1
    assert not np.asarray(got[0])[ignored].any()  # ignored rows: no loss
    # ... and no gradient (the rows of dh of ignored targets are exactly zero)
    assert not np.asarray(got[2])[ignored].any()


def test_head_nll_op_in_bfloat16_and_its_vjp():
    """The custom_vjp op, both implementations, with bfloat16 operands (the model's compute
    dtype): outputs in the inputs' dtypes; the Pallas op equals the XLA op (the same roundings)
    and the float32 oracle on the rounded inputs within the bfloat16 tolerance."""
    h, w, t, dn = inputs(45, 200, 32, jnp.bfloat16, seed=3)

    @jax.jit
    def run(h, w, dn):
        out = {}
        for kernel in ("pallas", "xla"):
            nll, vjp = jax.vjp(lambda h, w, k=kernel: ops.head_nll(h, w, t, kernel=k), h, w)
            out[kernel] = (nll, *vjp(dn))
        h32, w32 = h.astype(jnp.float32), w.astype(jnp.float32)
        nll, vjp = jax.vjp(lambda h, w: naive.nll(h, w, t), h32, w32)
        out["f32"] = (nll, *vjp(dn))
        return out

    out = run(h, w, dn)
    k, x, f = out["pallas"], out["xla"], out["f32"]
    assert k[1].dtype == k[2].dtype == jnp.bfloat16 and k[0].dtype == jnp.float32
    assert rel_err(k[0], f[0]) < F32_TOL and rel_err(k[0], x[0]) < F32_TOL
    for a, b, r in zip(k[1:], x[1:], f[1:]):
        assert rel_err(a, r) < BF16_TOL and rel_err(a, b) < BF16_TOL
    with pytest.raises(ValueError, match="cast both"):
        ops.head_nll(h, w.astype(jnp.float32), t)
    with pytest.raises(ValueError, match="kernel='gpu' is not one of xla, pallas"):
        ops.head_nll(h, w, t, kernel="gpu")


def test_fused_head_loss_equals_the_plain_loss():
    """head_cross_entropy(kernel=pallas_fused) against cross_entropy of the materialised logits
    (loss, dx, dw; every target of one row ignored), float32."""
    rng = np.random.default_rng(11)
    B, T, C, V = 2, 19, 24, 133
    x = jnp.asarray(rng.standard_normal((B, T, C)), jnp.float32)
    w = jnp.asarray(0.3 * rng.standard_normal((V, C)), jnp.float32)
    tt = np.asarray(rng.integers(0, V, (B, T)), np.int32)
    tt[1] = -1
    targets = jnp.asarray(tt)

    def plain(x, w):
        return cross_entropy(jnp.einsum("btc,vc->btv", x, w), targets)

    def fused_loss(x, w):
        return head_cross_entropy(x, w, targets, chunk=8, kernel="pallas_fused")

    want, gw = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(x, w)
    got, g = jax.jit(jax.value_and_grad(fused_loss, argnums=(0, 1)))(x, w)
    assert rel_err(got, want) < F32_TOL
    for a, r in zip(g, gw):
        assert a.dtype == r.dtype and rel_err(a, r) < F32_TOL


@SLOW
def test_model_with_the_fused_head_loss_equals_the_xla_model():
    """model.loss_kernel=pallas_fused against the XLA model: loss and every gradient, float32."""
    rng = np.random.default_rng(12)
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=97, block_size=16)
    params = api.init_params(cfg, 0)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 17)))
    results = []
    for c in (cfg, cfg.replace(loss_kernel="pallas_fused")):
        loss = lambda p, c=c: api.loss_fn(p, tokens[:, :-1], tokens[:, 1:], c)  # noqa: E731
        results.append(jax.jit(jax.value_and_grad(loss))(params))
    (l0, g0), (l1, g1) = results
    assert rel_err(l1, l0) < F32_TOL
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert rel_err(a, b) < F32_TOL


def test_pallas_fused_is_a_loss_kernel_by_name_only(monkeypatch):
    """model.loss_kernel takes pallas_fused (typed, checked at load, a resume may change it);
    the other kernel options do not; auto never resolves to it, on a GPU target either."""
    cfg = load_config(None, ["model.loss_kernel=pallas_fused"])
    assert cfg.model_config.loss_kernel == "pallas_fused"
    assert cfg.resume_may_change("model.loss_kernel")
    with pytest.raises(ConfigError) as e:
        load_config(None, ["model.loss_kernel=fused"])
    assert "auto, xla, pallas, pallas_fused" in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="model.mlp_kernel"):
        load_config(None, ["model.mlp_kernel=pallas_fused"])
    assert choice.resolve_loss("pallas_fused") == "pallas_fused"
    monkeypatch.setattr(choice, "AUTO_PICKS_PALLAS", True)
    with jax.sharding.use_abstract_mesh(target.mesh("h100").abstract_mesh):
        assert choice.resolve_loss("auto") == "pallas"
    assert choice.resolve_loss("auto") == "xla"


@SLOW
def test_head_loss_kernels_compile_for_the_h100_without_spills():
    """Forward and backward at C = 768 and 1600, V = 50304 (the padded GPT-2 vocabulary: 393
    tiles of 128), bfloat16, 4096 tokens, compiled for the H100 with register spills an error;
    within the H100's shared memory per block."""
    rep = target.replicated("h100")

    def S(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=rep)

    def program(h, w, h2, w2, t):
        out = []
        for hh, ww in ((h, w), (h2, w2)):
            nll, vjp = jax.vjp(lambda a, b: ops.head_nll(a, b, t), hh, ww)
            out += [nll, vjp(jnp.ones_like(nll))]
        return out

    N, V = 4096, 50304
    args = (S((N, 768), "bfloat16"), S((V, 768), "bfloat16"), S((N, 1600), "bfloat16"),
            S((V, 1600), "bfloat16"), S((N,), "int32"))  # fmt: skip
    r = target.compile_program(jax.jit(program), args, "h100", kernels=True, fail_on_spill=True)
    names = sorted(k.name.split("__")[0] for k in r.kernels if k.name.startswith("head_loss"))
    assert names == ["head_loss_bwd"] * 2 + ["head_loss_fwd"] * 2, names
    limit = target.get("h100").device["shared_memory_per_block_optin"]
    for k in r.kernels:
        assert 0 < k.programs and k.shared_memory <= limit
