"""Orbax checkpoints of a run: train state, RNG, data-loader position and the resolved config.

Saving is asynchronous (training continues while the arrays are written) and keeps the last
``checkpoint.keep``. A checkpoint holds the resolved config; restoring under a config whose
run-defining keys differ is refused with the differing keys, so a resumed run cannot silently
become another experiment.

Damage. Before restoring, :meth:`Checkpointer.select` checks the newest step's files
(``checkpoint_files.py``: final steps only, each file's recorded size, orbax's markers, its JSON
metadata) and the data-loader positions. A damaged step is moved to
``checkpoints/damaged/<step>-<reason>`` (never deleted), a warning names it, and the next newest
is tried; the run resumes from the newest intact one.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from linear_gpt2.platform.errors import CheckpointError, PathNotFoundError, UsageError
from linear_gpt2.training.batches import plan_batches
from linear_gpt2.training.checkpoint_files import (
    DAMAGED,
    MANIFEST,
    check_files,
    is_unreadable,
    read_json,
    short_error,
    slug,
    step_dirs,
    write_manifest,
)
from linear_gpt2.training.config import CheckpointConfig, Config, diff, load_config_from_dict


def _loader_shards(config: Config) -> int:
    """How many row shards this launch's processes read the data in (``BatchPlan.loader_count``)."""
    return plan_batches(config, jax.device_count(), jax.process_count()).loader_count


LOADER_STATE = "loader_state"


class IncompatibleCheckpointError(UsageError):
    """The checkpoint belongs to another experiment (or another number of processes): the
    command must change (a new run directory), so the command line exits 2."""


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


