#!/usr/bin/env python
"""Check and time everything on a lent GPU, one window of at most 9 minutes per device command.

    make gpu-check --dry-run                  # here: the windows, their units and estimates
    make gpu-compile                          # here: the next window's steps, compiled for the
                                              # H100 into runs/gpu_check/compiled/h100/
    python3 scripts/gpu_check.py --window next --pack $OUT/gpu_check.tar.gz   # on the GPU
    make gpu-unpack ARCHIVE=gpu_check.tar.gz  # here: merge, collect, render, headline tables
    python scripts/gpu_check.py --tiny ...    # the CPU path on tiny shapes (the tests)

A lent GPU gives 15 minutes of device time in all and one command at most 10: the work is cut
into windows (``--time-limit``, default 540 s, start and packing included), filled in the
order of value. Window 1 is the headline: the 124M step of ``flash`` and ``LT_chunked`` at 1k
to 64k, loaded from the steps compiled here, ``LT_chunked``'s kernels against cuDNN flash and
flash-linear-attention, and one context compiled on the GPU against the loaded steps. Then
the gpu tests, the larger sizes at 1k, ``LT_attention_parallel``'s kernels, sampling, the
memory check, the MQAR cell, the context grid, and what was measured once before.

The windows are cut from the units not yet done in the run folder (``runs/gpu_check/<device>/``;
carry ``runs/gpu_check`` to resume on a fresh machine, after ``make gpu-unpack`` of every archive
so far: the carried folder replaces the machine's), so every command is filled with work:
``--window next`` (the default, window 1 of what is left) or ``--window N``. A unit that
finished is not run again (one that failed at this commit, only with ``--retry-failed``; one
that failed at an earlier commit is run again); one whose estimate would end past the time
limit is not started; one still running at the limit is stopped and left undone. After every
unit the results are merged into ``--results`` (``*_<device>_measured.*``) and, with
``--pack``, packed into one archive: a window stopped early still returns what it measured.
``<device>`` is ``h100`` or ``h200``: an H200's figures go to files of their own.

``--compile-here`` compiles the steps of the window (``--window``) for the H100 on this
machine into the store the GPU's step units load from (``studies/gpu_check/compiled.py``), then prints
the carried bundle against the 64 MiB limit and JAX's cache-key fields here beside the last
GPU run's. ``--unpack FILE`` merges a window's archive back (``studies/gpu_check/back.py``).

Without a CUDA GPU (and without ``--tiny`` / ``--dry-run`` / ``--compile-here`` /
``--unpack``) it says so in one line and exits 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402

CARRY_LIMIT = 64 * 2**20  # the device tool's bytes per command: tracked files + carried paths


def parse_args(argv: list[str]) -> argparse.Namespace:
    from linear_gpt2.platform.provenance import REPO

    p = cli.ArgumentParser(
        prog="scripts/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--dry-run", action="store_true", help="list the windows and estimates")
    p.add_argument("--window", default="next", metavar="N|next",
                   help="the window to run or compile (default: the first not done)")  # fmt: skip
    p.add_argument("--time-limit", type=cli.positive_float, default=None, metavar="SECONDS",
                   help="a window's length (default 540; the dry run's windows follow it)")  # fmt: skip
    p.add_argument("--stop-after", type=cli.positive_float, default=None, metavar="SECONDS",
                   help="start no unit that would end past this (default: the window's length)")  # fmt: skip
    p.add_argument("--only", nargs="+", default=[], metavar="STAGE")
    p.add_argument("--skip", nargs="+", default=[], metavar="STAGE")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on whatever device (CPU)")
    p.add_argument("--run-dir", type=Path, default=None, help="default runs/gpu_check/<device>")
    p.add_argument("--results", type=Path, default=REPO / "benchmarks" / "results")
    p.add_argument("--store", type=Path, default=None,
                   help="steps compiled here (default runs/gpu_check/compiled/<target>)")  # fmt: skip
    p.add_argument("--retry-failed", action="store_true", help="run failed units again")
    p.add_argument("--pack", type=Path, default=None, metavar="FILE.tar.gz")
    p.add_argument("--no-progress", action="store_true", help="a line per unit, no bars")
    p.add_argument("--compile-here", action="store_true",
                   help="compile the window's steps for the GPU target into the store")  # fmt: skip
    p.add_argument("--unpack", type=Path, default=None, metavar="FILE.tar.gz",
                   help="merge a window's archive back here")  # fmt: skip
    p.add_argument("--runs", type=Path, default=None, help=argparse.SUPPRESS)
    p.add_argument("--render-root", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.window != "next" and not args.window.isdigit():
        p.error(f"--window takes a number or 'next', not {args.window!r}")
    return args


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    t0 = time.monotonic()
    from linear_gpt2.platform.provenance import REPO
    from studies.gpu_check import host, stages

    args = parse_args(argv)
    if args.unpack:
        from studies.gpu_check import back

        default = args.results.resolve() == (REPO / "benchmarks" / "results").resolve()
        back.merge_back(args.unpack, args.results, args.runs or REPO / host.RUNS,
                        args.render_root or (REPO if default else None))  # fmt: skip
        return 0
    if not (args.tiny or args.dry_run or args.compile_here):
        host.require_gpu()  # one line and exit 1, before anything is written
    host.install_wheels()  # before the plan: its configs need omegaconf, which the image lacks
    host.commit_from_file()
    target = "cpu" if args.tiny else "h100"
    store = args.store or REPO / host.RUNS / "compiled" / target
    plan = stages.build(args.results, tiny=args.tiny, store=store).select(args.only, args.skip)
    if args.dry_run or args.compile_here:
        run_dir = args.run_dir or REPO / host.RUNS / plan.device
        done, wins = _windows_left(args, plan, run_dir)
        if args.compile_here:
            return compile_here(args, plan, wins, done, store, target)
        print(_dry_run(plan, wins, done, args.results, run_dir))
        return 0
    env = host.probe()
    env.update(tiny=args.tiny, label="tiny_cpu" if args.tiny else None)
    dev = host.device_label(env)
    run_dir = args.run_dir or REPO / host.RUNS / dev
    host.write_environment(run_dir, env)
    done, wins = _windows_left(args, plan, run_dir)
    window = _pick(wins, args.window)
    if window is None:
        print(f"every unit of the plan is done in {run_dir}")
        return 0
    print(f"window {window.number} of {len(wins)} on {env.get('device_kind')} ({dev}) | jax "
          f"{env.get('jax_version')} | commit {env.get('git_commit')} | estimated "
          f"{window.seconds:.0f} s of {window.limit_s:.0f} | run folder {run_dir}")  # fmt: skip
    return _run_window(args, plan, window, run_dir, env, dev, store, target, t0)


def _windows_left(args, plan, run_dir: Path):
    """The units done in ``run_dir`` and the windows cut from the rest (a unit that failed at
    this commit counts as done unless ``--retry-failed``; ``runner.settled``): window 1 is
    always the next, and it is full."""
    from studies.gpu_check import runner

    done = runner.done_units(run_dir, plan)
    return done, _cut(args, plan, done)


def _cut(args, plan, done) -> list:
    """The windows of ``plan`` less its settled units (``runner.settled``)."""
    from linear_gpt2.platform.provenance import git_commit
    from studies.gpu_check import runner
    from studies.gpu_check.plan import WINDOW_LIMIT_S, windows

    commit = git_commit()
    finished = [k for k, d in done.items() if runner.settled(d, args.retry_failed, commit)]
    return windows(plan.without(finished), args.time_limit or WINDOW_LIMIT_S)


def _pick(wins, which: str):
    from linear_gpt2.platform.errors import UsageError

    if which == "next":  # the windows are cut from what is left: the first is the next
        return wins[0] if wins else None
    n = int(which)
    if not 1 <= n <= len(wins):
        raise UsageError(f"--window {n}: the plan has windows 1 to {len(wins)} at this time "
                         "limit (make gpu-check --dry-run lists them)")  # fmt: skip
    return wins[n - 1]


def _run_window(args, plan, window, run_dir, env, dev, store, target, t0) -> int:
    from studies.gpu_check import collect, host

    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    record = {"window": window.number, "device_kind": env.get("device_kind"), "device": dev,
              "limit_s": window.limit_s, "estimate_s": round(window.seconds, 1),
              "units": len(window.items), "units_done": 0, "started_utc": started,
              "unit_times": []}  # fmt: skip
    keys = set(window.keys())

    def merge_and_pack(outcome=None) -> None:
        if outcome is not None and outcome.status in ("ok", "failed", "stopped"):
            record["unit_times"].append({"stage": outcome.stage, "unit": outcome.unit,
                                         "status": outcome.status,
                                         "estimate_s": round(outcome.estimate_s, 1),
                                         "seconds": round(outcome.seconds, 1)})  # fmt: skip
        done = runner_done(run_dir, plan)
        record.update(seconds=round(time.monotonic() - t0, 1),
                      units_done=sum(k in done for k in keys))  # fmt: skip
        _write_record(run_dir, record)
        written = collect.collect_all(plan, run_dir, args.results, env, dev)
        if args.pack:
            host.pack(run_dir, written, args.pack, dev)

    merge_and_pack()  # the environment and the record travel even if no unit finishes
    use_store = store if (Path(store) / "index.json").is_file() else None
    outcomes = host.run_with_progress(plan, run_dir, args, segments=window.segments(),
                                      start=t0, store=use_store, target=target,
                                      after=merge_and_pack)  # fmt: skip
    merge_and_pack()
    if args.pack:
        print(f"packed {args.pack}")
    failed = [o for o in outcomes if o.status == "failed"]
    left = [o for o in outcomes if o.status in ("stopped", "skipped")]
    print(f"window {window.number}: {record['units_done']} of {record['units']} units done in "
          f"{record['seconds']:.0f} s (estimated {record['estimate_s']:.0f} s)")  # fmt: skip
    if left:
        print(f"stopped at the time limit with {len(left)} units to go: the next --window next "
              "resumes them")  # fmt: skip
    if failed:
        names = ", ".join(f"{o.stage}/{o.unit}" for o in failed)
        print(f"error: {len(failed)} units failed ({names}); their logs are in {run_dir}",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def runner_done(run_dir, plan):
    from studies.gpu_check import runner

    return runner.done_units(run_dir, plan)


def _write_record(run_dir: Path, record: dict) -> None:
    """``windows.jsonl``: this window's line replaced in place (one per window run)."""
    from studies.gpu_check.collect import WINDOWS

    path = run_dir / WINDOWS
    lines = path.read_text().splitlines() if path.is_file() else []
    keep = [ln for ln in lines if ln.strip() and
            json.loads(ln).get("started_utc") != record["started_utc"]]  # fmt: skip
    path.write_text("\n".join([*keep, json.dumps(record)]) + "\n")


