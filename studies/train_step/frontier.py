"""The memory frontier, compiled for a target (no device run): per attention x size, the largest
power-of-two context whose training step fits the target's budget with the cheapest memory
setting (``scripts/bench_step.py --target h100``; ``make frontier``)."""

from __future__ import annotations

import csv
import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from linear_gpt2.experiments import compile_step
from linear_gpt2.model.api import count_params, param_shapes
from linear_gpt2.model.config import ModelConfig
from linear_gpt2.platform.provenance import git_commit, json_default
from linear_gpt2.platform.target import CompileError
from linear_gpt2.training import memory_plan
from studies import common as reports
from studies.train_step import report_memory
from studies.train_step.step_time import model_config, short_error

# The post's largest context per attention and size (published-figures.md: the last context
# timed before OOM on one H100 80 GB; for 355M and 774M only flash and LT_chunked were run to
# their limit, and 1.6B's table stops at 64k).
POST_FRONTIER: dict[str, dict[str, int]] = {
    "124M": {
        "LT_attention": 32768,
        "LT_attention_parallel_no_flash": 32768,
        "LT_attention_parallel": 524288,
        "LT_state": 65536,
        "LT_state_parallel": 131072,
        "softmax": 16384,
        "flash": 524288,
        "LT_chunked": 524288,
    },
    "355M": {"flash": 262144, "LT_chunked": 262144},
    "774M": {"flash": 131072, "LT_chunked": 131072},
    "1.6B": {"flash": 65536, "LT_chunked": 65536},
}


@dataclasses.dataclass
class FrontierPoint:
    """One (attention, size, context) compiled for a target. ``status``: ``fits`` (with the
    cheapest memory setting that fits: ``remat``, ``loss_chunk``), ``too_big`` (not even the
    most frugal setting fits; larger contexts are not tried), or ``error``."""

    attention: str
    size: str
    context: int
    status: str
    n_params: int
    target: str
    memory_bytes: int | None = None  # the chosen (or, if too big, the most frugal) setting
    remat: str | None = None
    loss_chunk: int | None = None
    tried: list[list[Any]] = dataclasses.field(default_factory=list)  # [label, bytes]
    compile_seconds: float | None = None
    error: str | None = None
    git_commit: str | None = None  # the code it was compiled with (a sweep may span commits)
    kernel_design: str | None = None  # the spec's kernel_design for the target, if it has one
    # auto's choices for the chosen setting as traced for the target (compile_step.choices):
    # the glue's kernels and the blocks scanned or not; empty where the point predates them.
    choices: dict[str, Any] = dataclasses.field(default_factory=dict)


def frontier_point(
    attention: str,
    size: str,
    context: int,
    target: str,
    *,
    batch: int = 1,
    dtype: str = "bfloat16",
    start_rung: int = 0,
) -> FrontierPoint:
    """Compile one setting's training step for ``target`` with ``auto`` memory settings."""
    cfg = model_config(size, attention, context, dtype=dtype)
    n_params = count_params(param_shapes(cfg), non_embedding=False)
    point = FrontierPoint(attention, size, context, "fits", n_params, target)
    t0 = time.perf_counter()
    try:
        r = compile_step.compile_train_step(cfg, target, batch=batch, start_rung=start_rung)
    except CompileError as e:
        point.status, point.error = "error", short_error(e)
        return point
    point.compile_seconds = time.perf_counter() - t0
    point.memory_bytes = r.compile.memory.total
    point.remat, point.loss_chunk = r.config.remat, r.config.loss_chunk
    point.tried = [[name, m.total] for name, m in r.plan.tried]
    point.git_commit = git_commit()
    point.kernel_design = kernel_design(r.config, target, batch, dtype)
    point.choices = r.choices
    if not r.fits:
        point.status = "too_big"
    return point


def kernel_design(
    cfg: ModelConfig, target: str, batch: int, dtype: str, context: int | None = None
) -> str | None:
    """What the attention's ``kernel`` resolves to when the step is compiled for ``target`` at
    ``[batch, context]`` (the spec's ``kernel_design``, asked under the target's abstract mesh,
    as in the compile); None for a spec without one."""
    import jax

    from linear_gpt2.platform import target as targets

    spec = cfg.spec
    if spec.kernel_design is None:
        return None
    shape = (batch, context or cfg.block_size, cfg.n_head, cfg.head_dim)
    with jax.sharding.use_abstract_mesh(targets.mesh(target).abstract_mesh):
        return spec.kernel_design(shape, dtype, cfg.attention_options)


