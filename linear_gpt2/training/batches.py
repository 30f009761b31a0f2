"""How ``train.tokens_per_update`` splits into sequences, devices and micro-steps."""

from __future__ import annotations

import dataclasses

from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import Config


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How ``tokens_per_update`` splits into sequences, devices and micro-steps."""

    sequences: int  # sequences per update (all processes)
    accum: int  # micro-steps per update
    micro_batch: int  # sequences per device per micro-step
    devices: int
    processes: int

    @property
    def local_sequences(self) -> int:
        return self.sequences // self.processes


def plan_batches(cfg: Config, devices: int, processes: int) -> BatchPlan:
    """Derive accumulation; refuse combinations that do not divide, saying what to change."""
    t, ctx, mb = cfg.train.tokens_per_update, cfg.data.context, cfg.train.micro_batch
    if t % ctx:
        raise ConfigError(
            f"train.tokens_per_update={t} is not a multiple of data.context={ctx}; use a multiple "
            f"of the context, e.g. {max(ctx, t // ctx * ctx)}"
        )
    seqs = t // ctx
    per_micro = mb * devices
    if seqs % per_micro:
        fits = [m for m in range(1, mb + 1) if seqs % (m * devices) == 0]
        hint = (
            f"train.micro_batch={fits[-1]}"
            if fits
            else f"train.tokens_per_update={per_micro * ctx}"
        )
        raise ConfigError(
            f"{seqs} sequences per update (tokens_per_update={t} / context={ctx}) do not split into "
            f"micro-batches of micro_batch={mb} x {devices} devices = {per_micro} sequences; "
            f"try {hint}"
        )
    return BatchPlan(seqs, seqs // per_micro, mb, devices, processes)
