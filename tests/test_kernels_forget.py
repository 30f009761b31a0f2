"""The chunk-parallel ``LT_chunked`` kernels with forgetting (issue 14): document resets and
decay gates inside ``pallas_chunk`` (interpret mode on CPU; tests/test_target.py compiles them
for the H100).

Against the float64 recurrence of tests/test_attention_forget.py (as a ``lax.scan``, jitted;
values and the gradients with respect to q, k, v and the log-gates), and against the XLA oracle
(``kernels.lt_chunked.naive.chunked_linear_attention`` with ``kernels.forget.Forget``) with an initial and
a final state. The cases put resets at a chunk's first and last position, several in one chunk,
at position 0, none in a row (a document longer than the row); T odd (padded), D = 8 (padded),
32, 64 and 128 (D = 128: 32-row tiles, two column blocks), c = 16 ... 128 (two row tiles per
chunk at c = 128); the gradient kernels in one, two or three (three: the plan's with
forgetting); the sequence split into 1, 2 and 4 segments (the decayed segment prefix).

``LT_attention_parallel``'s kernels with forgetting, both designs (``pallas_tiled``: resident
blocks of two tiles, the backward's blocks of the log-gate sums its query tiles; and
``pallas_blocked``, the first design), against the same recurrence: resets at a block's first
and last position, several in one block, none in a row, decay none / fixed / gate, phi softplus
and elu1, T odd, D = 24 (padded) and 128, 16-row and 32-row blocks, 64-row key tiles beside
32-row query tiles, float32 and bfloat16; and a long strong decay that a float32 cumulative
log-gate loses.

Tolerances as tests/test_kernels.py: float32 1e-5 for outputs and 1e-4 for gradients
(measured <= 1e-6); bfloat16 against the float32 oracle on the same rounded inputs 1e-2 / 2e-2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import attention
from linear_gpt2.attention import feature_maps, linear, lt_chunked
from linear_gpt2.kernels.lt_chunked import ops as chunked_kernels
from linear_gpt2.kernels.lt_chunked import plan
from tests.helpers import SLOW, rel_err, slow
from tests.test_attention_linear import _phi

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")

EPS = 1e-6


def make(shape, resets_at, decay="gate", seed=0, dtype=jnp.float32):
    """q, k, v, dy (dtype), log_gate float32 ``[B, T, H]``, resets bool ``[B, T]`` (row 0 at
    ``resets_at``, the other rows none)."""
    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    B, T, H, _ = shape
    if decay == "gate":
        log_gate = np.log(rng.uniform(0.3, 1.0, (B, T, H))).astype(np.float32)
    elif decay == "fixed":
        log_gate = np.broadcast_to(np.log([0.9, 0.97, 0.99][:H]), (B, T, H)).astype(np.float32)
    else:
        log_gate = None
    resets = np.zeros((B, T), bool)
    resets[0, list(resets_at)] = True
    if dtype != jnp.float32:  # the reference sees the rounded inputs
        q, k, v, dy = (np.asarray(jnp.asarray(x, dtype), np.float32) for x in (q, k, v, dy))
    return q, k, v, dy, log_gate, resets


def reference_scan(q, k, v, log_gate, resets, feature_map="softplus"):
    """float64 y ``[B, T, H, D]``: tests/test_attention_forget.py's recurrence, as a
    ``lax.scan`` over positions so that it jits (its Python loop is slow at T = 256)."""
    phi = _phi(feature_map, jnp)
    fq, fk = phi(q), phi(k)
    B, T, H, D = q.shape
    g = jnp.exp(log_gate) * jnp.where(resets, 0.0, 1.0)[..., None]  # [B, T, H]

    def step(carry, x):
        S, z = carry
        fq_i, fk_i, v_i, g_i = x
        S = g_i[..., None, None] * S + fk_i[..., :, None] * v_i[..., None, :]
        z = g_i[..., None] * z + fk_i
        num = jnp.einsum("bhd,bhde->bhe", fq_i, S)
        den = jnp.einsum("bhd,bhd->bh", fq_i, z)
        return (S, z), num / (den[..., None] + EPS)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (fq, fk, v, g))
    init = (jnp.zeros((B, H, D, D), q.dtype), jnp.zeros((B, H, D), q.dtype))
    return jnp.moveaxis(jax.lax.scan(step, init, xs)[1], 0, 1)


def reference_grads(q, k, v, log_gate, resets, dy, feature_map="softplus"):
    """The float64 recurrence's y and its gradients (dq, dk, dv, dlog_gate)."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, log_gate)]
        r = jnp.asarray(resets)
        f = jax.jit(lambda *a: jax.vjp(lambda *b: reference_scan(*b, r, feature_map), *a))
        y, vjp = f(*args)
        return np.asarray(y), [np.asarray(g) for g in vjp(jnp.asarray(np.asarray(dy, np.float64)))]


