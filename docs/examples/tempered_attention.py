"""A researcher's own attention variant, outside the package: causal softmax with a temperature,
y = softmax(q k^T / (tau sqrt(D))) v. Put this file in a package of your own (``my_lab/``) and
select it by module path:

    PYTHONPATH=. python scripts/train.py configs/default.yaml \\
        attention.name=my_lab.tempered_attention attention.temperature=0.5

The module defines ``SPEC``; the rest of the library (config checks, FLOPs and MFU, sampling,
benchmarks, plots) learns everything it needs from it. tests/test_attention_plugin.py runs this
very file through train, sample, bench_step and plot_runs.
"""

import math

import jax
import jax.numpy as jnp

from linear_gpt2.attention import AttentionSpec
from linear_gpt2.attention.spec import quadratic_flops


def make(temperature: float = 1.0):
    """``fn(q, k, v) -> y``, all ``[B, T, H, D]``."""

    def fn(q, k, v):
        T, D = q.shape[1], q.shape[-1]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s / (temperature * math.sqrt(D)), -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)

    return fn


def check(options):
    if options.get("temperature", 1.0) <= 0:
        raise ValueError(f"temperature must be > 0, got {options['temperature']}")


SPEC = AttentionSpec(
    name="tempered_softmax",
    family="softmax",
    make=make,
    flops=quadratic_flops,  # forward matmul FLOPs per token of one layer: 4 T D per head
    extra_options={"temperature": 1.0},
    check=check,
)
