"""The data-parallel step against the one-device step, where the devices count different numbers
of targets: each device's gradients are its own (``train_step._local_gradients``), weighted by
its share of the micro-batch's counted targets and summed once per update."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import SLOW
from tests.test_trainer import _env

SCRIPT = r"""
import json
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from linear_gpt2.model.config import ModelConfig
import optax
from linear_gpt2.training.train_step import init_state, jit_train_step
from linear_gpt2.model import init_params

cfg = ModelConfig(vocab_size=97, block_size=16, n_layer=2, n_head=2, n_embd=32,
                  attention="LT_chunked", chunk_size=8)
tx = optax.sgd(1.0)  # the update is minus the gradient: the gradients compared, no Adam
rng = np.random.default_rng(0)
accum, B, T = 2, 4, 16
inputs = rng.integers(0, 97, (accum, B, T)).astype(np.int32)
targets = rng.integers(0, 97, (accum, B, T)).astype(np.int32)
# Unequal counts per device: sequence b keeps its first 4 + 3 b targets in micro-batch 0 and
# none of sequence 0 in micro-batch 1.
for b in range(B):
    targets[0, b, 4 + 3 * b:] = -1
targets[1, 0] = -1
out = {}
for name, devs in (("one", jax.devices()[:1]), ("four", jax.devices()[:4])):
    mesh = Mesh(np.array(devs), ("data",))
    prog = jit_train_step(cfg, tx, mesh, accum=accum, batch=B)
    state = jax.device_put(init_state(init_params(cfg, 0), tx), prog.state_shardings)
    put = lambda x: jax.device_put(jnp.asarray(x), prog.args[1].sharding)
    before = [np.asarray(x, np.float64) for x in jax.tree.leaves(state.params)]
    text = prog.step.lower(*prog.args).as_text()
    new, metrics = prog.step(state, put(inputs), put(targets), jax.random.key(0))
    out[name] = {
        "manual": "manual_computation" in text or "SPMDFullToShardShape" in text,
        "loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"]),
        "grads": [(a - np.asarray(x, np.float64)).ravel().tolist()
                  for a, x in zip(before, jax.tree.leaves(new.params))],
    }
print(json.dumps(out))
"""


@SLOW
def test_four_devices_with_unequal_counted_targets_match_one_device():
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], env=_env(4), capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.splitlines()[-1])
    one, four = got["one"], got["four"]
    # The four-device step takes the per-device path; the one-device step does not.
    assert four["manual"] and not one["manual"]
    assert abs(four["loss"] - one["loss"]) <= 1e-5 * abs(one["loss"])
    assert abs(four["grad_norm"] - one["grad_norm"]) <= 1e-5 * one["grad_norm"]
    for a, b in zip(one["grads"], four["grads"], strict=True):
        num = sum((x - y) ** 2 for x, y in zip(a, b, strict=True)) ** 0.5
        den = sum(x * x for x in a) ** 0.5 or 1.0
        assert num / den <= 1e-5
