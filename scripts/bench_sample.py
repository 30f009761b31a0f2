#!/usr/bin/env python
"""Time to sample the next token at each context length: KV cache (softmax) against the
recurrent state (linear), the post's sampling figure.

    python scripts/bench_sample.py                          # 124M, 1k .. 512k, on a GPU
    python scripts/bench_sample.py --sizes 1.6B --attentions flash LT_chunked
    python scripts/bench_sample.py --tiny                   # CPU: tiny model, 256 .. 16k

Batch 1, greedy, one token per jitted step with the cache donated, timed after
``block_until_ready``; ``--rounds`` interleaved passes over all settings of ``--steps`` tokens
each, median reported. The cache is sized for the context; ``--prefill`` first fills half of it
with real tokens (slow for a KV cache at long contexts, and the same per-token work: the KV
decoder attends over its whole buffer, masked). Writes ``STEM.json``, ``.csv``, ``.md`` (table
with fitted log-log slopes) and ``STEM_<size>.png`` into ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    from linear_gpt2.platform import provenance
    from studies.train_step import step_time as bench

    p = cli.ArgumentParser(
        prog="scripts/bench_sample.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("--attentions", nargs="+", default=["softmax", "LT_chunked"])
    p.add_argument("--sizes", nargs="+", default=None, choices=list(bench.SIZES))
    p.add_argument("--contexts", nargs="+", type=cli.positive_int, default=None)
    p.add_argument("--dtype", default=None, choices=("bfloat16", "float32"))
    p.add_argument("--steps", type=cli.positive_int, default=10, help="timed tokens per round")
    p.add_argument("--rounds", type=cli.positive_int, default=3)
    p.add_argument("--prefill", action="store_true", help="fill half the cache first")
    p.add_argument("--tiny", action="store_true", help="tiny model and contexts: CPU")
    p.add_argument("--out", default=str(provenance.REPO / "benchmarks" / "results"))
    p.add_argument("--stem", default=None, help="default sample_time_<device>")
    args = p.parse_args(argv)
    from linear_gpt2 import attention

    for name in args.attentions:
        attention.spec(name)  # an unknown name is a usage error before anything runs

    from linear_gpt2.training import distributed

    distributed.initialize()  # a missing device is one line, not a JAX traceback
    from linear_gpt2.experiments import plots
    from studies.sample_time import sample_time

    sizes = args.sizes or (["tiny"] if args.tiny else ["124M"])
    contexts = args.contexts or (
        [256, 1024, 4096, 16384] if args.tiny else bench.default_contexts(1024, 2**19)
    )
    dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    env = provenance.environment()
    stem = args.stem or f"sample_time_{'tiny_' if args.tiny else ''}" + provenance.device_slug(
        env["device_kind"]
    )
    all_rows = []
    for size in sizes:
        configs = [bench.model_config(size, a, max(contexts), dtype=dtype) for a in args.attentions]
        rows = sample_time.bench_next_token(
            None, configs, contexts, steps=args.steps, rounds=args.rounds, prefill=args.prefill
        )
        for r in rows:
            r["size"] = size
            ms = f"{r['median_ms']:.3f} ms" if r["median_ms"] else r["status"].upper()
            print(f"{size:>5} {r['decoder']:<32} {r['context']:>8}  {ms}")
        png = plots.plot_sample_times(
            rows,
            Path(args.out) / f"{stem}_{size}.png",
            title=f"GPT-2 {size}: time to sample the next token ({env['device_kind']})",
        )
        print(f"wrote {png}")
        all_rows += rows
    meta = {
        "environment": env,
        "title": f"{', '.join(sizes)}, {env['device_kind']}",
        "settings": {
            "sizes": {s: bench.SIZES[s] for s in sizes},
            "dtype": dtype,
            "steps": args.steps,
            "rounds": args.rounds,
            "prefill": args.prefill,
            "batch": 1,
        },
    }
    for path in sample_time.write_sample_results(all_rows, args.out, stem, meta):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
