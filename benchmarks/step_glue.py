"""Bytes moved and launches per training step, by op class and part of the model, compiled for
the H100: the step before and after issue 37's fused kernels, with the step-time MODEL beside.

Each point (attention, size, context, batch, memory setting) is the trainer's step
(``training.train_step.jit_train_step``: clip + AdamW, state donated) compiled for the H100 on
this machine, read launch by launch (``linear_gpt2/experiments/hlo_costs.py``) into the cost
rows the step-time MODEL prices (``step_costs.py``, ``step_model.py``; the fitted constants of
``train_step_h100_model.json``). Bytes and launches are exact counts of the compiled program;
milliseconds are the MODEL's, not a measurement.

    python benchmarks/step_glue.py --label before --code DIR   # compile with another tree's code
    python benchmarks/step_glue.py --label after               # compile with this tree
    python benchmarks/step_glue.py --no-compile                # price the cache, write json + md
    python benchmarks/step_glue.py --help                      # every label: options, points

The labels, their model options and their points are the study's
(``studies/train_step/step_glue.py``: ``OVERRIDES``, ``LABEL_POINTS``): a label added there is
one here.

``--code DIR`` compiles in a subprocess that imports ``linear_gpt2`` from DIR (e.g. ``git
archive <commit> | tar -x -C DIR``): the "before" program is main's own. The programs' costs are
cached per label and point in ``step_glue_h100_costs_compiled.json`` (resumable); the priced
summary is ``step_glue_h100_model.json``, rendered to ``step_glue_h100_model.md`` with, for each
glue A/B a lent GPU measured (``glue_ab_<card>_measured.json``), the MODEL priced on that card
beside it (``studies/train_step/report_model_vs_gpu.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
COSTS = "step_glue_h100_costs_compiled.json"
STEM = "step_glue_h100_model"
MODEL = "train_step_h100_model.json"


def _worker(spec: dict, out: Path) -> None:
    """Compile one point with the ``linear_gpt2`` first on ``sys.path``; write its optimized HLO
    text and memory to ``out``. Uses only APIs that main and this branch share."""
    from linear_gpt2.experiments.compile_step import mesh
    from linear_gpt2.platform.provenance import environment
    from linear_gpt2.platform.target import compile_program, get
    from linear_gpt2.training.config import TrainConfig
    from linear_gpt2.training.optim import optimizer
    from linear_gpt2.training.train_step import jit_train_step
    from studies.train_step.step_time import model_config

    t = get("h100")
    cfg = model_config(spec["size"], spec["attention"], spec["context"],
                       chunk_size=spec.get("chunk_size"), **spec["overrides"])  # fmt: skip
    program = jit_train_step(cfg, optimizer(TrainConfig()), mesh(t), accum=1, batch=spec["batch"])
    t0 = time.perf_counter()
    report, compiled = compile_program(
        program.step, program.args, t, keep_executable=True, what=spec["key"]
    )
    seconds = time.perf_counter() - t0
    (out / "program.hlo").write_text(compiled.as_text())
    (out / "meta.json").write_text(json.dumps({
        "memory_bytes": report.memory.total, "compile_seconds": seconds,
        "environment": environment(),
    }))  # fmt: skip


def compile_point(point, label: str, code: Path | None, log=print) -> dict:
    """``point`` compiled in a subprocess importing ``linear_gpt2`` from ``code`` (default this
    tree), priced into cost rows."""
    from linear_gpt2.experiments import hlo_costs
    from studies.train_step import step_costs, step_glue

    spec = {**step_glue.spec(point, label), "key": point.key}
    with tempfile.TemporaryDirectory(prefix="step_glue_") as tmp:
        env = {**os.environ, "PYTHONPATH": str(code or REPO)}
        cmd = [sys.executable, __file__, "--worker", json.dumps(spec), "--out", tmp]
        subprocess.run(cmd, env=env, check=True, cwd=code or REPO)
        text = (Path(tmp) / "program.hlo").read_text()
        meta = json.loads((Path(tmp) / "meta.json").read_text())
    rows = step_costs.cost_rows(hlo_costs.program_ops(text), step_glue.cost_point(point))
    log(f"{label} {point.key}: {meta['memory_bytes'] / 2**30:.2f} GiB, "
        f"{meta['compile_seconds']:.0f} s")  # fmt: skip
    # The attention core launch by launch where the page compares the two attentions (1k).
    detail = {}
    if point.context == 1024 and point.batch == 1:
        detail["attention_rows"] = step_glue.attention_rows(text, point)
    return {"spec": spec, "rows": rows, **detail, **meta}


def label_help(step_glue) -> str:
    """``--label``'s help: each of the study's labels with its model options and points."""
    every = len(step_glue.POINTS)

    def one(label: str) -> str:
        opts = step_glue.OVERRIDES[label]
        what = ", ".join(f"{k}={v}" for k, v in opts.items()) or "no options (a tree of --code)"
        n = len(step_glue.LABEL_POINTS.get(label, ())) or every
        return f"{label}: {what}; {n} of the {every} points"

    return "compile this label's points (--only narrows them):\n" + "\n".join(
        f"  {one(label)}" for label in step_glue.OVERRIDES
    )


def main(argv=None) -> int:
    # The compile worker first: it runs with another tree's linear_gpt2 and studies on its path
    # (--code), so nothing of this tree's study is imported before it.
    worker = argparse.ArgumentParser(add_help=False)
    worker.add_argument("--worker")
    worker.add_argument("--out", type=Path, default=RESULTS)
    known, _ = worker.parse_known_args(argv)
    if known.worker:
        _worker(json.loads(known.worker), known.out)
        return 0
    sys.path.insert(0, str(REPO))
    from linear_gpt2.platform.provenance import environment
    from studies.train_step import step_glue

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--label", choices=tuple(step_glue.OVERRIDES), help=label_help(step_glue))
    ap.add_argument("--code", type=Path, help="the tree whose linear_gpt2 compiles (default: this)")
    ap.add_argument("--commit", help="the commit --code was exported from (recorded)")
    ap.add_argument("--only", nargs="*", help="point keys to compile (default: all)")
    ap.add_argument("--restart", action="store_true", help="recompile the label's points")
    ap.add_argument("--no-compile", action="store_true", help="price the cache only")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)

    path = args.out / COSTS
    costs = json.loads(path.read_text()) if path.exists() else {"meta": {}, "points": {}}
    if args.label and not args.no_compile:
        done = costs["points"].setdefault(args.label, {})
        # Points compiled before points recorded their own commit keep their label's, which a
        # point compiled now replaces.
        before = costs["meta"].get("labels", {}).get(args.label, {}).get("environment", {})
        for other in done.values():
            other.setdefault("git_commit", before.get("git_commit"))
        for p in step_glue.POINTS:
            if (args.only and p.key not in args.only) or (p.key in done and not args.restart):
                continue
            if p.key not in step_glue.LABEL_POINTS.get(args.label, (p.key,)):
                continue
            entry = compile_point(p, args.label, args.code)
            env = entry.pop("environment")
            if args.commit:
                env["git_commit"] = args.commit
            # Each point's own commit: a label's points may be compiled at different commits.
            done[p.key] = {**entry, "git_commit": env.get("git_commit")}
            label = {
                "how": "compiled",
                "environment": {**env, "device_kind": "NVIDIA H100 SXM (compiled for, deviceless)"},
                "code": "this tree" if args.code is None else f"git archive of {args.commit}",
            }  # fmt: skip
            labels = {**costs["meta"].get("labels", {}), args.label: label}
            # The file's provenance is the "after" program's (this tree's), each label's beside.
            costs["meta"] = {**labels.get("after", label), "labels": labels}
            path.write_text(json.dumps(costs, indent=1) + "\n")  # after every point: resumable
    model = json.loads((RESULTS / MODEL).read_text())
    result = step_glue.summarise(costs, model)
    result["meta"] = {
        "how": "modelled",
        "environment": {**environment(), "device_kind": "NVIDIA H100 SXM (modelled)"},
        "costs": {"file": COSTS, **costs["meta"].get("labels", {})},
        "model": {"file": MODEL, "params": model["params"],
                  "commit": model["meta"]["environment"].get("git_commit")},
    }  # fmt: skip
    (args.out / f"{STEM}.json").write_text(json.dumps(result, indent=1) + "\n")
    from studies import common as reports

    md = reports.page(args.out / f"{STEM}.md", page_template(args.out))
    print(f"wrote {args.out / f'{STEM}.json'}, {md}")
    return 0


def page_template(out: Path = RESULTS) -> str:
    """The page's blocks: the priced summary, then the MODEL beside each glue A/B a lent GPU
    measured (``glue_ab_<card>_measured.json``, ``step_glue.vs_gpu``)."""
    from studies import common as reports

    blocks = [reports.block("step_glue.page", f"{STEM}.json")]
    blocks += [reports.block("step_glue.vs_gpu", COSTS, f"{STEM}.json", ab.name)
               for ab in sorted(out.glob("glue_ab_*_measured.json"))]  # fmt: skip
    return "\n".join(blocks)


if __name__ == "__main__":
    if "--worker" not in sys.argv:  # the worker imports --code's tree (its PYTHONPATH)
        sys.path.insert(0, str(REPO))
    try:
        from linear_gpt2.platform import process
    except ImportError:  # a tree from before process.configure (its import set the env itself)
        process = None
    if process is not None:
        process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