def value_and_grads(fn, dy, *args):
    """``fn(*args)`` and its vjp of ``dy``, forward and backward in one jitted program: op by
    op, every interpret-mode kernel and the XLA around it were dispatched and compiled alone."""

    @jax.jit
    def f(dy, *args):
        y, vjp = jax.vjp(fn, *args)
        return y, vjp(dy.astype(y.dtype))

    return f(jnp.asarray(dy), *args)


# The last column: raw q, k into the op with the feature map (phi' in the gradient kernels, the
# log-gate sums from phi(q).dphi(q) before it; the model's path), or features.
CASES = [  # shape, c, resets in row 0, decay, segments (None: the plan's), gradient kernels, raw
    slow((2, 61, 3, 8), 16, (16, 31, 35, 38, 40), "gate", None, None, True),  # T, D padded; G 4
    ((2, 61, 3, 8), 16, (16, 31, 35, 38, 40), "gate", 1, (("dq", "dk", "dv"),), True),
    slow((2, 61, 3, 8), 16, (0, 31, 32, 33), "fixed", 2, (("dq",), ("dk", "dv")), False),
    ((2, 61, 3, 8), 16, (16, 31, 35), "none", 2, None, False),  # resets only
    slow((1, 100, 1, 64), 32, (0, 31, 32, 50, 51, 52), "gate", 2, None, True),
    slow((1, 128, 1, 128), 64, (63, 64, 100), "gate", None, None, True),
    slow((1, 256, 1, 32), 128, (127, 130), "gate", 1, None, False),  # 2 row tiles
]


@pytest.mark.parametrize("shape, c, resets_at, decay, segments, grads, raw", CASES, ids=str)
def test_chunk_kernels_equal_the_float64_recurrence(
    shape, c, resets_at, decay, segments, grads, raw, monkeypatch
):
    if segments is not None:
        monkeypatch.setattr(plan, "segments", lambda *a, **k: segments)
    if grads is not None:
        monkeypatch.setattr(plan, "grad_kernels", lambda *a, **k: grads)
    q, k, v, dy, log_gate, resets = make(shape, resets_at, decay)
    r = jnp.asarray(resets)

    def fn(q, k, v, g):
        fm = feature_maps.get("softplus") if raw else None
        fq, fk = (q, k) if raw else linear.features(q, k, "softplus")
        return chunked_kernels.chunked_attention(
            fq, fk, v, c, EPS, kernel="pallas_chunk", log_gate=g, resets=r, feature_map=fm
        )

    if log_gate is None:  # resets only: no log-gate input, no gradient for it
        y, grads = value_and_grads(lambda q, k, v: fn(q, k, v, None), dy, q, k, v)
        ref, ref_grads = reference_grads(q, k, v, np.zeros(shape[:3], np.float32), resets, dy)
    else:
        y, grads = value_and_grads(fn, dy, q, k, v, log_gate)
        ref, ref_grads = reference_grads(q, k, v, log_gate, resets, dy)
    assert rel_err(y, ref) <= 1e-5, rel_err(y, ref)
    for label, g, r64 in zip(("dq", "dk", "dv", "dlog_gate"), grads, ref_grads):
        assert rel_err(g, r64) <= 1e-4, (label, rel_err(g, r64))


