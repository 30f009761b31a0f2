"""Which launch each glue kernel defaults to, read from a glue_kernels results file: the rows of
``benchmarks/bench_glue.py`` (``benchmarks/results/glue_kernels_<device>_measured.json``), each
candidate launch timed beside the default the kernels had when it was measured.

The rule (:func:`picks`, :func:`pick_defaults`), per kernel:

- a candidate qualifies if it ran at every row count the file measured the kernel at and its net
  time is below the measured default's at each of them;
- of those, the one with the smallest geometric mean over the row counts of its time over the
  default's; equal means go to the one listed first in the file (``launch.CANDIDATES``' order);
- it is adopted if that mean is at most :data:`THRESHOLD`; otherwise the measured default stays.

:data:`THRESHOLD` sits below 1 by more than the file's noise (:func:`ratio_noise`: the spread a
single round's time/default ratio shows), so a pick is not made on a difference that one round's
jitter could produce; ``tests/test_glue_launch.py`` checks both that and that
``linear_gpt2/kernels/launch.py``'s ``DEFAULTS`` are this rule's picks from the H200's file.

Nothing here imports JAX at import (the package's rule); :func:`pick_defaults` builds
``kernels.launch.Launch`` objects, so it imports the library when called.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from pathlib import Path
from typing import Any

# A candidate must beat the measured default by this geometric-mean ratio or better.
THRESHOLD = 0.97


def _key(launch: dict[str, Any]) -> tuple:
    return tuple(sorted(launch.items()))


def _label(launch: dict[str, Any]) -> str:
    from linear_gpt2.kernels.launch import Launch

    return Launch(**launch).label()


@dataclasses.dataclass(frozen=True)
class Pick:
    """One kernel's outcome: the ``measured`` default's launch (a ``Launch`` as a dict), the
    ``best`` qualifying candidate (None: none is faster at every row count), its ``ratios``
    (rows -> time over the default's) and their geometric mean, and the launch ``chosen``."""

    kernel: str
    measured: dict[str, Any]
    best: dict[str, Any] | None
    ratios: dict[int, float]
    geomean: float | None
    threshold: float

    @property
    def adopted(self) -> bool:
        return self.geomean is not None and self.geomean <= self.threshold

    @property
    def chosen(self) -> dict[str, Any]:
        return self.best if self.adopted and self.best is not None else self.measured

    def reason(self) -> str:
        """The outcome in one line."""
        if self.best is None:
            return (f"{self.kernel}: keeps {_label(self.measured)}: no candidate is faster at "
                    "every row count")  # fmt: skip
        at = ", ".join(f"{self.ratios[n]:.3f} at {n:,} rows" for n in sorted(self.ratios))
        verdict = (f"picks {_label(self.best)}" if self.adopted
                   else f"keeps {_label(self.measured)} over {_label(self.best)}")  # fmt: skip
        return (f"{self.kernel}: {verdict} (time over the measured default {at}, geometric mean "
                f"{self.geomean:.3f} against the threshold {self.threshold})")  # fmt: skip


def _groups(results: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Each kernel's Pallas rows, in the file's order."""
    out: dict[str, list[dict[str, Any]]] = {}
    for r in results["rows"]:
        if r.get("impl") == "pallas":
            out.setdefault(r["kernel"], []).append(r)
    return out


def _measured_default(kernel: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    defaults = {_key(r["launch"]): r["launch"] for r in rows if r.get("default")}
    if len(defaults) != 1:
        raise ValueError(
            f"{kernel}: the file marks {len(defaults)} launches as the default, not one"
        )
    return next(iter(defaults.values()))


def _geomean(xs: list[float]) -> float:
    # The n-th root of the product: one ratio is its own mean, exactly (the threshold's edge).
    return math.prod(xs) ** (1 / len(xs))


def picks(results: dict[str, Any], threshold: float = THRESHOLD) -> dict[str, Pick]:
    """The rule's outcome per kernel of ``results`` (a glue_kernels file's JSON)."""
    out = {}
    for kernel, rows in _groups(results).items():
        measured = _measured_default(kernel, rows)
        counts = sorted({r["rows"] for r in rows})
        time = {(_key(r["launch"]), r["rows"]): r["net_ms"] for r in rows if r["status"] == "ok"}
        base = {n: time.get((_key(measured), n)) for n in counts}
        best, best_ratios, best_mean = None, {}, None
        if all(t is not None and t > 0 for t in base.values()):
            seen = set()
            for r in rows:  # the file's order: the first of equal means stays
                k = _key(r["launch"])
                if k == _key(measured) or k in seen:
                    continue
                seen.add(k)
                ratios = {n: time[(k, n)] / base[n] for n in counts if (k, n) in time}
                if len(ratios) < len(counts) or max(ratios.values()) >= 1:
                    continue
                mean = _geomean([ratios[n] for n in counts])
                if best_mean is None or mean < best_mean:
                    best, best_ratios, best_mean = r["launch"], ratios, mean
        out[kernel] = Pick(kernel, measured, best, best_ratios, best_mean, threshold)
    return out


def pick_defaults(results: dict[str, Any], threshold: float = THRESHOLD) -> dict[str, Any]:
    """``{kernel: kernels.launch.Launch}``: the launch the rule picks for each kernel."""
    from linear_gpt2.kernels.launch import Launch

    return {k: Launch(**p.chosen) for k, p in picks(results, threshold).items()}


def ratio_noise(results: dict[str, Any]) -> float | None:
    """The file's noise of a time/default ratio: for every candidate at every row count (both it
    and the default timed in each round, side by side), the half-range of its per-round ratios
    (each round's time net of the input copy, as the medians are); their median over all. None
    when no candidate was timed beside its default."""
    spreads = []
    for kernel, rows in _groups(results).items():
        measured = _key(_measured_default(kernel, rows))
        ok = [r for r in rows if r["status"] == "ok"]
        base = {r["rows"]: r for r in ok if _key(r["launch"]) == measured}
        for r in ok:
            d = base.get(r["rows"])
            if d is None or _key(r["launch"]) == measured:
                continue
            c, cd = r.get("copy_ms") or 0.0, d.get("copy_ms") or 0.0
            pairs = [(a - c, b - cd) for a, b in zip(r["times_ms"], d["times_ms"])]
            per_round = [a / b for a, b in pairs if b > 0]  # a round under its copy's median: none
            if per_round:
                spreads.append((max(per_round) - min(per_round)) / 2)
    return statistics.median(spreads) if spreads else None


def load(path: str | Path) -> dict[str, Any]:
    """A glue_kernels results file."""
    return json.loads(Path(path).read_text())
