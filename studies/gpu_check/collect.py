"""The units' outputs merged into results files (``<kind>_<device>_measured.*``), and the page
``gpu_check_<device>_measured.md`` that renders them. Run after every unit, over every unit done
so far, so that a window cut short still leaves its results (and back here, over the run folder
an archive was merged into). ``<device>`` is the GPU's label (``h100``, ``h200``): an H200's
figures land in files of their own.
"""

from __future__ import annotations

import csv
import json
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

from studies.gpu_check import learning
from studies.gpu_check.plan import Plan, Stage
from studies.gpu_check.runner import read_done, unit_dir


def _meta(env: dict, **settings) -> dict[str, Any]:
    env = {k: v for k, v in env.items() if k not in ("allocator_fraction", "allocator_fraction_set_by",
                                                     "allocator_bytes_limit", "packages")}  # fmt: skip
    return {"how": "measured", "environment": env, "settings": settings}


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    return path


def _units(run_dir: Path, stage: Stage, name: str) -> list[tuple[str, Path]]:
    """``(unit, its output file)`` for each unit done with that file."""
    out = []
    for u in stage.units:
        d = read_done(run_dir, stage.name, u.name)
        f = unit_dir(run_dir, stage.name, u.name) / name
        if d is not None and f.is_file():
            out.append((u.name, f))
    return out


def tests(stage, run_dir, results, dev, env) -> list[Path]:
    files = []
    for unit, path in _units(run_dir, stage, "junit.xml"):
        cases = []
        for case in ET.parse(path).getroot().iter("testcase"):
            outcome, message = "passed", ""
            for tag in ("failure", "error", "skipped"):
                el = case.find(tag)
                if el is not None:
                    outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                    message = (
                        (el.get("message") or "").splitlines()[0][:300] if el.get("message") else ""
                    )
            cases.append({"name": case.get("name"), "outcome": outcome,
                          "seconds": float(case.get("time") or 0), "message": message})  # fmt: skip
        files.append({"file": f"tests/{unit}.py", "tests": cases})
    if not files:
        return []
    meta = _meta(env, marker="-m gpu", packages=env.get("packages"),
                 reference="float64 (values and gradients), tests/test_*.py")  # fmt: skip
    return [_write_json(results / f"gpu_tests_{dev}_measured.json", {"meta": meta, "files": files})]


def executables(run_dir: Path, stage: Stage, unit: str) -> list[dict]:
    """The unit's look-ups in the store of steps compiled here (``compiled.jsonl``)."""
    path = unit_dir(run_dir, stage.name, unit) / "compiled.jsonl"
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _step_rows(stage, run_dir) -> tuple[list[dict], dict | None, dict[str, list]]:
    rows, meta, looked = [], None, {}
    for unit, path in _units(run_dir, stage, "step.json"):
        data = json.loads(path.read_text())
        meta = meta or data["meta"]
        rows += data["results"]
        looked[unit] = executables(run_dir, stage, unit)
    return rows, meta, looked


def step(stage, run_dir, results, dev, env) -> list[Path]:
    from studies.train_step import step_time

    rows, meta, looked = _step_rows(stage, run_dir)
    if not rows:
        return []
    loaded = sum(e["status"] == "loaded" for es in looked.values() for e in es)
    misses = sorted({e.get("why", "") for es in looked.values() for e in es
                     if e["status"] != "loaded"})  # fmt: skip
    meta = {**meta, "sizes_and_contexts": "make gpu-check's step stage (gpu_check/stages.py)",
            "executables": f"{loaded} steps loaded from the store compiled here for the "
            f"target (gpu_check/compiled.py), the rest compiled on the device"
            + (f"; misses: {'; '.join(misses)}" if misses else ""),
            "executables_per_unit": looked}  # fmt: skip
    results_ = [step_time.StepResult(**{k: v for k, v in r.items()}) for r in rows]
    paths = step_time.write_results(results_, results, f"step_time_{dev}_measured", meta)
    return list(paths)


