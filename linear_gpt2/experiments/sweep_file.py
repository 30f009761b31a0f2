"""A sweep file read into its points: the grid and the explicit points expanded, each point's
overrides and run name (``sweep.py`` runs them; its docstring shows the file's format)."""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path
from typing import Any

import yaml

from linear_gpt2.platform.errors import ConfigError

SWEEP_KEYS = {"name", "base", "out_dir", "overrides", "grid", "points", "name_keys", "slurm"}


@dataclasses.dataclass(frozen=True)
class Point:
    """One run of a sweep: its index, run name, and the overrides that define it."""

    index: int
    name: str
    values: dict[str, Any]  # the point's own keys (grid entry + explicit point)
    overrides: tuple[str, ...]  # everything passed to load_config after the base file


@dataclasses.dataclass
class Sweep:
    path: Path
    name: str
    base: Path
    out_dir: Path
    overrides: dict[str, Any]
    points: list[Point]
    slurm: dict[str, Any]


def format_value(v: Any) -> str:
    """A value as the right-hand side of a ``key=value`` override (OmegaConf reads YAML)."""
    if isinstance(v, bool):
        return "true" if v else "false"
    if v is None:
        return "null"
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)):
        return repr(v)
    return yaml.safe_dump(v, default_flow_style=True).strip()


# Short names for the keys that usually vary, so run names read like ctx4096_LT_chunked_c64.
NAME_PREFIX = {
    "data.context": "ctx",
    "attention.name": "",
    "attention.chunk_size": "c",
    "model.preset": "",
    "train.micro_batch": "mb",
    "train.lr": "lr",
    "seed": "seed",
    "attention.doc_reset": "reset",
    "attention.decay": "decay",
    "attention.feature_map": "",
    "data.mqar.num_kv_pairs": "kv",
}


def name_part(key: str, value: Any) -> str:
    prefix = NAME_PREFIX.get(key, key.rsplit(".", 1)[-1])
    text = format_value(value)
    safe = "".join(c if c.isalnum() or c in "-._" else "-" for c in text).strip("-")
    return f"{prefix}{safe}"


def expand(grid: dict[str, list[Any]] | None, points: list[dict[str, Any]] | None):
    """The sweep's points as dicts of dotted keys: the cartesian product of the grid (keys in
    order; a value that is a mapping sets its keys together, the grid key only names the axis)
    combined with each explicit point (explicit values win)."""
    grid = grid or {}
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise ConfigError(f"sweep grid: {k} must be a non-empty list, got {v!r}")
    combos = []
    for vals in itertools.product(*grid.values()):
        combo: dict[str, Any] = {}
        for k, v in zip(grid, vals):
            # A named axis: each value is a mapping of overrides set together.
            combo.update(v) if isinstance(v, dict) else combo.__setitem__(k, v)
        combos.append(combo)
    combos = combos or [{}]
    explicit = points or [{}]
    for p in explicit:
        if not isinstance(p, dict):
            raise ConfigError(f"sweep points: each point is a mapping of overrides, got {p!r}")
    return [{**g, **p} for p in explicit for g in combos]


def load_sweep(path: str | Path, extra: list[str] | tuple[str, ...] = ()) -> Sweep:
    """Read a sweep file; ``extra`` overrides (``key=value``) apply to every point, last."""
    path = Path(path).absolute()
    if not path.is_file():
        raise ConfigError(
            f"sweep file {str(path)!r} does not exist; the shipped ones are in configs/sweeps/"
        )
    try:
        spec = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        first = str(e).replace("\n", " ")
        raise ConfigError(f"sweep file {str(path)!r} is not valid YAML ({first})") from None
    if not isinstance(spec, dict):
        raise ConfigError(
            f"sweep file {str(path)!r} must be a mapping (name, base, grid, ...), got "
            f"{type(spec).__name__}"
        )
    bad = [o for o in extra if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like section.key=value, got {bad}")
    unknown = set(spec) - SWEEP_KEYS
    if unknown:
        raise ConfigError(
            f"sweep {path}: unknown key(s) {sorted(unknown)}; valid: {sorted(SWEEP_KEYS)}"
        )
    if "base" not in spec:
        raise ConfigError(f"sweep {path}: needs 'base', the config file the points override")
    name = str(spec.get("name") or path.stem)
    base = (path.parent / spec["base"]).resolve()
    # Absolute, so that subprocesses, SLURM tasks (which cd to the repository) and a later
    # rerun from elsewhere all find the same run directories.
    out_dir = Path(spec.get("out_dir") or f"runs/{name}").absolute()
    fixed = dict(spec.get("overrides") or {})
    values = expand(spec.get("grid"), spec.get("points"))
    varying = [k for k in dict.fromkeys(k for v in values for k in v) if _varies(k, values)]
    name_keys = list(spec.get("name_keys") or varying)
    points = []
    seen: dict[str, int] = {}
    for i, v in enumerate(values):
        named = {**fixed, **v}  # name_keys may name a fixed key too (ctx16384_LT_chunked_c64)
        run = "_".join(name_part(k, named[k]) for k in name_keys if k in named) or f"point{i}"
        if run in seen:
            raise ConfigError(
                f"sweep {path}: points {seen[run]} and {i} would both be named {run!r}; add the "
                "key that tells them apart to name_keys"
            )
        seen[run] = i
        overrides = (
            *(f"{k}={format_value(x)}" for k, x in fixed.items()),
            *(f"{k}={format_value(x)}" for k, x in v.items()),
            f"log.name={run}",
            f"log.run_dir={out_dir / run}",
            f"log.wandb_group={name}",
            *extra,
        )
        points.append(Point(i, run, v, overrides))
    return Sweep(path, name, base, out_dir, fixed, points, dict(spec.get("slurm") or {}))


def _varies(key: str, values: list[dict[str, Any]]) -> bool:
    seen = {json.dumps(v.get(key, "<unset>"), sort_keys=True, default=str) for v in values}
    return len(seen) > 1
