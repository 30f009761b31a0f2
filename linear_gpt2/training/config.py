"""The run config, loaded: YAML files and dotted command-line overrides merged onto the schema.

A run is described by one :class:`Config` (its schema, six sections of frozen dataclasses with
their checks, is in ``config_schema.py``; every name of it is importable from here). Files in
``configs/`` are YAML and may extend others (``defaults: [base.yaml]``); overrides are
``section.key=value`` strings (``model.n_layer=24 attention.chunk_size=128``). OmegaConf merges
them onto the schema, which rejects unknown keys and values of the wrong type; the dataclasses
then check the values and the combinations. The ``attention`` section is merged as a plain
mapping and read by the variant's own options class (``AttentionConfig.from_values``), which
types and checks each option the same way. Every failure is a :class:`ConfigError` that names
the key and says what is valid.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import typing
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from linear_gpt2.model.config import ModelConfig, preset_values
from linear_gpt2.platform.errors import ConfigError
from linear_gpt2.training.config_schema import (
    DATA_SOURCES,
    AttentionConfig,
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    MQARConfig,
    TrainConfig,
)

# The schema and ConfigError, re-exported: run code reaches for them with load_config.
__all__ = [
    "DATA_SOURCES",
    "AttentionConfig",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "LogConfig",
    "MQARConfig",
    "ModelConfig",
    "TrainConfig",
    "diff",
    "flat_items",
    "load_config",
    "load_config_from_dict",
    "main",
    "save_config",
]


def _valid_keys(node: Any) -> list[str]:
    return [str(k) for k in node.keys()] if isinstance(node, DictConfig) else []


def _translate(err: OmegaConfBaseException, schema: DictConfig) -> ConfigError:
    """Turn an OmegaConf error into one that names the full key and lists the valid ones."""
    full_key = getattr(err, "full_key", None) or ""
    parent_key, _, leaf = str(full_key).rpartition(".")
    if isinstance(err, ConfigKeyError) or "not in" in str(err):
        parent = OmegaConf.select(schema, parent_key) if parent_key else schema
        valid = _valid_keys(parent)
        close = difflib.get_close_matches(leaf, valid, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        where = f"section {parent_key!r}" if parent_key else "the top level"
        return ConfigError(
            f"unknown config key {full_key!r}{hint}; valid keys in {where}: {', '.join(valid)}"
        )
    if isinstance(err, ValidationError):
        expected = OmegaConf.select(schema, full_key) if full_key else None
        kind = type(expected).__name__ if expected is not None else "the schema's type"
        msg = str(err).splitlines()[0]
        return ConfigError(
            f"{full_key}: wrong type ({msg}); expected a value like {expected!r} ({kind})"
        )
    return ConfigError(f"{full_key or 'config'}: {str(err).splitlines()[0]}")


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        with path.open() as f:
            data = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {str(path)!r} is not valid YAML ({_yaml_problem(e)})"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(
            f"config file {str(path)!r} must hold a mapping of sections, got {type(data).__name__}"
        )
    # ``defaults: [other.yaml, ...]`` lets a file extend others (paths relative to this file).
    bases = data.pop("defaults", []) or []
    merged: dict[str, Any] = {}
    for base in [bases] if isinstance(bases, str) else bases:
        merged = _deep_merge(merged, _read_yaml(path.parent / base))
    return _deep_merge(merged, data)


def _yaml_problem(e: yaml.YAMLError) -> str:
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


def _deep_merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = dict(a)
    for k, v in b.items():
        out[k] = (
            _deep_merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
        )
    return out


def load_config(
    path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()
) -> Config:
    """Load a run configuration: schema defaults, then the YAML file, then the overrides.

    ``model.preset`` (``124M``, ``355M``, ``774M``, ``1.6B`` or a Hugging Face name) fills
    ``n_layer``, ``n_head`` and ``n_embd`` before the file's and the overrides' own keys apply.
    """
    raw = _read_yaml(Path(path)) if path is not None else {}
    bad = [o for o in overrides if "=" not in o or o.startswith("=")]
    if bad:
        raise ConfigError(f"overrides must look like section.key=value, got {bad}")
    try:
        cli = OmegaConf.from_dotlist(list(overrides))
    except OmegaConfBaseException as e:  # pragma: no cover - malformed dotlist
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {e}") from None
    file_cfg = OmegaConf.create(raw)
    preset = OmegaConf.select(cli, "model.preset", default=None) or OmegaConf.select(
        file_cfg, "model.preset", default=None
    )
    for layer in (file_cfg, cli):
        if OmegaConf.select(layer, "model.preset", default=None) is not None:
            layer.model.pop("preset")
    layers = [file_cfg, cli]
    if preset is not None:
        layers.insert(0, OmegaConf.create({"model": preset_values(str(preset))}))
    return _build(layers)


def load_config_from_dict(data: dict[str, Any]) -> Config:
    """A ``Config`` from its ``to_dict()`` form (as saved with runs and checkpoints)."""
    return _build([OmegaConf.create(data)])


@functools.cache
def _schema_class() -> type:
    """:class:`Config`'s sections as OmegaConf's schema, with ``attention`` a plain mapping:
    its keys are the variant's, typed and checked by its options class, not by OmegaConf."""
    hints = typing.get_type_hints(Config)
    specs = []
    for f in fields(Config):
        if f.name == "attention":
            specs.append(("attention", dict[str, Any], dataclasses.field(default_factory=dict)))
        elif f.default_factory is not dataclasses.MISSING:
            specs.append(
                (f.name, hints[f.name], dataclasses.field(default_factory=f.default_factory))
            )
        else:
            specs.append((f.name, hints[f.name], dataclasses.field(default=f.default)))
    return dataclasses.make_dataclass("ConfigSchema", specs)


