"""Issue 37's glue kernels on a GPU: the real Triton lowering at the widths of GPT-2 124M, against
the plain-JAX oracle beside each kernel and a float64 reference (values and gradients).

``tests/test_kernels_glue.py`` checks the same kernels in interpret mode on the CPU at small odd
shapes; these tests are what a GPU adds: the compiled kernels (masks, tiles, atomics and
partial sums as Triton runs them) at the model's own widths, C = 768, 4C = 3072, the vocabulary
of 50304, with odd row counts. ``make gpu-check`` runs them in its first window: with the step
timed at ``pallas`` beside ``xla`` (its ``glue`` stage) they decide whether ``auto`` may take the
kernels (``linear_gpt2/kernels/choice.py``: ``AUTO_PICKS_PALLAS``). Skipped without a GPU.

Tolerances as the CPU file's: float32 1e-5 relative; bfloat16 against the float32 oracle on the
same rounded inputs, 1e-2 (one bfloat16 rounding of the output).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2.kernels.bias_add import ops as bias_ops
from linear_gpt2.kernels.bias_gelu import ops as gelu_ops
from linear_gpt2.kernels.cross_entropy import fused as ce_fused
from linear_gpt2.kernels.cross_entropy import naive as ce_naive
from linear_gpt2.kernels.layernorm import ops as ln_ops
from linear_gpt2.model import api
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.loss import cross_entropy, head_cross_entropy
from tests.helpers import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("full_precision_matmuls")]

F32_TOL, BF16_TOL = 1e-5, 1e-2
N, C, H = 1037, 768, 12  # rows not a multiple of any tile; 124M's width and heads
DTYPES = [jnp.float32, jnp.bfloat16]


def normal(rng, shape, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)


def tol(dtype) -> float:
    return F32_TOL if dtype == jnp.float32 else BF16_TOL


def _vjp(f, args, ct):
    out, vjp = jax.vjp(f, *args)
    return out, vjp(ct)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_layernorm_with_the_residual_equals_the_oracle_and_float64(dtype):
    rng = np.random.default_rng(1)
    x = normal(rng, (N, C), 3.0, dtype) + 0.5
    h = normal(rng, (N, C), 1.0, dtype)
    scale, bias = 1.0 + normal(rng, (C,), 0.1), normal(rng, (C,), 0.1)
    ct = (normal(rng, (N, C), 1.0, dtype), normal(rng, (N, C), 1.0, dtype))

    @jax.jit(static_argnames="kernel")
    def run(x, h, scale, bias, ct, kernel):
        f = lambda *a: ln_ops.add_layer_norm(*a, kernel=kernel, out_dtype=dtype)  # noqa: E731
        return _vjp(f, (x, h, scale, bias), ct)

    (out_k, g_k), (out_x, g_x) = (run(x, h, scale, bias, ct, kernel=k) for k in ("pallas", "xla"))
    for a, b in zip(jax.tree.leaves((out_k, g_k)), jax.tree.leaves((out_x, g_x))):
        assert a.shape == b.shape and a.dtype == b.dtype and rel_err(a, b) < tol(dtype)
    s = np.asarray(x, np.float64) + np.asarray(h, np.float64)
    mean = s.mean(-1, keepdims=True)
    y = (s - mean) / np.sqrt(((s - mean) ** 2).mean(-1, keepdims=True) + 1e-5)
    y = y * np.asarray(scale, np.float64) + np.asarray(bias, np.float64)
    assert rel_err(out_k[1], y) < tol(dtype) and rel_err(out_k[0], s) < tol(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=["f32", "bf16"])
def test_gpu_gelu_matmul_equals_the_oracle_and_float64(dtype):
    from scipy.special import erf

    rng = np.random.default_rng(2)
    z, b = normal(rng, (N, 4 * C), 2.0, dtype), normal(rng, (4 * C,))
    w, dy = normal(rng, (4 * C, C), 0.02), normal(rng, (N, C), 1.0, dtype)

    @jax.jit(static_argnames="kernel")
    def run(z, b, w, dy, kernel):
        return _vjp(lambda *a: gelu_ops.gelu_matmul(*a, kernel=kernel), (z, b, w), dy)

    (y_k, g_k), (y_x, g_x) = (run(z, b, w, dy, kernel=k) for k in ("pallas", "xla"))
    for a, r in zip((y_k, *g_k), (y_x, *g_x)):
        assert a.shape == r.shape and rel_err(a, r) < tol(dtype)
    u = np.asarray(z, np.float64) + np.asarray(b, np.float64)
    y64 = (0.5 * u * (1.0 + erf(u / np.sqrt(2.0)))) @ np.asarray(w, np.float64)
    assert rel_err(y_k, y64) < tol(dtype)


def test_gpu_bias_adds_equal_autodiff_of_the_dense_bias():
    D = C // H
    rng = np.random.default_rng(3)
    B, T = 1, N
    z, b = normal(rng, (B, T, 3 * C)), normal(rng, (3 * C,))
    x, zc, bc = normal(rng, (B, T, C)), normal(rng, (B, T, C)), normal(rng, (C,))
    cts = (tuple(normal(rng, (B, T, H, D)) for _ in range(3)), normal(rng, (B, T, C)))

    def plain(z, b, x, zc, bc):
        qkv = tuple(t.reshape(B, T, H, D) for t in jnp.split(z + b, 3, axis=-1))
        return qkv, x + (zc + bc)

    def fused(z, b, x, zc, bc):
        return (bias_ops.split_qkv(z, b, H, kernel="pallas"),
                bias_ops.add_residual(x, zc, bc, kernel="pallas"))  # fmt: skip

    want = jax.jit(lambda *a: _vjp(plain, a, cts))(z, b, x, zc, bc)
    got = jax.jit(lambda *a: _vjp(fused, a, cts))(z, b, x, zc, bc)
    for a, r in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert a.shape == r.shape and rel_err(a, r) < F32_TOL


def test_gpu_cross_entropy_over_the_gpt2_vocabulary_equals_the_oracle_and_float64():
    M, V = 515, 50304
    rng = np.random.default_rng(4)
    logits = normal(rng, (M, V), 4.0)
    t = np.asarray(rng.integers(0, V, M), np.int32)
    t[::7] = -1
    targets, count = jnp.asarray(t), jnp.float32((t != -1).sum())
    nll, dl = jax.jit(ce_fused.cross_entropy)(logits, targets, count)
    want = jax.jit(ce_naive.nll_and_grad)(logits, targets, count)
    assert rel_err(nll, want[0]) < F32_TOL and rel_err(dl, want[1]) < F32_TOL
    x = np.asarray(logits, np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    nll64 = np.where(t != -1, lse - x[np.arange(M), np.maximum(t, 0)], 0.0)
    assert rel_err(nll, nll64) < F32_TOL and not np.asarray(dl)[t == -1].any()


def test_gpu_head_loss_with_the_kernel_equals_the_plain_loss():
    rng = np.random.default_rng(5)
    B, T, V, chunk = 2, 517, 50304, 256
    x, w = normal(rng, (B, T, C)), normal(rng, (V, C), 0.02)
    targets = jnp.asarray(rng.integers(0, V, (B, T)), jnp.int32).at[0, :9].set(-1)

    def plain(x, w):
        return cross_entropy(jnp.einsum("btc,vc->btv", x, w), targets)

    def fused(x, w):
        return head_cross_entropy(x, w, targets, chunk=chunk, kernel="pallas")

    want, gw = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(x, w)
    got, g = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x, w)
    assert rel_err(got, want) < F32_TOL
    for a, r in zip(g, gw):
        assert rel_err(a, r) < F32_TOL


def test_gpu_model_with_every_glue_kernel_equals_the_xla_model():
    """Two blocks at 124M's width in float32: the loss and every gradient with the four glue
    kernels at ``pallas`` against the XLA program (``xla``), on the GPU."""
    glue = dict(layernorm_kernel="xla", mlp_kernel="xla", loss_kernel="xla", bias_kernel="xla")
    cfg = ModelConfig(n_layer=2, n_head=H, n_embd=C, vocab_size=50304, block_size=256,
                      loss_chunk=0, remat="none", **glue)  # fmt: skip
    fused = cfg.replace(**{k: "pallas" for k in glue})
    params = api.init_params(cfg, 0)
    tokens = jnp.asarray(np.random.default_rng(6).integers(0, 50304, (2, 257)), jnp.int32)
    out = {}
    for name, c in (("xla", cfg), ("pallas", fused)):
        loss = lambda p, c=c: api.loss_fn(p, tokens[:, :-1], tokens[:, 1:], c)  # noqa: E731
        out[name] = jax.jit(jax.value_and_grad(loss))(params)
    (l0, g0), (l1, g1) = out["xla"], out["pallas"]
    assert rel_err(l1, l0) < F32_TOL
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert rel_err(a, b) < F32_TOL
