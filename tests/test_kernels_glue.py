"""Issue 37's kernels of the step's glue against their oracles, and in the model.

- ``kernels/layernorm``: LayerNorm fused with the residual add (forward and backward kernels);
- ``kernels/bias_gelu``: the MLP's bias, exact GELU and projection (forward and backward);
- ``kernels/cross_entropy``: a chunk's cross-entropy and its gradient over the logits;
- ``kernels/bias_add``: c_attn's bias with the split into heads, the MLP's c_proj bias with the
  residual add (their gradients summed in the pass that writes the cotangent).

On CPU the Pallas kernels run in interpret mode (the kernel bodies as JAX ops): values and
gradients against the plain-JAX oracle beside them and a float64 reference, on odd shapes (rows
and columns that are not multiples of the tiles). Tolerances: float32 1e-5 relative (measured
1e-7 .. 4e-7); bfloat16 inputs and outputs against the float32 oracle on the same rounded
inputs: 1e-2 (one bfloat16 rounding of the output, 2^-8). Then the model: the three kernels
(``model.layernorm_kernel`` / ``mlp_kernel`` / ``loss_kernel`` = pallas) give the XLA model's
parameters, loss and gradients; ``auto`` is XLA on CPU and the kernels for the H100 target; per
device under a mesh of 4 CPU devices; and one compile for the H100 of every kernel, register
spills an error.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import kernels
from linear_gpt2.kernels import choice
from linear_gpt2.kernels.bias_add import ops as bias_ops
from linear_gpt2.kernels.bias_gelu import fused as gelu_fused
from linear_gpt2.kernels.bias_gelu import naive as gelu_naive
from linear_gpt2.kernels.bias_gelu import ops as gelu_ops
from linear_gpt2.kernels.cross_entropy import fused as ce_fused
from linear_gpt2.kernels.cross_entropy import naive as ce_naive
from linear_gpt2.kernels.layernorm import fused as ln_fused
from linear_gpt2.kernels.layernorm import naive as ln_naive
from linear_gpt2.kernels.layernorm import ops as ln_ops
from linear_gpt2.model import api
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.loss import cross_entropy, head_cross_entropy
from linear_gpt2.platform import target
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import load_config
from tests.helpers import SLOW, rel_err

ROOT = Path(__file__).resolve().parents[1]
F32_TOL = 1e-5
BF16_TOL = 1e-2

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")


def normal(rng, shape, scale=1.0, dtype=jnp.float32):
    return jnp.asarray(scale * rng.standard_normal(shape), jnp.float32).astype(dtype)


# --------------------------------------------------------------------------------------------
# LayerNorm + residual


def ln_reference(x, h, scale, bias):
    """float64 numpy: (s, y) of nanoGPT's LayerNorm after the residual add."""
    s = np.asarray(x, np.float64) + (0.0 if h is None else np.asarray(h, np.float64))
    mean = s.mean(-1, keepdims=True)
    var = ((s - mean) ** 2).mean(-1, keepdims=True)
    y = (s - mean) / np.sqrt(var + 1e-5) * np.asarray(scale, np.float64)
    return s, y + (0.0 if bias is None else np.asarray(bias, np.float64))


@pytest.mark.parametrize(
    "N, C, with_h, with_bias, residual_out",
    [(37, 96, True, True, True), (70, 200, True, False, True), (9, 130, False, True, False)],
)  # fmt: skip
def test_layernorm_kernels_equal_the_oracle_and_float64(N, C, with_h, with_bias, residual_out):
    rng = np.random.default_rng(N + C)
    x = normal(rng, (N, C), 3.0) + 0.5
    h = normal(rng, (N, C)) if with_h else None
    scale = 1.0 + normal(rng, (C,), 0.1)
    bias = normal(rng, (C,), 0.1) if with_bias else None
    ct = (normal(rng, (N, C)), normal(rng, (N, C)))

    @jax.jit(static_argnames="kernel")
    def run(x, h, scale, bias, ct, kernel):
        def f(x, h, scale, bias):
            return ln_ops.add_layer_norm(x, h, scale, bias, kernel=kernel,
                                         residual_out=residual_out)  # fmt: skip

        out, vjp = jax.vjp(f, x, h, scale, bias)
        return out, vjp(ct if residual_out else ct[1])

    (out_k, g_k), (out_x, g_x) = (run(x, h, scale, bias, ct, kernel=k) for k in ("pallas", "xla"))
    s_ref, y_ref = ln_reference(x, h, scale, bias)
    y_k = out_k[1] if residual_out else out_k
    assert rel_err(y_k, y_ref) < F32_TOL
    if residual_out:
        assert rel_err(out_k[0], s_ref) < F32_TOL
    for a, b in zip(jax.tree.leaves(g_k), jax.tree.leaves(g_x)):
        assert a.shape == b.shape and rel_err(a, b) < F32_TOL
    assert (g_k[1] is None) == (h is None) and (g_k[3] is None) == (bias is None)


