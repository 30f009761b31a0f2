"""Linear attention that forgets: document resets and decay gates (attention.doc_reset,
attention.decay) in every formulation, the decoders and the model.

The reference is written plainly in float64: a loop over positions that multiplies the state by
gamma_i (0 where a document starts) before adding phi(k_i) v_i^T. Gradients of the reference come
from autodiff of that loop under x64. Every formulation must equal it, values and gradients
(with respect to q, k, v and the log-gates)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from linear_gpt2 import attention
from linear_gpt2.model import forward, init_params, interop, loss_fn, param_shapes
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.gpt import document_starts
from linear_gpt2.model.layers import retnet_gammas
from linear_gpt2.model.tokenizer import EOT
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import load_config
from linear_gpt2.training.data.packing import document_ids, split_window
from tests.helpers import SLOW, rel_err, slow
from tests.test_attention_linear import LINEAR, _phi

pytestmark = pytest.mark.usefixtures("full_precision_matmuls")

EPS = 1e-6
B, T, H, D = 2, 48, 3, 8
CHUNK = 16  # resets below sit at a chunk's first (16) and last (31) position, and 3 in chunk 2
RESET_AT = (16, 31, 35, 38, 40)  # row 0; row 1 has none: a document longer than the row


def reference(q, k, v, log_gate, resets, feature_map, eps=EPS, xp=np):
    """float64 [B, T, H, D]: the recurrence with decay and resets, position by position (a
    Python loop for numpy; for jax the same step under ``lax.scan``, which compiles once)."""
    phi = _phi(feature_map, xp)
    fq, fk = phi(q), phi(k)
    Bq, Tq, Hq, Dq = q.shape

    def step(carry, x):
        S, z = carry
        fq_i, fk_i, v_i, lg_i, r_i = x
        g = xp.exp(lg_i) * xp.where(r_i, 0.0, 1.0)[:, None]  # [B, H]
        S = g[..., None, None] * S + fk_i[..., :, None] * v_i[..., None, :]
        z = g[..., None] * z + fk_i
        num = xp.einsum("bhd,bhde->bhe", fq_i, S)
        den = xp.einsum("bhd,bhd->bh", fq_i, z)
        return (S, z), num / (den[..., None] + eps)

    init = (xp.zeros((Bq, Hq, Dq, Dq)), xp.zeros((Bq, Hq, Dq)))
    if xp is np:
        carry, ys = init, []
        for i in range(Tq):
            carry, y = step(carry, (fq[:, i], fk[:, i], v[:, i], log_gate[:, i], resets[:, i]))
            ys.append(y)
        return np.stack(ys, axis=1)
    xs = tuple(jnp.swapaxes(a, 0, 1) for a in (fq, fk, v, log_gate, resets))
    _, ys = jax.lax.scan(step, init, xs)
    return jnp.swapaxes(ys, 0, 1)


@functools.cache
def _reference_vjp_fn(feature_map: str):
    # Jitted once per feature map (the resets and gates are data): run op by op, the position
    # loop's vjp took ~2 s per case.
    def vjp_of(q, k, v, g, r, dy):
        _, vjp = jax.vjp(lambda q, k, v, g: reference(q, k, v, g, r, feature_map, xp=jnp),
                         q, k, v, g)  # fmt: skip
        return vjp(dy)

    return jax.jit(vjp_of)


def reference_vjp(q, k, v, log_gate, resets, dy, feature_map):
    with jax.enable_x64(True):
        args = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, log_gate, dy)]
        grads = _reference_vjp_fn(feature_map)(*args[:4], jnp.asarray(resets), args[4])
        assert all(g.dtype == jnp.float64 for g in grads)
        return [np.asarray(g) for g in grads]


def make_inputs(decay: str, doc_reset: bool, seed: int = 0, shape=(B, T, H, D)):
    rng = np.random.default_rng(seed)
    q, k, v, dy = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
    b, t, h, _ = shape
    if decay == "none":
        log_gate = np.zeros((b, t, h), np.float32)
    elif decay == "fixed":  # RetNet's per-head constants
        log_gate = np.broadcast_to(np.log(retnet_gammas(h)), (b, t, h)).astype(np.float32)
    else:  # data-dependent: any gamma in (0.3, 1)
        log_gate = np.log(rng.uniform(0.3, 1.0, (b, t, h))).astype(np.float32)
    resets = np.zeros((b, t), bool)
    if doc_reset:
        resets[0, list(RESET_AT)] = True
    return q, k, v, dy, log_gate, resets


CASES = [(r, d) for r in (False, True) for d in ("none", "fixed", "gate")]


@functools.cache
def expected(feature_map: str, doc_reset: bool, decay: str):
    """The float64 reference's output and gradients (dq, dk, dv, dgate) for one case."""
    q, k, v, dy, log_gate, resets = make_inputs(decay, doc_reset)
    y = reference(*(x.astype(np.float64) for x in (q, k, v, log_gate)), resets, feature_map)
    return y, reference_vjp(q, k, v, log_gate, resets, dy, feature_map)


