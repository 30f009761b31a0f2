"""Per-kernel reports of a GPU compile: grid, threads and shared memory from XLA's thunk sequence,
registers and spills from ptxas's ``-v`` log, and the capture of that log.

:func:`linear_gpt2.platform.target.compile_program` with ``kernels=True`` dumps XLA's thunk
sequence and reads each Pallas/Triton kernel's launch from it (:func:`parse_thunk_sequence`);
ptxas reports registers and spills only in XLA's INFO log, which :func:`enable_ptxas_log` turns
on before JAX starts and :func:`captured_stderr` collects from file descriptor 2 while compiling
(:func:`parse_ptxas_log`), passing the rest through: without ``--debug`` only what is not one of
XLA's log records (:mod:`linear_gpt2.platform.logs`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

from linear_gpt2.platform.logs import debug_enabled


@dataclasses.dataclass
class KernelReport:
    name: str
    grid: tuple[int, int, int]
    threads: tuple[int, int, int]
    shared_memory: int  # bytes per block
    registers: int | None = None  # per thread (None: ptxas log not captured)
    spill_stores: int | None = None  # bytes per thread
    spill_loads: int | None = None
    stack_frame: int | None = None

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    @property
    def threads_per_block(self) -> int:
        return math.prod(self.threads)

    @property
    def spills(self) -> int | None:
        if self.spill_stores is None:
            return None
        return self.spill_stores + (self.spill_loads or 0)

    def as_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "programs": self.programs}


_THUNK = re.compile(
    r"kCustomKernel\b.*?\]\s+(?P<name>\S+)\s+grid:\s*\[(?P<g>[\d,\s]+)\]\s+"
    r"threads:\s*\[(?P<t>[\d,\s]+)\]\s+shared_memory:\s*(?P<smem>\d+)"
)


def parse_thunk_sequence(text: str, metadata: str | None = None) -> list[KernelReport]:
    """Kernels of an XLA ``*.thunk_sequence.txt`` dump, in launch order. With ``metadata`` (the
    ``*.thunk_metadata.txt`` beside it) only the Pallas kernels are kept: every kernel is a
    ``kCustomKernel`` in XLA's thunk sequence, and the metadata's profile annotation
    (``pallas_call.N``) is what tells a Pallas kernel from XLA's own fusions."""
    pallas = None
    if metadata is not None:
        pallas = {
            int(i)
            for a, i in re.findall(r'profile_annotation: "([^"]*)"\s*thunk_id: (\d+)', metadata)
            if a.startswith("pallas_call")
        }
    out = []
    for line in text.splitlines():
        m = _THUNK.search(line)
        if not m:
            continue
        tid = re.match(r"\s*(\d+):", line)
        if pallas is not None and (tid is None or int(tid[1]) not in pallas):
            continue
        g = tuple(int(x) for x in m["g"].replace(" ", "").split(",") if x)
        t = tuple(int(x) for x in m["t"].replace(" ", "").split(",") if x)
        out.append(KernelReport(m["name"], g, t, int(m["smem"])))  # type: ignore[arg-type]
    return out


def parse_ptxas_log(text: str) -> dict[str, dict[str, int]]:
    """``{function: {registers, spill_stores, spill_loads, stack_frame}}`` from ptxas ``-v``
    output (the last report wins where a function was built more than once)."""
    out: dict[str, dict[str, int]] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"Function properties for (\S+)", line)
        if m:
            current = m[1]
            out.setdefault(current, {})
            continue
        m = re.search(
            r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads", line
        )
        if m and current:
            out[current].update(
                stack_frame=int(m[1]), spill_stores=int(m[2]), spill_loads=int(m[3])
            )
            continue
        m = re.search(r"Used (\d+) registers", line)
        if m and current:
            out[current]["registers"] = int(m[1])
    return out


def enable_ptxas_log() -> None:
    """Make XLA log ptxas's ``-v`` report (registers, spills) for every kernel it builds.

    Must run before JAX's backends start (XLA reads its logging settings once); the
    ``scripts/compile.py`` command calls it first thing. The log is INFO level: outside a
    :func:`compile_program` call it would go to stderr, so keep this to compile runs."""
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "0"
    os.environ["TF_CPP_VMODULE"] = "subprocess_compilation=3"


def ptxas_log_enabled() -> bool:
    return os.environ.get("TF_CPP_MIN_LOG_LEVEL") == "0" and "subprocess_compilation" in (
        os.environ.get("TF_CPP_VMODULE") or ""
    )


_GLOG = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d")


@contextlib.contextmanager
def captured_stderr(enabled: bool) -> Iterator[list[str]]:
    """Collect what native code writes to fd 2 (XLA's log) into the yielded list; afterwards
    write back what is not one of XLA's log records, its fatal ones, and with ``--debug`` its
    warnings and errors too (:mod:`linear_gpt2.platform.logs`); never its INFO records."""
    shown = "WEF" if debug_enabled() else "F"
    box: list[str] = []
    if not enabled:
        yield box
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as tmp:
        os.dup2(tmp.fileno(), 2)
        try:
            yield box
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            box.append(text)
            keep, in_hidden = [], False
            for line in text.splitlines():
                record = _GLOG.match(line)
                if record and record[1] not in shown:
                    in_hidden = True
                    continue
                if in_hidden and (line.startswith(("ptxas", " ", "\t")) or not line.strip()):
                    continue  # continuation lines of a multi-line record (ptxas output)
                in_hidden = False
                if "failed call to cuInit" not in line:
                    keep.append(line)
            if keep:
                print("\n".join(keep), file=sys.stderr)
