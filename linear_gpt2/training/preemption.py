"""Preemption: SIGTERM (a scheduler's notice, e.g. SLURM's ``--signal=TERM@120``) or SIGINT
(Ctrl-C) asks the training loop to stop at the end of the current step, so that it saves a
checkpoint and exits cleanly instead of dying mid-update.
"""

from __future__ import annotations

import signal
from typing import Any


class StopFlag:
    """``with StopFlag() as stop:`` the first SIGTERM or SIGINT sets ``stop.signal`` (the
    signal's number) instead of ending the process, and the previous handlers come back on
    exit. A SIGINT after that first signal raises ``KeyboardInterrupt`` at once."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopFlag:
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread (e.g. some test runners): no handler
                pass
        return self

    def _handle(self, signum, frame) -> None:
        if self.signal is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
