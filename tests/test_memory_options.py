"""The memory options (model.loss_chunk, model.remat) change memory, never the function: the fused
head + loss and every rematerialisation policy give nanoGPT's loss and gradients; ``auto`` picks
the cheapest setting that fits, and on a device without a known limit (CPU) compiles exactly the
program it compiled before the options existed."""

from __future__ import annotations

import re
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AbstractMesh, AxisType

from linear_gpt2.model import init_params, loss_fn
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.loss import cross_entropy, head_cross_entropy, head_logits
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.platform.memory import MemoryReport
from linear_gpt2.platform.mesh import DATA, SEQ
from linear_gpt2.training import memory_plan
from linear_gpt2.training.config import load_config
from tests.helpers import rel_err, slow

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")


def _plain_head_loss(x, w, t, dtype):
    """The model's plain head (gpt.py without loss_chunk): the logits materialised."""
    return cross_entropy(head_logits(x, w, dtype), t)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape, chunk", [((3, 37), 8), ((1, 64), 64), ((2, 50), 1000)])
def test_fused_loss_equals_plain_loss_and_gradients(dtype, shape, chunk):
    rng = np.random.default_rng(0)
    V, C = 101, 24
    x = jnp.asarray(rng.standard_normal((*shape, C)).astype(np.float32))
    w = jnp.asarray(0.3 * rng.standard_normal((V, C)).astype(np.float32))
    t = jnp.asarray(rng.integers(-1, V, shape))  # -1: ignored, as nanoGPT's ignore_index
    fused = lambda x, w: head_cross_entropy(x, w, t, chunk=chunk, dtype=dtype)
    plain = lambda x, w: _plain_head_loss(x, w, t, dtype)
    (l1, g1), (l0, g0) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (fused, plain))
    tol = 1e-6 if dtype == "float32" else 1e-5  # bf16: same ops, summation order only
    assert abs(float(l1) - float(l0)) <= tol * abs(float(l0))
    assert rel_err(g1[0], g0[0]) <= tol and rel_err(g1[1], g0[1]) <= tol


def _float64_head_grads(x, w, t, rounded: bool):
    """numpy float64: d(mean nll)/dx ``[..., C]`` and /dw ``[V, C]`` of the tied head; with
    ``rounded`` nanoGPT's bfloat16 autocast roundings: the logits' gradient, dx and dw."""
    x, w, t = np.asarray(x, np.float64), np.asarray(w, np.float64), np.asarray(t)
    z = x @ w.T
    p = np.exp(z - z.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    valid = t != -1
    onehot = np.arange(w.shape[0]) == np.where(valid, t, 0)[..., None]
    dz = np.where(valid[..., None], p - onehot, 0.0) / max(valid.sum(), 1)
    r = (lambda a: np.asarray(a, jnp.bfloat16).astype(np.float64)) if rounded else np.asarray
    dz = r(dz)
    return r(dz @ w), r(dz.reshape(-1, w.shape[0]).T @ x.reshape(-1, w.shape[1]))


@pytest.mark.parametrize("kernel", ["xla", "pallas"])
def test_bfloat16_head_gradients_equal_the_plain_heads_and_float64(kernel):
    """At bfloat16 the chunked head (each cross-entropy kernel) and the plain head both round
    the gradient of the logits to bfloat16 before the backward's matmuls, as torch autocast
    does: their gradients agree up to summation order (dw's float32 sums in another order,
    a few elements one bfloat16 rounding apart), and both equal float64 with the same roundings
    up to such flips (the float32 gradient, unrounded, was 1.8e-3 .. 2.1e-3 from it), and
    float64 without them within bfloat16's tolerance (dx, dw rounded once: 2^-8)."""
    rng = np.random.default_rng(2)
    V, C = 301, 48
    bf = lambda a: jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32)
    x = bf(rng.standard_normal((2, 45, C)))
    w = bf(0.3 * rng.standard_normal((V, C)))
    t = jnp.asarray(rng.integers(-1, V, (2, 45)))
    fused = lambda x, w: head_cross_entropy(x, w, t, chunk=16, dtype="bfloat16", kernel=kernel)
    plain = lambda x, w: _plain_head_loss(x, w, t, "bfloat16")
    (l1, g1), (l0, g0) = (jax.jit(jax.value_and_grad(f, (0, 1)))(x, w) for f in (fused, plain))
    assert rel_err(l1, l0) <= 1e-6
    assert rel_err(g1[0], g0[0]) <= 2e-4 and rel_err(g1[1], g0[1]) <= 2e-4
    autocast, exact = (_float64_head_grads(x, w, t, rounded) for rounded in (True, False))
    for got in (g1, g0):
        assert got[0].dtype == got[1].dtype == jnp.float32
        assert rel_err(got[0], autocast[0]) <= 5e-4 and rel_err(got[1], autocast[1]) <= 5e-4
        assert rel_err(got[0], exact[0]) <= 1e-2 and rel_err(got[1], exact[1]) <= 1e-2


