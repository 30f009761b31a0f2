"""Device mesh and shardings: data parallel by default, FSDP-style parameter sharding as an option.

One mesh axis, ``data``, spans every device of every process. Batches are split along it. Under
data parallelism parameters and optimizer state are replicated; with ``fsdp`` each array is split
along its largest dimension that the device count divides (arrays too small or indivisible stay
replicated), and XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

AXIS = "data"


def make_mesh(devices: list | None = None) -> Mesh:
    devices = jax.devices() if devices is None else devices
    return Mesh(np.asarray(devices), (AXIS,), axis_types=(AxisType.Auto,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Split axis ``batch_axis`` of an ``ndim`` array across the mesh."""
    spec = [None] * ndim
    spec[batch_axis] = AXIS
    return NamedSharding(mesh, P(*spec))


def fsdp_spec(shape: tuple[int, ...], n: int, min_size: int = 2**14) -> P:
    if n == 1 or int(np.prod(shape)) < min_size:
        return P()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % n == 0:
            spec = [None] * len(shape)
            spec[axis] = AXIS
            return P(*spec)
    return P()


def state_shardings(abstract_state, mesh: Mesh, fsdp: bool):
    """A NamedSharding for every leaf of a (possibly abstract) pytree."""
    n = mesh.devices.size

    def one(leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, fsdp_spec(shape, n) if fsdp else P())

    return jax.tree.map(one, abstract_state)


def global_batch(local: np.ndarray, mesh: Mesh, batch_axis: int = 0) -> jax.Array:
    """Assemble each process's slice of the batch into one global array split on ``data``."""
    return jax.make_array_from_process_local_data(
        batch_sharding(mesh, local.ndim, batch_axis), local
    )