@SLOW
def test_registry_kernel_equals_the_float64_recurrence():
    """Through ``attention.get``: ``kernel=pallas`` with resets and gates runs the chunk-parallel
    kernels (no fallback warning) and equals the loop of tests/test_attention_forget.py."""
    import warnings

    shape = (2, 32, 1, 8)
    q, k, v, dy, log_gate, resets = make(shape, (15, 16, 20))
    fn = attention.get("LT_chunked", chunk_size=16, kernel="pallas", eps=EPS)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        y, grads = value_and_grads(
            lambda q, k, v, g: fn(q, k, v, resets=jnp.asarray(resets), log_gate=g),
            dy, q, k, v, log_gate,
        )  # fmt: skip
    ref, ref_grads = reference_grads(q, k, v, log_gate, resets, dy)
    assert rel_err(y, ref) <= 1e-5
    for label, g, r64 in zip(("dq", "dk", "dv", "dlog_gate"), grads, ref_grads):
        assert rel_err(g, r64) <= 1e-4, (label, rel_err(g, r64))


def _oracle(fq, fk, v, c, state, log_gate, resets):
    (num, den), final = lt_chunked.chunked_linear_attention(
        fq, fk, v, c, state, linear.Forget(log_gate, resets)
    )
    return linear.normalise(num, den, EPS, fq.dtype), final


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("shape, c", [((2, 64, 2, 16), 16)], ids=str)
def test_initial_and_final_state_with_forgetting_equal_the_oracle(shape, c, dtype):
    """Row 0 has a reset at position 0 (the initial state is dropped) and inside; row 1 keeps
    the initial state through decay only. Everything differentiated: the final state's
    cotangents are random, so the decayed segment prefix is checked both ways."""
    B, T, H, D = shape
    rng = np.random.default_rng(3)
    q, k, v, wy, log_gate, resets = make(shape, (0, c - 1, c + 3), dtype=dtype)
    fq, fk = linear.features(jnp.asarray(q, dtype), jnp.asarray(k, dtype), "softplus")
    v = jnp.asarray(v, dtype)
    S0 = jnp.asarray(rng.random((B, H, D, D)), jnp.float32)
    z0 = jnp.asarray(rng.random((B, H, D)) * 4.0, jnp.float32)
    wS = jnp.asarray(rng.standard_normal((B, H, D, D)) * 0.01, jnp.float32)
    wz = jnp.asarray(rng.standard_normal((B, H, D)) * 0.1, jnp.float32)
    r = jnp.asarray(resets)

    def kernel(fq, fk, v, S0, z0, g):
        return chunked_kernels.chunked_attention(
            fq, fk, v, c, EPS, initial_state=(S0, z0), return_final_state=True,
            kernel="pallas_chunk", log_gate=g, resets=r,
        )  # fmt: skip

    def oracle(fq, fk, v, S0, z0, g):
        return _oracle(fq, fk, v, c, (S0, z0), g, r)

    def grads(fn):
        def loss(*a):
            y, (S, z) = fn(*a)
            out = jnp.sum(y.astype(jnp.float32) * wy) + jnp.sum(S * wS) + jnp.sum(z * wz)
            return out, (y, S, z)

        return jax.jit(jax.grad(loss, argnums=range(6), has_aux=True))(
            fq, fk, v, S0, z0, jnp.asarray(log_gate)
        )

    (g_k, out_k), (g_o, out_o) = grads(kernel), grads(oracle)
    f32 = dtype == jnp.float32
    tol, gtol = (1e-5, 1e-4) if f32 else (1e-2, 2e-2)
    for label, a, b in zip(("y", "S", "z"), out_k, out_o):
        assert rel_err(a.astype(jnp.float32), b.astype(jnp.float32)) <= tol, label
    for label, a, b in zip(("dq", "dk", "dv", "dS0", "dz0", "dlog_gate"), g_k, g_o):
        err = rel_err(a.astype(jnp.float32), b.astype(jnp.float32))
        assert err <= gtol, (label, err)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_gradients_stay_finite_with_gamma_1e3(dtype):
    """gamma = 1e-3 everywhere (every chunk's carry underflows to 0 in float32) with random
    resets, over the longest sequence interpret mode affords in CI."""
    Tl, Hl, Dl = 2048, 1, 16
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, Tl, Hl, Dl)), dtype) for _ in range(3))
    log_gate = jnp.full((1, Tl, Hl), np.log(1e-3), jnp.float32)
    resets = jnp.asarray(rng.random((1, Tl)) < 1e-3)
    fn = attention.get("LT_chunked", chunk_size=64, kernel="pallas_chunk")
    loss = lambda q, k, v, g: fn(q, k, v, log_gate=g, resets=resets).astype(jnp.float32).sum()
    value, grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, log_gate)
    assert np.isfinite(float(value))
    for g in grads:
        g = np.asarray(g, np.float32)
        assert np.all(np.isfinite(g)) and np.any(g != 0)


