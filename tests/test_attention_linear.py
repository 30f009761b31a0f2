"""The linear-attention family against a float64 reference of the normalised formula

    y_i = sum_{j<=i} (phi(q_i) . phi(k_j)) v_j / (sum_{j<=i} phi(q_i) . phi(k_j) + eps)

(values and gradients, float32 and bfloat16), the recurrent decoder's contract, the chunk-size
errors, and the measured memory of ``LT_state_parallel``."""

from __future__ import annotations

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from linear_gpt2 import attention
from linear_gpt2.attention import linear
from linear_gpt2.attention.options import declared
from linear_gpt2.kernels.lt_attention_parallel import naive as parallel_naive
from linear_gpt2.kernels.lt_chunked import naive as chunked_naive
from linear_gpt2.platform.memory import attention_temp_bytes
from tests.helpers import rel_err

LINEAR = [n for n in attention.names() if attention.spec(n).family == "linear"]
FEATURE_MAPS = ("softplus", "elu1", "relu", "exp")
EPS = 1e-6

# Odd sizes on purpose: T = 37 is prime (no chunk size but 1 and T divides it), D is not a power
# of two.
B, T, H, D = 2, 37, 3, 24

F32_TOL = 1e-5
GRAD_TOL = 1e-4
# bfloat16 inputs, compared with the float64 reference on the same rounded inputs: the error is
# phi(q), phi(k) and the in-block scores rounded to bfloat16 (2^-9 relative) before the matmuls,
# and the output rounding; measured <= 3e-3 for every variant and feature map (docs/attention.md).
BF16_TOL = 1e-2


pytestmark = pytest.mark.usefixtures("full_precision_matmuls")


# --------------------------------------------------------------------------------------------
# float64 reference, written from the formula (NumPy, or jax.numpy under enable_x64 for grads)


def _phi(name, xp):
    return {
        "softplus": lambda x: xp.logaddexp(0.0, x),  # log(1 + e^x)
        "elu1": lambda x: xp.where(x > 0, x + 1.0, xp.exp(xp.minimum(x, 0.0))),
        "relu": lambda x: xp.maximum(x, 0.0),
        "exp": lambda x: xp.exp(x),
    }[name]


def reference(q, k, v, feature_map="softplus", eps=EPS, xp=np):
    """Normalised causal linear attention. q, k, v ``[B, T, H, D]`` float64 -> ``[B, T, H, D]``."""
    phi = _phi(feature_map, xp)
    fq, fk = phi(q), phi(k)
    n = q.shape[1]
    scores = xp.einsum("bihd,bjhd->bhij", fq, fk) * xp.tril(xp.ones((n, n)))  # j <= i
    num = xp.einsum("bhij,bjhd->bihd", scores, v)
    den = xp.einsum("bhij->bih", scores)
    return num / (den[..., None] + eps)


@functools.cache
def _reference_vjp_fn(feature_map: str, eps: float):
    # Jitted once per map and eps (one program per shape): op by op, each einsum and its
    # transposes were dispatched and compiled alone, ~4x the CPU time.
    def vjp_of(q, k, v, dy):
        _, vjp = jax.vjp(lambda q, k, v: reference(q, k, v, feature_map, eps, xp=jnp), q, k, v)
        return vjp(dy)

    return jax.jit(vjp_of)


def reference_vjp(q, k, v, dy, feature_map="softplus", eps=EPS):
    """Gradients of ``sum(reference(q, k, v) * dy)`` w.r.t. q, k, v, in float64 (autodiff of the
    formula with x64 enabled only inside this function)."""
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, dy)]
        grads = _reference_vjp_fn(feature_map, eps)(*args)
        assert all(g.dtype == jnp.float64 for g in grads)
        return [np.asarray(g) for g in grads]


def inputs(shape, seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for _ in range(4)]  # q, k, v, dy


def run(name, q, k, v, dy, **options):
    """Output and (dq, dk, dv) of attention ``name`` under cotangent dy, compiled."""
    fn = attention.get(name, eps=EPS, **options)

    @jax.jit
    def f(q, k, v, dy):
        y, vjp = jax.vjp(fn, q, k, v)
        return y, vjp(dy)

    return f(*(jnp.asarray(x) for x in (q, k, v, dy)))