def _check(case, y, grads, feature_map, doc_reset, decay, with_gate=True):
    ref, ref_grads = expected(feature_map, doc_reset, decay)
    assert rel_err(y, ref) <= 1e-5, f"{case}: y {rel_err(y, ref)}"
    labels = ("dq", "dk", "dv", "dgate") if with_gate else ("dq", "dk", "dv")
    for label, g, r in zip(labels, grads, ref_grads):
        assert rel_err(g, r) <= 1e-4, f"{case} {label}: {rel_err(g, r)}"


@pytest.mark.parametrize("feature_map", ["softplus", "elu1"])
@pytest.mark.parametrize("name", LINEAR)
def test_every_formulation_equals_the_float64_recurrence(name, feature_map):
    """doc_reset on/off x decay none/fixed/gate: one compiled function takes the resets and the
    log-gates as data (all-False resets and zero log-gates are the 'off' cases); a second call
    takes ``resets=None`` (decay without resets) and a third neither (the plain path)."""
    fn = attention.get(name, feature_map=feature_map, chunk_size=CHUNK, kernel="xla", eps=EPS)

    @jax.jit
    def with_both(q, k, v, g, r, dy):
        y, vjp = jax.vjp(lambda q, k, v, g: fn(q, k, v, resets=r, log_gate=g), q, k, v, g)
        return y, vjp(dy)

    for doc_reset, decay in CASES:
        q, k, v, dy, log_gate, resets = make_inputs(decay, doc_reset)
        y, grads = with_both(q, k, v, log_gate, resets, dy)
        _check(
            f"{name} {feature_map} {doc_reset=} {decay=}", y, grads, feature_map, doc_reset, decay
        )

    # Jitted like the first: op-by-op dispatch of the position loops took most of this test.
    @jax.jit
    def gate_only(q, k, v, g, dy):
        y, vjp = jax.vjp(lambda q, k, v, g: fn(q, k, v, log_gate=g), q, k, v, g)
        return y, vjp(dy)

    @jax.jit
    def plain(q, k, v, dy):
        y, vjp = jax.vjp(fn, q, k, v)
        return y, vjp(dy)

    q, k, v, dy, log_gate, _ = make_inputs("gate", False)
    y, grads = gate_only(q, k, v, log_gate, dy)
    _check(f"{name} {feature_map} gate only", y, grads, feature_map, False, "gate")
    y, grads = plain(q, k, v, dy)
    _check(f"{name} {feature_map} plain", y, grads, feature_map, False, "none", False)


# --------------------------------------------------------------------------------------------
# A row of two documents: the second one's outputs are those it gives alone


ALL = ["softmax", "flash", *LINEAR]


@pytest.mark.parametrize(
    "name", [slow(n) if n in ("LT_chunked", "LT_state_parallel") else n for n in ALL]
)
def test_second_document_of_a_row_is_computed_as_if_alone(name):
    """With resets, positions of the second document neither see the first nor its state: its
    outputs equal those of the document alone (and so do its decays, the same gates)."""
    first, second = 20, 28
    q, k, v, _, log_gate, _ = make_inputs("gate", False, seed=3, shape=(1, first + second, H, D))
    resets = np.zeros((1, first + second), bool)
    resets[0, first] = True
    kw = {"resets": jnp.asarray(resets)}
    decays = name in LINEAR
    if decays:
        kw["log_gate"] = jnp.asarray(log_gate)
    # Jitted: op by op, the position loops and scans dispatched (and compiled) each op alone.
    fn = jax.jit(attention.get(name, chunk_size=4, kernel="xla"))
    together = np.asarray(fn(q, k, v, **kw))[:, first:]
    alone_kw = {"log_gate": jnp.asarray(log_gate[:, first:])} if decays else {}
    alone = np.asarray(fn(q[:, first:], k[:, first:], v[:, first:], **alone_kw))
    assert rel_err(together, alone) <= 1e-6, rel_err(together, alone)


