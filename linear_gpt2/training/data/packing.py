"""Tokenize documents and pack the token stream into fixed windows.

The stream is ``doc_0 EOT doc_1 EOT doc_2 EOT ...`` (GPT-2 BPE ``encode_ordinary``, EOT=50256
after every document). It is cut into consecutive, non-overlapping windows of ``context + 1``
tokens; a window ``w`` gives ``inputs = w[:-1]`` and ``targets = w[1:]``. Concatenating the
windows gives back the stream (up to a final partial window), so no token is lost or repeated
and documents are packed across window boundaries without padding.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable

import numpy as np

from linear_gpt2.model.tokenizer import EOT, gpt2


def doc_tokens(text: str) -> np.ndarray:
    """``encode_ordinary(text) + [EOT]`` as uint16 (GPT-2 ids are < 2^16), shape [n + 1]."""
    ids = gpt2().encode_ordinary(text)
    ids.append(EOT)
    return np.asarray(ids, dtype=np.uint16)


def split_window(windows: np.ndarray, segments: bool = False) -> dict[str, np.ndarray]:
    """``{"inputs", "targets"}`` int32 [B, T] from windows [B, T + 1]; with ``segments`` also
    ``"segments"``, the :func:`document_ids` of the inputs."""
    w = windows.astype(np.int32, copy=False)
    batch = {"inputs": w[:, :-1], "targets": w[:, 1:]}
    if segments:
        batch["segments"] = document_ids(batch["inputs"])
    return batch


def document_ids(inputs: np.ndarray) -> np.ndarray:
    """int32 [B, T]: each input token's document within its row: 0 for the document the row
    starts in, one more after each EOT (the token after an EOT starts a document; the EOT ends
    the one before). What ``attention.doc_reset`` restarts attention at."""
    inputs = np.asarray(inputs)
    ids = np.zeros(inputs.shape, dtype=np.int32)
    np.cumsum(inputs[:, :-1] == EOT, axis=1, dtype=np.int32, out=ids[:, 1:])
    return ids


def document_boundaries(inputs: np.ndarray) -> list[np.ndarray]:
    """Positions of EOT in each row of ``inputs`` [B, T]: the token after each is a new document."""
    return [np.flatnonzero(row == EOT) for row in np.asarray(inputs)]


class Packer:
    """Accumulates tokenized documents and cuts batches of ``rows`` windows of ``window`` tokens.

    Each document is added with its position (any hashable, e.g. ``(epoch, file, row)``). After a
    batch is taken, :attr:`resume_point` says where the stream continues: ``(position, offset)``
    of the first document not fully emitted and how many of its tokens were emitted, or ``None``
    when the buffer is empty (continue after the last added document).
    """

    def __init__(self, window: int, rows: int):
        self.window, self.rows = window, rows
        self._segments: deque[tuple[Hashable, np.ndarray]] = deque()
        self._offset = 0  # tokens of the first segment already emitted
        self._size = 0  # tokens buffered and not yet emitted

    def add(self, position: Hashable, tokens: np.ndarray, offset: int = 0) -> None:
        """Buffer a document's tokens; ``offset`` > 0 drops a prefix already emitted before."""
        if not self._segments:
            self._offset = offset
        elif offset:
            raise ValueError("an offset is only valid for the first document of an empty buffer")
        self._segments.append((position, tokens))
        self._size += len(tokens) - offset

    def ready(self) -> bool:
        return self._size >= self.rows * self.window

    def take(self) -> np.ndarray:
        """The next batch of windows, uint16 [rows, window]; call only when :meth:`ready`."""
        need = self.rows * self.window
        out = np.empty(need, dtype=np.uint16)
        filled = 0
        while filled < need:
            _, seg = self._segments[0]
            n = min(len(seg) - self._offset, need - filled)
            out[filled : filled + n] = seg[self._offset : self._offset + n]
            filled += n
            self._offset += n
            if self._offset == len(seg):
                self._segments.popleft()
                self._offset = 0
        self._size -= need
        return out.reshape(self.rows, self.window)

    @property
    def resume_point(self) -> tuple[Hashable, int] | None:
        if not self._segments:
            return None
        return self._segments[0][0], self._offset
