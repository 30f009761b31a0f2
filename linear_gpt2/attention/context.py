"""Context parallelism in the attention: run a variant's per-slice form over the mesh's ``seq``
axis.

When the program being traced splits the sequence (``train.context_parallel`` > 1: the mesh is
``data x seq``), every tensor of the model is laid out with T split over ``seq``; outside the
attention nothing mixes positions, so XLA keeps them split. Inside, a variant whose spec sets
``context_parallel`` runs :func:`over_sequence`: its ``local(q, k, v, resets, log_gate)`` sees
one device's contiguous slice ``[B, T / N, H, D]`` and talks to the other slices through
collectives over :data:`SEQ` (the linear family gathers the slices' states,
``kernels/context.py``; ``flash`` gathers keys and values). The batch axis stays with XLA
(``shard_map`` over ``seq`` only).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.platform.mesh import SEQ, sequence_shards

__all__ = ["SEQ", "over_sequence", "sequence_shards"]


def over_sequence(
    local: Callable[..., jax.Array],
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    resets: jax.Array | None = None,
    log_gate: jax.Array | None = None,
) -> jax.Array:
    """``local`` on each device's slice of the sequence: q, k, v ``[B, T, H, D]``, resets
    ``[B, T]`` and log_gate ``[B, T, H]`` split along T over :data:`SEQ`; the output ``[B, T, H,
    D]`` likewise. ``local(q, k, v, resets, log_gate)`` gets None for what was not given."""
    T, n = q.shape[1], sequence_shards()
    if T % n:
        raise ConfigError(
            f"train.context_parallel: {n} slices do not split a sequence of {T} tokens; use a "
            f"context that {n} divides"
        )
    given = [x for x in (resets, log_gate) if x is not None]
    specs = [P(None, SEQ)] * (3 + len(given))

    def body(q, k, v, *rest):
        it = iter(rest)
        r = next(it) if resets is not None else None
        g = next(it) if log_gate is not None else None
        return local(q, k, v, r, g)

    mesh = jax.sharding.get_abstract_mesh()
    # check_vma off: the variants' scans start from constants (zeros, ones) that carry the
    # slice's values from the first step; the per-slice code stays the code of one device.
    run = jax.shard_map(
        body, mesh=mesh, in_specs=tuple(specs), out_specs=P(None, SEQ), axis_names={SEQ},
        check_vma=False,
    )  # fmt: skip
    return run(q, k, v, *given)