def test_flash_pallas_kernel_takes_the_documents_as_segment_ids():
    q, k, v, _, _, _ = make_inputs("none", False, seed=4, shape=(1, 40, 2, 16))
    resets = np.zeros((1, 40), bool)
    resets[0, [9, 25]] = True
    y = attention.get("flash", kernel="pallas")(q, k, v, resets=jnp.asarray(resets))
    ref = attention.get("softmax")(q, k, v, resets=jnp.asarray(resets))
    assert rel_err(y, ref) <= 1e-5


def test_cudnn_packed_segments_describe_the_documents():
    from linear_gpt2.kernels.flash.cudnn import packed_segments

    resets = np.zeros((2, 10), bool)
    resets[0, [3, 7]] = True
    offsets, lengths = packed_segments(jnp.asarray(resets))
    assert offsets.shape == (2, 11) and lengths.shape == (2, 10)
    np.testing.assert_array_equal(offsets[0, :4], [0, 3, 7, -1])
    np.testing.assert_array_equal(lengths[0, :4], [3, 4, 3, -1])
    np.testing.assert_array_equal(offsets[1, :2], [0, -1])
    np.testing.assert_array_equal(lengths[1, :2], [10, -1])


# --------------------------------------------------------------------------------------------
# Decoders: token by token and split prefills equal the whole sequence


@pytest.mark.parametrize("name", ["softmax", slow("LT_chunked")])
def test_decoder_steps_and_prefills_equal_the_full_pass(name):
    q, k, v, _, log_gate, resets = make_inputs("gate" if name != "softmax" else "none", True)
    kw = {"resets": jnp.asarray(resets)}
    if name != "softmax":
        kw["log_gate"] = jnp.asarray(log_gate)
    full = np.asarray(jax.jit(attention.get(name, chunk_size=CHUNK, kernel="xla"))(q, k, v, **kw))
    dec = attention.decoder(name, chunk_size=CHUNK)
    # Jitted (one program per prefill length, one for every step): op by op each step and
    # prefill dispatched, and compiled, its ops one at a time.
    step, prefill = jax.jit(dec.step), jax.jit(dec.prefill)
    state = dec.init(B, H, D, T, jnp.float32)
    ys = []
    for i in range(T):
        one = {("reset" if n == "resets" else n): a[:, i] for n, a in kw.items()}
        y, state = step(state, q[:, i], k[:, i], v[:, i], **one)
        ys.append(y)
    assert rel_err(np.stack(ys, 1), full) <= 1e-5
    # Prefills split right before a document start (16) and inside one (37).
    state = dec.init(B, H, D, T, jnp.float32)
    parts = []
    for a, b in ((0, 16), (16, 37), (37, T)):
        y, state = prefill(
            state, q[:, a:b], k[:, a:b], v[:, a:b], **{n: x[:, a:b] for n, x in kw.items()}
        )
        parts.append(y)
    assert rel_err(np.concatenate(parts, 1), full) <= 1e-5


# --------------------------------------------------------------------------------------------
# Strong decay over a long sequence


@SLOW
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("name", ["LT_chunked", "LT_state_parallel"])
def test_gradients_stay_finite_with_gamma_1e3_over_64k_positions(name, dtype):
    # The state-parallel form keeps every [D, D] prefix state: a narrow head keeps it cheap (the
    # underflow is in the log-gates' sums, not in D).
    Tl, Hl, Dl = 65536, 1, 16 if name == "LT_chunked" else 4
    rng = np.random.default_rng(5)
    q, k, v = (jnp.asarray(rng.standard_normal((1, Tl, Hl, Dl)), dtype) for _ in range(3))
    log_gate = jnp.full((1, Tl, Hl), np.log(1e-3), jnp.float32)
    resets = jnp.asarray(rng.random((1, Tl)) < 1e-3)
    fn = attention.get(name, chunk_size=64, kernel="xla")
    loss = lambda q, k, v, g: fn(q, k, v, log_gate=g, resets=resets).astype(jnp.float32).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(q, k, v, log_gate)
    for g in grads:
        assert np.all(np.isfinite(np.asarray(g, np.float32)))