def test_pallas_takes_forgetting_through_the_chunk_parallel_kernels():
    """``kernel=pallas`` with forgetting is the chunk-parallel design even where the cost model
    picks the single pass without it; the single pass asked for by name is a one-line error."""
    shape = (8, 1024, 12, 64, 64, jnp.bfloat16)
    assert chunked_kernels.choose("pallas", *shape) == chunked_kernels.FUSED
    assert chunked_kernels.choose("pallas", *shape, forget=True) == chunked_kernels.CHUNK
    q, k, v, _, log_gate, resets = make((1, 32, 1, 16), (5,))
    fq, fk = linear.features(jnp.asarray(q), jnp.asarray(k), "softplus")
    with pytest.raises(NotImplementedError, match="pallas_fused_chunk.*doc_reset"):
        chunked_kernels.chunked_attention(
            fq, fk, v, 16, EPS, kernel="pallas_fused_chunk", resets=jnp.asarray(resets)
        )
    # The registry's explicit single pass keeps its one-line error too.
    fn = attention.get("LT_chunked", chunk_size=16, kernel="pallas_fused_chunk")
    with pytest.raises(NotImplementedError, match="does not support"):
        fn(q, k, v, log_gate=jnp.asarray(log_gate))


def test_gate_projection_keeps_bfloat16_inputs_and_float32_precision():
    """The model's c_gate (``decay: gate``) reads a bfloat16 block input without a float32 copy
    of it (the memory acceptance at 1M tokens) and still gives x W + b to ~16 bits of W."""
    from linear_gpt2.model.layers import GateProjection

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((2, 8, 32)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((32, 4)) * 0.1, jnp.float32)
    b = jnp.asarray(rng.standard_normal(4), jnp.float32)
    mod = GateProjection(4, b)
    out = mod.apply({"params": {"kernel": w, "bias": b}}, x)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64) + np.asarray(b, np.float64)
    assert out.dtype == jnp.float32 and rel_err(out, exact) <= 1e-4
    jaxpr = str(jax.make_jaxpr(lambda x: mod.apply({"params": {"kernel": w, "bias": b}}, x))(x))
    assert "bf16[2,8,32]" in jaxpr and "f32[2,8,32]" not in jaxpr


