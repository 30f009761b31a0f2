"""The GPU cards' facts (linear_gpt2/platform/cards.py): one place, in step with what they come
from (the compile target, the step model's fit, the raw files priced with them)."""

from __future__ import annotations

import ast
import json
import re
import types
from pathlib import Path

import pytest

from linear_gpt2.kernels.lt_attention_parallel import cost as parallel_cost
from linear_gpt2.kernels.lt_chunked import cost
from linear_gpt2.model.flops import device_peak_flops
from linear_gpt2.platform import cards, target
from linear_gpt2.platform.cards import H100
from linear_gpt2.training import memory_plan

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def test_the_launch_overhead_is_the_step_models_measured_fit():
    """H100.launch_seconds is the launch overhead the step model fits to measured H100 steps: a
    refit that moves it further than the stated tolerance fails here until cards.py follows."""
    fit = json.loads((RESULTS / "train_step_h100_model.json").read_text())
    assert "launch_us" in fit["fitted"]
    fitted = fit["params"]["launch_us"] * 1e-6
    assert abs(fitted - H100.launch_seconds) <= cards.LAUNCH_FIT_TOLERANCE * H100.launch_seconds, (
        f"the step model's fit is {fitted * 1e6:.3g} us per launch, cards.H100 says "
        f"{H100.launch_seconds * 1e6:.3g} us: update linear_gpt2/platform/cards.py and re-price "
        "(benchmarks/roofline.py --reprice)"
    )


def test_the_sm_count_is_the_compile_targets():
    assert H100.sms == target.get("h100").device["core_count"]


def test_every_cost_model_prices_with_the_card():
    for peak, nbytes, sms, launch in (
        (cost.PEAK_FLOPS, cost.PEAK_BYTES, cost.SMS, cost.LAUNCH_SECONDS),
        (parallel_cost.PEAK_FLOPS, parallel_cost.PEAK_BYTES, parallel_cost.SMS,
         parallel_cost.LAUNCH_SECONDS),
    ):  # fmt: skip
        assert (peak, nbytes, sms, launch) == (
            H100.peak_bf16_flops, H100.hbm_bytes_per_s, H100.sms, H100.launch_seconds
        )  # fmt: skip
    assert memory_plan.HOST_BYTES_PER_S == H100.host_bytes_per_s
    assert memory_plan.MATMUL_FLOPS_PER_S == pytest.approx(0.7 * H100.peak_bf16_flops)


@pytest.mark.parametrize(
    "stem", ["kernel_roofline_h100_model", "kernel_roofline_parallel_h100_model"]
)
def test_the_roofline_pages_are_priced_with_the_card(stem):
    """The rendered rooflines hold the card's facts: a change in cards.py fails here until the
    pages are priced again (benchmarks/roofline.py --reprice)."""
    s = json.loads((RESULTS / f"{stem}.json").read_text())["meta"]["settings"]
    assert s["peak_tflops"] * 1e12 == pytest.approx(H100.peak_bf16_flops)
    assert s["peak_tb_per_s"] * 1e12 == pytest.approx(H100.hbm_bytes_per_s)
    assert s["sms"] == H100.sms
    assert s["launch_us"] * 1e-6 == pytest.approx(H100.launch_seconds), f"re-price {stem}"


@pytest.mark.parametrize(
    "kind, card",
    [("NVIDIA H100 80GB HBM3", cards.H100), ("NVIDIA H200", cards.H200),
     ("NVIDIA A100-SXM4-80GB", cards.A100), ("cpu", None), ("NVIDIA B200", None)],
)  # fmt: skip
def test_mfu_reads_the_peak_of_the_devices_card(kind, card):
    device = types.SimpleNamespace(device_kind=kind)
    assert cards.of_device_kind(kind) is card
    assert device_peak_flops(device) == (card.peak_bf16_flops if card else None)


def test_no_card_fact_is_typed_twice():
    """The datasheet figures appear as literals in cards.py only (the library, studies,
    benchmarks and scripts import them)."""
    literal = re.compile(r"(?<![\w.])(989e12|3\.35e12|4\.8e12|989\.4e12)(?![\w.])")
    found = [
        f"{p.relative_to(ROOT)}:{i}"
        for d in ("linear_gpt2", "studies", "benchmarks", "scripts")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p != ROOT / "linear_gpt2" / "platform" / "cards.py"
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if literal.search(line)
    ]
    assert not found, f"card facts typed outside linear_gpt2/platform/cards.py: {found}"


def test_no_sm_count_is_typed_in_code():
    """The SM count is a number in code (not prose) in cards.py only: grids sized for the card
    read ``H100.sms``."""
    cards = ROOT / "linear_gpt2" / "platform" / "cards.py"
    found = [
        f"{p.relative_to(ROOT)}:{node.lineno}"
        for d in ("linear_gpt2", "studies", "benchmarks", "scripts")
        for p in sorted((ROOT / d).rglob("*.py"))
        if p != cards
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Constant) and type(node.value) is int and node.value == H100.sms
    ]
    assert not found, f"the SM count typed outside linear_gpt2/platform/cards.py: {found}"