def run_frontier(
    attentions: Iterable[str],
    sizes: Iterable[str],
    target: str,
    contexts: Sequence[int],
    *,
    batch: int = 1,
    dtype: str = "bfloat16",
    done: Iterable[FrontierPoint] = (),
    on_result: Callable[[FrontierPoint], None] | None = None,
) -> list[FrontierPoint]:
    """Every attention x size over increasing ``contexts`` until the step no longer fits the
    target with any memory setting. Points in ``done`` (an earlier, interrupted sweep) are kept
    and not compiled again."""
    known = {(p.attention, p.size, p.context): p for p in done}
    results: list[FrontierPoint] = []
    for size in sizes:
        for name in attentions:
            rung = 0
            for context in sorted(contexts):
                p = known.get((name, size, context))
                if p is None:
                    p = frontier_point(
                        name, size, context, target, batch=batch, dtype=dtype, start_rung=rung
                    )
                    if on_result is not None:
                        on_result(p)
                results.append(p)
                if p.status != "fits":
                    break
                # Fitting needs no less at a longer context: start the next one at this rung.
                rung = memory_plan.rung(
                    ModelConfig(loss_chunk=p.loss_chunk or 0, remat=p.remat or "none")
                )
    return results


def frontier_limits(points: Iterable[FrontierPoint]) -> dict[str, dict[str, int | None]]:
    """``{attention: {size: largest context that fits (None: not even the smallest)}}``."""
    out: dict[str, dict[str, int | None]] = {}
    for p in points:
        entry = out.setdefault(p.attention, {})
        entry.setdefault(p.size, None)
        if p.status == "fits":
            entry[p.size] = max(entry[p.size] or 0, p.context)
    return out


FRONTIER_FIELDS = [
    "attention", "size", "n_params", "context", "status", "memory_bytes", "remat", "loss_chunk",
    "tried", "compile_seconds", "error", "target", "git_commit", "kernel_design", "jax_version",
]  # fmt: skip


def write_frontier(
    points: Sequence[FrontierPoint], out_dir: str | Path, stem: str, meta: dict[str, Any]
) -> tuple[Path, Path, Path]:
    """``stem.csv``, ``stem.json`` (``meta``, ``points``, ``limits``, the post's frontier) and
    ``stem.md`` (the largest context per attention x size beside the post's)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    env = meta.get("environment", {})
    csv_path, json_path, md_path = (out / f"{stem}.{ext}" for ext in ("csv", "json", "md"))
    with csv_path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FRONTIER_FIELDS)
        w.writeheader()
        for p in points:
            row = dataclasses.asdict(p)
            row["tried"] = ";".join(f"{n}:{b}" for n, b in p.tried)
            row.update(jax_version=env.get("jax_version"))  # git_commit: the point's own
            w.writerow({k: row.get(k) for k in FRONTIER_FIELDS})
    limits = frontier_limits(points)
    payload = {
        "meta": meta,
        "points": [dataclasses.asdict(p) for p in points],
        "limits": limits,
        "post_frontier": POST_FRONTIER,
    }
    json_path.write_text(json.dumps(payload, indent=1, default=json_default) + "\n")
    reports.page(md_path, report_memory.frontier_page(json_path.name))
    return csv_path, json_path, md_path


def read_frontier(path: str | Path) -> list[FrontierPoint]:
    """The points of a :func:`write_frontier` JSON file (to resume a sweep)."""
    data = json.loads(Path(path).read_text())
    return [FrontierPoint(**p) for p in data["points"]]


def read_backfilled(path: str | Path) -> dict[str, Any]:
    """``meta.backfilled`` of a :func:`write_frontier` JSON file: how fields of its points that
    the sweep did not record were filled in afterwards (a resumed sweep keeps those points, so
    it keeps this too); empty when there is none."""
    return json.loads(Path(path).read_text())["meta"].get("backfilled", {})
