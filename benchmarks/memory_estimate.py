#!/usr/bin/env python
"""``auto``'s memory estimate (``training/memory_plan.estimate``) against the compiled memory.

    python benchmarks/memory_estimate.py              # estimate every compiled point; compile
                                                      # the fresh points the raw file lacks
    python benchmarks/memory_estimate.py --no-compile # estimates only (minutes)

Every candidate setting that a raw file of ``benchmarks/results/`` records as compiled for an
H100 target (the shipped configs: ``configs_h100x8_compiled.json`` for ``configs/post``,
``context_parallel_h100x8_compiled.json`` for ``configs/long``; the one-GPU memory frontier,
``memory_frontier_h100_compiled.json``) is estimated here from its configuration, as
``auto`` estimates before compiling, and set beside its compiled memory (each at the commit its
file records). The fresh points (:data:`FRESH`) are compiled here at this commit, so the
comparison does not rest on older code alone. Writes ``memory_estimate_h100_compiled.{json,md}``
under ``--out`` (the compiles cached in the JSON: ``--restart`` compiles them again).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

RESULTS = REPO / "benchmarks" / "results"
STEM = "memory_estimate_h100_compiled"
# Compiled here at this commit: (name, config file, overrides, target, settings), settings None
# for every rung of the ladder, else the labels compiled (where a rung's compile takes minutes
# and is far over any budget, only those the plan compiles and the next rung down).
_256K = ("model.block_size=262144", "data.context=262144", "train.tokens_per_update=262144")
FRESH = (
    ("124M LT_chunked 64k, one GPU", "configs/post/124M_LT_chunked_64k.yaml",
     ("train.tokens_per_update=65536",), "h100", None),
    ("124M LT_chunked 256k over 8 GPUs (context parallel)", "configs/long/124M_LT_chunked_8M_cp8.yaml",
     _256K, "h100x8", None),
    # The context-parallel step at half and twice the slice: the estimate's context-parallel
    # terms (the slices' kept state inputs, the head's logits sharing the backward's space)
    # across lengths.
    ("124M LT_chunked 128k over 8 GPUs (context parallel)", "configs/long/124M_LT_chunked_8M_cp8.yaml",
     ("model.block_size=131072", "data.context=131072", "train.tokens_per_update=131072"),
     "h100x8", None),
    ("124M LT_chunked 512k over 8 GPUs (context parallel)", "configs/long/124M_LT_chunked_8M_cp8.yaml",
     ("model.block_size=524288", "data.context=524288", "train.tokens_per_update=524288"),
     "h100x8", None),
    # The shipped context-parallel configs as they are (configs/long/): the rungs auto compiles
    # and, where its estimate is near the budget, the next one up (8M: remat=full; flash:
    # loss_chunk=4096 remat=none).
    ("124M LT_chunked 8M over 8 GPUs (shipped)", "configs/long/124M_LT_chunked_8M_cp8.yaml", (),
     "h100x8", ("loss_chunk=4096 remat=full", "loss_chunk=4096 remat=offload")),
    ("1.6B LT_chunked 1M over 8 GPUs (shipped)", "configs/long/1.6B_LT_chunked_1M_cp8.yaml", (),
     "h100x8", ("loss_chunk=4096 remat=full", "loss_chunk=4096 remat=offload")),
    ("124M flash 2M over 8 GPUs (shipped)", "configs/long/124M_flash_2M_cp8.yaml", (), "h100x8",
     ("loss_chunk=4096 remat=none", "loss_chunk=4096 remat=dots", "loss_chunk=4096 remat=full")),
)  # fmt: skip


def xla_glue() -> dict[str, str]:
    """The step's glue kernels as every raw file compiled before ``auto`` took them on a GPU
    (kernels/choice.py: AUTO_PICKS_PALLAS) had them: XLA's. Those points are estimated with the
    glue pinned to it, so each estimate is of the program that was compiled; the fresh points,
    compiled at this commit, are estimated as configured."""
    from studies.train_step.step_glue import AFTER_KERNELS

    return {k: "xla" for k in AFTER_KERNELS}


def parse_label(label: str) -> dict:
    """``"loss_chunk=4096 remat=dots"`` -> ``{"loss_chunk": 4096, "remat": "dots"}``."""
    out = dict(w.split("=") for w in label.split())
    return {"loss_chunk": int(out["loss_chunk"]), "remat": out["remat"]}


def run_config(file: str, overrides=(), target: str = "h100x8"):
    """(run config, model config, StepShape, global sequences per micro-step) of a config file as the trainer lays it out on
    ``target``."""
    from linear_gpt2.experiments import compile_step
    from linear_gpt2.platform import target as targets
    from linear_gpt2.training.batches import plan_batches
    from linear_gpt2.training.config import load_config

    cfg = load_config(REPO / file, list(overrides))
    t = targets.get(target)
    bp = plan_batches(cfg, t.n_devices, int(t.topology.split("x")[1]))
    shape = compile_step.step_shape(t, bp.global_micro_batch, cfg.data.context, bp.accum,
                                    cfg.train.context_parallel, cfg.train.fsdp)  # fmt: skip
    return cfg, cfg.model_config, shape, bp.global_micro_batch


def points(results: Path):
    """(group, source file, its commit, point name, target, model config, StepShape, compiled
    bytes) for every compiled candidate the raw files record, estimated as it was compiled:
    where a row records ``auto``'s choices (``compile_step.choices``) with them, else with the
    glue at XLA's (:func:`xla_glue`) and the blocks scanned, the program of before those
    options were ``auto``."""
    for group, source, commit, point, tgt, m, shape, compiled, glue in _points(results):
        if glue is None:  # compiled before auto's choices were recorded (or were auto)
            pinned = {**xla_glue(), "scan_layers": True}
        else:  # the glue it recorded; each label's blocks as auto takes them for its remat
            pinned = glue
        pinned = {k: v for k, v in pinned.items() if getattr(m, k) == "auto"}
        yield group, source, commit, point, tgt, m.replace(**pinned), shape, compiled


def _glue(choices: dict | None) -> dict | None:
    """The glue's kernels among a row's recorded choices; None where it records none."""
    return {k: v for k, v in choices.items() if k.endswith("_kernel")} if choices else None


def _points(results: Path):
    from linear_gpt2.training.memory_plan import StepShape
    from studies.train_step.step_time import model_config

    post = json.loads((results / "configs_h100x8_compiled.json").read_text())
    commit = post["meta"]["environment"]["git_commit"]
    for r in post["rows"]:
        if "error" in r:
            continue
        _, m, shape, _ = run_config(r["config"])
        for label, compiled in r["tried"]:
            yield ("configs/post, one 8-GPU node", "configs_h100x8_compiled.json",
                   r.get("git_commit", commit), r["config"], "h100x8",
                   m.replace(**parse_label(label)), shape, compiled,
                   _glue(r.get("choices")))  # fmt: skip
    long = json.loads((results / "context_parallel_h100x8_compiled.json").read_text())
    for r in long["rows"]:
        _, m, shape, _ = run_config(r["config"], target=r["target"])
        for label, compiled in r["tried"]:
            yield ("configs/long, context parallel", "context_parallel_h100x8_compiled.json",
                   r["environment"]["git_commit"], r["config"], r["target"],
                   m.replace(**parse_label(label)), shape, compiled, None)  # fmt: skip
    switches = results / "model_switches_h100_compiled.json"
    if switches.exists():  # the model switches (benchmarks/model_switches.py)
        d = json.loads(switches.read_text())
        s = d["meta"]["settings"]
        for p in d["points"]:
            m = model_config(s["size"], s["attention"], p["context"], chunk_size=s["chunk_size"],
                             remat=p["remat"], loss_chunk=p["loss_chunk"], **p["switches"])  # fmt: skip
            yield ("model switches, one GPU", switches.name, p["git_commit"],
                   f"{s['attention']} {s['size']} {p['context']}, {p['variant']}", "h100", m,
                   StepShape(1, p["context"]), p["memory_bytes"], None)  # fmt: skip
    front = json.loads((results / "memory_frontier_h100_compiled.json").read_text())

    for p in front["points"]:
        for label, compiled in p.get("tried") or []:
            m = model_config(p["size"], p["attention"], p["context"], **parse_label(label))
            yield ("one GPU, batch 1 (memory frontier)", "memory_frontier_h100_compiled.json",
                   p.get("git_commit"), f"{p['attention']} {p['size']} {p['context']}", "h100",
                   m, StepShape(1, p["context"]), compiled, _glue(p.get("choices")))  # fmt: skip


def plan_of(name: str, file: str, overrides, tgt: str, fresh: dict) -> dict:
    """What ``memory_plan.plan`` does for a fresh point's config with ``auto`` settings: its
    estimates, the candidates it compiles (their compiled memory taken from the raw file
    instead of compiling again) and its choice."""
    from linear_gpt2.platform import target
    from linear_gpt2.platform.memory import MemoryReport
    from linear_gpt2.training import memory_plan

    _, m, shape, _ = run_config(file, overrides, tgt)
    m = m.replace(remat="auto", loss_chunk="auto")
    known = {f["setting"]: f["compiled_bytes"] for k, f in fresh.items()
             if k.startswith(f"{name}: ")}  # fmt: skip
    estimates = {}

    def estimate(c):
        with target.traced_for(tgt):
            estimates[memory_plan.label(c)] = e = memory_plan.estimate(c, shape)
        return e

    def compile_candidate(c):
        if memory_plan.label(c) not in known:
            raise SystemExit(
                f"{name}: the plan compiles {memory_plan.label(c)}, which the raw "
                "file lacks; add it to FRESH's settings and run without --no-compile"
            )
        total = known[memory_plan.label(c)]
        return MemoryReport(arguments=0, outputs=0, temporaries=total, aliased=0), None

    budget = target.get(tgt).budget_bytes
    p = memory_plan.plan(m, compile_candidate, budget, estimate=estimate)
    cols = {f["setting"]: f["collectives"] for k, f in fresh.items()
            if k.startswith(f"{name}: ") and f.get("collectives")}  # fmt: skip
    return {
        "point": name, "config": file, "target": tgt, "budget_bytes": budget,
        "chosen": memory_plan.label(p.config), "fits": p.fits,
        "compiled": [label for label, _ in p.tried],
        "candidates": [{"setting": k, "estimate_bytes": e.memory, "modelled_ms": e.seconds * 1e3,
                        "collective_bytes": e.collective_bytes, "compiled_bytes": known.get(k)}
                       for k, e in estimates.items()],
        "collectives_compiled": cols,
    }  # fmt: skip


def compile_fresh(cache: dict, restart: bool) -> None:
    """Compile every :data:`FRESH` point at every setting of the ladder its memory plan lists."""
    from linear_gpt2.experiments import compile_step
    from linear_gpt2.platform import provenance
    from linear_gpt2.platform import target as targets
    from linear_gpt2.training import memory_plan

    for name, file, overrides, target, settings in FRESH:
        _, m, shape, batch = run_config(file, overrides, target)
        for c in memory_plan.candidates(m):
            key = f"{name}: {memory_plan.label(c)}"
            if (key in cache and not restart) or settings and memory_plan.label(c) not in settings:
                continue
            t0 = time.perf_counter()
            r = compile_step.compile_train_step(
                c, target, batch=batch, accum=shape.accum, context=shape.context,
                fsdp=shape.fsdp, context_parallel=shape.context_parallel,
            )  # fmt: skip
            cache[key] = {
                "config": file, "overrides": list(overrides), "target": target,
                "setting": memory_plan.label(c), "compiled_bytes": r.compile.memory.total,
                "seconds": time.perf_counter() - t0, "collectives": r.collectives,
                "git_commit": provenance.environment()["git_commit"],
            }  # fmt: skip
            with targets.traced_for(target):  # which glue the step compiled had
                cache[key]["pallas_glue"] = memory_plan.pallas_glue(c)
            print(f"{key}: {r.compile.memory.total / 2**30:.2f} GiB", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--results", type=Path, default=RESULTS, help="the compiled raw files")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--restart", action="store_true")
    args = ap.parse_args(argv)
    from linear_gpt2.platform import provenance, target
    from linear_gpt2.training import memory_plan

    path = args.out / f"{STEM}.json"
    old = json.loads(path.read_text()) if path.exists() else {}
    fresh = {k: f for k, f in old.get("fresh", {}).items()  # points no longer listed dropped
             if any(k.startswith(f"{p[0]}: ") for p in FRESH)}  # fmt: skip
    if not args.no_compile:
        compile_fresh(fresh, args.restart)
    rows = []
    todo = list(points(args.results))
    for name, file, overrides, tgt, _ in FRESH:
        _, m, shape, _ = run_config(file, overrides, tgt)
        for key, f in fresh.items():
            if key.startswith(f"{name}: "):
                todo.append(("compiled at this commit", STEM + ".json", f["git_commit"], name,
                             tgt, m.replace(**parse_label(f["setting"])), shape,
                             f["compiled_bytes"]))  # fmt: skip
    for group, source, commit, point, tgt, m, shape, compiled in todo:
        with target.traced_for(tgt):
            e = memory_plan.estimate(m, shape)
        rows.append({
            "group": group, "source": source, "source_commit": commit, "point": point,
            "target": tgt, "setting": memory_plan.label(m), "attention": m.attention,
            "shape": shape.__dict__, "compiled_bytes": compiled, "estimate_bytes": e.memory,
            "estimate_parts": e.parts, "modelled_ms": e.seconds * 1e3,
            "collective_bytes": e.collective_bytes, "error": e.memory / compiled - 1,
            "margin": e.margin,
        })  # fmt: skip
        print(f"{group[:14]:<14} {point[:44]:<44} {memory_plan.label(m):<28} "
              f"est {e.memory / 2**30:7.2f} compiled {compiled / 2**30:7.2f} GiB "
              f"({e.memory / compiled - 1:+.1%})", flush=True)  # fmt: skip
    plans = [plan_of(name, file, overrides, tgt, fresh) for name, file, overrides, tgt, _ in FRESH]
    summary = {}
    for g in dict.fromkeys(r["group"] for r in rows):
        errs = [r["error"] for r in rows if r["group"] == g]
        summary[g] = {"n": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
                      "max_abs": max(abs(e) for e in errs), "min": min(errs), "max": max(errs)}  # fmt: skip
    errs = [r["error"] for r in rows]
    summary["all"] = {"n": len(errs), "median_abs": statistics.median(abs(e) for e in errs),
                      "max_abs": max(abs(e) for e in errs), "min": min(errs), "max": max(errs)}  # fmt: skip
    env = provenance.environment()
    meta = {
        "how": "compiled",
        "what": "auto's memory estimate (estimated from the configuration: parameters, AdamW "
        "state, gradients, the residuals autodiff keeps traced at one device's shapes, the "
        "backward's working set) beside the memory XLA's buffer assignment gives the step "
        "compiled for the target (deviceless); time MODELLED",
        "script": "benchmarks/memory_estimate.py",
        "environment": {**env, "device_kind": "NVIDIA H100 SXM (compiled for, deviceless)"},
        "settings": {"estimate_margin": memory_plan.ESTIMATE_MARGIN,
                     "unrolled_estimate_margin": memory_plan.UNROLLED_ESTIMATE_MARGIN,
                     "budget_bytes": target.get("h100").budget_bytes,
                     "fresh": [list(f) for f in FRESH]},
    }  # fmt: skip
    out = {"meta": meta, "summary": summary, "plans": plans, "rows": rows, "fresh": fresh}
    args.out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1, default=list) + "\n")
    from studies import common as reports

    md = reports.page(
        args.out / f"{STEM}.md", reports.block("memory_estimate.page", f"{STEM}.json")
    )
    s = summary["all"]
    print(f"estimate vs compiled: median |error| {s['median_abs']:.1%}, max {s['max_abs']:.1%} "
          f"over {s['n']} settings; wrote {path}, {md}")  # fmt: skip
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