# --------------------------------------------------------------------------------------------
# Model, config, interop, data


SMALL = dict(n_layer=2, n_head=2, n_embd=32, vocab_size=EOT + 1, block_size=64)


@SLOW
def test_gate_parameters_exist_only_with_decay_gate():
    # The parameter tree from param_shapes (traced, not compiled: a compilation each cost
    # seconds); the gate's values from one real initialisation.
    for decay, expect in (("none", False), ("fixed", False), ("gate", True)):
        p = param_shapes(ModelConfig(**SMALL, attention="LT_chunked", decay=decay))
        assert ("c_gate" in p["h"]["attn"]) == expect, decay
    p = init_params(ModelConfig(**SMALL, attention="LT_chunked", decay="gate"), 0)
    assert "c_gate" in p["h"]["attn"]
    assert p["h"]["attn"]["c_gate"]["kernel"].shape == (2, 32, 2)  # [layers, C, H]
    gamma = jax.nn.sigmoid(p["h"]["attn"]["c_gate"]["bias"][0])
    np.testing.assert_allclose(gamma, retnet_gammas(2), rtol=1e-6)  # starts as RetNet's decays


def test_decay_needs_a_linear_attention():
    with pytest.raises(ConfigError, match=r"attention.decay.*'softmax' takes no decay gates"):
        load_config(None, ["attention.name=softmax", "attention.decay=gate"])


def test_interop_refuses_what_gpt2_cannot_represent():
    cfg = ModelConfig(**SMALL, attention="LT_chunked", decay="gate")
    params = init_params(cfg, 0)
    with pytest.raises(interop.UnrepresentableError, match="decay='gate'.*export a model"):
        interop.to_nanogpt(params, cfg)
    plain = ModelConfig(**SMALL, attention="LT_chunked")
    sd = interop.to_hf(init_params(plain, 0), plain)
    with pytest.raises(interop.UnrepresentableError, match="no c_gate weights"):
        interop.from_hf(sd, cfg)
    interop.from_hf(sd, plain.replace(decay="fixed"))  # no parameters: imports


@SLOW
def test_model_uses_loader_documents_and_defaults_to_eot():
    rng = np.random.default_rng(7)
    tokens = rng.integers(0, 1000, (2, 40))
    tokens[0, [9, 30]] = EOT
    seg = document_ids(tokens)
    np.testing.assert_array_equal(seg[0, [9, 10, 30, 31]], [0, 1, 1, 2])
    np.testing.assert_array_equal(
        document_starts(jnp.asarray(tokens)), document_starts(jnp.asarray(tokens), seg)
    )
    cfg = ModelConfig(**SMALL, attention="LT_chunked", chunk_size=8, doc_reset=True, decay="gate")
    params = init_params(cfg, 0)
    a = forward(params, tokens, cfg)
    b = forward(params, tokens, cfg, segment_ids=jnp.asarray(seg))
    assert rel_err(a, b) == 0.0
    # Without doc_reset the documents see each other: a different function.
    c = forward(params, tokens, cfg.replace(doc_reset=False))
    assert rel_err(c, a) > 1e-3
    assert np.isfinite(float(loss_fn(params, tokens, tokens, cfg, segment_ids=seg)))


def test_split_window_yields_document_ids_on_request():
    w = np.arange(12, dtype=np.uint16).reshape(2, 6)
    w[0, 2] = EOT
    assert "segments" not in split_window(w)
    batch = split_window(w, segments=True)
    np.testing.assert_array_equal(batch["segments"][0], [0, 0, 0, 1, 1])
    np.testing.assert_array_equal(batch["segments"][1], [0, 0, 0, 0, 0])


def test_reference_loop_and_scan_agree():
    """The float64 reference's numpy loop (outputs) and its lax.scan form (gradients) are one
    function."""
    q, k, v, _, log_gate, resets = make_inputs("gate", True)
    a = reference(*(x.astype(np.float64) for x in (q, k, v, log_gate)), resets, "softplus")
    with jax.enable_x64(True):
        b = reference(*(jnp.asarray(x, jnp.float64) for x in (q, k, v, log_gate)),
                      jnp.asarray(resets), "softplus", xp=jnp)  # fmt: skip
        assert b.dtype == jnp.float64
    np.testing.assert_allclose(np.asarray(b), a, rtol=1e-12, atol=1e-12)