def test_layernorm_backward_kernel_equals_the_oracle_formula():
    """The backward kernel against naive.backward (the formula) and against autodiff of
    naive.forward (what the formula claims to be), with a residual cotangent."""
    rng = np.random.default_rng(3)
    N, C = 29, 72
    x, dy, ds = (normal(rng, (N, C)) for _ in range(3))
    scale, bias = 1.0 + normal(rng, (C,), 0.2), normal(rng, (C,))
    s, y, mean, rstd = ln_naive.forward(x, None, scale, bias)
    want = ln_naive.backward(s, mean, rstd, scale, dy, ds)

    @jax.jit
    def kernels(x, scale, bias, s, mean, rstd, dy, ds):
        _, _, mean_k, rstd_k = ln_fused.layernorm_fwd(x, None, scale, bias, 1e-5, jnp.float32)
        got = ln_fused.layernorm_bwd(s, mean, rstd, scale, dy, ds, jnp.float32, None)
        return mean_k, rstd_k, got

    mean_k, rstd_k, got = kernels(x, scale, bias, s, mean, rstd, dy, ds)
    assert rel_err(mean_k, mean) < F32_TOL and rel_err(rstd_k, rstd) < F32_TOL
    assert got[1] is None
    for a, b in zip((got[0], got[2], got[3]), want):
        assert rel_err(a, b) < F32_TOL
    _, vjp = jax.vjp(lambda x, sc, b: ln_naive.forward(x, None, sc, b)[:2], x, scale, bias)
    auto = vjp((ds, dy))
    for a, b in zip(want, auto):
        assert rel_err(a, b) < F32_TOL


def test_layernorm_kernels_in_bfloat16():
    """The model's dtypes: a float32 residual, a bfloat16 branch and output; and a bfloat16
    residual (model.residual_dtype): s, dx and dh in their own dtypes, within one rounding."""
    rng = np.random.default_rng(4)
    N, C = 33, 80
    for x_dtype in (jnp.float32, jnp.bfloat16):
        x = normal(rng, (N, C), 2.0, x_dtype)
        h = normal(rng, (N, C), 1.0, jnp.bfloat16)
        scale, bias = 1.0 + normal(rng, (C,), 0.1), normal(rng, (C,), 0.1)
        ct = (normal(rng, (N, C), 1.0, x_dtype), normal(rng, (N, C), 1.0, jnp.bfloat16))

        @jax.jit(static_argnames="kernel")
        def run(x, h, scale, bias, ct, kernel):
            def f(*args):
                return ln_ops.add_layer_norm(*args, kernel=kernel, out_dtype=jnp.bfloat16)

            out, vjp = jax.vjp(f, x, h, scale, bias)
            return out, vjp(ct)

        (out_k, g_k), (out_x, g_x) = (
            run(x, h, scale, bias, ct, kernel=k) for k in ("pallas", "xla")
        )
        assert out_k[0].dtype == x_dtype and out_k[1].dtype == jnp.bfloat16
        assert g_k[0].dtype == x_dtype and g_k[1].dtype == jnp.bfloat16
        for a, b in zip([*out_k, *g_k], [*out_x, *g_x]):
            assert rel_err(a, b) < BF16_TOL


# --------------------------------------------------------------------------------------------
# Bias + GELU + projection


