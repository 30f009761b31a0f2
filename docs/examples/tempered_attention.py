"""A researcher's own attention variant, outside the package: causal softmax with a temperature,
y = softmax(q k^T / (tau sqrt(D))) v. Put this file in a package of your own (``my_lab/``) and
select it by module path:

    PYTHONPATH=. python scripts/train.py configs/default.yaml \\
        attention.name=my_lab.tempered_attention attention.temperature=0.5

The module defines ``SPEC``; the rest of the library (config checks, FLOPs and MFU, sampling,
benchmarks, plots) learns everything it needs from it. Its options are one frozen dataclass:
each field is a config key ``attention.<field>``, typed and checked when the config loads
(``attention.temperature=abc`` or ``=0`` is one line naming the key, before anything is
written). tests/test_attention_plugin.py runs this very file through train, sample, bench_step
and plot_runs.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp

from linear_gpt2.attention import AttentionSpec, Options, option
from linear_gpt2.attention.options import positive
from linear_gpt2.attention.spec import quadratic_flops


@dataclasses.dataclass(frozen=True)
class TemperedOptions(Options):
    temperature: float = option(1.0, "tau: the scores are divided by tau sqrt(D)", check=positive)


def make(options: TemperedOptions):
    """``fn(q, k, v) -> y``, all ``[B, T, H, D]``."""
    temperature = options.temperature

    def fn(q, k, v):
        T, D = q.shape[1], q.shape[-1]
        s = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s / (temperature * math.sqrt(D)), -jnp.inf)
        return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, axis=-1).astype(v.dtype), v)

    return fn


SPEC = AttentionSpec(
    name="tempered_softmax",
    family="softmax",
    make=make,
    flops=quadratic_flops,  # forward matmul FLOPs per token of one layer: 4 T D per head
    options=TemperedOptions,
)
