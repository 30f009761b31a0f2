"""Device mesh and shardings: data parallel by default, the sequence split over devices
(context parallelism) and FSDP-style parameter sharding as options.

The mesh spans every device of every process. With ``train.context_parallel`` = 1 it has one
axis, ``data``: batches are split along it. With N > 1 it is ``data x seq``, ``seq`` of size N
and fastest-varying, so that the N devices sharing a sequence are neighbours (one host's, or
whole hosts in a row); each sequence is cut along T into N contiguous slices, one per device on
``seq`` (``attention/context.py`` says how attention crosses the cuts). Under data parallelism
parameters and optimizer state are replicated; with ``fsdp`` each array is split along its
largest dimension that the device count divides, over every device of the mesh (arrays too
small or indivisible stay replicated), and XLA inserts the all-gathers and reduce-scatters.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.platform.mesh import DATA, SEQ

AXIS = DATA


def make_mesh(devices: list | None = None, context_parallel: int = 1) -> Mesh:
    """The run's mesh over ``devices`` (default: every device of every process, each process's
    devices together): ``(data,)``, or ``(data, seq)`` with ``seq`` = ``context_parallel``."""
    n = context_parallel
    if n == 1:
        # One axis, as before context parallelism existed: the program compiled is unchanged.
        devices = jax.devices() if devices is None else devices
        return Mesh(np.asarray(devices), (DATA,), axis_types=(AxisType.Auto,))
    if devices is None:
        devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if len(devices) % n:
        raise ConfigError(
            f"train.context_parallel={n} does not divide the {len(devices)} devices; use a "
            f"divisor of {len(devices)}"
        )
    grid = np.asarray(devices).reshape(len(devices) // n, n)
    return Mesh(grid, (DATA, SEQ), axis_types=(AxisType.Auto, AxisType.Auto))


def sequence_shards(mesh: Mesh) -> int:
    """How many slices each sequence is cut into on ``mesh``."""
    return dict(mesh.shape).get(SEQ, 1)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh, ndim: int, batch_axis: int = 0) -> NamedSharding:
    """Split axis ``batch_axis`` of an ``ndim`` array across the mesh's ``data`` axis and, on a
    mesh with a ``seq`` axis, the last axis (T) across ``seq``."""
    spec = [None] * ndim
    spec[batch_axis] = DATA
    if SEQ in mesh.axis_names:
        spec[-1] = SEQ
    return NamedSharding(mesh, P(*spec))


def fsdp_spec(shape: tuple[int, ...], n: int, min_size: int = 2**14, axes=AXIS) -> P:
    """Split the largest dimension of ``shape`` that ``n`` divides over mesh ``axes`` (an axis
    name or a tuple of them, ``n`` devices in all); small or indivisible arrays stay whole."""
    if n == 1 or int(np.prod(shape)) < min_size:
        return P()
    for axis in sorted(range(len(shape)), key=lambda a: -shape[a]):
        if shape[axis] % n == 0:
            spec = [None] * len(shape)
            spec[axis] = axes
            return P(*spec)
    return P()


def state_shardings(abstract_state, mesh: Mesh, fsdp: bool):
    """A NamedSharding for every leaf of a (possibly abstract) pytree."""
    n = mesh.devices.size
    axes = AXIS if len(mesh.axis_names) == 1 else tuple(mesh.axis_names)

    def one(leaf):
        shape = tuple(getattr(leaf, "shape", ()))
        return NamedSharding(mesh, fsdp_spec(shape, n, axes=axes) if fsdp else P())

    return jax.tree.map(one, abstract_state)


def global_batch(
    local: np.ndarray, mesh: Mesh, batch_axis: int = 0, global_shape: tuple[int, ...] | None = None
) -> jax.Array:
    """Assemble each process's part of the batch into one global array split on ``data`` (and
    on ``seq`` along the last axis). ``global_shape`` is needed when processes hold parts of
    the same sequences (a ``seq`` group spanning hosts); otherwise it is inferred."""
    return jax.make_array_from_process_local_data(
        batch_sharding(mesh, local.ndim, batch_axis), local, global_shape
    )


def traced_on(mesh: Mesh, fn):
    """``fn`` traced with ``mesh`` as the abstract mesh in context, so the attention sees the
    ``seq`` axis it must cross (``platform.mesh.sequence_shards``) and, on GPUs, the row-wise
    kernels the devices they run on (``kernels/rows.py``: per device, not gathered); ``fn``
    itself on one device, or on CPUs without a ``seq`` axis, so that such a run traces exactly
    as before."""
    gpus = mesh.size > 1 and any(d.platform == "gpu" for d in mesh.devices.flat)
    if SEQ not in mesh.axis_names and not gpus:
        return fn

    @functools.wraps(fn)
    def traced(*args, **kwargs):
        with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
            return fn(*args, **kwargs)

    return traced
