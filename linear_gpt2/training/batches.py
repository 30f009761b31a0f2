"""How ``train.tokens_per_update`` splits into sequences, devices and micro-steps, and which
part of them each process loads."""

from __future__ import annotations

import dataclasses

from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config import Config


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """How ``tokens_per_update`` splits into sequences, devices and micro-steps.

    With context parallelism (``seq_shards`` = ``train.context_parallel`` > 1) the devices form
    ``data_devices`` groups of ``seq_shards``; a sequence lives on one group. A group lies on one
    process, or spans ``processes_per_sequence`` consecutive processes that load the same rows
    and each put ``1 / processes_per_sequence`` of T on their devices.
    """

    sequences: int  # sequences per update (all processes)
    accum: int  # micro-steps per update
    micro_batch: int  # sequences per data-parallel group per micro-step
    devices: int  # every device of every process
    processes: int
    seq_shards: int = 1
    process_index: int = 0

    @property
    def data_devices(self) -> int:
        """The size of the mesh's ``data`` axis: how many groups hold distinct sequences."""
        return self.devices // self.seq_shards

    @property
    def global_micro_batch(self) -> int:
        """Sequences per micro-step over every process."""
        return self.micro_batch * self.data_devices

    @property
    def processes_per_sequence(self) -> int:
        local = self.devices // self.processes
        return max(1, self.seq_shards // local)

    @property
    def loader_count(self) -> int:
        """How many processes load distinct rows (the loader's shard count)."""
        return self.processes // self.processes_per_sequence

    @property
    def loader_index(self) -> int:
        """Which of the :attr:`loader_count` row shards this process loads."""
        return self.process_index // self.processes_per_sequence

    @property
    def local_sequences(self) -> int:
        """Sequences per update this process loads."""
        return self.sequences // self.loader_count

    def local_positions(self, context: int) -> slice:
        """The part of each loaded sequence's T positions this process's devices hold."""
        g = self.processes_per_sequence
        part = self.process_index % g
        return slice(part * context // g, (part + 1) * context // g)


def plan_batches(cfg: Config, devices: int, processes: int, process_index: int = 0) -> BatchPlan:
    """Derive accumulation; refuse combinations that do not divide, saying what to change."""
    t, ctx, mb = cfg.train.tokens_per_update, cfg.data.context, cfg.train.micro_batch
    n = cfg.train.context_parallel
    if t % ctx:
        raise ConfigError(
            f"train.tokens_per_update={t} is not a multiple of data.context={ctx}; use a multiple "
            f"of the context, e.g. {max(ctx, t // ctx * ctx)}"
        )
    _check_sequence_layout(n, devices, processes)
    groups = devices // n
    seqs = t // ctx
    per_micro = mb * groups
    if seqs % per_micro:
        fits = [m for m in range(1, mb + 1) if seqs % (m * groups) == 0]
        hint = (
            f"train.micro_batch={fits[-1]}"
            if fits
            else f"train.tokens_per_update={per_micro * ctx}"
        )
        what = f"{devices} devices" if n == 1 else f"{groups} groups of {n} devices"
        raise ConfigError(
            f"{seqs} sequences per update (tokens_per_update={t} / context={ctx}) do not split into "
            f"micro-batches of micro_batch={mb} x {what} = {per_micro} sequences; "
            f"try {hint}"
        )
    return BatchPlan(seqs, seqs // per_micro, mb, devices, processes, n, process_index)


def _check_sequence_layout(n: int, devices: int, processes: int) -> None:
    """A sequence's N devices must be one host's or whole hosts': refuse layouts that split a
    host's devices across sequence groups unevenly."""
    if devices % n:
        raise ConfigError(
            f"train.context_parallel={n} does not divide the {devices} devices; use a divisor of "
            f"{devices}"
        )
    local = devices // processes
    if n > 1 and (local % n if n <= local else n % local):
        raise ConfigError(
            f"train.context_parallel={n} does not fit {processes} hosts of {local} devices: a "
            f"sequence's devices must be part of one host's (N dividing {local}) or whole hosts "
            f"(a multiple of {local})"
        )