def check(name, shape, seed=0, feature_map="softplus", **options):
    q, k, v, dy = inputs(shape, seed)
    y, grads = run(name, q, k, v, dy, feature_map=feature_map, **options)
    assert y.dtype == jnp.float32 and y.shape == shape
    ref = reference(*(x.astype(np.float64) for x in (q, k, v)), feature_map)
    err = rel_err(y, ref)
    assert err <= F32_TOL, f"{name} {feature_map} {options}: output rel err {err:.2e}"
    ref_grads = reference_vjp(q, k, v, dy, feature_map)
    assert not jax.config.jax_enable_x64  # x64 stayed inside reference_vjp
    for label, g, rg in zip("qkv", grads, ref_grads):
        gerr = rel_err(g, rg)
        if shape[1] == 1 and label in "qk":
            # y_0 = v_0 / (1 + eps / a) whatever q, k: their gradients are O(eps) and rounding
            # noise, so measure them on the scale of dv (= dy) instead.
            gerr = float(
                np.linalg.norm(np.asarray(g, np.float64) - rg) / np.linalg.norm(ref_grads[2])
            )
        assert gerr <= GRAD_TOL, f"{name} {feature_map} {options}: d{label} rel err {gerr:.2e}"


# --------------------------------------------------------------------------------------------
# float32: every variant, the feature maps, chunk sizes, scans


# Options that make each variant valid at T = 37: LT_chunked needs c | T; LT_attention_parallel
# pads T up to a multiple of its block size.
ODD_T_OPTIONS = {
    "LT_attention_parallel": dict(chunk_size=8),
    "LT_chunked": dict(chunk_size=T),
}


# Every variant with the default feature map, and each other map on two variants (phi is one
# shared helper, so every map need not meet every variant); each variant meets two maps.
ODD_T_CASES = [(name, "softplus") for name in LINEAR] + [
    ("LT_attention", "elu1"),
    ("LT_state_parallel", "elu1"),
    ("LT_state", "relu"),
    ("LT_attention_parallel", "relu"),
    ("LT_chunked", "exp"),
    ("LT_attention_parallel_no_flash", "exp"),
]


@pytest.mark.parametrize("name, feature_map", ODD_T_CASES)
def test_matches_reference_odd_sizes(name, feature_map):
    check(name, (B, T, H, D), feature_map=feature_map, **ODD_T_OPTIONS.get(name, {}))


@pytest.mark.parametrize("name", LINEAR)
def test_single_position(name):
    check(name, (B, 1, H, D), seed=1, chunk_size=1)


@pytest.mark.parametrize(
    "name, options",
    [
        ("LT_chunked", dict(chunk_size=1)),
        ("LT_chunked", dict(chunk_size=8)),
        ("LT_chunked", dict(chunk_size=64)),
        ("LT_attention_parallel", dict(chunk_size=1)),
        ("LT_attention_parallel", dict(chunk_size=16)),
        ("LT_attention_parallel", dict(chunk_size=64)),
        ("LT_attention_parallel", dict(chunk_size=24)),  # does not divide 64: padded
        ("LT_attention_parallel", dict(chunk_size=100)),  # longer than T: one block
        ("LT_state_parallel", dict(scan="cumsum")),
        ("LT_state_parallel", dict(scan="associative")),
    ],
    ids=lambda x: x if isinstance(x, str) else "-".join(f"{k}={v}" for k, v in x.items()),
)
def test_matches_reference_chunk_sizes_and_scans(name, options):
    check(name, (1, 64, 2, 16), seed=2, feature_map="elu1", **options)


@settings(
    max_examples=5,
    deadline=None,
    derandomize=True,
    phases=(Phase.explicit, Phase.generate),  # no shrinking: a failure reports its example as is
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    n_chunks=st.integers(1, 6),
    chunk=st.sampled_from([1, 2, 3, 5, 8]),
    d=st.sampled_from([1, 3, 8, 17]),
    h=st.integers(1, 3),
    scan=st.sampled_from(["cumsum", "associative"]),
)
def test_property_chunked_and_state_parallel(n_chunks, chunk, d, h, scan):
    shape = (1, n_chunks * chunk, h, d)
    q, k, v, _ = inputs(shape, seed=n_chunks * 100 + chunk * 10 + d)
    ref = reference(*(x.astype(np.float64) for x in (q, k, v)))
    for name, options in (
        ("LT_chunked", dict(chunk_size=chunk)),
        ("LT_state_parallel", dict(scan=scan)),
    ):
        y = jax.jit(attention.get(name, eps=EPS, **options))(q, k, v)
        assert rel_err(y, ref) <= F32_TOL, (name, shape, options)


# --------------------------------------------------------------------------------------------
# Errors


@pytest.mark.parametrize("t, c, divisor", [(64, 48, 32), (37, 64, 37), (10, 4, 2)])
def test_chunk_size_must_divide_T(t, c, divisor):
    fn = attention.get("LT_chunked", chunk_size=c)
    x = jnp.zeros((1, t, 1, 4))
    with pytest.raises(ValueError) as e:
        fn(x, x, x)
    msg = str(e.value)
    assert f"chunk_size={c}" in msg and f"T={t}" in msg and f"chunk_size={divisor}" in msg, msg


