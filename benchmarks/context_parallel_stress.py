"""Stress for issue 38: do context-parallel runs on host devices ever abort or hang?

Runs the trainer (``scripts/train.py``, the real entry point) on 8 XLA:CPU host devices with
``train.context_parallel=2`` (mesh data=4 x seq=2), ``configs/shakespeare.yaml`` cut to 2 layers
and 256 tokens (3.34M parameters), for 4 steps (``--steps``) then its diagnostics pass and its
evaluation, ``--runs`` times for each case (``flash``: the balanced ring; ``LT_chunked``: the
state exchange, with the fused loss), under load: a ``flash`` and an ``LT_chunked`` run go side
by side, and ``--burners`` processes spin on the CPU throughout (default: one per core). The
devices are asked for as a user would: ``JAX_NUM_CPU_DEVICES=8`` (default), which leaves
XLA:CPU's concurrency-optimised scheduler on, or ``--devices-by xla_flags``
(``--xla_force_host_platform_device_count``, under which importing the package turns it off).

Each run is ``ok`` (exit 0, every step in metrics.jsonl), ``abort`` (XLA's rendezvous
termination: devices waiting for collectives others never reached), ``hang`` (killed after
``--timeout`` s) or ``error`` (anything else, with its last line). Not part of the test suite:
20 runs a case take an hour or more on a loaded 2-core machine.

    nice -n 10 python benchmarks/context_parallel_stress.py --runs 20 --out runs/stress

Writes ``context_parallel_stress_cpu.json`` (the counts, every run's outcome and time, and
where they were obtained) to ``--results`` (default: ``--out``); ``--name`` its stem.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from linear_gpt2.platform import provenance  # noqa: E402

CASES = {
    "flash": ["attention.name=flash"],
    "LT_chunked": ["attention.name=LT_chunked"],
}
# configs/shakespeare.yaml (64 wide, the fused loss, diagnostics, 12 held-out batches) with 2
# layers and 256 tokens: 3.34M parameters, the configuration issue 38 saw abort.
BASE = "configs/shakespeare.yaml"
MODEL = [
    "model.n_layer=2", "model.block_size=256", "data.context=256", "train.micro_batch=4",
    "train.context_parallel=2", "log.wandb=disabled", "checkpoint.resume=never",
]  # fmt: skip
DEVICES = 8
ABORT_MARKS = ("rendezvous", "Termination timeout")


def _env(devices_by: str) -> dict[str, str]:
    """The runs' environment: 8 host devices asked for as a user would, by JAX's own setting
    (``JAX_NUM_CPU_DEVICES``) or by XLA's flag (``XLA_FLAGS``)."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT), WANDB_MODE="disabled")
    if devices_by == "xla_flags":
        flags = env.get("XLA_FLAGS", "")
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={DEVICES}".strip()
    else:
        env["JAX_NUM_CPU_DEVICES"] = str(DEVICES)
    return env


def _burner() -> subprocess.Popen:
    # A pure-Python spin: one busy core each, no memory, killed at the end.
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], start_new_session=True)


def _start(case: str, i: int, out: Path, steps: int, devices_by: str):
    run_dir = out / f"{case}_{i:02d}"
    log = out / f"{case}_{i:02d}.log"
    # The last step is followed by the diagnostics pass and an evaluation (12 batches).
    args = [sys.executable, str(ROOT / "scripts" / "train.py"), str(ROOT / BASE), *MODEL,
            f"train.max_steps={steps}", *CASES[case], f"log.run_dir={run_dir}"]  # fmt: skip
    with open(log, "w") as f:
        proc = subprocess.Popen(
            args,
            env=_env(devices_by),
            cwd=ROOT,
            stdout=f,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return proc, run_dir, log


def _classify(rc: int | None, run_dir: Path, log: Path, steps: int) -> tuple[str, str]:
    text = log.read_text(errors="replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if rc is None:
        return "hang", lines[-1] if lines else ""
    if any(m in text for m in ABORT_MARKS):
        mark = next(ln for ln in lines if any(m in ln for m in ABORT_MARKS))
        return "abort", mark[:300]
    metrics = run_dir / "metrics.jsonl"
    done = []
    if metrics.exists():
        done = [json.loads(ln).get("step") for ln in metrics.read_text().splitlines() if ln]
    if rc == 0 and done == list(range(1, steps + 1)):
        return "ok", ""
    return "error", f"rc={rc} steps={done} " + (lines[-1][:300] if lines else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=20, help="runs per case")
    p.add_argument("--steps", type=int, default=4, help="training steps per run")
    p.add_argument(
        "--devices-by",
        choices=("jax_num_cpu_devices", "xla_flags"),
        default="jax_num_cpu_devices",
        help="how the 8 host devices are asked for",
    )
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--burners", type=int, default=os.cpu_count() or 2)
    p.add_argument("--timeout", type=float, default=600.0, help="seconds before a run is a hang")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "cp_stress")
    p.add_argument("--results", type=Path, default=None, help="folder of the JSON (--out)")
    p.add_argument("--label", default="", help="recorded in the JSON (e.g. before/after)")
    p.add_argument("--name", default="context_parallel_stress_cpu", help="the JSON's stem")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results = args.results or args.out
    # SIGTERM (a scheduler, a kill) unwinds like Ctrl-C, so the finally below stops every child.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    burners = [_burner() for _ in range(args.burners)]
    runs: list[dict] = []
    started: dict = {}
    t_start = time.time()
    try:
        for i in range(args.runs):
            started = {
                c: (*_start(c, i, args.out, args.steps, args.devices_by), time.time())
                for c in args.cases
            }
            for case, (proc, run_dir, log, t0) in started.items():
                try:
                    rc = proc.wait(timeout=max(1.0, args.timeout - (time.time() - t0)))
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    rc = None
                outcome, detail = _classify(rc, run_dir, log, args.steps)
                runs.append({"case": case, "run": i, "outcome": outcome, "rc": rc,
                             "seconds": round(time.time() - t0, 1), "detail": detail})  # fmt: skip
                print(f"{case:>10} {i:2d}: {outcome:5s} {runs[-1]['seconds']:6.1f} s {detail}",
                      flush=True)  # fmt: skip
    finally:
        children = burners + [proc for proc, *_ in started.values() if proc.poll() is None]
        for child in children:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
    counts = {
        c: {o: sum(r["case"] == c and r["outcome"] == o for r in runs)
            for o in ("ok", "abort", "hang", "error")}
        for c in args.cases
    }  # fmt: skip
    record = {
        "meta": {
            "how": "measured",
            "environment": provenance.environment(),
            "label": args.label,
            "settings": {
                "devices": DEVICES, "devices_by": args.devices_by, "burners": args.burners,
                "steps": args.steps, "runs": args.runs, "base": BASE, "model": MODEL,
                "cases": CASES,
            },
            "wall_s": round(time.time() - t_start),
        },
        "counts": counts,
        "runs": runs,
    }  # fmt: skip
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"{args.name}.json"
    path.write_text(json.dumps(record, indent=1) + "\n")
    for c, n in counts.items():
        print(f"{c}: " + ", ".join(f"{k} {v}" for k, v in n.items()))
    print(f"wrote {path}")
    return 0 if all(n["ok"] == args.runs for n in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
