"""The glue kernels' default launches come from a GPU's measurement by a stated rule
(``studies/gpu_check/glue_launch.py``): ``kernels/launch.py``'s ``DEFAULTS`` are the rule applied
to the committed H200 file (a new measurement that moves a pick fails here, in one line), the
threshold sits beyond that file's noise, and the rule itself on made-up rows: the threshold, a
win at every row count, the geometric mean, ties, failed and missing rows."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from linear_gpt2.kernels import launch
from linear_gpt2.kernels.launch import Launch
from studies.common.core import Raw
from studies.gpu_check import glue_launch
from studies.gpu_check.report import glue_kernels

MEASURED = (
    Path(__file__).resolve().parents[1] / "benchmarks/results/glue_kernels_h200_measured.json"
)


def test_the_defaults_are_the_rule_applied_to_the_h200_measurement():
    picks = glue_launch.picks(glue_launch.load(MEASURED))
    assert set(picks) == set(launch.DEFAULTS), "the file does not time every glue kernel"
    differ = [p.reason() for k, p in picks.items() if Launch(**p.chosen) != launch.DEFAULTS[k]]
    assert not differ, (
        f"kernels/launch.py's DEFAULTS are not the rule's picks from {MEASURED.name}: "
        + "; ".join(differ)
    )
    assert glue_launch.pick_defaults(glue_launch.load(MEASURED)) == launch.DEFAULTS


def test_the_threshold_sits_beyond_the_measurements_noise():
    """A pick must beat the default by more than the spread one round's ratio shows."""
    noise = glue_launch.ratio_noise(glue_launch.load(MEASURED))
    assert noise is not None and 0 < noise <= 1 - glue_launch.THRESHOLD, (
        f"{MEASURED.name}: a time/default ratio varies by {noise:.3f} between rounds, more "
        f"than the threshold {glue_launch.THRESHOLD} allows: state a threshold further from 1"
    )


def test_the_page_marks_the_default_then_and_now():
    data = glue_launch.load(MEASURED)
    text, picks = glue_kernels(Raw(MEASURED.name, data)), glue_launch.picks(data)
    for name, now in launch.DEFAULTS.items():
        then = Launch(**picks[name].measured)
        row = f"| `{name}` | 65,536 | "
        if then == now:
            assert f"{row}{now.label()} (default) |" in text, name
        else:
            assert f"{row}{now.label()} (default now) |" in text, name
            assert f"{row}{then.label()} (default when measured) |" in text, name
    assert "| adopted |" in text and "| kept the default |" in text


# The rule on made-up files: launches by name, each kernel's default "d".
A, B, C, D = (
    Launch(4, programs_per_sm=1),
    Launch(4, programs_per_sm=2),
    Launch(4, tile=8),
    Launch(8),
)
NAMES = {"a": A, "b": B, "c": C, "d": D}


def _file(times: dict[str, dict[int, float | None]], rounds: dict[str, list[float]] | None = None):
    """One kernel ``k``'s rows: ``times[name][rows]`` its net ms (None: it failed there; a row
    count left out: not timed there), ``d`` the default; an XLA row faster than all."""
    rows = [{"kernel": "k", "rows": 16, "impl": "xla", "launch": None, "default": False,
             "status": "ok", "net_ms": 1e-6, "times_ms": [1e-6]}]  # fmt: skip
    for name, by_rows in times.items():
        for n, ms in by_rows.items():
            rows.append({"kernel": "k", "rows": n, "impl": "pallas",
                         "launch": dataclasses.asdict(NAMES[name]), "default": name == "d",
                         "status": "ok" if ms is not None else "compile failed: x",
                         **({"net_ms": ms, "copy_ms": None,
                             "times_ms": (rounds or {}).get(name, [ms])} if ms is not None else {})})  # fmt: skip
    return {"meta": {}, "rows": rows}


def _pick(times, threshold=0.97) -> Launch:
    return glue_launch.pick_defaults(_file(times), threshold)["k"]


def test_the_rule_adopts_only_at_or_below_the_threshold():
    assert _pick({"d": {16: 1.0, 64: 1.0}, "a": {16: 0.96, 64: 0.96}}) == A
    assert _pick({"d": {16: 1.0, 64: 1.0}, "a": {16: 0.98, 64: 0.98}}) == D
    assert _pick({"d": {16: 1.0}, "a": {16: 0.97}}) == A  # at most: the edge is adopted
    assert _pick({"d": {16: 1.0, 64: 1.0}, "a": {16: 0.98, 64: 0.98}}, threshold=0.99) == A


def test_the_rule_needs_a_win_at_every_row_count():
    slower_at_64 = {"d": {16: 1.0, 64: 1.0}, "a": {16: 0.5, 64: 1.01}, "b": {16: 0.95, 64: 0.95}}
    assert _pick(slower_at_64) == B  # a's mean (0.71) is the best, but it loses at 64
    assert _pick({"d": {16: 1.0, 64: 1.0}, "a": {16: 0.5, 64: 1.0}}) == D  # a tie is no win
    failed = {"d": {16: 1.0, 64: 1.0}, "a": {16: 0.5, 64: None}, "b": {16: 0.95, 64: 0.95}}
    assert _pick(failed) == B
    untimed = {"d": {16: 1.0, 64: 1.0}, "a": {16: 0.5}, "b": {16: 0.95, 64: 0.95}}
    assert _pick(untimed) == B
    assert _pick({"d": {16: 1.0, 64: None}, "a": {16: 0.5, 64: 0.5}}) == D  # no default to beat


def test_the_rule_takes_the_best_geometric_mean_and_the_first_of_equal_ones():
    # a: mean 0.9; b: 0.8 and 0.99, mean 0.890 (its worst row is the worse, its mean the better)
    assert _pick({"d": {16: 1.0, 64: 1.0}, "a": {16: 0.9, 64: 0.9}, "b": {16: 0.8, 64: 0.99}}) == B
    assert _pick({"d": {16: 1.0, 64: 1.0}, "a": {16: 0.9, 64: 0.8}, "b": {16: 0.8, 64: 0.9}}) == A
    assert _pick({"d": {16: 1.0, 64: 1.0}, "b": {16: 0.8, 64: 0.9}, "a": {16: 0.9, 64: 0.8}}) == B
    p = glue_launch.picks(_file({"d": {16: 2.0, 64: 4.0}, "c": {16: 1.0, 64: 1.0}}))["k"]
    assert p.ratios == {16: 0.5, 64: 0.25} and p.geomean == pytest.approx(0.5**1.5)
    assert p.adopted and "picks 4 warps, 1 stages, tile 8" in p.reason() and "\n" not in p.reason()


def test_a_file_without_one_default_is_refused():
    with pytest.raises(ValueError, match="k: the file marks 0 launches as the default"):
        glue_launch.picks(_file({"a": {16: 1.0}}))


def test_the_noise_is_the_median_half_range_of_the_per_round_ratios():
    rounds = {"d": [1.0, 1.0, 2.0], "a": [0.9, 1.1, 1.8], "b": [1.0, 1.0, 2.0]}
    data = _file({"d": {16: 1.0}, "a": {16: 1.0}, "b": {16: 1.0}}, rounds)
    # a's ratios per round: 0.9, 1.1, 0.9 (half-range 0.1); b's: 1, 1, 1 (0)
    assert glue_launch.ratio_noise(data) == pytest.approx(0.05)
    assert glue_launch.ratio_noise(_file({"d": {16: 1.0}})) is None
