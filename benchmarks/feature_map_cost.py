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

Writes ``feature_map_cost_h100_compiled.json`` (after every point) and renders ``.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
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


def point_key(fm: str, T: int) -> str:
    return f"{fm}:{T}"


def compile_point(fm: str, T: int) -> dict:
    from linear_gpt2.attention import feature_maps
    from linear_gpt2.experiments import compile_step, hlo_costs, step_costs
    from linear_gpt2.kernels import key_blocks
    from linear_gpt2.model.config import ModelConfig
    from linear_gpt2.training import memory_plan
    from studies.train_step import step_model as sm

    fdim = MAPS[fm]
    cfg = ModelConfig.preset(
        "124M", attention="LT_chunked", chunk_size=CHUNK, feature_map=fm, feature_dim=fdim,
        block_size=T, dtype="bfloat16",
    )  # fmt: skip
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
    }


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
    args = ap.parse_args(argv)
    kernel_report.enable_ptxas_log()  # before JAX starts: registers and spills from ptxas

    from linear_gpt2.platform import provenance
    from studies import common as reports

    path = args.out / f"{STEM}.json"
    data = {"meta": {}, "points": {}, "cached": {}}
    if path.exists() and not args.restart:
        data = json.loads(path.read_text())
    data["meta"] = {
        "how": "compiled",
        "environment": provenance.environment(),
        "settings": {"size": "124M", "batch": 1, "dtype": "bfloat16", "attention": "LT_chunked",
                     "chunk_size": CHUNK, "kernel": "auto", "target": "h100",
                     "maps": MAPS, "command": "python benchmarks/feature_map_cost.py"},
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
            print(f"{key}: compiling", flush=True)
            try:
                data["points"][key] = compile_point(fm, T)
            except Exception as e:  # a point that does not compile is a result too
                data["points"][key] = {"feature_map": fm, "context": T, "error": str(e)[:400]}
            p = data["points"][key]
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
