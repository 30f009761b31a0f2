"""Third-party logs stay off the terminal unless ``--debug``: an entry point's stderr holds our
own warnings and its one-line ``error: ...``, not XLA's C++ log (its rematerialisation and
scheduler complaints about a step that does not fit run to pages), absl's, orbax's, JAX's or
TensorStore's.

:mod:`linear_gpt2.platform.cli` sets XLA's minimum log level to FATAL when it is imported
(:func:`quiet_native_logs`: ``TF_CPP_MIN_LOG_LEVEL=3``, which jaxlib reads once as it loads;
a crash still says why), and while an entry point runs raises those Python loggers to CRITICAL
and drops the Python warnings those packages issue (:func:`quiet_python_logs`). Our own
warnings are untouched: ``warning: ...`` lines printed to stderr, ``warnings.warn`` called from
``linear_gpt2`` and the ``linear_gpt2.*`` loggers. With ``--debug`` (or ``LINEAR_GPT2_DEBUG=1``)
nothing is hidden. A log level the user set is kept; the one set here is marked, so that a
process started with ``--debug`` by a quiet one (a sweep point) shows everything again.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence

DEBUG_ENV = "LINEAR_GPT2_DEBUG"
DEBUG_FLAG = "--debug"
NATIVE_LEVEL_ENV = "TF_CPP_MIN_LOG_LEVEL"  # XLA's (and TSL's): read once, when jaxlib loads
_SET_HERE_ENV = "LINEAR_GPT2_QUIET_NATIVE"  # NATIVE_LEVEL_ENV was set by this module
THIRD_PARTY_LOGGERS = ("absl", "jax", "jaxlib", "orbax", "tensorstore", "flax", "etils", "optax")
# Packages whose Python warnings are theirs, not ours: told by the code that called warn(), not
# by the module a stacklevel attributes the warning to (ours point at our callers, theirs often
# at our code).
_THIRD_PARTY_PACKAGES = frozenset(
    ("jax", "jaxlib", "flax", "orbax", "optax", "absl", "tensorstore", "etils", "chex")
)


def debug_enabled(argv: Sequence[str] = ()) -> bool:
    """``--debug`` in ``argv`` or ``LINEAR_GPT2_DEBUG`` set to a true value."""
    value = os.environ.get(DEBUG_ENV, "").strip().lower()
    return DEBUG_FLAG in argv or value not in ("", "0", "false", "no", "off")


def quiet_native_logs(argv: Sequence[str] = ()) -> bool:
    """XLA's C++ log off the terminal unless ``argv`` or the environment asks for ``--debug``;
    returns whether it is. Only effective before jaxlib is imported."""
    if debug_enabled(argv):
        if os.environ.pop(_SET_HERE_ENV, None):
            os.environ.pop(NATIVE_LEVEL_ENV, None)
        return False
    if NATIVE_LEVEL_ENV not in os.environ:
        os.environ[NATIVE_LEVEL_ENV] = "3"
        os.environ[_SET_HERE_ENV] = "1"
    return True


@contextlib.contextmanager
def quiet_python_logs(enabled: bool = True) -> Iterator[None]:
    """Within the block, the third-party Python loggers at CRITICAL and their warnings ignored;
    both as they were afterwards (entry points also run in process, in tests and notebooks)."""
    if not enabled:
        yield
        return
    loggers = [logging.getLogger(name) for name in THIRD_PARTY_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        show = warnings.showwarning

        def show_ours(message, category, filename, lineno, file=None, line=None):
            if _issued_by_third_party():
                return
            show(message, category, filename, lineno, file, line)

        warnings.showwarning = show_ours
        for logger in loggers:
            logger.setLevel(logging.CRITICAL)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)


def _issued_by_third_party() -> bool:
    """Whether the code that called ``warnings.warn`` (the first frame above the warnings
    machinery and this module) belongs to one of the third-party packages."""
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in ("warnings", __name__):
        frame = frame.f_back
    if frame is None:
        return False
    return str(frame.f_globals.get("__name__", "")).split(".")[0] in _THIRD_PARTY_PACKAGES


class _Callback(logging.Handler):
    def __init__(self, write: Callable[[str], None]):
        super().__init__()
        self.write = write

    def emit(self, record: logging.LogRecord) -> None:
        self.write(record.getMessage())


@contextlib.contextmanager
def echo(name: str, write: Callable[[str], None], level: int = logging.INFO) -> Iterator[None]:
    """Within the block, each record of logger ``name`` (and its children) at ``level`` or above
    is passed to ``write`` as its message: how an entry point shows the library's INFO records
    that matter to it (the kernel choices made by shape) without a global list. The logger's
    level is lowered to ``level`` meanwhile if it was higher, and restored."""
    logger = logging.getLogger(name)
    handler, old = _Callback(write), logger.level
    if logger.getEffectiveLevel() > level:
        logger.setLevel(level)
    logger.addHandler(handler)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)
