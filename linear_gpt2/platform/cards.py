"""The GPU cards' facts that MFU and the cost models price with: each fact once, with its origin.

One :class:`Card` per card. :data:`H100` is the post's card and the one every cost model prices
(``kernels/*/cost.py``, ``training/memory_plan.py``, the studies' step model); the others carry
only the dense bf16 peak that MFU divides by (``model/flops.py``). Each field's origin:

- ``peak_bf16_flops``: dense bf16 tensor-core FLOP/s, no sparsity: NVIDIA's datasheet;
- ``hbm_bytes_per_s``: the HBM bandwidth: NVIDIA's datasheet;
- ``sms``: the streaming multiprocessors: NVIDIA's datasheet, and for the H100 also the
  ``core_count`` of the compile target's device description (``assets/targets/h100_sxm.txtpb``;
  ``tests/test_cards.py`` holds them equal);
- ``launch_seconds``: the time one kernel launch adds to a sequence of dependent launches
  (launch plus ramp-up), MEASURED for the H100 as the step-time model's fitted ``launch_us``
  (``studies/train_step/step_model.py``, fitted to step times measured on a lent H100:
  ``benchmarks/results/train_step_h100_model.json``, ``params.launch_us``), rounded to three
  figures; ``tests/test_cards.py`` fails when that file's fit and this constant drift apart by
  more than :data:`LAUNCH_FIT_TOLERANCE`. A refit that moves it means updating it here and
  re-rendering the pages priced with it (the kernel rooflines);
- ``host_bytes_per_s``: host offload to pinned memory, each way: ASSUMED (PCIe 5 x16), not
  measured on a card.

``None``: not recorded for that card (nothing prices it there).
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Card:
    """One GPU card's facts (module docstring: the origin of each)."""

    name: str  # matched as a substring of ``jax.Device.device_kind``
    peak_bf16_flops: float
    hbm_bytes_per_s: float | None = None
    sms: int | None = None
    launch_seconds: float | None = None
    host_bytes_per_s: float | None = None


# The H100 SXM 80 GB: the post's card, and the card every cost model prices.
H100 = Card(
    "H100",
    peak_bf16_flops=989e12,  # datasheet
    hbm_bytes_per_s=3.35e12,  # datasheet, HBM3
    sms=132,  # datasheet; the compile target's core_count
    launch_seconds=1.86e-6,  # measured: the step model's fit (module docstring)
    host_bytes_per_s=50e9,  # assumed: PCIe 5 x16
)
# The H200 141 GB: the H100's compute on faster HBM3e (benchmarks/results/*_h200_measured.*).
H200 = Card("H200", peak_bf16_flops=989e12, hbm_bytes_per_s=4.8e12, sms=132)  # datasheet
A100 = Card("A100", peak_bf16_flops=312e12)  # datasheet
L40S = Card("L40S", peak_bf16_flops=362e12)  # datasheet
A10G = Card("A10G", peak_bf16_flops=125e12)  # the A10's datasheet figure (as MFU has used)

# Looked up in this order by :func:`of_device_kind` (first substring match).
CARDS: tuple[Card, ...] = (H200, H100, A100, L40S, A10G)

# How far (relative) the step model's fitted launch overhead may move before H100.launch_seconds
# must be updated (tests/test_cards.py).
LAUNCH_FIT_TOLERANCE = 0.05


def of_device_kind(kind: str) -> Card | None:
    """The card whose name ``kind`` (a ``device_kind`` such as "NVIDIA H100 80GB HBM3")
    contains, or None (a CPU, an unlisted card)."""
    return next((c for c in CARDS if c.name in kind), None)
