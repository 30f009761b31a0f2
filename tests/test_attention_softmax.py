"""Softmax-family attention (``softmax``, ``flash``) against a float64 NumPy reference, and the
KV-cache decoder against full attention."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import attention
from linear_gpt2.attention import flash, softmax
from linear_gpt2.kernels import KernelUnavailableError
from linear_gpt2.kernels.flash import pallas as flash_pallas
from tests.helpers import rel_err

# Odd sizes on purpose: T is not a multiple of any kernel block, D not a power of two.
B, T, H, D = 2, 37, 3, 24

F32_TOL = 1e-5
GRAD_TOL = 1e-4
# bfloat16 has an 8-bit significand (relative rounding 2^-9 = 2e-3): the inputs are compared with
# the reference on the same rounded inputs, so the error is the output rounding plus the
# attention weights rounded to bfloat16 before the value product, a few 1e-3.
BF16_TOL = 1e-2


# --------------------------------------------------------------------------------------------
# float64 reference


def _mask(T_, resets=None):
    """Causal, and with ``resets`` ``[B, T]`` (a document starts there) within a document."""
    m = np.tril(np.ones((T_, T_), bool))
    if resets is None:
        return m
    doc = np.cumsum(np.asarray(resets), axis=1)
    return m & (doc[:, None, :, None] == doc[:, None, None, :])


def ref_attention(q, k, v, resets=None):
    """Causal softmax attention in float64 NumPy. q, k, v ``[B, T, H, D]`` -> ``[B, T, H, D]``."""
    q, k, v = (np.asarray(t, np.float64) for t in (q, k, v))
    T_, D_ = q.shape[1], q.shape[-1]
    s = np.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(D_)
    s = np.where(_mask(T_, resets), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("bhqk,bkhd->bqhd", p, v)


def ref_attention_vjp(q, k, v, dy, resets=None):
    """Gradients of ``sum(ref_attention(q, k, v) * dy)`` w.r.t. q, k, v, analytically in float64.

    With S = q k^T / sqrt(D) (masked), P = softmax(S), y = P v:
    dv = P^T dy, dP = dy v^T, dS = P * (dP - rowsum(dP * P)), dq = dS k / sqrt(D),
    dk = dS^T q / sqrt(D).
    """
    q, k, v, dy = (np.asarray(t, np.float64) for t in (q, k, v, dy))
    T_, D_ = q.shape[1], q.shape[-1]
    c = 1.0 / math.sqrt(D_)
    s = np.einsum("bqhd,bkhd->bhqk", q, k) * c
    s = np.where(_mask(T_, resets), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    dv = np.einsum("bhqk,bqhd->bkhd", p, dy)
    dp = np.einsum("bqhd,bkhd->bhqk", dy, v)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True))
    dq = np.einsum("bhqk,bkhd->bqhd", ds, k) * c
    dk = np.einsum("bhqk,bqhd->bkhd", ds, q) * c
    return dq, dk, dv


def test_reference_gradient_matches_finite_differences():
    """The analytic reference VJP is itself right (central differences in float64)."""
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((1, 5, 2, 4)) for _ in range(4))
    grads = ref_attention_vjp(q, k, v, dy)
    eps = 1e-6
    for i in range(3):
        for idx in [(0, 0, 0, 0), (0, 3, 1, 2), (0, 4, 0, 3)]:
            xp, xm = [a.copy() for a in (q, k, v)], [a.copy() for a in (q, k, v)]
            xp[i][idx] += eps
            xm[i][idx] -= eps
            fd = ((ref_attention(*xp) - ref_attention(*xm)) * dy).sum() / (2 * eps)
            assert abs(fd - grads[i][idx]) < 1e-7, (i, idx)


# --------------------------------------------------------------------------------------------
# helpers


def _qkv(seed=0, shape=(B, T, H, D), dtype=jnp.float32):
    ks = jax.random.split(jax.random.key(seed), 4)
    q, k, v, dy = (jax.random.normal(kk, shape, jnp.float32) for kk in ks)
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), dy


def _grads(fn, q, k, v, dy):
    """d/d(q, k, v) of sum(fn(q, k, v) * dy), through jit."""
    loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * dy)
    return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)


# (name, options): every CPU-runnable softmax-family implementation.
CPU_IMPLS = [
    ("softmax", {}),
    ("flash", {"kernel": "xla"}),
    ("flash", {"kernel": "auto"}),
    ("flash", {"kernel": "pallas"}),
]
IDS = ["softmax", "flash-xla", "flash-auto", "flash-pallas"]


# --------------------------------------------------------------------------------------------
# forward and backward against the reference


@pytest.mark.parametrize(("name", "opts"), CPU_IMPLS, ids=IDS)
def test_forward_and_grads_float32(name, opts):
    fn = attention.get(name, **opts)
    q, k, v, dy = _qkv()
    y = jax.jit(fn)(q, k, v)
    assert y.shape == (B, T, H, D) and y.dtype == jnp.float32
    assert rel_err(y, ref_attention(q, k, v)) <= F32_TOL

    grads = _grads(fn, q, k, v, dy)
    for g, g_ref, label in zip(grads, ref_attention_vjp(q, k, v, dy), "qkv"):
        assert g.dtype == jnp.float32
        assert rel_err(g, g_ref) <= GRAD_TOL, f"d{label}"


@pytest.mark.parametrize(("name", "opts"), CPU_IMPLS, ids=IDS)
def test_forward_and_grads_bfloat16(name, opts):
    fn = attention.get(name, **opts)
    q, k, v, dy = _qkv(seed=1, dtype=jnp.bfloat16)
    y = jax.jit(fn)(q, k, v)
    assert y.dtype == jnp.bfloat16
    # Reference on the same (bfloat16-rounded) inputs, in float64. Measured ~2e-3 (output) and
    # ~3e-3 (gradients) for every implementation.
    assert rel_err(y, ref_attention(q, k, v)) <= BF16_TOL
    grads = _grads(fn, q, k, v, dy)
    for g, g_ref, label in zip(grads, ref_attention_vjp(q, k, v, dy), "qkv"):
        assert g.dtype == jnp.bfloat16
        assert rel_err(g, g_ref) <= BF16_TOL, f"d{label}"


@pytest.mark.parametrize("shape", [(1, 130, 1, 16), (1, 16, 2, 8)], ids=["T130", "T16"])
def test_pallas_pads_to_block_multiple(shape):
    """T = 130 is past the default 128 block and not a multiple of it (padded to 256); T = 16 is
    the minimum block, no padding. Forward and backward stay exact."""
    assert flash_pallas.block_sizes(130) == (128, 32)
    assert flash_pallas.block_sizes(37) == (64, 32)
    assert flash_pallas.block_sizes(5) == (16, 16)
    fn = attention.get("flash", kernel="pallas")
    q, k, v, dy = _qkv(seed=2, shape=shape)
    assert rel_err(jax.jit(fn)(q, k, v), ref_attention(q, k, v)) <= F32_TOL
    grads = _grads(fn, q, k, v, dy)
    for g, g_ref in zip(grads, ref_attention_vjp(q, k, v, dy)):
        assert rel_err(g, g_ref) <= GRAD_TOL


def test_cudnn_on_cpu_raises_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("checks the CPU error")
    fn = attention.get("flash", kernel="cudnn")
    q, k, v, _ = _qkv(shape=(1, 8, 1, 8))
    with pytest.raises(KernelUnavailableError, match=r"needs a CUDA GPU.*kernel=xla"):
        fn(q, k, v)
    with pytest.raises(KernelUnavailableError, match="pallas"):
        jax.jit(fn)(q, k, v)


def test_flash_registry_contract():
    spec = attention.spec("flash")
    assert spec.options is flash.FlashOptions and spec.kernels == ("auto", "xla", "pallas", "cudnn")
    assert attention.spec("flash").dropout is False
    assert attention.spec("softmax").dropout is True
    # Options only the linear variants read are checked and ignored (a sweep carries them).
    fn = attention.get("flash", kernel="xla", chunk_size=64, feature_map="relu", eps=1e-6)
    q, k, v, _ = _qkv(shape=(1, 8, 2, 8))
    assert rel_err(fn(q, k, v), ref_attention(q, k, v)) <= F32_TOL
    with pytest.raises(ValueError, match=r"kernel: 'triton' is not valid.*: auto, xla, pallas"):
        attention.get("flash", kernel="triton")
    with pytest.raises(ValueError, match="'nope' is not valid"):
        attention.decoder("flash", kernel="nope")


# --------------------------------------------------------------------------------------------
# dropout (softmax only)


def test_dropout():
    q, k, v, _ = _qkv(seed=3, shape=(1, 16, 2, 8))
    y0 = softmax.softmax_attention(q, k, v)
    key = jax.random.key(7)
    assert jnp.array_equal(
        softmax.softmax_attention(q, k, v, dropout_rate=0.0, dropout_rng=key), y0
    )
    y1 = softmax.softmax_attention(q, k, v, dropout_rate=0.2, dropout_rng=key)
    assert not jnp.allclose(y1, y0)
    # The kept weights are rescaled by 1/(1 - rate), so E[y] = y0; 4000 draws leave a relative
    # error of about sqrt(rate / (1 - rate) / 4000) ~ 1e-2 (a few times less: weights spread).
    n = 4000
    ys = jax.jit(
        jax.vmap(lambda r: softmax.softmax_attention(q, k, v, dropout_rate=0.2, dropout_rng=r))
    )(jax.random.split(key, n))
    assert rel_err(ys.mean(0), y0) < 0.02


# --------------------------------------------------------------------------------------------
# KV-cache decoder

MAX_LEN = 48  # > T: the unused end of the cache must be masked


@pytest.mark.parametrize("name", ["softmax", "flash"])
def test_decoder_steps_equal_full(name):
    dec = attention.decoder(name)
    q, k, v, _ = _qkv(seed=4)
    full = ref_attention(q, k, v)

    def body(state, qkv_t):
        y, state = dec.step(state, *qkv_t)
        return state, y

    state = dec.init(B, H, D, MAX_LEN, jnp.float32)
    xs = tuple(jnp.moveaxis(t, 1, 0) for t in (q, k, v))  # scan over time
    state, ys = jax.jit(lambda s, xs: jax.lax.scan(body, s, xs))(state, xs)
    assert int(state[2]) == T
    assert state[0].shape == (B, MAX_LEN, H, D)
    assert rel_err(jnp.moveaxis(ys, 0, 1), full) <= F32_TOL


def test_decoder_prefill_split_equals_whole_and_full():
    dec = softmax.make_decoder()
    q, k, v, _ = _qkv(seed=5)
    full = ref_attention(q, k, v)
    prefill = jax.jit(dec.prefill)

    y_one, s_one = prefill(dec.init(B, H, D, MAX_LEN), q, k, v)
    assert rel_err(y_one, full) <= F32_TOL

    cut = 15
    s = dec.init(B, H, D, MAX_LEN)
    y_a, s = prefill(s, q[:, :cut], k[:, :cut], v[:, :cut])
    y_b, s = prefill(s, q[:, cut:], k[:, cut:], v[:, cut:])
    y_two = jnp.concatenate([y_a, y_b], axis=1)
    assert rel_err(y_two, y_one) <= F32_TOL
    for a, b in zip(s, s_one):
        assert jnp.array_equal(a, b)


def test_decoder_step_after_prefill():
    dec = softmax.make_decoder()
    q, k, v, _ = _qkv(seed=6)
    full = ref_attention(q, k, v)
    cut = 30
    y, s = jax.jit(dec.prefill)(dec.init(B, H, D, MAX_LEN), q[:, :cut], k[:, :cut], v[:, :cut])
    step = jax.jit(dec.step)
    ys = [y]
    for t in range(cut, T):
        y_t, s = step(s, q[:, t], k[:, t], v[:, t])
        assert y_t.shape == (B, H, D)
        ys.append(y_t[:, None])
    assert rel_err(jnp.concatenate(ys, axis=1), full) <= F32_TOL


def test_decoder_bfloat16_cache():
    dec = softmax.make_decoder()
    q, k, v, _ = _qkv(seed=8, shape=(1, 12, 2, 16), dtype=jnp.bfloat16)
    s = dec.init(1, 2, 16, 16, jnp.bfloat16)
    y, s = jax.jit(dec.prefill)(s, q, k, v)
    assert y.dtype == jnp.bfloat16 and s[0].dtype == jnp.bfloat16 and s[2].dtype == jnp.int32
    assert rel_err(y, ref_attention(q, k, v)) <= BF16_TOL


def test_decoder_overflow():
    """Writing past max_len: an error where the position is known (eager, or a block longer than
    the cache), and NaN (never a silently clamped write) inside ``jit``."""
    dec = softmax.make_decoder()
    q, k, v, _ = _qkv(seed=9, shape=(1, 3, 1, 8))
    s = dec.init(1, 1, 8, 4)
    _, s = dec.prefill(s, q, k, v)  # pos = 3
    with pytest.raises(ValueError, match=r"overflow: 3 cached tokens \+ 3 new > max_len=4"):
        dec.prefill(s, q, k, v)
    with pytest.raises(ValueError, match="max_len=2"):
        jax.jit(dec.prefill)(dec.init(1, 1, 8, 2), q, k, v)

    y, s_over = jax.jit(dec.prefill)(s, q, k, v)
    assert bool(jnp.isnan(y).all()) and int(s_over[2]) == 6
    y_next, _ = jax.jit(dec.step)(s_over, q[:, 0], k[:, 0], v[:, 0])
    assert bool(jnp.isnan(y_next).all())
    y_fits, _ = jax.jit(dec.step)(s, q[:, 0], k[:, 0], v[:, 0])  # 3 + 1 fits
    assert bool(jnp.isfinite(y_fits).all())


# --------------------------------------------------------------------------------------------
# GPU only (skipped on CPU by conftest)


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["cudnn", "auto", "pallas", "xla"])
def test_gpu_bfloat16_forward_and_grads(kernel):
    fn = attention.get("flash", kernel=kernel)
    q, k, v, dy = _qkv(seed=10, shape=(B, T, H, 64), dtype=jnp.bfloat16)
    y = jax.jit(fn)(q, k, v)
    assert y.dtype == jnp.bfloat16
    assert rel_err(y, ref_attention(q, k, v)) <= BF16_TOL
    grads = _grads(fn, q, k, v, dy)
    for g, g_ref in zip(grads, ref_attention_vjp(q, k, v, dy)):
        assert g.dtype == jnp.bfloat16
        assert rel_err(g, g_ref) <= BF16_TOL


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", ["pallas", "xla"])
def test_gpu_float32_exact(kernel):
    """Real Triton lowering of the Pallas kernel (not interpret), with IEEE float32 dots: TF32,
    the GPU default, would give ~1e-3."""
    fn = attention.get("flash", kernel=kernel)
    q, k, v, dy = _qkv(seed=11)
    with jax.default_matmul_precision("highest"):
        y = jax.jit(fn)(q, k, v)
        grads = _grads(fn, q, k, v, dy)
    assert rel_err(y, ref_attention(q, k, v)) <= F32_TOL
    for g, g_ref in zip(grads, ref_attention_vjp(q, k, v, dy)):
        assert rel_err(g, g_ref) <= GRAD_TOL


@pytest.mark.gpu
def test_gpu_cudnn_float32_rejected_and_auto_falls_back():
    q, k, v, _ = _qkv(seed=12, shape=(1, 16, 2, 64))
    with pytest.raises(KernelUnavailableError, match="bfloat16 or float16"):
        attention.get("flash", kernel="cudnn")(q, k, v)
    with pytest.warns(UserWarning, match="uses xla"):
        with jax.default_matmul_precision("highest"):
            y = jax.jit(attention.get("flash", kernel="auto"))(q, k, v)
    assert rel_err(y, ref_attention(q, k, v)) <= F32_TOL


@pytest.mark.gpu
def test_gpu_cudnn_odd_length_and_documents_match_xla():
    """cuDNN's training kernels need an even length: an odd one is padded (exact by causality),
    with and without document resets (cuDNN's packed sequences against xla's mask), each also
    against the float64 reference with the documents' mask (values and gradients)."""
    q, k, v, dy = _qkv(seed=13, shape=(2, 37, 3, 64), dtype=jnp.bfloat16)
    resets = jnp.zeros((2, 37), bool).at[0, 5].set(True).at[0, 36].set(True).at[1, 20].set(True)
    for r in (None, resets):
        fns = [
            functools.partial(attention.get("flash", kernel=name), resets=r)
            for name in ("cudnn", "xla")
        ]
        ys = [jax.jit(f)(q, k, v) for f in fns]
        r64 = None if r is None else np.asarray(r)
        assert rel_err(ys[0], ys[1]) <= BF16_TOL, r is None
        assert rel_err(ys[0], ref_attention(q, k, v, r64)) <= BF16_TOL, r is None
        g_cudnn, g_xla = (_grads(f, q, k, v, dy) for f in fns)
        for a, b, ref in zip(g_cudnn, g_xla, ref_attention_vjp(q, k, v, dy, r64)):
            assert rel_err(a, b) <= BF16_TOL and rel_err(a, ref) <= BF16_TOL, r is None
