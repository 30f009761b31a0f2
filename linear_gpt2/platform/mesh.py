"""The device mesh's axes: ``data`` (batch rows) and ``seq`` (contiguous slices of the sequence,
context parallelism), and how big each is in the program being traced.

The trainer lays its mesh out as ``data x seq`` (``training/sharding.py``); code that has to act
differently when the sequence is split (the attention's context-parallel forms) asks
:func:`axis_size` of the mesh in context, which is the one being compiled for, as
:func:`linear_gpt2.platform.device.platform` does for the device kind.
"""

from __future__ import annotations

import jax

DATA = "data"
SEQ = "seq"


def axis_size(name: str) -> int:
    """The size of mesh axis ``name`` in the abstract mesh in context; 1 when there is no mesh
    in context or it has no such axis."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or name not in mesh.axis_names:
        return 1
    return int(dict(zip(mesh.axis_names, mesh.axis_sizes))[name])


def manual_axes() -> frozenset[str]:
    """The axes of the abstract mesh in context that are manual already: inside a
    ``shard_map`` over them each device holds its own part, and code that splits arrays over
    the mesh (``kernels/rows.py``, the loss over devices) must leave them out."""
    return frozenset(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ()))


def sequence_shards() -> int:
    """How many slices the sequence is split into in the program being traced."""
    return axis_size(SEQ)
