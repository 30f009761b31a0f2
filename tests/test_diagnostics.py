"""Stability diagnostics: per-layer statistics equal to a float64 forward pass written out by
hand, loss spikes counted (an injected learning-rate jump), and the training step compiled
exactly as without the feature."""

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from linear_gpt2.model import diagnostics, init_params
from linear_gpt2.model import gpt as model_lib
from linear_gpt2.model import layer_stats as diag
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.model.gpt import document_starts
from linear_gpt2.training.config import TrainConfig
from linear_gpt2.training.optim import optimizer
from linear_gpt2.training.sharding import make_mesh
from linear_gpt2.training.spikes import SpikeCounter
from linear_gpt2.training.train_step import jit_train_step
from tests.helpers import SLOW


def _ln(x, p):
    mu = x.mean(-1, keepdims=True)
    var = ((x - mu) ** 2).mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(var + 1e-5) * p["scale"] + p["bias"]


def _dense(x, p):
    return x @ np.asarray(p["kernel"], np.float64) + np.asarray(p["bias"], np.float64)


def _gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def _softplus(x):
    return np.logaddexp(0, x)


def reference_stats(params, tokens, segments, cfg):
    """float64: the forward pass and, per layer, the statistics, by the recurrence itself."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    B, T = tokens.shape
    H, D, C = cfg.n_head, cfg.head_dim, cfg.n_embd
    resets = np.asarray(document_starts(jnp.asarray(tokens), jnp.asarray(segments)))
    x = p["wte"]["embedding"][tokens] + p["wpe"]["embedding"][:T][None]
    out = {name: [] for name in diag.LAYER_STATS}
    for layer in range(cfg.n_layer):
        h = jax.tree.map(lambda a, i=layer: a[i], p["h"])
        a = _ln(x, h["ln_1"])
        q, k, v = np.split(_dense(a, h["attn"]["c_attn"]), 3, axis=-1)
        q, k, v = (t.reshape(B, T, H, D) for t in (q, k, v))
        g = 1 / (1 + np.exp(-_dense(a, h["attn"]["c_gate"])))  # [B, T, H]
        fq, fk = _softplus(q), _softplus(k)
        y = np.zeros((B, T, H, D))
        den = np.zeros((B, T, H))
        norms = []
        for b in range(B):
            for hh in range(H):
                S, z = np.zeros((D, D)), np.zeros(D)
                for t in range(T):
                    gamma = 0.0 if resets[b, t] else g[b, t, hh]
                    S = gamma * S + np.outer(fk[b, t, hh], v[b, t, hh])
                    z = gamma * z + fk[b, t, hh]
                    den[b, t, hh] = fq[b, t, hh] @ z
                    y[b, t, hh] = fq[b, t, hh] @ S / (den[b, t, hh] + cfg.eps)
                norms.append(np.linalg.norm(S))
        out["den_min"].append(den.min())
        out["den_mean"].append(den.mean())
        out["state_norm"].append(np.mean(norms))
        out["out_rms"].append(np.sqrt(np.mean(y**2)))
        out["gamma_mean"].append(g.mean())
        x = x + _dense(y.reshape(B, T, C), h["attn"]["c_proj"])
        m = h["mlp"]
        x = x + _dense(_gelu(_dense(_ln(x, h["ln_2"]), m["c_fc"])), m["c_proj"])
    return {k: np.asarray(v) for k, v in out.items()}


def test_layer_statistics_match_a_forward_pass_by_hand(full_precision_matmuls):
    cfg = ModelConfig(
        n_layer=2,
        n_head=2,
        n_embd=16,
        block_size=8,
        vocab_size=64,
        attention="LT_chunked",
        chunk_size=4,
        decay="gate",
        doc_reset=True,
    )
    params = init_params(cfg, seed=3)
    # A gate that depends on the input, so gamma_mean is not just the initial constants.
    params["h"]["attn"]["c_gate"]["kernel"] = (
        jax.random.normal(jax.random.key(1), params["h"]["attn"]["c_gate"]["kernel"].shape) * 0.5
    )
    tokens = np.asarray(jax.random.randint(jax.random.key(2), (2, 8), 0, 64))
    segments = np.array([[0, 0, 0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 2, 2]])
    run = jax.jit(diagnostics, static_argnums=2)
    got = run(params, tokens, cfg, segment_ids=jnp.asarray(segments))
    want = reference_stats(params, tokens, segments, cfg)
    assert set(got) == set(diag.LAYER_STATS)
    for name in diag.LAYER_STATS:
        assert got[name].shape == (2,), name
        np.testing.assert_allclose(np.asarray(got[name]), want[name], rtol=2e-5, err_msg=name)
    flat = diag.flatten(got)
    assert flat["diag/layer1/state_norm"] == pytest.approx(want["state_norm"][1], rel=2e-5)
    assert len(flat) == 2 * len(diag.LAYER_STATS)

    # softmax has no linear state: only the output's RMS.
    soft = cfg.replace(attention="softmax", decay="none")
    stats = run(init_params(soft, 0), tokens, soft, segment_ids=jnp.asarray(segments))
    assert set(stats) == {"out_rms"}


def _lowered(cfg):
    tx = optimizer(TrainConfig(tokens_per_update=64, micro_batch=2, warmup_steps=1, max_steps=5))
    prog = jit_train_step(cfg, tx, make_mesh(), accum=2, batch=2, context=16)
    return prog.step.lower(*prog.args).as_text()


@pytest.mark.parametrize(
    "kw",
    [
        dict(attention="softmax"),
        dict(attention="LT_chunked", chunk_size=8, decay="gate", doc_reset=True),
    ],
)
def test_train_step_is_the_same_program_without_the_feature(kw, monkeypatch):
    """The step lowered as the trainer builds it equals the step built with the feature's two
    hooks removed: no statistics code (it would raise if traced) and no diagnostics collection
    in the layer scan."""
    cfg = ModelConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=256, **kw)
    cfg = cfg.replace(remat="none", loss_chunk=0)
    today = _lowered(cfg)

    def never(*a, **k):
        raise AssertionError("the training step traced the diagnostics")

    scan = model_lib.nn.scan

    def scan_without_collection(target, variable_axes, **kwargs):
        axes = {k: v for k, v in variable_axes.items() if k != diag.COLLECTION}
        return scan(target, variable_axes=axes, **kwargs)

    monkeypatch.setattr(model_lib.diag, "layer_stats", never)
    monkeypatch.setattr(model_lib.nn, "scan", scan_without_collection)
    assert _lowered(cfg) == today


def test_spike_counter():
    c = SpikeCounter(margin=0.5, window=4)
    losses = [5.0, 4.9, 4.8, 4.7, 4.6, 6.0, 6.1, 4.6, 4.5, 7.0, float("nan"), 4.4]
    flags = [c.update(i + 1, x) for i, x in enumerate(losses)]
    assert c.steps == [6, 10] and c.count == 2  # 6-7 are one spike; NaN is not counted
    assert flags[5] and not flags[6] and flags[9]
    off = SpikeCounter(margin=0.0, window=4)
    assert (
        not any(off.update(i, x) for i, x in enumerate([1.0, 1.0, 9.0, 9.0, 9.0])) and not off.steps
    )


def test_spike_in_a_fast_first_descent_is_counted():
    # The shape of the CPU context grid's LT_chunked run at 128 (benchmarks/results/
    # context_cpu.md): the loss falls from 10.8 to 6.85 in 20 updates, jumps to 10.42 at update
    # 21 and is back at 6.70 at 22. The 50-step mean alone was still above 9.92 there and
    # missed it (the counter before the median baseline).
    descent = [10.8 - 3.95 * (i / 19) ** 2 for i in range(20)]  # slow in the lr warmup
    losses = [*descent, 10.42, 6.70, *(6.65 - 0.02 * i for i in range(10))]
    c = SpikeCounter(margin=0.5, window=50)
    flags = [c.update(i + 1, x) for i, x in enumerate(losses)]
    assert c.steps == [21] and flags[20], c.steps
    mean_only = SpikeCounter(margin=0.5, window=50)
    for i, x in enumerate(losses[:20]):
        mean_only.update(i + 1, x)
    assert mean_only.mean + 0.5 > 10.42 > mean_only.baseline + 0.5


SPIKE_RUN = """
model: {vocab_size: 50304, block_size: 16, n_layer: 2, n_head: 2, n_embd: 32}
attention: {name: LT_chunked, chunk_size: 8}
data: {source: sample, context: 16}
train: {tokens_per_update: 128, micro_batch: 8, max_steps: 14, warmup_steps: 0, lr: 1.0e-3}
log: {wandb: disabled, eval_every: 0, every: 1, diagnostics: true, spike_margin: 0.5, spike_window: 5}
checkpoint: {resume: auto, every: 100, async_save: false}
"""


@SLOW
def test_learning_rate_jump_is_counted_as_a_spike_and_diagnostics_are_logged(tmp_path, monkeypatch):
    from linear_gpt2.training import trainer
    from linear_gpt2.training.config import load_config

    jump = 9  # the update of step 9 (1-based) and later ones run at a learning rate 1000x larger

    def jumping(train_cfg):
        schedule = lambda count: jnp.where(count < jump - 1, 1e-3, 1.0)
        return optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=0.0)

    monkeypatch.setattr(trainer, "optimizer", jumping)
    (tmp_path / "run.yaml").write_text(SPIKE_RUN)
    run_dir = tmp_path / "run"
    over = [f"log.run_dir={run_dir}", f"data.path={tmp_path / 'sample'}"]
    trainer.train(load_config(tmp_path / "run.yaml", over))
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    spikes = [r["step"] for r in records if r.get("diag/spike")]
    # The loss of step 10 is the first computed after the jump; the first too-large step may
    # still lower the loss (it follows the gradient), the next ones overshoot.
    assert spikes and jump < spikes[0] <= jump + 2, [(r["step"], r["loss"]) for r in records]
    assert all(r["diag/spikes"] == 0 for r in records if r["step"] <= jump)
    assert records[-1]["diag/spikes"] == len(spikes)
    # Per-layer statistics on every logged step (log.every = 1), under the one prefix.
    for r in records:
        for layer in (0, 1):
            for name in ("den_min", "den_mean", "state_norm", "out_rms"):
                assert math.isfinite(r[f"diag/layer{layer}/{name}"])
        assert "diag/layer2/out_rms" not in r
    # Resuming replays the counter from the log: the count carries on.
    trainer.train(load_config(tmp_path / "run.yaml", [*over, "train.max_steps=15"]))
    last = json.loads(Path(run_dir / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == 15 and last["diag/spikes"] >= len(spikes)
