"""Fused kernels (``linear_gpt2.kernels``) against their pure-JAX oracles.

On CPU the Pallas kernels run in interpret mode: the same kernel bodies, block specs and loops,
executed as JAX ops, so these tests check the algorithms (forward and the hand-written
backward), not the Triton lowering. Tests marked ``gpu`` compile the real kernels (and the
jax-triton one) on the lent GPU machine; conftest skips them on CPU.

Tolerances: float32 <= 1e-4 relative (measured ~1e-7 for outputs, ~5e-7 for gradients, with
``default_matmul_precision("highest")``); bfloat16 inputs against the float32 oracle on the
same rounded inputs: 1e-2 for outputs, 2e-2 for gradients (measured <= 2.4e-3 and <= 5.3e-3,
the same as the XLA oracle run in bfloat16; docs/attention.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import attention, kernels
from linear_gpt2.attention import linear, lt_attention_parallel, lt_chunked
from linear_gpt2.kernels import pallas_chunked, pallas_parallel, triton_chunked
from tests.helpers import rel_err
from tests.test_attention_linear import reference, reference_vjp

EPS = 1e-6
F32_TOL = 1e-4
BF16_TOL = 1e-2
BF16_GRAD_TOL = 2e-2


pytestmark = pytest.mark.usefixtures("full_precision_matmuls")


def inputs(shape, seed=0):
    rng = np.random.default_rng(seed)
    return [jnp.asarray(rng.standard_normal(shape).astype(np.float32)) for _ in range(4)]


def chunked_oracle(fq, fk, v, c, eps):
    (num, den), _ = lt_chunked.chunked_linear_attention(fq, fk, v, c)
    return linear.normalise(num, den, eps, v.dtype)


# kernel under test -> its oracle, both with the interface (fq, fk, v, c, eps) -> y.
KERNELS = {
    "chunked": (pallas_chunked.chunked_attention, chunked_oracle),
    "parallel": (pallas_parallel.blocked_attention, lt_attention_parallel.blocked_linear_attention),
}


def value_and_grads(fn, fq, fk, v, dy):
    @jax.jit
    def f(fq, fk, v, dy):
        y, vjp = jax.vjp(fn, fq, fk, v)
        return y, vjp(dy)

    return f(fq, fk, v, dy)


def compare(kernel, shape, c, feature_map="softplus", dtype=jnp.float32, seed=0):
    """Errors (output, dphi(q), dphi(k), dv) of a kernel against its oracle in float32 on the
    same (rounded) inputs."""
    fused, oracle = KERNELS[kernel]
    q, k, v, dy = inputs(shape, seed)
    fq, fk = linear.features(q.astype(dtype), k.astype(dtype), feature_map)
    v, dy = v.astype(dtype), dy.astype(dtype)
    y, grads = value_and_grads(lambda a, b, d: fused(a, b, d, c, EPS), fq, fk, v, dy)
    assert y.dtype == dtype and y.shape == shape
    assert all(g.dtype == dtype and g.shape == shape for g in grads)
    up = [x.astype(jnp.float32) for x in (fq, fk, v, dy)]
    y_ref, grads_ref = value_and_grads(lambda a, b, d: oracle(a, b, d, c, EPS), *up)
    errs = [rel_err(y.astype(jnp.float32), y_ref)]
    errs += [rel_err(g.astype(jnp.float32), r) for g, r in zip(grads, grads_ref)]
    return errs


# Odd-but-valid sizes: T not a power of two, D padded (24 -> 32, 40 -> 64), B and H > 1, and
# several chunk/block sizes including one chunk covering T.
F32_CASES = [
    ((2, 96, 3, 24), 32, "softplus"),
    ((1, 64, 2, 40), 16, "elu1"),
    ((1, 32, 1, 16), 32, "exp"),
]


@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("shape, c, feature_map", F32_CASES, ids=lambda x: str(x))
def test_float32_matches_oracle(kernel, shape, c, feature_map):
    errs = compare(kernel, shape, c, feature_map)
    assert max(errs) <= F32_TOL, f"{kernel} {shape} c={c}: errors (y, dq, dk, dv) {errs}"


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_bfloat16_within_tolerance(kernel):
    y_err, *grad_errs = compare(kernel, (2, 64, 2, 24), 16, "softplus", jnp.bfloat16, seed=3)
    assert y_err <= BF16_TOL, y_err
    assert max(grad_errs) <= BF16_GRAD_TOL, grad_errs


# --------------------------------------------------------------------------------------------
# Through the registry: kernel=pallas, against the float64 formula


@pytest.mark.parametrize(
    "name, t, chunk_size",
    [
        ("LT_chunked", 96, 32),
        ("LT_chunked", 64, 64),
        ("LT_attention_parallel", 37, 16),  # T padded to 48 around the kernel
        ("LT_attention_parallel", 20, 64),  # block capped at 32 >= T
    ],
)
def test_registry_pallas_matches_float64_reference(name, t, chunk_size):
    shape = (2, t, 3, 24)
    q, k, v, dy = inputs(shape, seed=5)
    fn = attention.get(name, kernel="pallas", chunk_size=chunk_size, feature_map="relu", eps=EPS)
    y, grads = value_and_grads(fn, q, k, v, dy)
    ref = reference(*(np.asarray(x, np.float64) for x in (q, k, v)), "relu")
    assert rel_err(y, ref) <= F32_TOL
    for label, g, r in zip("qkv", grads, reference_vjp(q, k, v, dy, "relu")):
        assert rel_err(g, r) <= F32_TOL, label


def test_zero_features_and_zero_eps_stay_finite():
    # relu features all zero and eps = 0: y = 0 and zero gradients, not NaN (as in xla).
    q = -jnp.ones((1, 32, 1, 16))
    for name in ("LT_chunked", "LT_attention_parallel"):
        fn = attention.get(name, kernel="pallas", chunk_size=16, feature_map="relu", eps=0.0)
        y, grads = value_and_grads(fn, q, q, jnp.ones_like(q), jnp.ones_like(q))
        assert np.all(np.asarray(y) == 0.0), name
        assert all(np.all(np.isfinite(np.asarray(g))) for g in grads), name


# --------------------------------------------------------------------------------------------
# Selection and errors


def test_kernel_options_and_errors():
    for name in ("LT_chunked", "LT_attention_parallel"):
        with pytest.raises(ValueError, match="power of two >= 16"):
            attention.get(name, kernel="pallas", chunk_size=24)
        with pytest.raises(ValueError, match="int >= 1 or 'auto'"):
            attention.get(name, chunk_size="fast")
    with pytest.raises(NotImplementedError, match="valid kernels: auto, xla, pallas$"):
        attention.get("LT_attention_parallel", kernel="triton")
    # auto is xla off a GPU, whatever the chunk size.
    assert kernels.resolve_kernel("auto", "LT_chunked", lt_chunked.KERNELS, 24) == "xla"
    assert kernels.padded_head_dim(24) == 32 and kernels.padded_head_dim(8) == 16


@pytest.mark.skipif(kernels.on_gpu(), reason="checks the CPU error")
def test_triton_unavailable_is_a_clear_error():
    with pytest.raises(kernels.KernelUnavailableError, match=r"pip install \.\[triton\]|CUDA GPU"):
        attention.get("LT_chunked", kernel="triton")
    assert triton_chunked.unavailable_reason()


# --------------------------------------------------------------------------------------------
# GPU only: the real Triton lowering (no interpret mode) and the jax-triton kernel


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(KERNELS))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_lowering_matches_oracle(kernel, dtype):
    errs = compare(kernel, (2, 256, 3, 64), 64, "softplus", dtype)
    tol = (F32_TOL, F32_TOL) if dtype == jnp.float32 else (BF16_TOL, BF16_GRAD_TOL)
    assert errs[0] <= tol[0] and max(errs[1:]) <= tol[1], errs


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gpu_triton_matches_oracle(dtype):
    pytest.importorskip("jax_triton", reason="pip install .[triton]")
    KERNELS["triton"] = (triton_chunked.chunked_attention, chunked_oracle)
    try:
        errs = compare("triton", (2, 256, 3, 40), 64, "softplus", dtype)
    finally:
        del KERNELS["triton"]
    tol = (F32_TOL, F32_TOL) if dtype == jnp.float32 else (BF16_TOL, BF16_GRAD_TOL)
    assert errs[0] <= tol[0] and max(errs[1:]) <= tol[1], errs


@pytest.mark.gpu
def test_gpu_auto_is_pallas():
    assert kernels.resolve_kernel("auto", "LT_chunked", lt_chunked.KERNELS, 64) == "pallas"
    with pytest.warns(UserWarning, match="uses xla"):
        assert kernels.resolve_kernel("auto", "LT_chunked", lt_chunked.KERNELS, 8) == "xla"
