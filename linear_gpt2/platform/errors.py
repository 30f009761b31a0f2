"""The project's expected failures: what the library raises when a run cannot go on.

Two families, told apart by who has to act (``linear_gpt2.platform.cli`` maps them to exit codes):

- :class:`UsageError` (exit 2): the command as given cannot run; fixing the arguments, the config
  or a file the user wrote (a sweep file, a prompt) fixes it. ``ValueError`` subclass.
  :class:`ConfigError` is one.
- :class:`RunError` (exit 1): the inputs are there but damaged or unusable (data, shards,
  checkpoints), a device or an optional dependency is missing, or training itself failed
  (non-finite loss, out of memory). ``RuntimeError`` subclass.

Messages are one line where possible and name the file, key or value and the fix; the classes add
no behaviour beyond that, so library callers can catch the builtin bases as before.
"""

from __future__ import annotations

import difflib
import importlib


class LinearGPT2Error(Exception):
    """Base of every expected failure; ``exit_code`` is what ``linear_gpt2.platform.cli`` exits with."""

    exit_code = 1


class UsageError(LinearGPT2Error, ValueError):
    """Bad arguments, config, sweep file or prompt: the user changes the command (exit 2)."""

    exit_code = 2


class PathNotFoundError(UsageError, FileNotFoundError):
    """A path given on the command line (or in the config) does not exist (exit 2)."""


class RunError(LinearGPT2Error, RuntimeError):
    """Damaged or unusable data, checkpoint, shard or device; a failed run (exit 1)."""

    exit_code = 1


class DataError(RunError):
    """Input data that cannot be used as is; the message names the file and what to do."""


class DataNotFoundError(DataError, FileNotFoundError):
    """The data a config points at does not exist (also a ``FileNotFoundError``)."""


class CheckpointError(RunError):
    """A checkpoint that cannot be read, or no checkpoint where one is needed."""


class DeviceError(RunError):
    """The requested device, backend or kernel is not available here."""


class OutOfMemoryError(RunError, MemoryError):
    """The device ran out of memory; the message names the sizes and the settings to change."""


class MissingDependencyError(RunError, ImportError):
    """An optional package is not installed; the message gives the ``pip install`` command.

    ``MissingDependencyError("jax_triton", "pip install -e '.[triton]'", "kernel=triton")``
    reads: ``kernel=triton needs the optional package 'jax_triton', which is not installed;
    install it with: pip install -e '.[triton]'``.
    """

    def __init__(self, package: str, install: str | None = None, needed_for: str | None = None):
        self.package = package
        self.install = install or f"pip install {package}"
        who = needed_for or "this command"
        super().__init__(
            f"{who} needs the optional package {package!r}, which is not installed; "
            f"install it with: {self.install}"
        )
        self.name = package


def require(module: str, install: str | None = None, needed_for: str | None = None):
    """``importlib.import_module(module)``, or :class:`MissingDependencyError` naming the fix."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        if e.name is not None and e.name.split(".")[0] != module.split(".")[0]:
            raise  # the package is there but one of its own imports failed: a real error
        raise MissingDependencyError(module.split(".")[0], install, needed_for) from e


class ConfigError(UsageError):
    """A configuration that cannot run, with the offending key and what would be valid (a
    ``ValueError``; the command line exits 2)."""


def check(cond: bool, key: str, message: str) -> None:
    """Raise :class:`ConfigError` ``"key: message"`` unless ``cond``."""
    if not cond:
        raise ConfigError(f"{key}: {message}")


def check_choice(value: object, key: str, valid: tuple[str, ...] | list[str]) -> None:
    """Raise :class:`ConfigError` naming ``key``, the closest valid value and all of them, unless
    ``value`` is one of ``valid``."""
    if value not in valid:
        close = difflib.get_close_matches(str(value), [str(v) for v in valid], n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"{key}: {value!r} is not valid{hint}; valid values: {', '.join(valid)}")
