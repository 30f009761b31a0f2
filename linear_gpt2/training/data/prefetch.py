"""Reading ahead: an iterator run in a background thread, a bounded number of items ahead of its
consumer, so that the next batch is ready when the device finishes a step. Used by the
:class:`~linear_gpt2.training.data.loader.Loader` (``data.prefetch`` batches).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any


class _End:
    pass


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """Runs an iterator in a daemon thread, ``depth`` items ahead, through a bounded queue.

    Exceptions raised by the iterator are re-raised in the consumer at the point they occurred;
    :meth:`close` stops the thread (also while it is blocked on a full queue) and joins it.
    """

    def __init__(self, make_iter: Callable[[], Iterator[Any]], depth: int):
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._done = False
        self._thread = threading.Thread(target=self._run, args=(make_iter,), daemon=True)
        self._thread.name = "linear_gpt2-data-prefetch"
        self._thread.start()

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def _run(self, make_iter: Callable[[], Iterator[Any]]) -> None:
        it = None
        try:
            it = make_iter()
            for item in it:
                if not self._put(item):
                    return
            self._put(_End())
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises
            self._put(_Failed(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()  # release open files in the thread that opened them

    def __next__(self) -> Any:
        if self._done:
            raise StopIteration
        item = self._q.get()
        if isinstance(item, _End):
            self._done = True
            raise StopIteration
        if isinstance(item, _Failed):
            self._done = True
            raise item.exc
        return item

    def close(self, timeout: float = 10.0) -> None:
        self._stop.set()
        while True:  # unblock a producer waiting on a full queue
            try:
                self._q.get_nowait()
            except queue.Empty:
                break
        self._thread.join(timeout)