def compile_ab(stage, run_dir, results, dev, env, plan=None) -> list[Path]:
    """Each setting of the ``compile_ab`` units beside the same setting of the step unit of
    the same name: median ms loaded (compiled here) and compiled on the GPU, their ratio."""
    rows = []
    step_stage = plan.stage("step") if plan is not None else None
    for unit, path in _units(run_dir, stage, "step.json"):
        there = {(r["attention"], r["context"]): r for r in json.loads(path.read_text())["results"]}
        here_path = unit_dir(run_dir, "step", unit) / "step.json"
        if step_stage is None or not here_path.is_file():
            continue
        looked = executables(run_dir, step_stage, unit)
        for r in json.loads(here_path.read_text())["results"]:
            t = there.get((r["attention"], r["context"]))
            if t is None or not r.get("median_ms") or not t.get("median_ms"):
                continue
            rows.append({
                "attention": r["attention"], "size": r["size"], "context": r["context"],
                "chunk_size": r.get("chunk_size"), "loaded_ms": r["median_ms"],
                "compiled_there_ms": t["median_ms"], "ratio": r["median_ms"] / t["median_ms"],
                "loaded": sum(e["status"] == "loaded" for e in looked),
                "looked_up": len(looked),
            })  # fmt: skip
    if not rows:
        return []
    meta = _meta(env, compared="step/<unit> (steps loaded from the store compiled here, "
                 "deviceless) against compile_ab/<unit> (compiled on the GPU), same session",
                 ratio="loaded median / compiled-there median")  # fmt: skip
    return [_write_json(results / f"compile_ab_{dev}_measured.json", {"meta": meta, "rows": rows})]


def glue(stage, run_dir, results, dev, env) -> list[Path]:
    """The glue units' side-by-side steps (``step.json``'s ``side_by_side``: the step with the
    glue kernels at xla and at pallas, one process per point) into ``glue_ab_<dev>_measured
    .json``, and its page ``glue_ab_<dev>_measured.md``, which says which setting won where and
    by how much, beside the glue kernels' gpu tests when they have run."""
    rows, meta = [], None
    for unit, path in _units(run_dir, stage, "step.json"):
        data = json.loads(path.read_text())
        meta = meta or data["meta"]
        times = {(r["attention"], r.get("chunk_size"), r.get("variant")): r
                 for r in data["results"]}  # fmt: skip
        for e in data.get("side_by_side", []):
            memory = {v: times.get((e["attention"], e["chunk_size"], v), {}).get("memory_bytes")
                      for v in e["median_ms"]}  # fmt: skip
            rounds = {v: times.get((e["attention"], e["chunk_size"], v), {}).get("rounds_ms")
                      for v in e["median_ms"]}  # fmt: skip
            rows.append({**e, "unit": unit, "memory_bytes": memory, "rounds_ms": rounds})
    if not rows:
        return []
    s = meta.get("settings", {})
    meta = {**meta, "settings": {k: s.get(k) for k in (
        "dtype", "warmup", "repeats", "rounds", "side_by_side", "model_options",
        "compile_threads")}}  # fmt: skip
    meta["settings"]["units"] = "make gpu-check's glue stage (gpu_check/stages.py: GLUE_POINTS)"
    meta["settings"]["compiled"] = "on the GPU, each variant side by side in one process"
    path = _write_json(results / f"glue_ab_{dev}_measured.json", {"meta": meta, "rows": rows})
    from studies.gpu_check import page

    return [path, page.write_glue(results, dev)]


def kernel_sweep(stage, run_dir, results, dev, env) -> list[Path]:
    rows, meta = [], None
    for u in stage.units:
        if read_done(run_dir, stage.name, u.name) is None:
            continue
        for path in sorted(unit_dir(run_dir, stage.name, u.name).glob("bench_kernels-*.json")):
            data = json.loads(path.read_text())
            rows += data.get("rows", [])
            meta = meta or {"how": "measured", "environment": {k: data.get(k) for k in (
                "device_kind", "platform", "jax_version", "jaxlib_version", "git_commit",
                "time_utc")}, "settings": {k: data.get(k) for k in (
                "shape", "dtype", "chunk_size", "warmup", "repeats", "interpret_mode", "flop_count")}}  # fmt: skip
    if not rows:
        return []
    return [_write_json(results / f"kernel_sweep_{dev}_measured.json", {"meta": meta,
                        "rows": rows})]  # fmt: skip


