"""A MODEL of the training step's time on the H100, checked against the 37 measured step times.

Every step timed on the lent H100 (``benchmarks/results/step_time_h100_*.json``; the memory
check's four, ``memory_check_h100.json``, held out of the fit) is compiled for the H100 on this
machine as it ran (attention, size, context, chunk size; the memory setting ``auto`` chose,
matched by the compiled memory the device reported), its optimized program priced per kernel
(``linear_gpt2/experiments/hlo_costs.py``, ``step_costs.py``) and the step modelled as a sum of
roofline times at fitted fractions of the H100's peaks plus an overhead per launch
(``step_model.py``). Then the breakdown of the 124M step at 64k and 1M by op class, and what the
model predicts concrete changes would do to each target gap of issue 30 (``step_targets.py``).

    python benchmarks/step_model.py              # compile what the cache lacks (~20 min), fit
    python benchmarks/step_model.py --no-compile # the cached costs only: seconds
    python benchmarks/step_model.py --tiny --out DIR  # a tiny model, synthetic times (tests)

Writes ``train_step_h100_costs_compiled.json`` (the cache: per point the setting, the memory
match and the cost rows; resumable, ``--restart`` recompiles) and
``train_step_h100_model.{json,md}`` under ``--out`` (default benchmarks/results/). Every fitted
fraction of a peak is bounded by what the lent card measured (``card_ceilings_h100.json``:
no kernel multiplies faster than its dense bf16 matmul), not by the datasheet.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402
from linear_gpt2.platform.provenance import environment  # noqa: E402
from studies.train_step import (
    step_costs,  # noqa: E402
    step_targets,  # noqa: E402
)
from studies.train_step import step_model as sm  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
COSTS = "train_step_h100_costs_compiled.json"
STEM = "train_step_h100_model"
CEILINGS = "card_ceilings_h100.json"
FOCUS = ("LT_chunked:124M:65536", "flash:124M:65536", "LT_chunked:124M:1048576:offload:4096")


def tiny_points() -> list[step_costs.Point]:
    """Two tiny steps; their "measured" times are set from the model (synthetic)."""
    return [
        step_costs.Point("flash", "tiny", 256, None, 0.0, 1, "synthetic", "none", 0),
        step_costs.Point("LT_chunked", "tiny", 256, 64, 0.0, 1, "synthetic", "none", 0),
        step_costs.Point("LT_chunked", "tiny", 512, 64, 0.0, 1, "synthetic", "none", 0, True),
    ]


def load_costs(path: Path, restart: bool) -> dict:
    if restart or not path.exists():
        return {"meta": {}, "points": {}}
    return json.loads(path.read_text())


def compile_missing(points, costs: dict, path: Path, meta: dict) -> None:
    for p in points:
        if p.key in costs["points"]:
            continue
        entry = step_costs.compile_point(p, log=lambda s: print(s, flush=True))
        costs["points"][p.key] = {"point": p.__dict__, **entry}
        costs["meta"] = meta
        path.write_text(json.dumps(costs, indent=1) + "\n")  # after every point: resumable


def load_ceilings(results: Path) -> tuple[dict, str | None]:
    """The lent card's measured ceilings (``card_ceilings_h100.json``, written by
    ``benchmarks/card_ceilings.py``) and the file's name; empty where there is none."""
    path = results / CEILINGS
    if not path.exists():
        return {}, None
    return {k: v for k, v in json.loads(path.read_text())["ceilings"].items() if v}, path.name


def model(points, costs: dict, loo: bool = True, ceilings: dict | None = None) -> dict:
    """Fit on the points not held out, each fraction bounded by the card's measured
    ``ceilings`` (``step_model.bounds``); every point's error; breakdowns; the targets."""
    have = [p for p in points if p.key in costs["points"]]
    rows = {p.key: costs["points"][p.key]["rows"] for p in have}
    fit_on = [(rows[p.key], p.measured_ms / 1e3) for p in have if not p.held_out]
    limits = sm.bounds(ceilings)
    params = sm.fit(fit_on, limits=limits)
    loo_errors = sm.leave_one_out(fit_on, params, limits) if loo else [None] * len(fit_on)
    fixed_mm = sm.fit(fit_on, sm.Params(matmul=0.7), free=[k for k in sm.FITTED if k != "matmul"],
                      limits=limits)  # fmt: skip
    unbounded = sm.fit(fit_on)
    out_points, i = [], 0
    for p in have:
        c = costs["points"][p.key]
        modelled = sm.predict(rows[p.key], params) * 1e3
        row = {
            "key": p.key, "attention": p.attention, "size": p.size, "context": p.context,
            "chunk_size": p.chunk_size, "remat": c["remat"], "loss_chunk": c["loss_chunk"],
            "settings_from": c["settings_from"], "memory_match": c["memory_match"],
            "source": p.source, "held_out": p.held_out, "measured_ms": p.measured_ms,
            "modelled_ms": modelled, "error": modelled / p.measured_ms - 1,
            "loo_error": None, "launches": sm.launches(rows[p.key]),
            "breakdown_ms": {k: v * 1e3 for k, v in sm.breakdown(rows[p.key], params).items()},
        }  # fmt: skip
        if not p.held_out:
            row["loo_error"] = loo_errors[i]
            i += 1
        out_points.append(row)
    fitted = [r for r in out_points if not r["held_out"]]
    held = [r for r in out_points if r["held_out"]]
    focus = {}
    for key in FOCUS:
        if key in rows:
            focus[key] = {
                "by_class_ms": {k: v * 1e3 for k, v in sm.breakdown(rows[key], params).items()},
                "by_part_ms": {k: v * 1e3 for k, v in
                               sm.breakdown(rows[key], params, by="part").items()},
                "by_pass_ms": {k: v * 1e3 for k, v in
                               sm.breakdown(rows[key], params, by="pass").items()},
                "totals": sm.totals(rows[key]),
            }  # fmt: skip
    measured = {p.key: p.measured_ms for p in have}
    return {
        "params": {k: getattr(params, k) for k in (*sm.FITTED, "host_bytes_per_s")},
        "fitted": list(sm.FITTED),
        "bounds": {k: list(v) for k, v in limits.items()},
        "bound_from": dict(sm.CEILING_OF),
        "ceilings": ceilings or {},
        "at_bound": [k for k in sm.FITTED if abs(getattr(params, k) - limits[k][1]) < 1e-6],
        "fit": {
            **sm.summary([r["error"] for r in fitted]),
            "loo": sm.summary([r["loo_error"] for r in fitted]) if loo else None,
            "held_out": sm.summary([r["error"] for r in held]) if held else None,
            "matmul_fixed_0.7": {
                "params": {k: getattr(fixed_mm, k) for k in sm.FITTED},
                **sm.summary(sm.errors(fit_on, fixed_mm)),
            },
            "unbounded": {  # within the datasheet peaks only, as fitted before the ceilings
                "params": {k: getattr(unbounded, k) for k in sm.FITTED},
                **sm.summary(sm.errors(fit_on, unbounded)),
            },
        },
        "points": out_points,
        "focus": focus,
        "targets": step_targets.evaluate(rows, measured, params),
    }