def _dry_run(plan, wins, done, results: Path, run_dir: Path) -> str:
    from studies.gpu_check import collect
    from studies.gpu_check.plan import dry_run_text

    last = None
    path = results / f"gpu_check_{plan.device}_measured.json"
    if path.is_file():
        recorded = json.loads(path.read_text()).get("windows", [])
        last = recorded[-1] if recorded else None
    last = (collect.window_records(run_dir) or [last])[-1]
    loaded = {(s.name, u.name) for s in plan.stages for u in s.units
              if any(c.what == "steps loaded" for c in u.costs)}  # fmt: skip
    return dry_run_text(plan, wins, done, last, loaded)


def compile_here(args, plan, wins, done, store_dir: Path, target: str) -> int:
    """The window's steps compiled for ``target`` into the store; the bundle; the key fields."""
    from linear_gpt2.platform.errors import UsageError
    from studies.gpu_check import compiled, host

    if os.environ.get("XLA_FLAGS") and not args.tiny:
        raise UsageError(f"XLA_FLAGS={os.environ['XLA_FLAGS']!r} is set: the steps would be "
                         "compiled (and keyed) with flags the GPU's units do not have; unset it")  # fmt: skip
    window = _pick(wins, args.window)
    if window is None:
        print("every unit is done: nothing to compile")
        return 0
    if not args.tiny:
        host.record_commit()
    budget = compiled.expected_budget(args.results, target)
    store = compiled.Store(store_dir)

    def report(unit, entry) -> None:
        mem = entry.get("memory_bytes")
        print(f"  {unit.name:<14} {entry['what']:<70} {entry.get('bytes', 0) / 2**20:6.2f} MiB "
              f"{(mem or 0) / 2**30:6.2f} GiB  {entry['key'][-12:]}", flush=True)  # fmt: skip

    # A window whose steps load is priced lower and may take in further units (whose steps
    # then compile on the GPU): compile those too, until the window's steps are all here.
    entries: list = []
    for _ in range(4):
        units = [u for _, u in window.items if u.compiles and not plan_known(args, store_dir)
                 .all_compiled(u.compiles)]  # fmt: skip
        if not units:
            break
        n = sum(len(u.compiles) for u in units)
        print(f"window {window.number}: {n} step settings of {len(units)} units, compiled for "
              f"{target} into {store_dir}" + (f" (the GPU's budget, expected: "
              f"{budget / 2**30:.1f} GiB)" if budget else ""), flush=True)  # fmt: skip
        entries += compiled.compile_units(store, units, target, budget,
                                          dtype="float32" if args.tiny else "bfloat16",
                                          report=report)  # fmt: skip
        window = _replan(args, store_dir, window.number, done)
    entries = [{**e, "window": window.number} for e in entries]
    code = compiled.code_fingerprint()
    entries += [{**e, "key": k} for k, e in store.index().items()
                if k not in {x["key"] for x in entries} and e.get("code") == code]  # fmt: skip
    print(bundle_text(store_dir))
    gpu, source = host.last_gpu_environment(args.results)
    fields = [] if args.tiny else compiled.plain_cache_fields(gpu, target)
    if fields:
        print(key_fields_text(fields, source))
    path = _write_compile_record(args.results, window, target, budget, entries, fields, source)
    print(f"wrote {path}")
    return 0