def glue_kernels(stage, run_dir, results, dev, env) -> list[Path]:
    """``benchmarks/bench_glue.py``'s rows (each launch candidate and XLA, per kernel and rows)."""
    rows, meta = [], None
    for _, path in _units(run_dir, stage, "bench_glue.json"):
        data = json.loads(path.read_text())
        rows += data["rows"]
        meta = meta or data["meta"]
    if not rows:
        return []
    return [
        _write_json(results / f"glue_kernels_{dev}_measured.json", {"meta": meta, "rows": rows})
    ]


def kernels(stage, run_dir, results, dev, env) -> list[Path]:
    rows, notes, meta = [], [], None
    for _, path in _units(run_dir, stage, "kernels.json"):
        data = json.loads(path.read_text())
        meta = meta or data["meta"]
        rows += data["rows"]
        notes += data.get("notes", [])
    if not rows:
        return []
    out = results / f"kernels_{dev}_measured"
    _write_json(out.with_suffix(".json"), {"meta": meta, "rows": rows, "notes": notes})
    fields = ["B", "H", "D", "forget", "impl", "T", "mode", "status", "ms", "min_ms", "max_ms",
              "tflops", "check_rel_err"]  # fmt: skip
    with out.with_suffix(".csv").open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)
    return [out.with_suffix(".json"), out.with_suffix(".csv")]


def profile(stage, run_dir, results, dev, env) -> list[Path]:
    found = [json.loads(p.read_text()) for _, p in _units(run_dir, stage, "profile.json")]
    if not found:
        return []
    meta = {**found[0]["meta"], "settings": {**found[0]["meta"].get("settings", {})}}
    return [_write_json(results / f"profile_{dev}_measured.json",
                        {"meta": meta, "profiles": [f["profile"] for f in found]})]  # fmt: skip


def sample(stage, run_dir, results, dev, env) -> list[Path]:
    from studies.sample_time import sample_time

    rows, meta = [], None
    for _, path in _units(run_dir, stage, "sample.json"):
        data = json.loads(path.read_text())
        meta = meta or data["meta"]
        rows += data["rows"]
    if not rows:
        return []
    sizes = sorted({r.get("size") for r in rows})
    meta = {k: v for k, v in meta.items() if k != "how"}
    meta["title"] = f"{', '.join(sizes)}, {meta['environment']['device_kind']}"
    return sample_time.write_sample_results(rows, results, f"sample_time_{dev}_measured", meta)


def memory(stage, run_dir, results, dev, env) -> list[Path]:
    rows, meta = [], None
    for _, path in _units(run_dir, stage, "memory.json"):
        data = json.loads(path.read_text())
        meta = meta or data["meta"]
        rows += data["rows"]
    if not rows:
        return []
    stem = f"memory_check_{dev}_measured"
    path = _write_json(results / f"{stem}.json", {"meta": meta, "rows": rows})
    from studies import common as reports

    reports.page(results / f"{stem}.md", "\n".join([
        "# Compiled memory vs the real GPU's peak (measured on the device)", "",
        reports.block("memory_check.about", path.name),
        reports.block("memory_check.table", path.name),
    ]))  # fmt: skip
    return [path, results / f"{stem}.md"]


def _evals(run: Path) -> tuple[list[dict], dict]:
    records = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    done_path = run / "DONE"
    done = json.loads(done_path.read_text()) if done_path.is_file() else {}
    return [r for r in records if "val_loss" in r], done


def _learning(stage, run_dir, env, spec) -> list[dict]:
    rows = []
    for u in stage.units:
        if read_done(run_dir, stage.name, u.name) is None:
            continue
        run = unit_dir(run_dir, stage.name, u.name) / "run"
        evals, done = _evals(run)
        cfg = done.get("config", {})
        curve = [(int(r["step"]), float(r["val_loss"])) for r in evals]
        rows.append({
            "name": u.name, "stopped_by": done.get("stopped_by"), "steps": done.get("step"),
            "context": cfg.get("data", {}).get("context"), "seed": cfg.get("seed"),
            "attention": cfg.get("attention", {}), "curve": curve,
            "val_acc": [(int(r["step"]), r["val_acc"]) for r in evals if "val_acc" in r],
            **learning.curve_summary(curve),
        })  # fmt: skip
    return rows