@SLOW
def test_decoder_prefill_with_forgetting_through_the_kernels():
    """The decoder's prefill (``kernel=pallas``) continues a state through resets and gates with
    the chunk-parallel kernels, equal to the XLA prefill: outputs and the state it returns."""
    shape = (2, 40, 1, 16)
    q, k, v, _, log_gate, resets = make(shape, (0, 17, 31))
    args = [jnp.asarray(x) for x in (q, k, v)]
    kw = dict(log_gate=jnp.asarray(log_gate), resets=jnp.asarray(resets))
    out = {}
    for kernel in ("pallas", "xla"):
        dec = attention.decoder("LT_chunked", chunk_size=16, kernel=kernel, eps=EPS)
        prefill = jax.jit(dec.prefill)  # op by op, each kernel and op compiled alone
        state = dec.init(2, 1, 16)
        _, state = prefill(state, *(x[:, :8] for x in args))  # a state to continue from
        part = {n: a[:, 8:] for n, a in kw.items()}
        out[kernel] = prefill(state, *(x[:, 8:] for x in args), **part)
    (y, (S, z)), (y_x, (S_x, z_x)) = out["pallas"], out["xla"]
    assert rel_err(y, y_x) <= 1e-5 and rel_err(S, S_x) <= 1e-5 and rel_err(z, z_x) <= 1e-5


# --------------------------------------------------------------------------------------------
# LT_attention_parallel's flash-style kernel with forgetting


PARALLEL_CASES = [  # shape, c, resets in row 0 (None: no resets input), decay, phi, dtype
    # T = 61 padded to 64 (L and seg edge-padded), D = 24 padded to 32; resets at a block's first
    # (16) and last (31) position and three in block 2; row 1 is one document longer than it.
    ((2, 61, 2, 24), 16, (16, 31, 35, 38, 40), "gate", "softplus", "float32"),
    # fixed decay: the gate case's program (the feature map is applied before the kernels, and
    # elu1 is checked below), so it compiles nothing new
    ((2, 61, 2, 24), 16, (16, 31, 35, 38, 40), "fixed", "softplus", "float32"),
    ((2, 61, 2, 24), 16, (0, 16, 31, 47), "none", "softplus", "float32"),  # resets only
    ((1, 80, 2, 16), 32, None, "gate", "elu1", "float32"),  # gates only; 32-row blocks
    ((2, 48, 2, 16), 16, (15, 16, 20), "gate", "softplus", "bfloat16"),
    # c = 64: the tiled forward's key tiles of 64 rows in 128-row query blocks, its backward's
    # query tiles of 32 in 128-row key blocks (T padded 150 -> 256); resets at both kinds of
    # block boundary
    ((1, 150, 1, 16), 64, (0, 31, 32, 63, 64, 100, 127, 128), "gate", "softplus", "float32"),
    # D = 128: the tiled backward's 64-row key blocks beside 128-row query blocks (T 100 -> 128)
    ((1, 100, 1, 128), 64, (0, 33, 64, 65), "gate", "elu1", "float32"),
]
# The Pallas forward kernel each design launches (its name in the jaxpr).
PARALLEL_FORWARD = {
    "pallas_tiled": "lt_attention_parallel_tiled_fwd",
    "pallas_blocked": "lt_attention_parallel_forward",
}
# pallas_tiled_dq: the tiled forward beside its own backward kernels (its cases below).
FORWARD_OF = {**PARALLEL_FORWARD, "pallas_tiled_dq": "lt_attention_parallel_tiled_fwd"}


@functools.cache
def _parallel_run(kernel: str, feature_map: str, c: int, with_resets: bool):
    """jit of (dy, resets, q, k, v[, log_gate]) -> y float32 and its vjp of dy, forward and
    backward in one program (the backward, run op by op from a vjp, compiled each kernel and op
    alone); one per configuration, so that cases of one shape and dtype share its compilation."""
    fn = attention.get(
        "LT_attention_parallel", feature_map=feature_map, chunk_size=c, kernel=kernel, eps=EPS
    )

    @jax.jit
    def run(dy, resets, *args):
        def call(q, k, v, *g):
            y = fn(q, k, v, resets=resets if with_resets else None, log_gate=g[0] if g else None)
            return y.astype(jnp.float32)

        y, vjp = jax.vjp(call, *args)
        return y, vjp(dy)

    return run


