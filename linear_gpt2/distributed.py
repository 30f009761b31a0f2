"""Multi-host start-up: join the processes of one job before any JAX computation.

``jax.distributed.initialize()`` detects SLURM and Open MPI launches by itself. For other launches
(and for tests on one machine) set ``JAX_COORDINATOR_ADDRESS=host:port``, ``JAX_NUM_PROCESSES``
and ``JAX_PROCESS_ID`` in each process's environment.
"""

from __future__ import annotations

import os

import jax


def launched_multiprocess() -> bool:
    env = os.environ
    return bool(
        env.get("JAX_COORDINATOR_ADDRESS")
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
    )


def initialize() -> None:
    """Join the job's processes if this is a multi-process launch; a no-op otherwise."""
    if not launched_multiprocess():
        return
    kwargs = {}
    if "JAX_NUM_PROCESSES" in os.environ:
        kwargs["num_processes"] = int(os.environ["JAX_NUM_PROCESSES"])
    if "JAX_PROCESS_ID" in os.environ:
        kwargs["process_id"] = int(os.environ["JAX_PROCESS_ID"])
    jax.distributed.initialize(**kwargs)