def mqar(stage, run_dir, results, dev, env) -> list[Path]:
    rows = _learning(stage, run_dir, env, "mqar")
    if not rows:
        return []
    meta = _meta(env, sweep="configs/sweeps/mqar_zoology_gpu.yaml", stop="99% test accuracy")
    return [_write_json(results / f"mqar_{dev}_measured.json", {"meta": meta, "runs": rows})]


def context(stage, run_dir, results, dev, env) -> list[Path]:
    rows = _learning(stage, run_dir, env, "context")
    if not rows:
        return []
    for r in rows:
        a = r["attention"]
        r["variant"] = (
            a.get("name", "?")
            + (" + doc_reset" if a.get("doc_reset") else "")
            + (f" + decay: {a['decay']}" if a.get("decay") not in (None, "none") else "")
        )
    gaps = learning.gaps([{**r, "final_loss": r["final_loss"]} for r in rows])
    meta = _meta(env, sweep="configs/sweeps/context_gpu.yaml", passes=learning.PASSES)
    data = {"meta": meta, "runs": rows, "gaps": gaps}
    return [_write_json(results / f"context_{dev}_measured.json", data)]


COLLECTORS: dict[str, Callable[..., list[Path]]] = {
    "tests": tests, "kernels": kernels, "step": step, "profile": profile, "sample": sample,
    "memory": memory, "mqar": mqar, "context": context, "compile_ab": compile_ab,
    "kernel_sweep": kernel_sweep, "glue": glue, "glue_kernels": glue_kernels,
}  # fmt: skip
WINDOWS = "windows.jsonl"  # the run folder's record of each window: estimate, time, units


def window_records(run_dir: Path) -> list[dict]:
    path = Path(run_dir) / WINDOWS
    if not path.is_file():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def units_record(plan: Plan, run_dir: Path, results: Path, env: dict, dev: str) -> Path:
    """Every unit's time next to its estimate, and every window's (what the next plan is
    priced from; the dry run shows the last window's estimate beside what it took)."""
    units = []
    for s in plan.stages:
        for u in s.units:
            d = read_done(run_dir, s.name, u.name)
            if d is not None:
                units.append({**d, "phase": s.phase, "tier": u.tier})
    path = results / f"gpu_check_{dev}_measured.json"
    data = json.loads(path.read_text()) if path.is_file() else {}
    keyed = {(u["stage"], u["unit"]): u for u in data.get("units", [])}
    keyed.update({(u["stage"], u["unit"]): u for u in units})
    wins = {(w.get("started_utc"), w.get("window")): w for w in data.get("windows", [])}
    wins.update({(w.get("started_utc"), w.get("window")): w for w in window_records(run_dir)})
    meta = _meta(env, packages=env.get("packages"),
                 allocator_fraction=env.get("allocator_fraction"),
                 written_utc=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
    meta["machine"] = {k: env.get(k) for k in (
        "backend_platform_version", "topology_fingerprint", "cuda", "compute_capability",
        "compression", "xla_flags", "allocator_bytes_limit")}  # fmt: skip
    return _write_json(path, {"meta": meta, "units": list(keyed.values()),
                              "windows": sorted(wins.values(), key=lambda w: w.get("started_utc") or "")})  # fmt: skip


def collect_all(plan: Plan, run_dir: Path, results: Path, env: dict, dev: str | None = None
                ) -> list[Path]:  # fmt: skip
    """Every stage's results files, the units and windows record and the page, for device
    label ``dev`` (default the plan's)."""
    from studies.gpu_check import page

    dev = dev or plan.device
    results.mkdir(parents=True, exist_ok=True)
    written = []
    for s in plan.stages:
        if s.name == "compile_ab":
            written += compile_ab(s, run_dir, results, dev, env, plan)
        else:
            written += COLLECTORS[s.name](s, run_dir, results, dev, env)
    written.append(units_record(plan, run_dir, results, env, dev))
    written.append(page.write(results, dev))
    return written
