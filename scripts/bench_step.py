#!/usr/bin/env python
"""Time one full training step (forward, backward, AdamW) per attention x model size x context.

    python scripts/bench_step.py                              # every attention, 124M, 1k.. OOM
    python scripts/bench_step.py --sizes 124M 355M --attentions flash LT_chunked
    python scripts/bench_step.py --tiny                       # CPU smoke run, every attention
    python scripts/bench_step.py --tiny --max-bytes 3000000   # simulate a small device

Batch 1, bf16 matmuls (``model.dtype=bfloat16``), median of ``--repeats`` steps after
``--warmup``, timed after ``block_until_ready``. Contexts are powers of two from ``--min-context``
until a setting runs out of memory (XLA RESOURCE_EXHAUSTED), which is recorded as that
(attention, size)'s limit; larger contexts are then skipped. ``--max-bytes N`` treats a setting
whose compiled step needs more than N bytes (XLA ``memory_analysis()``: arguments + outputs +
temporaries - donated aliases) as out of memory, recorded the same way (``oom_reason`` says
"simulated"). LT_chunked is timed at each of ``--chunk-sizes`` that divides the context and the
fastest is kept.

Writes ``STEM.csv`` and ``STEM.json`` (device kind, git commit, jax version, raw times, limits,
slopes) and ``STEM_<size>.png`` (log-log, one line per attention, OOM marked, fitted slopes in
the legend) into ``--out`` (default ``benchmarks/results``); STEM is ``step_time_<device>``.
Compile-only (``--target h100``): no step is run. For each attention x size, every power-of-two
context from ``--min-context`` is compiled for the target (``scripts/compile.py``'s machinery,
deviceless) with ``model.remat`` / ``model.loss_chunk`` ``auto`` until not even the most frugal
setting fits the target's budget. Writes ``memory_frontier_<target>_compiled.{csv,json,md,png}``
(largest context per attention x size beside the post's); an interrupted sweep resumes from the
JSON (``--restart`` recompiles everything).

``--model KEY=VALUE ...`` sets model options beyond the size's for every setting (``ModelConfig``
fields: ``layernorm_kernel=pallas``, ``remat=none``, ``loss_chunk=4096``, ``scan_layers=false``;
each row records them). ``--side-by-side NAME:KEY=VALUE,KEY=VALUE NAME:...`` times every setting
under each named set of options (on top of ``--model``) in one process: compiled together, then
``--rounds`` rounds of ``--repeats`` steps, the sets' order alternating from round to round;
the JSON's ``side_by_side`` gives each set's median and its ratio to the first set's, overall
and per round. LT_chunked runs at each ``--chunk-sizes`` value that divides the context.

``--tiny`` (and ``--fast-compile``) compile with XLA's CPU backend at -O0, which halves compile
time where compilation dominates; its times are for checking the pipeline, not for reporting
(``--tiny --full-compile`` times the tiny model as optimised for real).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402  (before JAX: it sets XLA's log level)

# isort: split
from linear_gpt2 import attention  # noqa: E402
from linear_gpt2.experiments import plots  # noqa: E402
from linear_gpt2.platform import provenance  # noqa: E402
from studies.train_step import frontier  # noqa: E402
from studies.train_step import step_time as bench  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = cli.ArgumentParser(
        prog="scripts/bench_step.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--attentions", nargs="+", default=None, help="default: every registered name")
    p.add_argument("--sizes", nargs="+", default=None, choices=list(bench.SIZES))
    p.add_argument(
        "--contexts", nargs="+", type=cli.positive_int, default=None, help="explicit contexts"
    )
    p.add_argument("--min-context", type=cli.positive_int, default=1024)
    p.add_argument("--max-context", type=cli.positive_int, default=2**20)
    p.add_argument("--batch", type=cli.positive_int, default=1)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--warmup", type=cli.nonnegative_int, default=2)
    p.add_argument("--repeats", type=cli.positive_int, default=5)
    p.add_argument("--chunk-sizes", nargs="+", type=cli.positive_int, default=None)
    p.add_argument(
        "--max-bytes", type=cli.positive_int, default=None, help="simulated device memory (bytes)"
    )
    p.add_argument("--tiny", action="store_true", help="tiny model, short contexts: CPU smoke run")
    p.add_argument("--out", default=str(provenance.REPO / "benchmarks" / "results"))
    p.add_argument("--stem", default=None, help="output file stem (default step_time_<device>)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument(
        "--compile-threads",
        type=cli.positive_int,
        default=1,
        help="compile each context's settings side by side before timing them (a GPU machine)",
    )
    p.add_argument("--target", default=None, help="compile-only memory frontier for this target")
    p.add_argument("--restart", action="store_true", help="with --target: ignore earlier results")
    p.add_argument(
        "--fast-compile",
        action="store_true",
        help="XLA -O0 (halves CPU compile time; on with --tiny; not for reported timings)",
    )
    p.add_argument(
        "--full-compile", action="store_true", help="with --tiny: optimise as for real timings"
    )
    p.add_argument("--model", nargs="+", default=[], metavar="KEY=VALUE",
                   help="model options for every setting (ModelConfig fields)")  # fmt: skip
    p.add_argument("--side-by-side", nargs="+", default=[], metavar="NAME:KEY=VALUE,...",
                   help="time each setting under each named set of model options, side by side")  # fmt: skip
    p.add_argument("--rounds", type=cli.positive_int, default=5,
                   help="with --side-by-side: rounds of --repeats steps per set")  # fmt: skip
    args = p.parse_args(argv)
    try:
        args.model = parse_model_options(args.model, "--model")
        args.side_by_side = parse_side_by_side(args.side_by_side)
    except ValueError as e:
        p.error(str(e))
    if args.side_by_side and args.target:
        p.error("--side-by-side times steps; it has no compile-only form (drop --target)")
    if args.min_context > args.max_context:
        p.error(f"--min-context {args.min_context} is above --max-context {args.max_context}")
    for name in args.attentions or ():
        attention.spec(name)  # an unknown name is a usage error before anything runs
    if args.target:
        from linear_gpt2.platform import target

        target.get(args.target)
    return args


def parse_model_options(items: list[str], flag: str) -> dict:
    """``KEY=VALUE`` items as model options (values read as YAML scalars: ``4096``, ``false``,
    ``pallas``), each key a field of ``ModelConfig``."""
    import dataclasses

    import yaml

    from linear_gpt2.model.config import ArchConfig

    fields = [f.name for f in dataclasses.fields(ArchConfig)]
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"{flag} takes KEY=VALUE, not {item!r}")
        if key not in fields or key in ("block_size", "dtype"):
            valid = ", ".join(f for f in fields if f not in ("block_size", "dtype"))
            raise ValueError(f"{flag} {item!r}: {key!r} is not a model option here; the options "
                             f"are {valid} (the context and dtype have flags of their own)")  # fmt: skip
        out[key] = yaml.safe_load(value) if value else value
    return out


def parse_side_by_side(items: list[str]) -> dict[str, dict]:
    """``NAME:KEY=VALUE,KEY=VALUE`` items as {name: options}, in order (the first: the
    baseline); at least two, names unique."""
    out: dict[str, dict] = {}
    for item in items:
        name, sep, rest = item.partition(":")
        if not sep or not name:
            raise ValueError(f"--side-by-side takes NAME:KEY=VALUE,..., not {item!r}")
        if name in out:
            raise ValueError(f"--side-by-side names {name!r} twice")
        out[name] = parse_model_options([x for x in rest.split(",") if x], f"--side-by-side {name}")
    if len(out) == 1:
        raise ValueError("--side-by-side needs two or more sets of options to compare")
    return out


def side_by_side_main(args, names, sizes, contexts, chunks, warmup, repeats, fast, report):
    """Every (size, context, attention, chunk size) under each set of ``--side-by-side``."""
    results = []
    for size in sizes:
        for context in sorted(contexts):
            for name in names:
                base = bench.model_config(size, name, context, dtype=args.dtype, **args.model)
                cands = (
                    bench.chunk_candidates(context, chunks)
                    if base.spec.sweep_chunk_size
                    else [None]
                )
                for c in cands:
                    variants = {v: {**args.model, **o} for v, o in args.side_by_side.items()}
                    rows = bench.side_by_side(
                        name, size, context, variants, batch=args.batch, dtype=args.dtype,
                        chunk_size=c, warmup=warmup, rounds=args.rounds, repeats=repeats,
                        compiler_options=bench.FAST_COMPILE if fast else None,
                        compile_threads=args.compile_threads,
                    )  # fmt: skip
                    for r in rows:
                        report(r)
                    results += rows
    return results


def frontier_main(args) -> int:
    from linear_gpt2.platform import target

    t = target.get(args.target)
    names = args.attentions or attention.names()
    sizes = args.sizes or [s for s in bench.SIZES if s != "tiny"]
    contexts = args.contexts or bench.default_contexts(args.min_context, args.max_context)
    env = provenance.environment()
    env["device_kind"] = f"{t.device['name']} (compiled for, deviceless; no GPU here)"
    stem = args.stem or f"memory_frontier_{t.name}_compiled"
    out = Path(args.out)
    done, backfilled = [], {}
    if not args.restart and (out / f"{stem}.json").exists():
        done = frontier.read_frontier(out / f"{stem}.json")
        backfilled = frontier.read_backfilled(out / f"{stem}.json")
        print(f"resuming: {len(done)} points already compiled in {out / f'{stem}.json'}")
    meta = {
        "how": "compiled",
        "environment": env,
        "settings": {
            "target": t.name,
            "target_description": t.describe(),
            "budget_gib": t.budget_bytes / 2**30,
            "batch": args.batch,
            "dtype": args.dtype,
            "memory": "model.remat=auto, model.loss_chunk=auto (memory_plan.LADDER)",
            "step": "train_step.jit_train_step (clip, AdamW), state donated",
            "method": "compiled for the target with XLA's GPU compiler on a CPU-only machine",
        },
        # What the earlier file said of the points it kept (filled in after they were written).
        **({"backfilled": backfilled} if backfilled else {}),
    }
    points: list = list(done)

    def report(p) -> None:
        points.append(p)
        mem = f"{p.memory_bytes / 2**30:7.2f} GiB" if p.memory_bytes else "      -"
        print(
            f"{p.size:>5} {p.attention:<31} {p.context:>8} {p.status:<8} {mem} "
            f"{p.remat or ''} {('loss_chunk=' + str(p.loss_chunk)) if p.loss_chunk else ''}"
            f"{(' ' + p.error) if p.error else ''}",
            flush=True,
        )
        frontier.write_frontier(points, out, stem, meta)  # after every point: resumable

    print(f"{t.describe()} | jax {env['jax_version']} | commit {env['git_commit']}")
    results = frontier.run_frontier(
        names, sizes, t.name, contexts, batch=args.batch, dtype=args.dtype, done=done,
        on_result=report,
    )  # fmt: skip
    # The files keep the earlier points this run did not revisit (other attentions or sizes).
    keyed = {(p.attention, p.size, p.context): p for p in done}
    keyed.update({(p.attention, p.size, p.context): p for p in results})
    results = list(keyed.values())
    paths = frontier.write_frontier(results, out, stem, meta)
    print("wrote " + ", ".join(str(p) for p in paths))
    if not args.no_plot:
        png = plots.plot_memory_frontier(
            [bench.dataclasses.asdict(p) for p in results],
            out / f"{stem}.png",
            t.budget_bytes / 2**30,
            frontier.POST_FRONTIER,
            title=f"Training-step memory per device vs context, compiled for {t.name} "
            "(x: does not fit; triangle: the post's largest context)",
        )
        print(f"wrote {png}")
    print(paths[2].read_text())
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.target:  # compile-only: no device is used
        return frontier_main(args)
    from linear_gpt2.training import distributed

    distributed.initialize()  # a missing device is one line, not a JAX traceback
    names = args.attentions or attention.names()
    if args.tiny:
        sizes = args.sizes or ["tiny"]
        contexts = args.contexts or list(bench.TINY_CONTEXTS)
        chunks = args.chunk_sizes or list(bench.TINY_CHUNK_CANDIDATES)
        warmup, repeats = min(args.warmup, 1), min(args.repeats, 3)
    else:
        sizes = args.sizes or ["124M"]
        contexts = args.contexts or bench.default_contexts(args.min_context, args.max_context)
        chunks = args.chunk_sizes or list(bench.CHUNK_CANDIDATES)
        warmup, repeats = args.warmup, args.repeats
    fast = args.fast_compile or (args.tiny and not args.full_compile)
    env = provenance.environment()
    stem = args.stem or (
        f"step_time_{'tiny_' if args.tiny else ''}{provenance.device_slug(env['device_kind'])}"
    )
    print(f"device {env['device_kind']} | jax {env['jax_version']} | commit {env['git_commit']}")

    def report(r: bench.StepResult) -> None:
        what = (
            f"{r.median_ms:9.2f} ms" + (f" (chunk {r.chunk_size})" if r.chunk_size else "")
            if r.status == "ok"
            else f"{r.status.upper()}: {r.oom_reason or r.error}"
        )
        tag = f" [{r.variant}]" if r.variant else ""
        print(f"{r.size:>5} {r.attention:<31} {r.context:>8}  {what}{tag}", flush=True)

    if args.side_by_side:
        results = side_by_side_main(args, names, sizes, contexts, chunks, warmup, repeats, fast,
                                    report)  # fmt: skip
    else:
        results = bench.run_benchmark(
            names,
            sizes,
            contexts,
            on_result=report,
            batch=args.batch,
            dtype=args.dtype,
            warmup=warmup,
            repeats=repeats,
            max_bytes=args.max_bytes,
            chunk_sizes=chunks,
            compiler_options=bench.FAST_COMPILE if fast else None,
            compile_threads=args.compile_threads,
            overrides=args.model,
        )
    meta = {
        "how": "measured",
        "environment": env,
        "settings": {
            "batch": args.batch,
            "dtype": args.dtype,
            "warmup": warmup,
            "repeats": repeats,
            "steps_timed": repeats,  # each median is of this many steps (results[].times_ms)
            "compile_threads": args.compile_threads,
            "max_bytes": args.max_bytes,
            "model_options": args.model,
            "side_by_side": args.side_by_side or None,
            "rounds": args.rounds if args.side_by_side else None,
            "chunk_candidates": chunks,
            "compiler_options": bench.FAST_COMPILE if fast else None,
            "contexts": contexts,
            "sizes": {s: bench.SIZES[s] for s in sizes},
            "step": "make_train_step + optim.optimizer (clip, AdamW), state donated",
            # What model.remat / loss_chunk "auto" resolved against (results[].remat, loss_chunk).
            **provenance.allocator(),
        },
    }
    csv_path, json_path = bench.write_results(results, args.out, stem, meta)
    print(f"wrote {csv_path} and {json_path}")
    if not args.no_plot:
        rows = [bench.dataclasses.asdict(r) for r in results]
        for size in sizes:
            png = plots.plot_step_times(
                rows,
                size,
                Path(args.out) / f"{stem}_{size}.png",
                title=f"GPT-2 {size}, batch 1, {args.dtype}: ms per training step "
                f"({env['device_kind']})",
            )
            print(f"wrote {png}")
    for name, per_size in bench.limits(results).items():
        for size, lim in per_size.items():
            if lim["oom_at"] or lim["error_at"]:
                print(
                    f"limit {size} {name}: max context {lim['max_context']}, OOM at "
                    f"{lim['oom_at']}, error at {lim['error_at']}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
