"""What recall costs in speed (issue 39): the 124M training step with each feature map, compiled
for the H100 on this CPU machine, at 1k, 16k and 64k tokens, beside softplus and flash.

Per point: the step (``train_step.jit_train_step``: batch 1, bf16, AdamW) of ``LT_chunked``
(chunk 64, ``kernel: auto`` = the Pallas kernels on the H100) with the feature map, compiled
deviceless for the H100 with the auto memory settings (``compile_step.compile_train_step``): its
compiled memory, the setting ``auto`` chose, every Pallas kernel's registers and spills
(ptxas's log), and the step-time MODEL (``studies/train_step/step_model.py``: the optimized program
priced per launch, ``step_costs.cost_rows``, at the parameters fitted to the 37 measured H100
steps, ``train_step_h100_model.json``). Flash and softplus also have their measured H100 times
(``train_step_h100_costs_compiled.json``, the points the model was fitted on); flash's memory
and model come from that file (compiled at its commit).

    python benchmarks/feature_map_cost.py                  # every point (resumable: cached)
    python benchmarks/feature_map_cost.py --maps taylor2 --contexts 1024
    python benchmarks/feature_map_cost.py --maps power2 --timeout 1800

Each point compiles in a child process bounded by ``--timeout`` seconds of wall time. Before
compiling, the child records the auto memory plan's estimate of every candidate setting (traced,
nothing compiled: ``memory_plan.estimate``), so a point whose compile does not finish in time
still says what the auto settings resolve to (a timeout is recorded as such, with them). Every
point records the commit it was compiled at (points cached from an earlier run keep theirs).

Writes ``feature_map_cost_h100_compiled.json`` (after every point) and renders ``.md``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import kernel_report  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "feature_map_cost_h100_compiled"
# (feature map, attention.feature_dim): Based's and ReBased's 16-dim projections; the symmetric
# power on the head dim (64), the post's follow-up.
MAPS = {"softplus": 0, "taylor2": 16, "rebased": 16, "power2": 0}
CONTEXTS = (1024, 16384, 65536)
CHUNK = 64
# Wall-clock seconds one point's compile may take (power2's 1k step took 35 minutes on this
# 2-core machine); a point past it is recorded as a timeout, with the plan's estimates.
TIMEOUT_S = 3600


def point_key(fm: str, T: int) -> str:
    return f"{fm}:{T}"


def _config(fm: str, T: int):
    from linear_gpt2.model.config import ModelConfig

    return ModelConfig.preset(
        "124M", attention="LT_chunked", chunk_size=CHUNK, feature_map=fm, feature_dim=MAPS[fm],
        block_size=T, dtype="bfloat16",
    )  # fmt: skip


def plan_estimates(fm: str, T: int) -> dict:
    """What ``auto``'s memory plan thinks of each candidate setting before compiling any (as
    ``compile_step.compile_train_step`` estimates them, traced for the H100): the budget, and
    per candidate its estimated memory, MODELLED time (the plan's ranking rates) and whether
    the plan would compile it (estimated within the budget and its margin)."""
    from linear_gpt2.experiments import compile_step
    from linear_gpt2.platform import target
    from linear_gpt2.training import memory_plan

    cfg, t = _config(fm, T), target.get("h100")
    shape = compile_step.step_shape(t, 1, T)
    rows = []
    for c in memory_plan.candidates(cfg):
        with target.traced_for(t):
            e = memory_plan.estimate(c, shape)
        limit = t.budget_bytes * (1 + e.margin)
        rows.append({"setting": memory_plan.label(c), "memory_bytes": e.memory,
                     "modelled_ms": e.seconds * 1e3, "compiled": e.memory <= limit})  # fmt: skip
    return {"budget_bytes": t.budget_bytes, "candidates": rows}


def compile_point(fm: str, T: int) -> dict:
    from linear_gpt2.attention import feature_maps
    from linear_gpt2.experiments import compile_step, hlo_costs
    from linear_gpt2.kernels import key_blocks
    from linear_gpt2.platform import provenance
    from linear_gpt2.training import memory_plan
    from studies.train_step import step_costs
    from studies.train_step import step_model as sm

    fdim = MAPS[fm]
    cfg = _config(fm, T)
    t0 = time.perf_counter()
    r = compile_step.compile_train_step(cfg, "h100", batch=1, kernels=True)
    seconds = time.perf_counter() - t0
    d_key = feature_maps.get(fm).dim(cfg.qk_dim)
    nk = key_blocks.plan(d_key, cfg.head_dim)[1]
    point = step_costs.Point("LT_chunked", "124M", T, CHUNK, 0.0, 0, STEM, key_blocks=nk)
    rows = step_costs.cost_rows(hlo_costs.program_ops(r.hlo_text), point)
    params = sm.Params(**json.loads((RESULTS / "train_step_h100_model.json").read_text())["params"])
    return {
        "feature_map": fm,
        "feature_dim": fdim,
        "context": T,
        "key_features": d_key,
        "key_blocks": nk,
        "state_floats_per_head": d_key * cfg.head_dim + d_key,
        "memory_bytes": r.compile.memory.total,
        "fits": r.fits,
        "setting": memory_plan.label(r.config),
        "tried": [[name, m.total] for name, m in r.plan.tried],
        "modelled_ms": sm.predict(rows, params) * 1e3,
        "breakdown_ms": {k: v * 1e3 for k, v in sm.breakdown(rows, params).items()},
        "kernels": _kernels(r.compile.kernels),
        "compile_seconds": seconds,
        "commit": provenance.git_commit(),
    }


def run_point(fm: str, T: int, timeout: float) -> dict:
    """:func:`compile_point` in a child process, stopped after ``timeout`` seconds: the point,
    or its error, or ``timeout_s`` with the plan's estimates (written by the child first)."""
    from linear_gpt2.platform import provenance

    with tempfile.TemporaryDirectory(prefix="feature_map_cost_") as tmp:
        out, est = Path(tmp) / "point.json", Path(tmp) / "estimates.json"
        cmd = [sys.executable, __file__, "--one", fm, str(T), "--one-out", str(out),
               "--one-estimates", str(est)]  # fmt: skip
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, timeout=timeout, capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            point = {"feature_map": fm, "context": T, "timeout_s": timeout,
                     "commit": provenance.git_commit()}  # fmt: skip
            if est.exists():
                point["plan"] = json.loads(est.read_text())
            return point
        if out.exists():
            return json.loads(out.read_text())
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
        return {"feature_map": fm, "context": T, "commit": provenance.git_commit(),
                "error": f"exit {proc.returncode} after {time.perf_counter() - t0:.0f} s: "
                         f"{tail[0][:300]}"}  # fmt: skip


def one(fm: str, T: int, out: Path, estimates: Path) -> int:
    """The child of :func:`run_point`: the plan's estimates, then the compiled point (or the
    error it raised) as JSON files."""
    estimates.write_text(json.dumps(plan_estimates(fm, T)) + "\n")
    try:
        point = compile_point(fm, T)
    except Exception as e:  # a point that does not compile is a result too
        from linear_gpt2.platform import provenance

        point = {"feature_map": fm, "context": T, "error": str(e)[:400],
                 "commit": provenance.git_commit()}  # fmt: skip
    point["plan"] = json.loads(estimates.read_text())
    out.write_text(json.dumps(point) + "\n")
    return 0


def _kernels(found) -> list[dict]:
    """The Pallas kernels (one row per name: the largest registers and spills seen)."""
    out: dict[str, dict] = {}
    for k in found:
        if not k.name.startswith(("lt_chunked", "lt_attention_parallel")):
            continue
        row = out.setdefault(k.name, {"name": k.name, "registers": None, "spills": None,
                                      "programs": 0})  # fmt: skip
        for key, value in (("registers", k.registers), ("spills", k.spills)):
            if value is not None:
                row[key] = max(row[key] or 0, value)
        row["programs"] = max(row["programs"], k.programs)
    return sorted(out.values(), key=lambda r: r["name"])


def cached(attention: str, T: int) -> dict | None:
    """A point of the step model's cache (compiled at its commit, measured on the H100)."""
    from studies.train_step import step_model as sm

    costs = json.loads((RESULTS / "train_step_h100_costs_compiled.json").read_text())
    model = json.loads((RESULTS / "train_step_h100_model.json").read_text())
    entry = costs["points"].get(f"{attention}:124M:{T}")
    if entry is None:
        return None
    params = sm.Params(**model["params"])
    return {
        "attention": attention,
        "context": T,
        "memory_bytes": entry["memory_bytes"],
        "setting": f"remat={entry['remat']}, loss_chunk={entry['loss_chunk']}",
        "measured_ms": entry["point"]["measured_ms"],
        "modelled_ms": sm.predict(entry["rows"], params) * 1e3,
        "source": entry["point"]["source"],
        "commit": costs["meta"].get("environment", {}).get("git_commit"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--maps", nargs="+", default=list(MAPS), choices=list(MAPS))
    ap.add_argument("--contexts", nargs="+", type=int, default=list(CONTEXTS))
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--restart", action="store_true", help="recompile the cached points")
    ap.add_argument("--timeout", type=float, default=TIMEOUT_S,
                    help=f"seconds one point's compile may take (default {TIMEOUT_S})")  # fmt: skip
    ap.add_argument("--one", nargs=2, metavar=("MAP", "T"), help=argparse.SUPPRESS)
    ap.add_argument("--one-out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--one-estimates", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    kernel_report.enable_ptxas_log()  # before JAX starts: registers and spills from ptxas
    if args.one:
        return one(args.one[0], int(args.one[1]), args.one_out, args.one_estimates)

    from linear_gpt2.platform import provenance
    from studies import common as reports

    path = args.out / f"{STEM}.json"
    data = {"meta": {}, "points": {}, "cached": {}}
    if path.exists() and not args.restart:
        data = json.loads(path.read_text())
        # Points of a run that recorded only one commit for the file: theirs is that one.
        earlier = data.get("meta", {}).get("environment", {}).get("git_commit")
        for p in data["points"].values():
            p.setdefault("commit", earlier)
    data["meta"] = {
        "how": "compiled",
        "environment": provenance.environment(),
        "settings": {"size": "124M", "batch": 1, "dtype": "bfloat16", "attention": "LT_chunked",
                     "chunk_size": CHUNK, "kernel": "auto", "target": "h100",
                     "maps": MAPS, "timeout_s": args.timeout,
                     "command": "python benchmarks/feature_map_cost.py"},
        "model": "train_step_h100_model.json",
    }  # fmt: skip
    for T in args.contexts:
        for name in ("flash", "LT_chunked"):
            c = cached(name, T)
            if c:
                data["cached"][f"{name}:{T}"] = c
    for fm in args.maps:
        for T in args.contexts:
            key = point_key(fm, T)
            if key in data["points"]:
                continue
            print(f"{key}: compiling (at most {args.timeout:.0f} s)", flush=True)
            data["points"][key] = p = run_point(fm, T, args.timeout)
            print(f"{key}: {json.dumps({k: v for k, v in p.items() if k != 'kernels'})}",
                  flush=True)  # fmt: skip
            path.write_text(json.dumps(data, indent=1) + "\n")
    path.write_text(json.dumps(data, indent=1) + "\n")
    reports.page(args.out / f"{STEM}.md", reports.block("feature_map_cost.page", path.name))
    print(f"wrote {path} and {STEM}.md")
    return 0


if __name__ == "__main__":
    from linear_gpt2.platform import process

    process.configure()  # the settings JAX reads as it starts (platform/process.py)
    raise SystemExit(main())
