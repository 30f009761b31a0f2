"""Multi-host start-up: join the processes of one job before any JAX computation.

``jax.distributed.initialize()`` detects SLURM and Open MPI launches by itself. For other launches
(and for tests on one machine) set ``JAX_COORDINATOR_ADDRESS=host:port``, ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID`` in each process's environment.
"""

from __future__ import annotations

import os

import jax

from linear_gpt2.platform.errors import DeviceError


def launched_multiprocess() -> bool:
    env = os.environ
    return bool(
        env.get("JAX_COORDINATOR_ADDRESS")
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    )


def initialize() -> None:
    """Join the job's processes if this is a multi-process launch, then start JAX's backend
    (:func:`check_backend`)."""
    if launched_multiprocess():
        kwargs = {}
        if "JAX_NUM_PROCESSES" in os.environ:
            kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
        if "JAX_PROCESS_ID" in os.environ:
            kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
        jax.distributed.initialize(**kwargs)
    check_backend()


def check_backend() -> None:
    """Start JAX's backend now, so that a missing device or plugin is one :class:`DeviceError`
    saying what to do (JAX raises a bare ``AssertionError`` for ``JAX_PLATFORMS=cuda`` without
    the CUDA plugin, a ``RuntimeError`` for a backend that fails to start)."""
    try:
        jax.devices()
    except Exception as e:  # noqa: BLE001 - every failure here means the same to the user
        platforms = os.environ.get("JAX_PLATFORMS") or "(unset)"
        why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DeviceError(
            f"JAX cannot start its backend with JAX_PLATFORMS={platforms} ({why}); for GPUs "
            "install the CUDA build (pip install -e '.[gpu]') on a machine with one, or unset "
            "JAX_PLATFORMS to use the devices that are there"
        ) from e