def synthesize(points, costs: dict) -> list:
    """The tiny run's "measured" times: the model at its default parameters, +-5%."""
    p0 = sm.Params()
    out = []
    for i, p in enumerate(points):
        t = sm.predict(costs["points"][p.key]["rows"], p0) * 1e3 * (1.05 if i % 2 else 0.95)
        out.append(step_costs.dataclasses.replace(p, measured_ms=t))
    return out


def main(argv=None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv) -> int:
    ap = cli.ArgumentParser(
        prog="benchmarks/step_model.py", description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--results", type=Path, default=RESULTS, help="where the measured files are")
    ap.add_argument("--no-compile", action="store_true", help="use the cached costs only")
    ap.add_argument("--restart", action="store_true", help="recompile every point")
    ap.add_argument("--no-loo", action="store_true", help="skip the leave-one-out refits")
    ap.add_argument("--tiny", action="store_true", help="tiny model, synthetic times (tests)")
    args = ap.parse_args(argv)
    points = tiny_points() if args.tiny else step_costs.measured_points(args.results)
    path = args.out / COSTS
    costs = load_costs(path, args.restart)
    env = environment()
    meta = {
        "how": "compiled",
        "environment": {**env, "device_kind": "NVIDIA H100 SXM (compiled for, deviceless)"},
        "settings": {
            "target": "h100", "step": "train_step.jit_train_step (clip, AdamW), state donated",
            "batch": 1, "dtype": "bfloat16",
            "memory_setting": "as recorded; else the first of memory_plan.LADDER whose compiled "
            f"memory is within {step_costs.MEMORY_MATCH:.0%} of the device's",
            "measured": "synthetic (the model at its default parameters, +-5%)" if args.tiny
            else "benchmarks/results/step_time_h100_*.json, memory_check_h100.json",
        },
    }  # fmt: skip
    if not args.no_compile:
        args.out.mkdir(parents=True, exist_ok=True)
        compile_missing(points, costs, path, meta)
    elif not any(p.key in costs["points"] for p in points):
        raise cli.UsageError(
            f"--no-compile: {path} holds no compiled costs of the {len(points)} points to "
            "model; run once without --no-compile (it compiles them, ~20 min, resumable), or "
            f"give --out the folder that holds {COSTS}"
        )
    if args.tiny:
        points = synthesize(points, costs)
    ceilings, ceilings_file = ({}, None) if args.tiny else load_ceilings(args.results)
    result = model(points, costs, loo=not args.no_loo, ceilings=ceilings)
    args.out.mkdir(parents=True, exist_ok=True)
    result["meta"] = {
        "how": "modelled",
        "environment": {**env, "device_kind": "NVIDIA H100 SXM (modelled)"},
        "costs": {"file": COSTS, **costs.get("meta", {})},
        "settings": {
            "peak_tflops": sm.PEAK_FLOPS / 1e12, "peak_tb_per_s": sm.PEAK_BYTES / 1e12,
            "host_gb_per_s": sm.HOST_BYTES_PER_S / 1e9, "tiny": args.tiny,
            "ceilings_file": ceilings_file,
            "measured": meta["settings"]["measured"],
        },
    }  # fmt: skip
    (args.out / f"{STEM}.json").write_text(json.dumps(result, indent=1) + "\n")
    from studies import common as reports

    md = reports.page(args.out / f"{STEM}.md", reports.block("step_model.page", f"{STEM}.json"))
    f = result["fit"]
    print(f"MODEL: median |error| {f['median_abs']:.1%}, max {f['max_abs']:.1%} over {f['n']} "
          f"points; wrote {args.out / f'{STEM}.json'}, {md}")  # fmt: skip
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
