"""Orbax checkpoints of a run: train state, RNG, data-loader position and the resolved config.

Saving is asynchronous (training continues while the arrays are written) and keeps the last
``checkpoint.keep``. A checkpoint holds the resolved config; restoring under a config whose
run-defining keys differ is refused with the differing keys, so a resumed run cannot silently
become another experiment.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from linear_gpt2.config import CheckpointConfig, Config, diff

# Keys that may change between a run and its resumption: logging, budgets, and implementation
# choices that do not change the function computed (kernel, chunk size, micro-batch split).
MUTABLE_PREFIXES = (
    "log.",
    "checkpoint.",
    "train.max_steps",
    "train.max_hours",
    "train.micro_batch",
    "train.on_nan",
    "train.fsdp",
    "attention.kernel",
    "attention.chunk_size",
    "model.remat",
    "model.loss_chunk",
)


class IncompatibleCheckpointError(RuntimeError):
    pass


class Checkpointer:
    def __init__(self, directory: str | Path, cfg: CheckpointConfig):
        self.directory = Path(directory).absolute()
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=cfg.keep,
                enable_async_checkpointing=cfg.async_save,
                create=True,
            ),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

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
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=force,
        )
        self._prune_data_states()

    def restore(self, step: int, abstract_state: Any, config: Config) -> tuple[Any, dict[str, Any]]:
        """Restore ``step`` into arrays laid out like ``abstract_state`` (shapes and shardings);
        returns the state and this process's data-loader position."""
        meta = self.manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))[
            "meta"
        ]
        check_compatible(meta["config"], config, self.directory / str(step))
        path = self._data_state_path(step)
        if not path.exists():
            raise IncompatibleCheckpointError(
                f"checkpoint {self.directory / str(step)} has no data-loader position for process "
                f"{jax.process_index()} ({path} is missing): it was saved by a run with "
                f"{meta['processes']} process(es), this run has {jax.process_count()}"
            )
        restored = self.manager.restore(
            step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
        )
        return restored["state"], json.loads(path.read_text())

    def _data_state_path(self, step: int) -> Path:
        return (
            self.directory.parent
            / "loader_state"
            / str(step)
            / f"process_{jax.process_index()}.json"
        )

    def _write_data_state(self, step: int, data_state: dict[str, Any]) -> None:
        path = self._data_state_path(step)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(data_state))
        tmp.replace(path)

    def _prune_data_states(self) -> None:
        root = self.directory.parent / "loader_state"
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
        self.manager.wait_until_finished()

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def check_compatible(saved: dict[str, Any], current: Config, where: Path | str) -> None:
    from linear_gpt2.config import load_config_from_dict

    try:
        saved_cfg = load_config_from_dict(saved)
    except Exception as e:  # a config from an older/newer schema
        raise IncompatibleCheckpointError(
            f"checkpoint {where} was written with a config this version cannot read ({e}); "
            "start a new run directory or set checkpoint.resume=never"
        ) from None
    changed = {
        k: v for k, v in diff(saved_cfg, current).items() if not k.startswith(MUTABLE_PREFIXES)
    }
    if changed:
        lines = "\n".join(f"  {k}: checkpoint={a!r} now={b!r}" for k, (a, b) in changed.items())
        raise IncompatibleCheckpointError(
            f"checkpoint {where} belongs to a different experiment; these keys differ:\n{lines}\n"
            "Use the checkpoint's values, start a new run directory (log.name=...), or set "
            "checkpoint.resume=never to start from scratch."
        )


def abstract(tree: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), tree, shardings
    )