@pytest.mark.parametrize("kernel", list(PARALLEL_FORWARD))
@pytest.mark.parametrize("shape, c, resets_at, decay, feature_map, dtype", PARALLEL_CASES, ids=str)
def test_parallel_kernel_equals_the_float64_recurrence(
    shape, c, resets_at, decay, feature_map, dtype, kernel
):
    """``LT_attention_parallel`` with resets and gates runs each design's Pallas kernel pair (no
    fallback warning, no XLA path) and equals the recurrence: values and gradients with respect
    to q, k, v and the log-gates."""
    _check_parallel(shape, c, resets_at, decay, feature_map, dtype, kernel)


def _check_parallel(shape, c, resets_at, decay, feature_map, dtype, kernel) -> str:
    """The check of :func:`test_parallel_kernel_equals_the_float64_recurrence`; returns the
    program's jaxpr."""
    import warnings

    dtype = jnp.dtype(dtype)
    q, k, v, dy, log_gate, resets = make(shape, resets_at or (), decay, dtype=dtype)
    run = _parallel_run(kernel, feature_map, c, resets_at is not None)
    r = None if resets_at is None else jnp.asarray(resets)
    args = [jnp.asarray(x, dtype) for x in (q, k, v)]
    if log_gate is not None:
        args.append(jnp.asarray(log_gate))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        jaxpr = str(jax.make_jaxpr(run)(jnp.asarray(dy), r, *args))
        y, grads = run(jnp.asarray(dy), r, *args)
    assert FORWARD_OF[kernel] in jaxpr, "the Pallas forward kernel"
    g64 = np.zeros(shape[:3], np.float32) if log_gate is None else log_gate
    ref, ref_grads = reference_grads(q, k, v, g64, resets, dy, feature_map)
    tol, gtol = (1e-5, 1e-4) if dtype == "float32" else (1e-2, 2e-2)
    assert rel_err(y, ref) <= tol, rel_err(y, ref)
    for label, g, r64 in zip(("dq", "dk", "dv", "dlog_gate"), grads, ref_grads):
        assert rel_err(np.asarray(g, np.float32), r64) <= gtol, (label, rel_err(g, r64))
    return jaxpr


# pallas_tiled_dq (what kernel=pallas runs with the tiled forward): PARALLEL_CASES' c = 64 case,
# its D = 128 case (the key kernel's 128-row blocks, where the atomic kernel's are 64), and its
# first case in bfloat16 at B = H = 1.
TILED_DQ_CASES = [
    PARALLEL_CASES[5],
    PARALLEL_CASES[6],
    ((1, 61, 1, 24), 16, (16, 31, 35, 38, 40), "gate", "softplus", "bfloat16"),
]


@pytest.mark.parametrize("case", TILED_DQ_CASES, ids=["c64", "d128", "bf16-odd"])
def test_parallel_tiled_dq_backward_equals_the_float64_recurrence(case):
    """``pallas_tiled_dq`` (the tiled forward, dphi(k), dv and dphi(q) in two kernels without
    atomics) with resets and gates, against the recurrence: values and gradients with respect to
    q, k, v and the log-gates. c = 64: the key kernel's query tiles of 32 and the dq kernel's
    key tiles of 64 are each kernel's own log-gate blocks, resets at both kinds of boundary; in
    bfloat16, T and D padded (61, 24) and c = 16 capping the tiles, several resets in one block.
    Both backward kernels run (their names in the jaxpr)."""
    shape, c, resets_at, decay, feature_map, dtype = case
    jaxpr = _check_parallel(shape, c, resets_at, decay, feature_map, dtype, "pallas_tiled_dq")
    assert "lt_attention_parallel_tiled_dkv" in jaxpr and "lt_attention_parallel_tiled_dq" in jaxpr
    assert "atomic" not in jaxpr