@pytest.mark.parametrize(
    "name", [n for n in LINEAR if n not in ("LT_chunked", "LT_attention_parallel")]
)
def test_unimplemented_kernel_is_a_clear_error(name):
    with pytest.raises(
        ValueError, match=r"kernel: 'pallas' is not valid; valid values: auto, xla$"
    ):
        attention.get(name, kernel="pallas")
    attention.get(name, kernel="xla")
    attention.get(name, kernel="auto")


def test_unknown_feature_map_and_scan():
    with pytest.raises(
        ValueError,
        match="feature_map: 'tanh' .*: softplus, elu1, relu, exp, taylor2, power2, rebased",
    ):
        attention.get("LT_state", feature_map="tanh")
    with pytest.raises(ValueError, match="scan: 'blelloch' .*: cumsum, associative"):
        attention.get("LT_state_parallel", scan="blelloch")


def test_options_declared():
    expected = {
        "LT_attention": {"feature_map", "feature_dim", "kernel", "eps"},
        "LT_attention_parallel_no_flash": {"feature_map", "feature_dim", "kernel", "eps"},
        "LT_attention_parallel": {"feature_map", "feature_dim", "chunk_size", "kernel", "eps"},
        "LT_state": {"feature_map", "feature_dim", "kernel", "eps"},
        "LT_state_parallel": {"feature_map", "feature_dim", "kernel", "scan", "eps"},
        "LT_chunked": {"feature_map", "feature_dim", "chunk_size", "kernel", "eps"},
    }
    layer = {"doc_reset", "decay"}  # every variant's (the model's layer reads them)
    for name, opts in expected.items():
        assert set(declared(attention.spec(name).options)) == opts | layer, name
        assert set(attention.spec(name).options().as_dict()) == opts | layer, name


def test_eps_is_added_to_the_denominator():
    # relu features that are all zero: y = 0 / (0 + eps) = 0 rather than NaN, in every variant;
    # eps = 1 with one key of score e^0 . e^0 = 1: y = v / (1 + 1).
    zero_scores = (-jnp.ones((1, 2, 1, 3)), jnp.ones((1, 2, 1, 3)), jnp.ones((1, 2, 1, 3)))
    one_score = (jnp.zeros((1, 1, 1, 1)),) * 2 + (jnp.ones((1, 1, 1, 1)),)
    for name in LINEAR:
        fn = attention.get(name, feature_map="relu", chunk_size=1)
        np.testing.assert_array_equal(np.asarray(fn(*zero_scores)), 0.0, err_msg=name)
        fn = attention.get(name, feature_map="exp", eps=1.0, chunk_size=1)
        np.testing.assert_allclose(np.asarray(fn(*one_score)), 0.5, rtol=1e-6, err_msg=name)


# --------------------------------------------------------------------------------------------
# bfloat16


BF16_OPTIONS = {"LT_attention_parallel": dict(chunk_size=8), "LT_chunked": dict(chunk_size=8)}
BF16_MAPS = dict(zip(LINEAR, ("softplus", "exp", "elu1", "exp", "softplus", "exp")))


@pytest.mark.parametrize("name", LINEAR)
def test_bfloat16_within_tolerance(name):
    shape = (B, 32, H, D)
    q, k, v, _ = inputs(shape, seed=3)
    qb, kb, vb = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    fm = BF16_MAPS[name]
    fn = attention.get(name, feature_map=fm, eps=EPS, **BF16_OPTIONS.get(name, {}))
    y = jax.jit(fn)(qb, kb, vb)
    assert y.dtype == jnp.bfloat16
    rounded = (np.asarray(x.astype(jnp.float32), np.float64) for x in (qb, kb, vb))
    err = rel_err(y.astype(jnp.float32), reference(*rounded, fm))
    assert err <= BF16_TOL, f"{name} {fm}: bf16 rel err {err:.2e}"


CORES = {
    "LT_attention": "lt_attention",
    "LT_attention_parallel_no_flash": "lt_attention_parallel_no_flash",
    "LT_state": "lt_state",
    "LT_state_parallel": "lt_state_parallel",
}


def test_bfloat16_sums_are_float32():
    # Each core returns the numerator and denominator before normalisation: both float32.
    x = jax.ShapeDtypeStruct((1, 8, 2, 4), jnp.bfloat16)
    for name, fn_name in CORES.items():
        module = importlib.import_module(f"linear_gpt2.attention.{fn_name}")
        num, den = jax.eval_shape(getattr(module, fn_name), x, x, x)
        assert num.dtype == den.dtype == jnp.float32, name
    chunked = chunked_naive.chunked_linear_attention
    (num, den), (S, z) = jax.eval_shape(lambda a, b, c: chunked(a, b, c, 4), x, x, x)
    assert num.dtype == den.dtype == S.dtype == z.dtype == jnp.float32
    # The blocked variant's saved residuals (y, denominators) are float32 too.
    _, res = jax.eval_shape(lambda a, b, c: parallel_naive._fwd(a, b, c, 4, EPS), x, x, x)
    assert res[3].dtype == res[4].dtype == jnp.float32