def _write_compile_record(results: Path, window, target, budget, entries, fields, source) -> Path:
    """``compile_here_<target>_compiled.json``: what was compiled for the window, the bundle
    that carries it, and JAX's key fields here beside the last GPU run's (docs/results.md)."""
    from linear_gpt2.platform import provenance
    from studies.gpu_check import back, compiled, host

    env = provenance.environment()
    env["device_kind"] = f"{compiled.target_kind(target)} (compiled for, deviceless; no GPU here)"
    meta = {"how": "compiled", "environment": env, "settings": {
        "window": window.number, "window_limit_s": window.limit_s, "target": target,
        "gpu_budget_bytes": budget, "store": str(host.RUNS / "compiled" / target),
        "host_pinned": compiled.PINNED_HOST, "key_source": source,
        "carried": [".whl", str(host.RUNS)], "carry_limit_bytes": CARRY_LIMIT}}  # fmt: skip
    keys = {e["key"]: e for e in entries}
    data = {"meta": meta, "entries": list(keys.values()), "bundle": host.bundle_sizes(),
            "key_fields": fields}  # fmt: skip
    results.mkdir(parents=True, exist_ok=True)
    path = results / f"compile_here_{target}_compiled.json"
    path.write_text(json.dumps(data, indent=1, default=str) + "\n")
    back.add_to_index(results, [path])
    return path