@pytest.mark.parametrize("kernel", ["xla", "pallas_tiled", "pallas_tiled_dq", "pallas_blocked"])
def test_parallel_forms_keep_precision_after_a_long_strong_decay(kernel):
    """A row whose first 96 positions decay by log gamma = -1e4 each (|L| reaches ~1e6, as
    gamma = 0.3 does over a million tokens), then gamma = e^-0.05: a float32 L cumulated over the
    whole row loses L_i - L_j (measured before the block-local form: output error 4.6e-3,
    gradients 2e-2); with block-local log-gates every form stays at float32 rounding."""
    B, T, H, D, c = 1, 256, 1, 16, 16
    q, k, v, dy, _, resets = make((B, T, H, D), ())
    log_gate = np.full((B, T, H), -0.05, np.float32)
    log_gate[:, :96] = -1e4
    fn = attention.get(
        "LT_attention_parallel", feature_map="softplus", chunk_size=c, kernel=kernel, eps=EPS
    )
    call = lambda q, k, v, g: fn(q, k, v, log_gate=g).astype(jnp.float32)  # noqa: E731
    y, grads = value_and_grads(call, dy, *map(jnp.asarray, (q, k, v, log_gate)))
    ref, ref_grads = reference_grads(q, k, v, log_gate, resets, dy)
    assert rel_err(y, ref) <= 1e-5, rel_err(y, ref)
    for label, g, r64 in zip(("dq", "dk", "dv", "dlog_gate"), grads, ref_grads):
        assert rel_err(np.asarray(g, np.float32), r64) <= 1e-4, (label, rel_err(g, r64))


# --------------------------------------------------------------------------------------------
# GPU only: the real Triton lowering of the kernels with resets and gates (never run on a GPU
# before make gpu-check), against the float64 recurrence


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("D, decay", [(64, "gate"), (128, "gate"), (64, "none")], ids=str)
def test_gpu_chunk_kernels_with_forgetting_equal_the_float64_recurrence(D, decay, dtype):
    shape, c = (2, 256, 3, D), 64
    q, k, v, dy, log_gate, resets = make(shape, (0, 63, 64, 130, 255), decay, seed=5, dtype=dtype)
    r = jnp.asarray(resets)
    cast = [jnp.asarray(x, dtype) for x in (q, k, v, dy)]

    def fn(q, k, v, g):
        fq, fk = linear.features(q, k, "softplus")
        return chunked_kernels.chunked_attention(
            fq, fk, v, c, EPS, kernel="pallas_chunk", log_gate=g, resets=r
        )

    if log_gate is None:
        y, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, None), *cast[:3])
        ref, ref_grads = reference_grads(q, k, v, np.zeros(shape[:3], np.float32), resets, dy)
    else:
        y, vjp = jax.vjp(fn, *cast[:3], jnp.asarray(log_gate))
        ref, ref_grads = reference_grads(q, k, v, log_gate, resets, dy)
    tol = (1e-5, 1e-4) if dtype == jnp.float32 else (1e-2, 2e-2)
    assert rel_err(y.astype(jnp.float32), ref) <= tol[0], rel_err(y.astype(jnp.float32), ref)
    for label, g, r64 in zip(("dq", "dk", "dv", "dlog_gate"), vjp(cast[3]), ref_grads):
        err = rel_err(jnp.asarray(g, jnp.float32), r64)
        assert err <= tol[1], (label, err)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_parallel_tiled_dq_with_forgetting_equals_the_float64_recurrence(D, dtype):
    """The Triton lowering of ``pallas_tiled_dq`` (what kernel=pallas runs with the tiled
    forward) with resets and gates: T padded 250 -> 256, resets at both kinds of block
    boundary, against the float64 recurrence."""
    case = ((2, 250, 3, D), 64, (0, 31, 32, 63, 64, 130, 249), "gate", "softplus", dtype)
    jaxpr = _check_parallel(*case, "pallas_tiled_dq")
    assert "lt_attention_parallel_tiled_dkv" in jaxpr and "lt_attention_parallel_tiled_dq" in jaxpr