def test_erfc_fit_is_float32_accurate():
    from scipy.special import erfc  # float64

    # erfc(5) = 1.5e-12; past it float32's exp of -x^2 alone is off by ~x^2 2^-24 relative.
    x = np.linspace(-5.0, 5.0, 20001, dtype=np.float32)
    got = np.asarray(jax.jit(gelu_fused.erfc)(jnp.asarray(x)), np.float64)
    exact = erfc(x.astype(np.float64))
    assert np.max(np.abs(got - exact) / exact) < 2e-6


def test_gelu_matmul_kernels_equal_the_oracle_and_autodiff():
    """Forward and backward of gelu(z + b) @ w: kernels, the oracle's hand-written backward, and
    autodiff of Flax's nn.gelu; the backward kernel's recomputed g equals the forward's. F = 1100:
    two column blocks of 1024, the second masked; 37 rows: the last row tile masked."""
    N, F, C = 37, 1100, 16
    rng = np.random.default_rng(F)
    z, b = normal(rng, (2, N, F), 3.0), normal(rng, (F,))
    w, dy = normal(rng, (F, C), 0.1), normal(rng, (2, N, C))

    def flax_mlp(z, b, w):
        return jax.nn.gelu(z + b, approximate=False) @ w

    @jax.jit(static_argnames="kernel")
    def run(z, b, w, dy, kernel):
        f = flax_mlp if kernel == "flax" else lambda *a: gelu_ops.gelu_matmul(*a, kernel=kernel)
        y, vjp = jax.vjp(f, z, b, w)
        return y, vjp(dy)

    y_ref, g_ref = run(z, b, w, dy, kernel="flax")
    for kernel in ("pallas", "xla"):
        y, g = run(z, b, w, dy, kernel=kernel)
        assert rel_err(y, y_ref) < F32_TOL
        for a, r in zip(g, g_ref):
            assert rel_err(a, r) < F32_TOL
    dg = normal(rng, (N, F))
    dz, g, db = jax.jit(gelu_fused.bias_gelu_bwd)(z[0], b, dg)
    want = gelu_naive.backward(z[0], b, dg)
    for a, r in zip((dz, g, db), want):
        assert rel_err(a, r) < F32_TOL
    assert rel_err(g, jax.jit(gelu_fused.bias_gelu_fwd)(z[0], b)) < F32_TOL


def test_gelu_matmul_in_bfloat16_is_one_rounding_from_float32():
    rng = np.random.default_rng(7)
    z = normal(rng, (45, 300), 2.0, jnp.bfloat16)
    b, w = normal(rng, (300,)), normal(rng, (300, 32), 0.1)
    dy = normal(rng, (45, 32), 1.0, jnp.bfloat16)

    @jax.jit
    def run(z, b, w, dy):
        y, vjp = jax.vjp(gelu_ops.gelu_matmul, z, b, w)
        y32, vjp32 = jax.vjp(gelu_naive.gelu_matmul, z.astype(jnp.float32), b, w)
        return y, vjp(dy), y32, vjp32(dy.astype(jnp.float32))

    y, g, y32, g32 = run(z, b, w, dy)
    assert y.dtype == jnp.bfloat16 and rel_err(y, y32) < BF16_TOL
    for a, r in zip(g, g32):
        assert rel_err(a, r) < BF16_TOL


# --------------------------------------------------------------------------------------------
# Bias adds


