"""``auto`` for the kernels of the step's glue (``model.layernorm_kernel``, ``mlp_kernel``,
``loss_kernel``): ``pallas`` when the program is traced for a GPU (the target's devices, not the
process's backend: ``platform.device``), ``xla`` elsewhere, where the program stays the plain
one of before."""

from __future__ import annotations

from linear_gpt2.platform.device import compiling_for_gpu

KERNELS = ("auto", "xla", "pallas")


def resolve(kernel: str, option: str = "kernel") -> str:
    """The implementation behind ``option`` = ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"{option}={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "auto":
        return "pallas" if compiling_for_gpu() else "xla"
    return kernel
