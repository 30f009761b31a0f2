"""Which platform a program is traced for.

Kernel choices (``kernel=auto``: cuDNN / Pallas on a GPU, XLA elsewhere) ask :func:`platform`,
not the process's default backend: while a program is compiled for a GPU target on a machine
without one (:mod:`linear_gpt2.platform.target`), the abstract mesh in context is made of that
target's devices, and the kernels must be chosen for them.
"""

from __future__ import annotations

import jax


def platform() -> str:
    """``gpu`` while tracing for a GPU target (an abstract mesh of GPU devices is in context),
    else the process's default backend."""
    am = jax.sharding.get_abstract_mesh()
    dev = None if am.empty else getattr(am, "abstract_device", None)
    if dev is not None and getattr(dev, "platform", None):
        return dev.platform
    return jax.default_backend()


def compiling_for_gpu() -> bool:
    """Whether the program being traced is for a GPU: the process's GPU, or a GPU compile
    target."""
    return platform() == "gpu"


def gpu_present() -> bool:
    """Whether a GPU can run things here (timing, autotuning); compiling for one needs none."""
    return jax.default_backend() == "gpu"