# --------------------------------------------------------------------------------------------
# Recurrent decoder


def decode(dec, q, k, v, plan, dtype=jnp.float32):
    """Run ``dec`` over the sequence in pieces: ``plan`` lists ("step", 1) / ("prefill", n)."""
    state = dec.init(q.shape[0], q.shape[2], q.shape[3], q.shape[1], dtype)
    step, prefill = jax.jit(dec.step), jax.jit(dec.prefill)
    ys, t = [], 0
    for kind, n in plan:
        if kind == "step":
            y, state = step(state, q[:, t], k[:, t], v[:, t])
            ys.append(y[:, None])
        else:
            y, state = prefill(state, q[:, t : t + n], k[:, t : t + n], v[:, t : t + n])
            ys.append(y)
        t += n
    assert t == q.shape[1]
    return jnp.concatenate(ys, axis=1), state


@pytest.mark.parametrize(
    "plan",
    [
        [("step", 1)] * 19,
        [("prefill", 19)],
        [("prefill", 7), ("prefill", 12)],
        [("prefill", 5), ("step", 1), ("step", 1), ("prefill", 11), ("step", 1)],
    ],
    ids=["steps", "one-prefill", "two-prefills", "mixed"],
)
def test_decoder_matches_full_sequence(plan):
    shape = (2, 19, 2, 8)
    q, k, v, _ = (jnp.asarray(x) for x in inputs(shape, seed=4))
    full = attention.get("LT_chunked", chunk_size=19, feature_map="elu1", eps=EPS)(q, k, v)
    dec = attention.decoder("LT_chunked", chunk_size=4, feature_map="elu1", eps=EPS)
    y, (S, z) = decode(dec, q, k, v, plan)
    assert rel_err(y, full) <= F32_TOL
    # The final state is the full sums S = sum_j phi(k_j) v_j^T, z = sum_j phi(k_j).
    fk = np.asarray(linear.FEATURE_MAPS["elu1"](k), np.float64)
    assert rel_err(S, np.einsum("bthd,bthe->bhde", fk, np.asarray(v, np.float64))) <= F32_TOL
    assert rel_err(z, fk.sum(1)) <= F32_TOL


def test_decoder_bfloat16_state_is_float32():
    shape = (1, 6, 2, 8)
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in inputs(shape, seed=5)[:3])
    dec = attention.decoder("LT_state")
    state = dec.init(1, 2, 8, 1024, jnp.bfloat16)
    assert [s.dtype for s in state] == [jnp.float32, jnp.float32]
    assert state[0].shape == (1, 2, 8, 8) and state[1].shape == (1, 2, 8)
    y, state = dec.prefill(state, q[:, :5], k[:, :5], v[:, :5])
    assert y.dtype == jnp.bfloat16 and [s.dtype for s in state] == [jnp.float32] * 2
    y1, state = dec.step(state, q[:, 5], k[:, 5], v[:, 5])
    assert y1.dtype == jnp.bfloat16 and [s.dtype for s in state] == [jnp.float32] * 2
    rounded = (np.asarray(x.astype(jnp.float32), np.float64) for x in (q, k, v))
    ref = reference(*rounded)
    assert rel_err(jnp.concatenate([y, y1[:, None]], 1).astype(jnp.float32), ref) <= BF16_TOL


def test_every_linear_variant_has_the_shared_decoder():
    for name in LINEAR:
        assert attention.spec(name).make_decoder is linear.make_decoder, name
        attention.decoder(name)  # accepts the variant's own options


# --------------------------------------------------------------------------------------------
# Memory of LT_state_parallel: T D^2 floats per head, forward and backward


@pytest.mark.parametrize("backward", [False, True], ids=["forward", "forward+backward"])
def test_state_parallel_memory_grows_like_T_D2(backward):
    b, h, d = 1, 2, 32
    fn = attention.get("LT_state_parallel")
    small = attention_temp_bytes(fn, (b, 128, h, d), backward)
    large = attention_temp_bytes(fn, (b, 256, h, d), backward)
    one_state_array = b * 128 * h * d * d * 4  # all T states, float32
    assert small >= one_state_array, (small, one_state_array)
    assert 1.8 <= large / small <= 2.2, (small, large)
    # The chunked form keeps T/c states instead: far less at the same size.
    chunked = attention_temp_bytes(
        attention.get("LT_chunked", chunk_size=32), (b, 256, h, d), backward
    )
    assert chunked * 4 < large, (chunked, large)
