"""The page of a ``make gpu-check`` run: ``gpu_check_<device>_measured.md``, a generated block
for each results file the run has written so far (in the order of the windows)."""

from __future__ import annotations

from pathlib import Path

from studies import common as reports

# (raw file, renderer, heading), in the order of the stages.
BLOCKS = (
    (
        "gpu_check_{dev}_measured.json",
        "gpu_check.units",
        "Windows and units: time against the estimate",
    ),
    ("step_time_{dev}_measured.json", "gpu_check.steps", "Training step"),
    ("kernels_{dev}_measured.json", "gpu_check.kernels", "Kernels"),
    (
        "compile_ab_{dev}_measured.json",
        "gpu_check.compile_ab",
        "Steps compiled here against steps compiled on the GPU",
    ),
    ("glue_ab_{dev}_measured.json", "gpu_check.glue", "The glue kernels: pallas against xla"),
    ("gpu_tests_{dev}_measured.json", "gpu_check.tests", "GPU tests"),
    (
        "kernel_sweep_{dev}_measured.json",
        "gpu_check.kernel_sweep",
        "LT_attention_parallel's kernels",
    ),
    (
        "glue_kernels_{dev}_measured.json",
        "gpu_check.glue_kernels",
        "The glue kernels one by one: launches against XLA",
    ),
    ("profile_{dev}_measured.json", "gpu_check.profile", "Where the step's time goes"),
    ("sample_time_{dev}_measured.json", "gpu_check.sample", "Sampling"),
    ("memory_check_{dev}_measured.json", "memory_check.table", "Memory"),
    ("mqar_{dev}_measured.json", "gpu_check.mqar", "MQAR"),
    ("context_{dev}_measured.json", "gpu_check.context", "Context study"),
)


# Raw files a block reads beside its own once they exist: the glue verdict, the glue kernels'
# gpu tests (without them it says to keep AUTO_PICKS_PALLAS off), on this page as on its own.
ALSO_READS = {"gpu_check.glue": ("gpu_tests_{dev}_measured.json",)}


def template(results: Path, dev: str) -> str:
    lines = [
        f"# make gpu-check on {dev} (measured)",
        "",
        "Written by `scripts/gpu_check.py` (`make gpu-check`) from its run folder; every number "
        "below is rendered from the raw file its block names.",
    ]
    for raw, name, heading in BLOCKS:
        raw = raw.format(dev=dev)
        if (results / raw).is_file():
            lines += ["", f"## {heading}", "", reports.block(name, *_raws(results, dev, name, raw))]
    return "\n".join(lines)


def _raws(results: Path, dev: str, name: str, raw: str) -> list[str]:
    """A block's raw files: its own and those of :data:`ALSO_READS` that exist."""
    also = (f.format(dev=dev) for f in ALSO_READS.get(name, ()))
    return [raw, *(f for f in also if (results / f).is_file())]


def write(results: Path, dev: str) -> Path:
    """The page from its template every time: a window adds results files, and with them
    blocks (``reports.page`` keeps a page's blocks as they are)."""
    path = results / f"gpu_check_{dev}_measured.md"
    path.write_text(template(results, dev))
    reports.page(path, template(results, dev))
    return path


def glue_template(results: Path, dev: str) -> str:
    """``glue_ab_<dev>_measured.md``: what decides ``kernels/choice.py``'s ``AUTO_PICKS_PALLAS``,
    the step timed with the glue kernels at pallas beside xla and, once they have run, the
    kernels' gpu tests."""
    raws = _raws(results, dev, "gpu_check.glue", f"glue_ab_{dev}_measured.json")
    return "\n".join([
        f"# The glue kernels on {dev}: the step at `pallas` beside `xla` (measured)", "",
        "Written by `scripts/gpu_check.py` (`make gpu-check`'s glue stage; `make gpu-unpack` "
        "renders it back here). Whether `auto` may take issue 37's glue kernels on a GPU "
        "(`linear_gpt2/kernels/choice.py`: `AUTO_PICKS_PALLAS`) is decided here.", "",
        reports.block("gpu_check.glue", *raws),
    ])  # fmt: skip


def write_glue(results: Path, dev: str) -> Path:
    """The glue page from its template every time (the tests' file may have come since)."""
    path = results / f"glue_ab_{dev}_measured.md"
    path.write_text(glue_template(results, dev))
    reports.page(path, glue_template(results, dev))
    return path