def _head_backward_dots(text: str, V: int) -> list[tuple[str, str]]:
    """The operands' element types of the head's backward matmuls in a lowered program: each
    dot_general with an operand that has a ``V`` axis and a result that is not the logits
    ``[..., V]`` (dx = dlogits @ W, dW = dlogits^T @ x)."""
    found = []
    for line in text.splitlines():
        m = re.search(
            r"stablehlo\.dot_general .*: \(tensor<(.+?)>, tensor<(.+?)>\) -> tensor<(.+?)>", line
        )
        if not m:
            continue
        (*a, ta), (*b, tb), (*out, _) = (s.split("x") for s in m.groups())
        if str(V) in a + b and out[-1] != str(V):
            found.append((ta, tb))
    return found


HEAD_CFG = ModelConfig(n_layer=1, n_head=2, n_embd=32, vocab_size=97, block_size=64,
                       dtype="bfloat16", remat="none", loss_kernel="xla")  # fmt: skip


@pytest.mark.parametrize("head", ["plain", "chunked", "chunked pallas", "over devices"])
def test_head_backward_matmuls_take_bfloat16_operands(head):
    """At dtype bfloat16 the gradient of the logits meets the head's backward matmuls in
    bfloat16, as under torch autocast, in every head that trains: the plain head, the chunked
    loss with either cross-entropy kernel, and the chunked loss split over a data x seq mesh
    (lowered under an abstract mesh). The float32 gradient made them float32 GEMMs (TF32 on an
    H100, half bfloat16's rate): LT_chunked's two largest ops in the 124M step at 64k tokens."""
    V = HEAD_CFG.vocab_size
    if head == "plain" or head == "chunked":
        cfg = HEAD_CFG.replace(loss_chunk=0 if head == "plain" else 8)
        params = jax.eval_shape(lambda: init_params(cfg, 0))
        tokens = jnp.zeros((2, 32), jnp.int32)
        grad = jax.grad(lambda p: loss_fn(p, tokens, tokens, cfg))
        text = jax.jit(grad).lower(params).as_text()
    else:
        x = jax.ShapeDtypeStruct((2, 32, HEAD_CFG.n_embd), jnp.float32)
        w = jax.ShapeDtypeStruct((V, HEAD_CFG.n_embd), jnp.float32)
        t = jnp.zeros((2, 32), jnp.int32)
        kernel = "pallas" if head == "chunked pallas" else "xla"
        loss = lambda x, w: head_cross_entropy(x, w, t, chunk=8, dtype="bfloat16", kernel=kernel)
        mesh = AbstractMesh((1, 2), (DATA, SEQ), axis_types=(AxisType.Auto,) * 2)
        with jax.sharding.use_abstract_mesh(mesh) if head == "over devices" else nullcontext():
            text = jax.jit(jax.grad(loss, (0, 1))).lower(x, w).as_text()
        assert ("sdy.manual_computation" in text) == (head == "over devices")
    assert _head_backward_dots(text, V) == [("bf16", "bf16")] * 2


def test_fused_loss_with_every_target_ignored_is_zero_with_zero_gradients():
    x, w = jnp.ones((1, 8, 4)), jnp.ones((5, 4))
    t = -jnp.ones((1, 8), jnp.int32)
    loss, (gx, gw) = jax.value_and_grad(lambda x, w: head_cross_entropy(x, w, t, chunk=3), (0, 1))(
        x, w
    )
    assert float(loss) == 0.0 and not np.any(np.asarray(gx)) and not np.any(np.asarray(gw))


CFG = ModelConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=97, block_size=64)