def test_bias_add_kernels_equal_autodiff_of_the_dense_bias():
    """split_qkv and add_residual against autodiff of the plain bias add (Flax's Dense: the bias
    in the compute dtype), values and gradients; C = 72 has no power-of-two block of 16 or more
    (one masked block per head gradient), 13 rows not a multiple of the row tiles."""
    H, D = 2, 36
    rng = np.random.default_rng(D)
    B, T, C = 2, 13, H * D
    z, b = normal(rng, (B, T, 3 * C)), normal(rng, (3 * C,))
    x, zc, bc = normal(rng, (B, T, C)), normal(rng, (B, T, C)), normal(rng, (C,))
    cts = tuple(normal(rng, (B, T, H, D)) for _ in range(3))
    ds = normal(rng, (B, T, C))

    def plain(z, b, x, zc, bc):
        qkv = tuple(t.reshape(B, T, H, D) for t in jnp.split(z + b, 3, axis=-1))
        return qkv, x + (zc + bc)

    def fused(z, b, x, zc, bc, kernel):
        return bias_ops.split_qkv(z, b, H, kernel=kernel), bias_ops.add_residual(
            x, zc, bc, kernel=kernel
        )

    @jax.jit
    def run(*args):
        out = {}
        for name, f in (("plain", plain), ("xla", partial(fused, kernel="xla")),
                        ("pallas", partial(fused, kernel="pallas"))):  # fmt: skip
            y, vjp = jax.vjp(f, *args)
            out[name] = (y, vjp((cts, ds)))
        return out

    out = run(z, b, x, zc, bc)
    for name in ("xla", "pallas"):
        for a, r in zip(jax.tree.leaves(out[name]), jax.tree.leaves(out["plain"])):
            assert rel_err(a, r) < F32_TOL, name


# --------------------------------------------------------------------------------------------
# Cross-entropy


def test_cross_entropy_kernel_equals_the_oracle_and_float64():
    """37 rows (the last row tile masked) over a vocabulary of 5003 (three tiles of 2048, the
    last masked), every fifth target ignored."""
    M, V = 37, 5003
    rng = np.random.default_rng(M)
    logits = normal(rng, (M, V), 4.0)
    t = np.asarray(rng.integers(0, V, M), np.int32)
    t[::5] = -1  # ignored targets
    targets, count = jnp.asarray(t), jnp.float32(max((t != -1).sum(), 1) + 3)
    nll, dl = jax.jit(ce_fused.cross_entropy)(logits, targets, count)
    want = ce_naive.nll_and_grad(logits, targets, count)
    assert rel_err(nll, want[0]) < F32_TOL and rel_err(dl, want[1]) < F32_TOL
    x = np.asarray(logits, np.float64)
    lse = np.log(np.exp(x - x.max(1, keepdims=True)).sum(1)) + x.max(1)
    nll64 = np.where(t != -1, lse - x[np.arange(M), np.maximum(t, 0)], 0.0)
    assert rel_err(nll, nll64) < F32_TOL
    assert not np.asarray(dl)[t == -1].any()  # ignored rows: no gradient


def test_head_loss_with_the_kernel_equals_the_plain_loss():
    """head_cross_entropy with kernel=pallas, by chunks of 16 (the last one padded), against
    cross_entropy of the materialised logits: loss and gradients in x and w."""
    chunk = 16
    rng = np.random.default_rng(chunk)
    B, T, C, V = 2, 27, 24, 301
    x, w = normal(rng, (B, T, C)), normal(rng, (V, C), 0.3)
    t = np.asarray(rng.integers(0, V, (B, T)), np.int32)
    t[0, :4] = -1
    targets = jnp.asarray(t)

    def plain(x, w):
        return cross_entropy(jnp.einsum("btc,vc->btv", x, w), targets)

    want, gw = jax.jit(jax.value_and_grad(plain, argnums=(0, 1)))(x, w)
    fused = lambda x, w: head_cross_entropy(x, w, targets, chunk=chunk, kernel="pallas")  # noqa: E731
    got, g = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)))(x, w)
    assert rel_err(got, want) < F32_TOL
    for a, r in zip(g, gw):
        assert rel_err(a, r) < F32_TOL


# --------------------------------------------------------------------------------------------
# In the model


FUSED = dict(
    layernorm_kernel="pallas", mlp_kernel="pallas", loss_kernel="pallas", bias_kernel="pallas"
)


@SLOW
def test_model_with_the_fused_kernels_equals_the_xla_model():
    """The same parameters (initialised the same: names, shapes, values), loss and gradients
    with every glue kernel on, in float32 (the loss kernel on the whole sequence as one chunk,
    ``loss_chunk`` unset)."""
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=48, vocab_size=97, block_size=32)
    fused = cfg.replace(**FUSED)
    params = api.init_params(cfg, 0)
    assert jax.tree.all(jax.tree.map(lambda a, b: bool((a == b).all()), params,
                                     api.init_params(fused, 0)))  # fmt: skip
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 97, (2, 33)))
    results = {}
    for name, c in (("xla", cfg), ("pallas", fused)):
        loss = lambda p, c=c: api.loss_fn(p, tokens[:, :-1], tokens[:, 1:], c)  # noqa: E731
        results[name] = jax.jit(jax.value_and_grad(loss))(params)
    (l0, g0), (l1, g1) = results["xla"], results["pallas"]
    assert rel_err(l1, l0) < F32_TOL
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        assert rel_err(a, b) < F32_TOL