def _build(layers: list[DictConfig]) -> Config:
    schema = OmegaConf.structured(_schema_class())
    try:
        merged = schema
        for layer in layers:
            merged = OmegaConf.merge(merged, layer)
        obj = OmegaConf.to_object(merged)
        sections = {f.name: getattr(obj, f.name) for f in fields(obj)}
    except ConfigError:
        raise
    except OmegaConfBaseException as e:
        raise _translate(e, schema) from None
    sections["attention"] = AttentionConfig.from_values(sections["attention"])
    return Config(**sections)


def save_config(cfg: Config, path: str | Path) -> None:
    """Write ``cfg`` as YAML, replacing ``path`` only once the new file is whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(cfg.to_yaml())
    tmp.replace(path)


def flat_items(cfg: Config) -> dict[str, Any]:
    """``{"model.n_layer": 12, ...}``: the resolved config as dotted keys (for wandb and diffs)."""
    out: dict[str, Any] = {}

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else k, v)
        else:
            out[prefix] = node

    walk("", cfg.to_dict())
    return out


def diff(a: Config, b: Config) -> dict[str, tuple[Any, Any]]:
    """Keys whose values differ between two configs: ``{key: (a_value, b_value)}``."""
    fa, fb = flat_items(a), flat_items(b)
    return {k: (fa.get(k), fb.get(k)) for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _print_config(argv: list[str]) -> int:
    args = list(argv)
    if args and args[0] in ("-h", "--help"):
        print(main.__doc__)
        return 0
    path = args.pop(0) if args and "=" not in args[0] else None
    print(load_config(path, args).to_yaml(), end="")
    return 0


def main(argv: list[str] | None = None) -> int:
    """``python -m linear_gpt2.training.config CONFIG [key=value ...]``: print the resolved
    config (exit 2 with a one-line error for a bad key or value)."""
    from linear_gpt2.platform import cli  # the entry point's: importing the library sets nothing

    return cli.run(_print_config, argv)


if __name__ == "__main__":
    raise SystemExit(main())