# Each policy and the fused loss at least once, each attention family once (compiles dominate).
@pytest.mark.parametrize(
    "attention, loss_chunk, remat",
    [
        slow("softmax", 16, "none"),
        slow("LT_chunked", 0, "dots"),
        ("flash", 7, "full"),
        ("LT_attention_parallel", 0, "offload"),
    ],
)
def test_model_loss_and_grads_unchanged_by_memory_options(attention, loss_chunk, remat):
    cfg = CFG.replace(attention=attention, chunk_size=16, loss_chunk=0, remat="none")
    params = init_params(cfg, 0)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.integers(0, 97, (2, 32)))
    y = jnp.asarray(rng.integers(-1, 97, (2, 32)))
    vg = jax.jit(jax.value_and_grad(loss_fn), static_argnums=3)
    l0, g0 = vg(params, x, y, cfg)
    l1, g1 = vg(params, x, y, cfg.replace(loss_chunk=loss_chunk, remat=remat))
    assert abs(float(l1) - float(l0)) <= 1e-6 * float(l0)
    worst = max(jax.tree.leaves(jax.tree.map(rel_err, g1, g0)))
    assert worst <= 1e-6, worst


def test_config_accepts_policies_and_booleans_and_rejects_the_rest():
    assert load_config(None, ["model.remat=true"]).model.remat == "full"
    assert load_config(None, ["model.remat=false"]).model.remat == "none"
    assert load_config(None, ["model.remat=offload"]).model.remat == "offload"
    assert load_config(None, ["model.loss_chunk=2048"]).model.loss_chunk == 2048
    with pytest.raises(ConfigError, match=r"model.remat.*'ful'.*did you mean 'full'"):
        load_config(None, ["model.remat=ful"])
    with pytest.raises(ConfigError, match="model.loss_chunk"):
        load_config(None, ["model.loss_chunk=-4"])


# --------------------------------------------------------------------------------------------
# auto


def _mem(total: int) -> MemoryReport:
    return MemoryReport(arguments=0, outputs=0, temporaries=total, aliased=0)


def test_plan_takes_the_cheapest_candidate_that_fits():
    cost = {(0, "none"): 100, (4096, "none"): 80, (4096, "dots"): 40, (4096, "full"): 20}
    seen = []

    def compile_candidate(c):
        seen.append((c.loss_chunk, c.remat))
        return _mem(cost.get((c.loss_chunk, c.remat), 10)), f"exe-{c.remat}"

    p = memory_plan.plan(CFG, compile_candidate, budget=50)
    assert (p.config.loss_chunk, p.config.remat) == (4096, "dots") and p.fits
    assert p.executable == "exe-dots" and seen == [(0, "none"), (4096, "none"), (4096, "dots")]
    # Explicit values are kept: only the auto field varies.
    p = memory_plan.plan(CFG.replace(remat="full"), compile_candidate, budget=50)
    assert (p.config.loss_chunk, p.config.remat) == (0, "full")
    # Nothing fits: the most frugal candidate, reported as not fitting, every memory listed.
    p = memory_plan.plan(CFG, compile_candidate, budget=5)
    assert not p.fits and p.config.remat == "offload" and len(p.tried) == 5


def test_plan_without_a_memory_limit_compiles_nothing_and_keeps_todays_program():
    def never(c):
        raise AssertionError("compiled")

    p = memory_plan.plan(CFG, never, budget=None)
    assert (p.config.loss_chunk, p.config.remat) == (0, "none") and p.executable is None
    assert memory_plan.device_budget() is None  # the CPU reports no limit


def test_default_cpu_step_is_the_program_compiled_before_the_options():
    """auto resolves to (loss_chunk 0, remat none) on CPU: the lowered step is identical to the
    explicit plain one, i.e. the default run's compiled step is unchanged."""
    from linear_gpt2.training.config import TrainConfig
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.sharding import make_mesh
    from linear_gpt2.training.train_step import jit_train_step

    tx, mesh = optimizer(TrainConfig()), make_mesh(jax.devices()[:1])
    assert (CFG.loss_chunk, CFG.remat) == ("auto", "auto")
    texts = []
    # The unresolved auto config as the model sees it, and the explicit plain settings.
    for cfg in (CFG, CFG.replace(loss_chunk=0, remat="none")):
        prog = jit_train_step(cfg, tx, mesh, accum=2, batch=1, context=32)
        texts.append(prog.step.lower(*prog.args).as_text())
    assert texts[0] == texts[1]


def test_the_gpu_allocator_share_defaults_high_and_keeps_the_users(tmp_path):
    """JAX's allocator takes 75% of a GPU unless told otherwise, which made auto rematerialise
    steps that fit on a real H100; the process settings raise the default, never a user's."""
    import os
    import subprocess
    import sys

    code = (
        "import os; from linear_gpt2.platform import process; process.configure(); "
        "print(os.environ['XLA_PYTHON_CLIENT_MEM_FRACTION'])"
    )
    env = {k: v for k, v in os.environ.items() if k != "XLA_PYTHON_CLIENT_MEM_FRACTION"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "0.95", out.stderr
    env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = "0.5"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "0.5", out.stderr
