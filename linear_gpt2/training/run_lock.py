"""One writer per run directory: the trainer holds an exclusive lock on ``RUN_DIR/trainer.lock``
for as long as it runs, and a second trainer on the same directory stops before it writes
anything, naming the holder.

The lock is ``flock(2)`` through ``filelock``: the kernel drops it when the holding process ends
in any way (a crash, ``kill -9``, a node that reboots), so a killed trainer never blocks the next
run. The file holds the holder's host, pid, start time and command, written once the lock is
taken; it is removed when the trainer ends normally and left (stale, harmless) by a killed one.
Across hosts the lock is as good as the file system's ``flock``: NFS (v4, or v3 with lockd)
carries it to the server, Lustre only when mounted with ``-o flock``; on a file system without
``flock`` (Lustre's default ``noflock``) the trainer warns and runs unlocked. ``docs/training.md``
("One writer per run directory") says the same for users.

A job of several processes (``jax.distributed``) takes one lock, on process 0, and every process
learns whether it got it before anything is written.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import filelock
import jax
import numpy as np
from jax.experimental import multihost_utils

from linear_gpt2.platform.errors import RunError

LOCK_FILE = "trainer.lock"
# flock(2) is missing (Lustre without -o flock) or has no lock manager behind it (NFSv3 without
# lockd): the file system cannot lock, which is not a refusal.
_NO_FLOCK = (errno.ENOSYS, errno.ENOLCK, errno.EOPNOTSUPP)


class RunDirectoryLockedError(RunError):
    """Another trainer holds the run directory (exit 1); the message names it."""


class RunDirectoryNotWritableError(RunError):
    """The run directory (or its lock file) cannot be created or written (exit 1)."""


def _holder_record() -> dict[str, Any]:
    return {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "started": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "command": " ".join(sys.argv)[:500],
    }


def read_holder(run_dir: str | Path) -> dict[str, Any] | None:
    """The holder record in ``RUN_DIR/trainer.lock``, or None (no file, or not written yet).
    The record of a trainer that was killed stays in the file until the next one takes it."""
    try:
        record = json.loads((Path(run_dir) / LOCK_FILE).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def describe_holder(record: dict[str, Any] | None) -> str:
    """``pid 123 on host n1 (since 2025-01-01 10:00:00 UTC)`` or ``an unknown process``."""
    if not record:
        return "a process that has not written its name yet"
    text = f"pid {record.get('pid', '?')} on host {record.get('host', '?')}"
    if record.get("started"):
        text += f" (since {record['started']})"
    if record.get("host") == socket.gethostname() and isinstance(record.get("pid"), int):
        try:
            os.kill(record["pid"], 0)
        except ProcessLookupError:
            text += ", which is no longer running here: a process it started still holds it"
        except OSError:
            pass
    return text


class RunLock:
    """``with RunLock(run_dir):`` the exclusive lock on ``run_dir`` (created if missing; removed
    again on release if the lock was all that was written into it)."""

    def __init__(self, run_dir: str | Path, warn: Callable[[str], None] | None = None):
        self.run_dir = Path(run_dir).absolute()
        self.path = self.run_dir / LOCK_FILE
        self.warn = warn or _warn_stderr
        self._lock: filelock.UnixFileLock | None = None
        self._created: list[Path] = []  # directories this lock created, innermost first

    def acquire(self) -> None:
        """Take the lock, or raise :class:`RunDirectoryLockedError` (held by another process)
        or :class:`RunDirectoryNotWritableError`."""
        self._make_run_dir()
        lock = filelock.UnixFileLock(
            self.path,
            timeout=0,
            thread_local=False,
            fallback_to_soft=False,  # a soft lock outlives a killed holder
            on_acquired=_write_holder,
        )
        try:
            lock.acquire()
        except filelock.Timeout:
            self._remove_created_dirs()
            raise RunDirectoryLockedError(
                f"log.run_dir {self.run_dir} is in use by another trainer: "
                f"{describe_holder(_await_holder(self.run_dir))}; wait for it to end (or stop it), "
                "or start this run in another directory (log.name=... or log.run_dir=...)"
            ) from None
        except OSError as e:
            if e.errno in _NO_FLOCK:
                self.warn(
                    f"log.run_dir {self.run_dir} cannot be locked: its file system has no "
                    f"flock ({e.strerror}); make sure no other trainer uses this directory "
                    "(on Lustre, mount with -o flock)"
                )
                return
            self._remove_created_dirs()
            raise self._not_writable(e) from None
        self._lock = lock

    def release(self) -> None:
        if self._lock is None:
            self._remove_created_dirs()
            return
        with contextlib.suppress(FileNotFoundError):
            # Removed while still held: a process waiting on this inode finds it unlinked and
            # does not take a lock that nobody else would see.
            self.path.unlink()
        self._lock.release()
        self._lock = None
        self._remove_created_dirs()

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def _make_run_dir(self) -> None:
        missing = []
        for d in (self.run_dir, *self.run_dir.parents):
            if d.exists():
                break
            missing.append(d)
        if self.run_dir.exists() and not self.run_dir.is_dir():
            raise RunDirectoryNotWritableError(
                f"log.run_dir {self.run_dir} is a file, not a directory; set log.run_dir (or "
                "log.name, for runs/<name>) to a directory"
            )
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise self._not_writable(e) from None
        self._created = missing

    def _remove_created_dirs(self) -> None:
        """A run refused before it wrote anything leaves no directory behind."""
        for d in self._created:
            try:
                d.rmdir()
            except OSError:
                break  # something else was written there: keep it
        self._created = []

    def _not_writable(self, e: OSError) -> RunDirectoryNotWritableError:
        where = e.filename or self.run_dir
        return RunDirectoryNotWritableError(
            f"log.run_dir {self.run_dir} cannot be written ({e.strerror or e}: {where}); set "
            "log.run_dir (or log.name, for runs/<name>) to a directory you can write, or fix "
            "its permissions"
        )


def _await_holder(run_dir: Path, seconds: float = 2.0) -> dict[str, Any] | None:
    """The holder's record, waiting up to ``seconds`` for it: the holder takes the lock and then
    writes its record, so a trainer refused in between would otherwise name nobody."""
    deadline = time.monotonic() + seconds
    while (record := read_holder(run_dir)) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    return record


def _write_holder(fd: int) -> None:
    data = (json.dumps(_holder_record()) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _warn_stderr(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def job_lock(run_dir: str | Path, warn: Callable[[str], None] | None = None) -> Iterator[None]:
    """The run directory's lock for the whole job: process 0 takes it, and every process raises
    when it could not (process 0 with the reason, the others pointing at it)."""
    if jax.process_count() == 1:
        with RunLock(run_dir, warn):
            yield
        return
    lock = RunLock(run_dir, warn) if jax.process_index() == 0 else None
    failure: BaseException | None = None
    if lock is not None:
        try:
            lock.acquire()
        except Exception as e:  # noqa: BLE001 - every process must hear of it, then it is raised
            failure = e
    ok = multihost_utils.broadcast_one_to_all(np.int32(failure is None))
    if failure is not None:
        raise failure
    if not int(ok):
        raise RunDirectoryLockedError(
            f"process 0 could not lock log.run_dir {Path(run_dir).absolute()}; its error says why"
        )
    try:
        yield
    finally:
        if lock is not None:
            lock.release()
