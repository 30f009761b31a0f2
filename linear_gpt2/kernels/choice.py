"""``auto`` for the kernels of the step's glue (``model.layernorm_kernel``, ``mlp_kernel``,
``loss_kernel``, ``bias_kernel``).

``auto`` follows the kernels' one rule (:func:`linear_gpt2.kernels.resolve_kernel`): ``pallas``
when the program is traced for a GPU (the target's devices, not the process's backend), ``xla``
elsewhere, so the CPU program is XLA's, byte for byte. :data:`AUTO_PICKS_PALLAS` held ``auto`` at
``xla`` until a GPU had run the kernels' gpu tests and timed the step with them against XLA's
(``make gpu-check``'s glue stage; its page, ``benchmarks/results/glue_ab_<device>_measured.md``,
gives the verdict). A pick of the Pallas kernel by ``auto`` is logged once per option on the
kernels' choices logger (``kernels.CHOICES``)."""

from __future__ import annotations

from linear_gpt2 import kernels

KERNELS = ("auto", "xla", "pallas")
# model.loss_kernel's further choice: the head and the loss as one kernel pair that never writes
# the logits (kernels/head_loss/). Only by name: auto does not pick it (no GPU has timed it).
FUSED_HEAD = "pallas_fused"
LOSS_KERNELS = (*KERNELS, FUSED_HEAD)
# On since a GPU ran the glue kernels' gpu tests and the step with them beat XLA's at every
# point timed (benchmarks/results/glue_ab_h200_measured.md); False puts auto back on xla.
AUTO_PICKS_PALLAS = True
_NOTED: set[str] = set()


def resolve(kernel: str, option: str = "kernel") -> str:
    """The implementation (``xla`` or ``pallas``) behind ``option`` = ``kernel``."""
    if kernel not in KERNELS:
        raise ValueError(f"{option}={kernel!r} is not one of {', '.join(KERNELS)}")
    if kernel == "auto" and not AUTO_PICKS_PALLAS:
        return "xla"
    impl = kernels.resolve_kernel(kernel, option)
    if kernel == "auto" and impl == "pallas" and option not in _NOTED:
        _NOTED.add(option)
        kernels.note_choice(f"{option}=auto: pallas (the program is for a GPU)", __name__)
    return impl


def resolve_loss(kernel: str, option: str = "model.loss_kernel") -> str:
    """The implementation behind ``model.loss_kernel``: :func:`resolve`'s, or
    :data:`FUSED_HEAD` when asked for by name."""
    return FUSED_HEAD if kernel == FUSED_HEAD else resolve(kernel, option)


def is_fused_head(impl: str) -> bool:
    """Whether a resolved loss implementation is the fused head + loss (kernels/head_loss/)."""
    return impl == FUSED_HEAD


def is_pallas(impl: str) -> bool:
    """Whether a resolved implementation (:func:`resolve`'s answer) is the Pallas kernel: the
    kernels layer names its implementations, the model asks it."""
    return impl == "pallas"


def use_pallas(kernel: str, option: str = "kernel") -> bool:
    """Whether ``option`` = ``kernel`` runs the Pallas kernel in the program being traced."""
    return is_pallas(resolve(kernel, option))
