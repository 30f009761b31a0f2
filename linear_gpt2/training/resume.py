"""Where a run continues from: ``checkpoint.resume`` resolved to a checkpointer and a step, and
the state, RNG and data position restored from it.

``checkpoint.resume`` is ``auto`` (this run's own newest intact checkpoint, if any), ``never``
(refused when the run directory already holds checkpoints) or a path to another run's
checkpoints (used only until this run has checkpoints of its own, so a preempted run continues
itself). Every refusal is raised before the trainer writes anything into the run directory.
Damaged checkpoints of this run are moved aside (``checkpoint.Checkpointer.select``); another
run's are only skipped. On several processes, process 0's choice of step is everyone's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from linear_gpt2.platform.errors import CheckpointError, UsageError
from linear_gpt2.training import checkpoint as ckpt_lib
from linear_gpt2.training.config import Config
from linear_gpt2.training.data import Loader
from linear_gpt2.training.train_step import TrainState


class RunDirectoryInUseError(UsageError):
    """``checkpoint.resume=never`` on a run directory that already holds checkpoints."""


def resume_source(
    cfg: Config, own: ckpt_lib.Checkpointer, warn: Callable[[str], None]
) -> tuple[ckpt_lib.Checkpointer | None, int | None]:
    """Where this run continues from: ``(checkpointer, step or None for its newest)``, or
    ``(None, None)`` to start at step 0. Refusals raise before anything is written."""
    resume = cfg.checkpoint.resume
    if resume == "auto":
        return own, None
    if resume == "never":
        if own.steps():
            raise RunDirectoryInUseError(
                f"{own.directory} already holds checkpoints (latest step {own.latest_step()}) and "
                "checkpoint.resume=never; continue that run with checkpoint.resume=auto, start a "
                f"new one with another log.name or log.run_dir, or move {own.directory.parent} "
                "aside to start it over"
            )
        return None, None
    if own.steps():  # a preempted run that started from another checkpoint: continue its own
        warn(
            f"checkpoint.resume={resume}: {own.directory} already holds this run's checkpoints; "
            "continuing from those"
        )
        return own, None
    directory, step = ckpt_lib.resolve_checkpoint(resume)
    source = ckpt_lib.Checkpointer(directory, cfg.checkpoint, warn=warn)
    if not source.steps():
        raise CheckpointError(
            f"checkpoint.resume={resume!r} holds no checkpoint (no step directories in "
            f"{directory}); point it at a run directory or a checkpoints directory, or use "
            "checkpoint.resume=auto"
        )
    return source, step


def restore_run(
    source: ckpt_lib.Checkpointer,
    step: int | None,
    cfg: Config,
    abstract_state: TrainState,
    shardings: TrainState,
    rng: jax.Array,
    loader: Loader,
    *,
    own: bool,
) -> tuple[int, TrainState, jax.Array] | None:
    """``(step, train state, RNG)`` of the newest intact checkpoint of ``source`` (or of
    ``step``), with ``loader`` moved to the data position saved with it; ``None`` when there is
    no checkpoint to continue from. The state is laid out by ``shardings``; ``rng`` only gives
    the key's shape. ``own``: ``source`` is this run's checkpointer (damage is moved aside)."""
    abstract = {
        "train": ckpt_lib.abstract(abstract_state, shardings),
        "rng": np.asarray(jax.random.key_data(rng)),
    }
    found = restore(source, step, cfg, abstract, own=own)
    if found is None:
        return None
    start_step, restored, data_state = found
    try:
        loader.load_state_dict(data_state)
    except ValueError as e:
        raise ckpt_lib.IncompatibleCheckpointError(
            f"checkpoint {source.directory / str(start_step)}: {e}; start a new run "
            "(another log.name) to train on other data"
        ) from None
    return start_step, restored["train"], jax.random.wrap_key_data(restored["rng"])


def restore(
    source: ckpt_lib.Checkpointer, step: int | None, cfg: Config, abstract: Any, own: bool
) -> tuple[int, Any, dict[str, Any]] | None:
    """``(step, state, loader position)`` of the newest intact checkpoint, or ``None``. Damaged
    checkpoints of this run are moved aside (by process 0, once every process agreed on the
    step); another run's are only skipped."""
    if jax.process_count() == 1 and step is None:
        try:
            return source.restore_latest(cfg, abstract, move_damaged=own)
        finally:
            if not own:
                source.close()
    chosen = source.select(cfg, move_damaged=False, step=step)
    if jax.process_count() > 1:
        chosen_all = int(
            multihost_utils.broadcast_one_to_all(np.int64(-1 if chosen is None else chosen))
        )
        chosen = None if chosen_all < 0 else chosen_all
        if own and jax.process_index() == 0:
            for s, reason in source.last_damaged:
                if chosen is None or s > chosen:
                    source.move_aside(s, reason)
        multihost_utils.sync_global_devices("linear_gpt2: damaged checkpoints moved aside")
    if chosen is None:
        return None
    try:
        state, data_state = source.restore(chosen, abstract)
    except Exception as e:
        raise CheckpointError(
            f"checkpoint {source.directory / str(chosen)} could not be restored "
            f"({ckpt_lib.short_error(e)}); if it is damaged, move it to "
            f"{source.directory / ckpt_lib.DAMAGED}/ and run again"
        ) from e
    finally:
        if not own:
            source.close()
    return chosen, state, data_state


def hours_trained(source: ckpt_lib.Checkpointer, step: int, *, own: bool, metrics: Path) -> float:
    """Wall-clock hours this run had trained when ``step`` was saved, which the new call's
    ``hours`` and ``train.max_hours`` continue from: the checkpoint's record, else (a checkpoint
    written before it was recorded) the ``hours`` of that step's line in ``metrics``. Another
    run's checkpoint (``checkpoint.resume=PATH``) starts this run's clock at 0."""
    if not own:
        return 0.0
    try:
        hours = source.read_meta(step).get("hours")
    except (OSError, ValueError, AttributeError):
        hours = None
    if isinstance(hours, (int, float)):
        return float(hours)
    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return 0.0
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("step") == step:
            value = record.get("hours")
            return float(value) if isinstance(value, (int, float)) else 0.0
    return 0.0