class Checkpointer:
    """The checkpoints of one run directory (``RUN_DIR/checkpoints``), with the data-loader
    positions beside them (``RUN_DIR/loader_state/<step>/process_<i>.json``).

    Constructing one touches nothing on disk; the directory is created by the first save.
    ``warn(message)`` reports damaged checkpoints (default: a line on stderr).
    """

    def __init__(
        self,
        directory: str | Path,
        cfg: CheckpointConfig,
        *,
        warn: Callable[[str], None] | None = None,
    ):
        self.directory = Path(directory).absolute()
        self.cfg = cfg
        self.warn = warn or _warn_stderr
        self._manager: ocp.CheckpointManager | None = None
        self._saved_here: set[int] = set()  # steps this process saved (they get a manifest)
        self._verified: set[int] = set()
        self.last_damaged: list[tuple[int, str]] = []  # (step, reason) found by select()

    # ---------------------------------------------------------------- orbax, created lazily

    @property
    def manager(self) -> ocp.CheckpointManager:
        if self._manager is None:
            self._manager = ocp.CheckpointManager(
                self.directory,
                options=ocp.CheckpointManagerOptions(
                    max_to_keep=self.cfg.keep,
                    enable_async_checkpointing=self.cfg.async_save,
                    create=True,
                ),
            )
        return self._manager

    def _reset_manager(self) -> None:
        if self._manager is not None:
            try:
                self._manager.close()
            except Exception:  # noqa: BLE001 - a manager left broken by a failed restore
                pass
        self._manager = None

    # ---------------------------------------------------------------- listing and checking

    def steps(self) -> list[int]:
        return step_dirs(self.directory)

    def latest_step(self) -> int | None:
        """The newest step directory (not checked; see :meth:`select`)."""
        steps = self.steps()
        return steps[-1] if steps else None

    def loader_state_path(self, step: int, process: int | None = None) -> Path:
        p = jax.process_index() if process is None else process
        return self.directory.parent / LOADER_STATE / str(step) / f"process_{p}.json"

    def read_meta(self, step: int) -> dict[str, Any]:
        return read_json(self.directory / str(step) / "meta" / "metadata")

    def check(self, step: int, config: Config | None = None) -> str | None:
        """Why ``step`` cannot be resumed from (damage), or ``None`` when it looks intact.

        With ``config``, raises :class:`IncompatibleCheckpointError` when the step belongs to
        another experiment or another number of processes (that is not damage)."""
        reason, verified = check_files(self.directory / str(step))
        if reason:
            return reason
        if verified:
            self._verified.add(step)
        meta = self.read_meta(step)
        if config is not None:
            check_compatible(meta.get("config", {}), config, self.directory / str(step))
        processes = int(meta.get("processes", 1))
        if config is not None and processes != jax.process_count():
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} was saved by {processes} process(es), "
                f"this run has {jax.process_count()}; the data order resumes only with the same "
                "number of hosts: launch as many, or start a new run (another log.name)"
            )
        shards = int(meta.get("loader_shards", processes))
        if config is not None and processes > 1 and shards != _loader_shards(config):
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} was saved with the data read in "
                f"{shards} shards, this layout reads {_loader_shards(config)} (processes "
                "sharing sequences under train.context_parallel read the same rows); resume with "
                "the checkpoint's train.context_parallel, or start a new run (another log.name)"
            )
        for p in range(processes):
            path = self.loader_state_path(step, p)
            rel = path.relative_to(self.directory.parent)
            if not path.is_file():
                return f"missing {rel}"
            try:
                if not isinstance(read_json(path), dict):
                    raise ValueError
            except (OSError, ValueError):
                return f"unreadable {rel}"
        return None

    def select(
        self,
        config: Config | None = None,
        *,
        move_damaged: bool = True,
        step: int | None = None,
        report: bool = True,
    ) -> int | None:
        """The newest intact step (or ``step``, if given and intact), ``None`` if there is none.

        Damaged steps newer than it are reported through ``warn`` and, with ``move_damaged``,
        moved to ``checkpoints/damaged/`` -- after the choice is made, so a refusal (an
        incompatible config) leaves the directory as it was. When every step is damaged they
        are moved and :class:`CheckpointError` says so: starting over is left to the user.
        ``report=False`` only looks (no warning, no move, no error for damage): the refusals
        (:class:`IncompatibleCheckpointError`) still raise.
        """
        candidates = [s for s in reversed(self.steps()) if step is None or s == step]
        if step is not None and not candidates:
            raise CheckpointError(f"{self.directory} has no checkpoint for step {step}")
        damaged: list[tuple[int, str]] = []
        chosen = None
        for s in candidates:
            reason = self.check(s, config)
            if reason is None:
                chosen = s
                break
            damaged.append((s, reason))
        self.last_damaged = damaged
        if not report:
            return chosen
        for s, reason in damaged:
            if move_damaged:
                dest = self.move_aside(s, reason)
                where = f"moved to {dest}"
            else:
                where = "left in place"
            then = f"resuming from step {chosen}" if chosen is not None else "no intact one is left"
            self.warn(
                f"checkpoint step {s} in {self.directory} is damaged ({reason}); {where}; {then}"
            )
        if chosen is None and damaged:
            steps = ", ".join(str(s) for s, _ in damaged)
            if step is not None:
                raise CheckpointError(
                    f"checkpoint step {step} in {self.directory} is damaged ({damaged[0][1]}); "
                    "use another step or the run directory (its newest intact step)"
                )
            raise CheckpointError(
                f"every checkpoint in {self.directory} is damaged (steps {steps}); "
                + (
                    f"they were moved to {self.directory / DAMAGED}, so running again starts "
                    "this run from step 0"
                    if move_damaged
                    else "restore them, or start a new run"
                )
            )
        return chosen

    def move_aside(self, step: int, reason: str) -> Path:
        """Move step ``step`` (and its loader positions) to ``damaged/<step>-<reason>``."""
        root = self.directory / DAMAGED
        root.mkdir(parents=True, exist_ok=True)
        dest = root / f"{step}-{slug(reason)}"
        if dest.exists():
            dest = dest.with_name(f"{dest.name}-{time.strftime('%Y%m%dT%H%M%S')}")
        shutil.move(str(self.directory / str(step)), str(dest))
        loader = self.directory.parent / LOADER_STATE / str(step)
        if loader.is_dir():
            shutil.move(str(loader), str(dest / LOADER_STATE))
        self._verified.discard(step)
        self._reset_manager()  # orbax caches its list of steps
        return dest

    # ---------------------------------------------------------------- save and restore

    def save(
        self,
        step: int,
        state: Any,
        meta: dict[str, Any],
        data_state: dict[str, Any],
        force: bool = False,
    ) -> None:
        """Save ``state`` (a pytree of global arrays) and ``meta`` (JSON) as ``step``, and this
        process's data-loader position beside it (each host reads its own part of the data)."""
        self._write_data_state(step, data_state)
        self.manager.wait_until_finished()  # orbax waits for the previous save here anyway
        self._write_manifests()
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
        self._saved_here.add(step)
        self._prune_data_states()

    def restore_state(self, step: int, abstract_state: Any) -> Any:
        """The saved pytree of ``step``, as arrays laid out like ``abstract_state``."""
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )
        return restored["state"]

    def restore(self, step: int, abstract_state: Any) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` into arrays laid out like ``abstract_state`` (shapes and shardings);
        returns the state and this process's data-loader position. Call :meth:`select` first."""
        state = self.restore_state(step, abstract_state)
        return state, read_json(self.loader_state_path(step))

    def restore_latest(
        self, config: Config | None, abstract_state: Any, *, move_damaged: bool = True
    ) -> tuple[int, Any, dict[str, Any]] | None:
        """:meth:`select` then :meth:`restore`; ``(step, state, loader position)`` or ``None``
        when there is no checkpoint. A step that passed the checks but cannot be read is treated
        as damaged when its file list was never recorded (single process); otherwise the error
        names the step and how to set it aside by hand."""
        while True:
            step = self.select(config, move_damaged=move_damaged)
            if step is None:
                return None
            try:
                state, data_state = self.restore(step, abstract_state)
                return step, state, data_state
            except Exception as e:  # noqa: BLE001 - classified below
                first = short_error(e)
                unreadable = is_unreadable(e)
                where = self.directory / str(step)
                if (
                    step in self._verified
                    or not unreadable
                    or not move_damaged
                    or jax.process_count() > 1
                ):
                    raise CheckpointError(
                        f"checkpoint {where} could not be restored ({first}); "
                        f"if it is damaged, move it aside (mv {where} {self.directory / DAMAGED}/) "
                        "and run again to resume from the previous one"
                    ) from e
                self.warn(f"checkpoint step {step} in {self.directory} cannot be read ({first})")
                dest = self.move_aside(step, "unreadable")
                self.warn(f"moved it to {dest}; trying the previous checkpoint")

    def _data_state_path(self, step: int) -> Path:
        return self.loader_state_path(step)

    def _write_data_state(self, step: int, data_state: dict[str, Any]) -> None:
        path = self._data_state_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data_state))
        tmp.replace(path)

    def _write_manifests(self) -> None:
        """File lists for the steps this process saved, once orbax has finalized them."""
        if jax.process_index() != 0:
            return
        for step in sorted(self._saved_here):
            step_dir = self.directory / str(step)
            if step_dir.is_dir() and not (step_dir / MANIFEST).exists():
                write_manifest(step_dir)
        self._saved_here.clear()

    def _prune_data_states(self) -> None:
        root = self.directory.parent / LOADER_STATE
        keep = {str(s) for s in self.manager.all_steps()}
        if jax.process_index() != 0 or not root.exists():
            return
        for d in root.iterdir():
            if (
                d.name not in keep
                and d.name.isdigit()
                and int(d.name) < max(map(int, keep), default=0)
            ):
                shutil.rmtree(d, ignore_errors=True)

    def wait(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._write_manifests()

    def close(self) -> None:
        if self._manager is not None:
            self._manager.wait_until_finished()
            self._write_manifests()
            self._manager.close()
            self._manager = None


def resolve_checkpoint(path: str | Path) -> tuple[Path, int | None]:
    """``(checkpoints directory, step or None for the newest)`` from a run directory
    (``RUN/checkpoints/<step>``), a checkpoints directory, or one step's directory."""
    p = Path(path).expanduser().absolute()
    if (p / "checkpoints").is_dir():
        return p / "checkpoints", None
    if re.fullmatch(r"\d+", p.name) and p.is_dir():
        return p.parent, int(p.name)
    if p.is_dir():
        return p, None
    raise PathNotFoundError(
        f"{path} does not exist or is not a directory; give a run directory (RUN_DIR, holding "
        "checkpoints/), a checkpoints directory or one step's directory (RUN_DIR/checkpoints/120)"
    )


def check_compatible(saved: dict[str, Any], current: Config, where: Path | str) -> None:
    run_dir = Path(where).parent.parent
    start_over = (
        f"to continue that run use its values; for a new experiment pick a new run directory "
        f"(log.name=... or log.run_dir=...), or move {run_dir} aside to start it over"
    )
    try:
        saved_cfg = load_config_from_dict(saved)
    except Exception as e:  # a config from an older/newer schema
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise IncompatibleCheckpointError(
            f"checkpoint {where} was written with a config this version cannot read ({first}); "
            + start_over
        ) from None
    # Keys a resumed run may change (logging, budgets, implementation choices such as the kernel
    # or chunk size) are declared beside their fields: Config.resume_may_change.
    changed = {
        k: v for k, v in diff(saved_cfg, current).items() if not current.resume_may_change(k)
    }
    if changed:
        keys = ", ".join(f"{k} (checkpoint {a!r}, now {b!r})" for k, (a, b) in changed.items())
        raise IncompatibleCheckpointError(
            f"checkpoint {where} belongs to a different experiment: {keys}; {start_over}"
        )


def abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )
