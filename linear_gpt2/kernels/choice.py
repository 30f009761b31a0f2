"""``auto`` for the kernels of the step's glue (``model.layernorm_kernel``, ``mlp_kernel``,
``loss_kernel``, ``bias_kernel``): the kernels' one rule (:func:`linear_gpt2.kernels.resolve_kernel`),
``pallas`` when the program is traced for a GPU (the target's devices, not the process's backend),
``xla`` elsewhere, where the program stays the plain one of before. A pick of the Pallas kernel by
``auto`` is logged once per option on the kernels' choices logger (``kernels.CHOICES``)."""

from __future__ import annotations

from linear_gpt2 import kernels

KERNELS = ("auto", "xla", "pallas")
_NOTED: set[str] = set()


def resolve(kernel: str, option: str = "kernel") -> str:
    """The implementation (``xla`` or ``pallas``) behind ``option`` = ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"{option}={kernel!r} is not one of {', '.join(KERNELS)}")
    impl = kernels.resolve_kernel(kernel, option)
    if kernel == "auto" and impl == "pallas" and option not in _NOTED:
        _NOTED.add(option)
        kernels.note_choice(f"{option}=auto: pallas (the program is for a GPU)", __name__)
    return impl