def test_auto_is_xla_on_cpu_and_the_kernels_for_the_h100(caplog, monkeypatch):
    """auto follows the target being compiled for, not the process's backend (``AUTO_PICKS_PALLAS``
    on, since a GPU ran and timed the kernels; off, it is xla everywhere); on CPU the default
    step is the program of before (its lowered text equals the one with every glue kernel set
    to xla and the blocks scanned: ``model.scan_layers``' auto follows the same rule,
    tests/test_model_switches.py)."""
    assert choice.AUTO_PICKS_PALLAS
    assert choice.resolve("auto") == "xla" and choice.resolve("pallas") == "pallas"
    with monkeypatch.context() as off:
        off.setattr(choice, "AUTO_PICKS_PALLAS", False)
        with jax.sharding.use_abstract_mesh(target.mesh("h100").abstract_mesh):
            assert choice.resolve("auto", "model.x_kernel") == "xla"
    assert choice.resolve("auto") == "xla"
    choice._NOTED.discard("model.test_kernel")
    with (
        jax.sharding.use_abstract_mesh(target.mesh("h100").abstract_mesh),
        caplog.at_level(logging.INFO, logger=kernels.CHOICES),
    ):
        assert choice.resolve("auto", "model.test_kernel") == "pallas"
    # The pick is one INFO record under the kernels' choices logger (what the trainer prints).
    assert [r.getMessage() for r in caplog.records if r.name.startswith(kernels.CHOICES)] == [
        "model.test_kernel=auto: pallas (the program is for a GPU)"
    ]
    with pytest.raises(ValueError, match="model.mlp_kernel='gpu' is not one of auto, xla"):
        choice.resolve("gpu", "model.mlp_kernel")
    cfg = ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=64, block_size=16)
    xla = cfg.replace(
        layernorm_kernel="xla", mlp_kernel="xla", loss_kernel="xla", bias_kernel="xla",
        scan_layers=True,
    )  # fmt: skip
    tokens = jnp.zeros((2, 16), jnp.int32)
    params = jax.eval_shape(lambda: api.init_params(cfg, 0))

    def lowered(c):
        return (
            jax.jit(jax.grad(lambda p: api.loss_fn(p, tokens, tokens, c))).lower(params).as_text()
        )

    text = lowered(cfg)
    assert text == lowered(xla) and "pallas" not in text and "stablehlo.while" in text


KERNEL_KEYS = ("layernorm_kernel", "mlp_kernel", "loss_kernel", "bias_kernel")


def test_kernel_options_are_checked_at_load_and_a_resume_may_change_them():
    """The four options are typed model fields: a bad value is a one-line ConfigError naming
    the key and the choices (the CLI's exit 2), and a resumed run may change them (they pick an
    implementation of the same function)."""
    for key in KERNEL_KEYS:
        with pytest.raises(ConfigError) as e:
            load_config(None, [f"model.{key}=gpu"])
        text = str(e.value)
        assert f"model.{key}" in text and "auto, xla, pallas" in text and "\n" not in text
        with pytest.raises(ConfigError, match=f"model.{key}"):
            load_config(None, [f"model.{key}=3"])
    cfg = load_config(None, [f"model.{k}=pallas" for k in KERNEL_KEYS])
    assert cfg.model_config.layernorm_kernel == "pallas"
    assert all(cfg.resume_may_change(f"model.{k}") for k in KERNEL_KEYS)
    assert not cfg.resume_may_change("model.n_embd")


