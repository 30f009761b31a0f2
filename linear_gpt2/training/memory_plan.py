"""``model.remat: auto`` and ``model.loss_chunk: auto``: the cheapest setting whose step fits.

The memory options change neither the function nor its gradients, only what is kept for the
backward pass, so choosing among them is a question of cost. The candidates, cheapest first:

====  ===========  ========  ==============================================================
 #    loss_chunk   remat     cost beyond the plain step
====  ===========  ========  ==============================================================
 1    0            none      none: today's program (nanoGPT's head, everything kept)
 2    4096         none      none in FLOPs (the fused loss computes its gradient in the
                             forward pass, ``loss.py``); one scan over token chunks
 3    4096         dots      recompute LayerNorm, GELU, phi and attention in the backward
 4    4096         full      recompute each block's forward (+1/3 of the blocks' FLOPs)
 5    4096         offload   as full, plus each block's input to host memory and back
====  ===========  ========  ==============================================================

Values set explicitly in the config are kept; only ``auto`` fields vary. :func:`plan` compiles
the candidates in order for the devices the step will run on (the trainer's own GPUs, or a
compile target such as the H100, ``target.py``) and takes the first whose compiled memory fits
the budget; the winning executable is returned, so nothing is compiled twice. Where the devices
report no memory limit (the CPU) the first candidate is taken without compiling: the default
CPU run compiles exactly the program it compiled before these options existed.

Measured (compiled for the H100 here; 124M, batch 1, ``LT_chunked``, 64k tokens): 70.8 GiB
(1), 50.9 (2), 18.0 (3), 7.95 (4), 5.71 GiB (5).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.memory import GiB, MemoryReport

LOSS_CHUNK = 4096
LADDER: tuple[tuple[int, str], ...] = (
    (0, "none"),
    (LOSS_CHUNK, "none"),
    (LOSS_CHUNK, "dots"),
    (LOSS_CHUNK, "full"),
    (LOSS_CHUNK, "offload"),
)
# Share of a device's allocator limit a planned step may use (the rest: fragmentation, cuDNN
# workspaces, tiles autotuned on the device).
DEVICE_BUDGET_FRACTION = 0.92


def label(cfg: ModelConfig) -> str:
    return f"loss_chunk={cfg.loss_chunk} remat={cfg.remat}"


def candidates(cfg: ModelConfig) -> list[ModelConfig]:
    """Resolutions of ``cfg``'s ``auto`` memory fields, cheapest first (explicit values kept)."""
    out: list[ModelConfig] = []
    for chunk, remat in LADDER:
        c = cfg.replace(
            loss_chunk=chunk if cfg.loss_chunk == "auto" else cfg.loss_chunk,
            remat=remat if cfg.remat == "auto" else cfg.remat,
        )
        if c not in out:
            out.append(c)
    return out


def rung(cfg: ModelConfig) -> int:
    """Position of a resolved config's setting in :data:`LADDER` (0 when not on it)."""
    key = (cfg.loss_chunk, cfg.remat)
    return next((i for i, r in enumerate(LADDER) if r == key), 0)


def is_resolved(cfg: ModelConfig) -> bool:
    return cfg.loss_chunk != "auto" and cfg.remat != "auto"


@dataclasses.dataclass
class Plan:
    config: ModelConfig  # resolved: no auto left
    fits: bool
    budget: int | None  # bytes; None: the devices report no limit
    memory: MemoryReport | None = None  # of the chosen candidate, if it was compiled
    executable: Any = None  # its compiled step, if it was compiled
    tried: list[tuple[str, MemoryReport]] = dataclasses.field(default_factory=list)

    def describe(self) -> str:
        if self.budget is None:
            return f"{label(self.config)} (no device memory limit known: the cheapest setting)"
        steps = "; ".join(f"{name}: {m.total / GiB:.2f} GiB" for name, m in self.tried)
        verdict = "fits" if self.fits else "does NOT fit"
        return f"{label(self.config)} {verdict} in {self.budget / GiB:.1f} GiB (compiled: {steps})"


def plan(
    cfg: ModelConfig,
    compile_candidate: Callable[[ModelConfig], tuple[MemoryReport, Any]],
    budget: int | None,
    start: int = 0,
) -> Plan:
    """The first of :func:`candidates` whose compiled step fits ``budget`` bytes per device.

    ``compile_candidate(cfg) -> (MemoryReport, executable)`` compiles the step for a resolved
    config. With ``budget`` None nothing is compiled and the cheapest candidate is returned.
    When none fits, the plan holds the most frugal one with ``fits=False`` and every
    candidate's memory, for the caller's error message. ``start`` skips the cheapest
    candidates (a sweep over growing contexts knows the smaller context's choice did not fit
    with less)."""
    cands = candidates(cfg)
    cands = cands[min(start, len(cands) - 1) :]
    if budget is None:
        return Plan(cands[0], True, None)
    tried: list[tuple[str, MemoryReport]] = []
    mem, exe = None, None
    for c in cands:
        mem, exe = compile_candidate(c)
        tried.append((label(c), mem))
        if mem.total <= budget:
            return Plan(c, True, budget, mem, exe, tried)
    return Plan(cands[-1], False, budget, mem, exe, tried)


def device_budget(devices: list[Any] | None = None) -> int | None:
    """Bytes a step may use on each of ``devices`` (default: the local ones): the allocator's
    limit times :data:`DEVICE_BUDGET_FRACTION`; None where the backend reports none (CPU)."""
    devices = jax.local_devices() if devices is None else devices
    limits = []
    for d in devices:
        try:
            stats = d.memory_stats()
        except Exception:
            return None
        if not stats or "bytes_limit" not in stats:
            return None
        limits.append(int(stats["bytes_limit"]))
    return int(min(limits) * DEVICE_BUDGET_FRACTION) if limits else None