def plan_known(args, store_dir: Path):
    from studies.gpu_check.known import Known

    return Known(args.results, "tiny_cpu" if args.tiny else "h100", store=store_dir)


def _replan(args, store_dir: Path, number: int, done):
    from studies.gpu_check import stages

    plan = stages.build(args.results, tiny=args.tiny, store=store_dir).select(args.only, args.skip)
    return _cut(args, plan, done)[number - 1]


def bundle_text(store_dir: Path) -> str:
    from studies.gpu_check import host

    sizes = host.bundle_sizes()
    total = sum(sizes.values())
    lines = [f"carried with the device command (limit {CARRY_LIMIT / 2**20:.0f} MiB):"]
    lines += [f"  {name:<30} {size / 2**20:7.2f} MiB" for name, size in sizes.items()]
    verdict = "within" if total <= CARRY_LIMIT else "OVER"
    lines.append(f"  {'total':<30} {total / 2**20:7.2f} MiB ({verdict} the limit)")
    return "\n".join(lines)


def key_fields_text(rows: list[dict], source: str) -> str:
    """JAX's cache-key fields of a deviceless compile beside the last GPU run's record."""
    lines = [f"JAX's persistent-cache key, deviceless here vs the GPU ({source}):"]
    for r in rows:
        state = {True: "same", False: "DIFFERS", None: "not recorded"}[r["match"]]
        lines.append(f"  {r['field']:<20} {state:<13} here {str(r['here'])!r:.60}"
                     f" / gpu {str(r['gpu'])!r:.60}")  # fmt: skip
    lines.append(
        "  (the store's own key takes both machine fields from the target, so only "
        "the program, jaxlib, the flags and the device kind must agree)"
    )
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
