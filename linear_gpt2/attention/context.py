"""The attention over the mesh: each device's own sequences (:func:`over_batch`) and, with
context parallelism, a variant's per-slice form over the mesh's ``seq`` axis.

A Pallas or Triton kernel is a custom call, which XLA's SPMD partitioner does not split: given
q, k, v with the batch sharded over ``data`` it gathers every device's sequences and runs all
of them on each (the glue kernels meet the same in ``kernels/rows.py``). The model therefore
calls every variant through :func:`over_batch`, which runs it inside ``shard_map`` over
``data`` on the device's own sequences; attention never mixes sequences, so this is exact for
any variant, a researcher's own too.

When the program being traced splits the sequence (``train.context_parallel`` > 1: the mesh is
``data x seq``), every tensor of the model is laid out with T split over ``seq``; outside the
attention nothing mixes positions, so XLA keeps them split. Inside, a variant whose spec sets
``context_parallel`` runs :func:`over_sequence`: its ``local(q, k, v, resets, log_gate)`` sees
one device's contiguous slice ``[B, T / N, H, D]`` and talks to the other slices through
collectives over :data:`SEQ` (the linear family gathers the slices' states,
``kernels/context.py``; ``flash`` gathers keys and values), inside :func:`over_batch`'s
``shard_map`` over ``data`` where the batch is split.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.platform.mesh import DATA, SEQ, axis_size, manual_axes, sequence_shards

__all__ = ["SEQ", "over_batch", "over_sequence", "sequence_shards"]


def _batch_shards(B: int) -> int:
    """Devices the batch of B sequences is split over in the program being traced: the mesh's
    ``data`` axis where it has several devices, divides B and is not manual already (inside a
    ``shard_map`` over it); else 1."""
    n = axis_size(DATA)
    if n == 1 or B % n:
        return 1
    return 1 if DATA in manual_axes() else n


def over_batch(fn: Callable[..., jax.Array], q, k, v, **kwargs) -> jax.Array:
    """``fn(q, k, v, **kwargs)`` on each device's own sequences: q, k, v ``[B, T, H, D]`` and
    the per-token ``kwargs`` (``resets`` ``[B, T]``, ``log_gate`` ``[B, T, H]``) split along B
    over :data:`DATA`; the output ``[B, T, H, D]`` likewise. Called directly where the batch is
    not split (one device, no mesh in context: the CPU program is unchanged) and with a
    dropout key (a replicated key would draw the same masks on every device; the variants
    that take one are XLA's, which the partitioner splits)."""
    if _batch_shards(q.shape[0]) == 1 or "dropout_rng" in kwargs:
        return fn(q, k, v, **kwargs)
    names = list(kwargs)

    def body(q, k, v, *rest):
        return fn(q, k, v, **dict(zip(names, rest)))

    # check_vma off, as over_sequence: the variants' scans start from constants.
    run = jax.shard_map(
        body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(P(DATA),) * (3 + len(names)),
        out_specs=P(DATA), axis_names={DATA}, check_vma=False,
    )  # fmt: skip
    return run(q, k, v, *kwargs.values())


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
