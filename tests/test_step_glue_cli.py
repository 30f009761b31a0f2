"""``benchmarks/step_glue.py``'s command line takes its labels from the study
(``studies/train_step/step_glue.py``: ``OVERRIDES``, ``LABEL_POINTS``): a label added there is
one the benchmark compiles, with its options in ``--help``."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from studies.train_step import step_glue

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location(
        "bench_step_glue", ROOT / "benchmarks" / "step_glue.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_study_label_is_a_choice_with_its_options_and_points(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--help"])
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the help
    assert "{" + ",".join(step_glue.OVERRIDES) + "}" in text
    for label, options in step_glue.OVERRIDES.items():
        n = len(step_glue.LABEL_POINTS.get(label, ())) or len(step_glue.POINTS)
        assert f"{label}: " in text and f"; {n} of the {len(step_glue.POINTS)} points" in text
        assert all(f"{k}={v}" in text for k, v in options.items()), label


def test_an_unknown_label_is_a_usage_error_naming_the_labels(bench, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--label", "no_such_label", "--no-compile"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'no_such_label'" in err and all(k in err for k in step_glue.OVERRIDES)
