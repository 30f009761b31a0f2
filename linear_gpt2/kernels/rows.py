"""Row-wise kernels under a mesh of several devices: run them per device.

A Pallas kernel is a custom call, which XLA's SPMD partitioner does not split: given operands
sharded over the batch (data parallelism) or the sequence (context parallelism), it gathers every
device's rows onto each device and runs the whole batch everywhere. The kernels of
:mod:`.layernorm`, :mod:`.bias_gelu` and :mod:`.head_loss` treat tokens independently (or sum
over them), so they run inside ``shard_map`` over the mesh's ``data`` and ``seq`` axes on each
device's own rows, exactly; what they sum over tokens is summed over the devices by the caller
(a ``psum``) or by the transpose of ``shard_map`` (the gradients of replicated parameters).
"""

from __future__ import annotations

import jax
from jax.sharding import PartitionSpec as P

from linear_gpt2.platform.mesh import DATA, SEQ, axis_size, manual_axes


def split(x: jax.Array) -> tuple[P, frozenset[str]] | None:
    """The spec that splits x ``[B, T, ...]`` over the mesh's ``data`` (B) and ``seq`` (T) axes
    and those axes, when the mesh in context has several devices along them and they divide B
    and T; None otherwise (one device, or no mesh: call the kernel directly)."""
    if x.ndim < 2:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    names = () if mesh.empty else mesh.axis_names
    # An axis already manual (inside a shard_map over it: the training step's per-device
    # gradients, a context-parallel slice) holds each device's own rows: nothing to split.
    manual = manual_axes()
    data, seq = (axis_size(a) if a in names and a not in manual else 1 for a in (DATA, SEQ))
    if data * seq == 1 or x.shape[0] % data or x.shape[1] % seq:
        return None
    axes = frozenset(a for a, n in ((DATA, data), (SEQ, seq)) if n > 1)
    return P(DATA if data > 1 else None, SEQ if seq > 1 else None), axes


def per_device(fn, args: tuple, specs: tuple, out_specs, axes: frozenset[str]):
    """``fn(*args)`` inside ``shard_map`` over ``axes`` of the mesh in context, ``specs`` the
    argument specs (``P()`` for a replicated argument or None)."""
    run = jax.shard_map(
        fn, mesh=jax.sharding.get_abstract_mesh(), in_specs=specs, out_specs=out_specs,
        axis_names=set(axes), check_vma=False,
    )  # fmt: skip
    return run(*args)
