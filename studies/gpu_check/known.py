"""What is known of the H100 before a GPU comes: the prices :mod:`.stages` puts on its units.

Read from ``benchmarks/results/``: the step times and compile times measured on the lent H100
(``step_time_h100_*.json``, ``memory_check_h100*.json``), the memory settings ``auto`` compiles
before one fits (the compiled frontier, ``memory_frontier_h100_compiled.json``: its ``tried``),
the unit times an earlier ``make gpu-check`` recorded (``gpu_check_h100_measured.json``), and
the steps compiled here for the next windows (``runs/gpu_check/compiled/h100/index.json``,
:mod:`.compiled`): a unit whose steps are all there is priced as loading them.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

from studies.gpu_check.plan import Cost, assumed

Key = tuple[str, str, int]  # attention, size, context


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


class Known:
    """Measured, compiled and recorded facts about ``device`` (``h100``) in ``results``."""

    def __init__(self, results: Path, device: str = "h100", store: Path | None = None):
        self.results = Path(results)
        self.device = device
        self.compiled = _compiled_settings(store)
        self.steps: dict[Key, dict[str, Any]] = {}
        self.compiles: dict[Key, tuple[float, str]] = {}
        self.frontier: dict[Key, dict[str, Any]] = {}
        self.recorded: dict[tuple[str, str], tuple[float, str]] = {}
        for path in sorted(self.results.glob(f"step_time_{device}_*.json")):
            data = _load(path)
            for r in (data or {}).get("results", []):
                if r.get("status") == "ok" and r.get("median_ms"):
                    key = (r["attention"], r["size"], int(r["context"]))
                    self.steps[key] = {**r, "file": path.name}
                    if r.get("compile_s"):
                        self.compiles[key] = (float(r["compile_s"]), path.name)
        for path in sorted(self.results.glob(f"memory_check_{device}*.json")):
            data = _load(path)
            for r in (data or {}).get("rows", []):
                if r.get("status") != "ok":
                    continue
                key = (r["attention"], r["size"], int(r["context"]))
                self.steps.setdefault(key, {**r, "file": path.name})
                if r.get("compile_seconds"):
                    self.compiles.setdefault(key, (float(r["compile_seconds"]), path.name))
        data = _load(self.results / f"memory_frontier_{device}_compiled.json")
        for p in (data or {}).get("points", []):
            self.frontier[(p["attention"], p["size"], int(p["context"]))] = p
        self.frontier_limits = (data or {}).get("limits", {})
        self.frontier_file = f"memory_frontier_{device}_compiled.json"
        data = _load(self.results / f"gpu_check_{device}_measured.json")
        for u in (data or {}).get("units", []):
            if u.get("status") == "ok" and u.get("seconds"):
                name = f"gpu_check_{device}_measured.json"
                self.recorded[(u["stage"], u["unit"])] = (float(u["seconds"]), name)

    # ------------------------------------------------------------------ step and compile times

    def step_ms(self, attention: str, size: str, context: int, chunk: int | None = None):
        """The measured median ms per step (at ``chunk``'s candidate if timed), and its file."""
        r = self.steps.get((attention, size, context))
        if r is None:
            return None
        chunk_ms = {int(k): v for k, v in (r.get("chunk_ms") or {}).items()}
        ms = chunk_ms.get(chunk, r["median_ms"]) if chunk is not None else r["median_ms"]
        return float(ms), r["file"]

    def best_chunk(self, attention: str, size: str, context: int) -> int | None:
        r = self.steps.get((attention, size, context))
        return None if r is None else r.get("chunk_size")

    def step_cost(self, attention: str, size: str, context: int, steps: int, chunk=None) -> Cost:
        """``steps`` training steps at the measured time; without one, scaled from the nearest
        measured context of the same attention and size by tokens (an assumption)."""
        hit = self.step_ms(attention, size, context, chunk)
        what = "timed steps"
        if hit is not None:
            return Cost(what, steps, hit[0] / 1e3, f"measured: {hit[1]}")
        near = [(abs(k[2] - context), k) for k in self.steps if k[:2] == (attention, size)]
        if near:
            key = min(near)[1]
            ms, file = self.step_ms(*key)
            scale = context / key[2]
            return Cost(what, steps, ms / 1e3 * scale, f"assumption: step_by_tokens (from {file})")
        return assumed("compile_step", what, steps)  # nothing at all: as long as a compile

    def compile_cost(self, attention: str, size: str, context: int, programs: int = 1) -> Cost:
        """``programs`` compiles of the step: measured at this point, else the median of the
        measured compiles (they vary little with context: the program is the same size)."""
        what = "step compiles"
        if (attention, size, context) in self.compiles:
            s, file = self.compiles[(attention, size, context)]
            return Cost(what, programs, s, f"measured: {file}")
        if self.compiles:
            s = statistics.median(v[0] for v in self.compiles.values())
            files = ", ".join(sorted({v[1] for v in self.compiles.values()}))
            return Cost(what, programs, s, f"measured: median compile of {files}")
        return assumed("compile_step", what, programs)

    def rungs(self, attention: str, size: str, context: int) -> tuple[int, str | None]:
        """How many memory settings ``auto`` compiles before one fits (the compiled
        frontier's ``tried``), 1 where the frontier did not reach the point."""
        p = self.frontier.get((attention, size, context))
        if p is None or not p.get("tried"):
            return 1, None
        return len(p["tried"]), self.frontier_file

    def fits(self, attention: str, size: str, context: int) -> bool:
        """Whether the step fits the H100 by the compiled frontier (its largest context per
        attention and size); True where the frontier has no word on it."""
        p = self.frontier.get((attention, size, context))
        if p is not None:
            return p.get("status") == "fits"
        limit = self.frontier_limits.get(attention, {}).get(size)
        return limit is None or context <= limit

    def all_compiled(self, settings) -> bool:
        """Whether every (attention, size, context, chunk) of ``settings`` was compiled into
        the store from this tree's program code (the GPU checks the real key; this prices the
        plan)."""
        return bool(settings) and all(tuple(s) in self.compiled for s in settings)

    def recorded_cost(self, stage: str, unit: str) -> Cost | None:
        hit = self.recorded.get((stage, unit))
        if hit is None:
            return None
        return Cost("recorded unit", 1, hit[0], f"recorded: {hit[1]}")


def _compiled_settings(store: Path | None) -> set[tuple]:
    """The settings the store holds for this tree's program code (``compiled.code_fingerprint``:
    a commit that changes only results or docs keeps them)."""
    if store is None:
        return set()
    index = _load(Path(store) / "index.json") or {}
    if not index:
        return set()
    from studies.gpu_check.compiled import code_fingerprint

    code = code_fingerprint()
    return {tuple(e["setting"]) for e in index.values()
            if e.get("setting") and e.get("code") == code}  # fmt: skip