def test_the_step_is_traced_with_a_gpu_mesh_in_context():
    """Under data parallelism on GPUs the trainer traces the step with its mesh in context, so
    the row-wise kernels run per device (on CPUs without a seq axis it does not: the program
    of before)."""
    from jax.sharding import PartitionSpec as P

    from linear_gpt2.kernels import rows
    from linear_gpt2.training.sharding import make_mesh, traced_on

    def split():
        return rows.split(jnp.zeros((8, 4, 2)))

    assert traced_on(make_mesh(list(target.devices("h100x8"))), split)() == (
        P("data", None),
        frozenset({"data"}),
    )
    one = make_mesh(jax.devices()[:1])
    assert traced_on(one, split) is split and split() is None


@SLOW
def test_fused_kernels_per_device_under_a_mesh_equal_one_device():
    """data x seq meshes of 4 CPU devices (2 x 1, 2 x 2): the kernels run per device on
    their rows (a custom call would otherwise be gathered), and give one device's loss and
    gradients."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "workers" / "glue_kernels_mesh.py")],
        env={**__import__("os").environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu",
             "XLA_FLAGS": "--xla_force_host_platform_device_count=4"},
        check=True, timeout=1800, capture_output=True, text=True,
    ).stdout  # fmt: skip
    rows = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    assert [(r["data"], r["seq"]) for r in rows] == [(2, 1), (2, 2)]
    for r in rows:
        assert r["loss"] < 1e-6 and r["grads"] < 1e-5, r
        assert r["gathers"] <= r["gathers_xla"], r  # no all-gather of rows for the kernels


@SLOW
def test_glue_kernels_compile_for_the_h100_without_spills():
    """Every kernel, forward and backward, compiled for the H100 (register spills an error):
    LayerNorm at C = 768 (rows padded to 1024 lanes) and 1600 (2048), the MLP activation at
    F = 3072 and 6400, the cross-entropy at 2048 x 50304, the split into heads at C = 768."""
    rep = target.replicated("h100")

    def S(shape, dtype):
        return jax.ShapeDtypeStruct(shape, jnp.dtype(dtype), sharding=rep)

    def program(x, h, sc, x2, sc2, z, b, w, z2, b2, w2, logits, t, zq, bq):
        def ln(x, h, sc):
            return ln_ops.add_layer_norm(x, h, sc, sc, kernel="pallas", out_dtype="bfloat16")

        out = [jax.grad(lambda *a: sum(o.astype(jnp.float32).sum() for o in ln(*a)),
                        argnums=(0, 1, 2))(x, h, sc)]  # fmt: skip
        out.append(jax.grad(lambda x, sc: ln(x, None, sc)[1].astype(jnp.float32).sum(),
                            argnums=(0, 1))(x2, sc2))  # fmt: skip
        for zz, bb, ww in ((z, b, w), (z2, b2, w2)):
            y, vjp = jax.vjp(gelu_ops.gelu_matmul, zz, bb, ww)
            out += [y, vjp(jnp.ones_like(y))]
        out.append(ce_fused.cross_entropy(logits, t, jnp.float32(7.0)))
        q, vjp = jax.vjp(lambda z, b: bias_ops.split_qkv(z, b, 12), zq, bq)
        out += [q, vjp(q)]
        return out

    args = (S((2048, 768), "float32"), S((2048, 768), "bfloat16"), S((768,), "float32"),
            S((512, 1600), "float32"), S((1600,), "float32"), S((2048, 3072), "bfloat16"), S((3072,), "float32"),
            S((3072, 768), "float32"), S((256, 6400), "bfloat16"), S((6400,), "float32"),
            S((6400, 1600), "float32"), S((2048, 50304), "float32"), S((2048,), "int32"),
            S((2, 1024, 2304), "bfloat16"), S((2304,), "float32"))  # fmt: skip
    r = target.compile_program(jax.jit(program), args, "h100", kernels=True, fail_on_spill=True)
    names = {k.name.split("__")[0] for k in r.kernels}
    assert names == {"layernorm_fwd", "layernorm_bwd", "bias_gelu_fwd", "bias_gelu_bwd",
                     "cross_entropy", "bias_add_bwd"}, names  # fmt: skip
    limit = target.get("h100").device["shared_memory_per_block_optin"]
    assert all(0 < k.programs and k.shared_memory <= limit for k in r.kernels)
