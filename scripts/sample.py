#!/usr/bin/env python
"""Sample text from a trained model.

    python scripts/sample.py runs/default --prompt "The meaning of life is" --tokens 100
    python scripts/sample.py runs/default/checkpoints/120 --temperature 0     # greedy
    python scripts/sample.py RUN --num-samples 3 --top-k 50 --temperature 0.8 --seed 1

PATH is a run directory (its latest checkpoint), a checkpoints directory, or one checkpoint's
step directory. Decoding keeps a KV cache for softmax/flash and the constant-size recurrent state
for the linear attentions (``linear_gpt2.model.sampling``); ids beyond GPT-2's 50257 (the padded part
of the vocabulary) are never sampled. A prompt longer than ``block_size - --tokens`` loses its
beginning, with a warning that says how many tokens the model sees. Bad values and unreadable
checkpoints end with one line ``error: ...`` (exit 2 for arguments, 1 for checkpoints;
``--debug`` shows the traceback).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    p = cli.ArgumentParser(
        prog="scripts/sample.py",
        description=__doc__,
        formatter_class=argparse.RawTextHelpFormatter,
    )
    p.add_argument("path", help="run directory or checkpoint directory")
    p.add_argument("--prompt", default="\n", help="text to continue (default: a newline)")
    p.add_argument("--tokens", type=int, default=100, help="new tokens per sample (>= 1)")
    p.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=cli.nonnegative_int, default=0)
    p.add_argument("--num-samples", type=int, default=1, help="samples drawn as one batch")
    args = p.parse_args(argv)
    for name, value, low in (
        ("--tokens", args.tokens, 1),
        ("--num-samples", args.num_samples, 1),
        ("--top-k", args.top_k, 1),
    ):
        if value is not None and value < low:
            raise cli.UsageError(f"{name} must be >= {low}, got {value}")
    if not args.temperature >= 0 or args.temperature == float("inf"):  # also rejects nan
        raise cli.UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")

    from linear_gpt2.training import distributed

    distributed.initialize()  # a missing device is one line, not a JAX traceback
    import jax.numpy as jnp

    from linear_gpt2.model import sampling, tokenizer
    from linear_gpt2.training import trained

    params, model_cfg, cfg, step = trained.load(args.path)
    ids = tokenizer.encode(args.prompt) or [tokenizer.EOT]
    ids, dropped = sampling.fit_prompt(ids, args.tokens, model_cfg.block_size)
    if dropped:
        print(
            f"warning: the prompt is {len(ids) + dropped} tokens and --tokens {args.tokens} leaves "
            f"room for {len(ids)} of the model's block_size {model_cfg.block_size}: the model "
            f"sees only the last {len(ids)} prompt tokens (the first {dropped} are dropped)",
            file=sys.stderr,
        )
    prompt = jnp.asarray([ids] * args.num_samples, jnp.int32)
    t0 = time.perf_counter()
    out = sampling.generate(
        params,
        model_cfg,
        prompt,
        args.tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        seed=args.seed,
        vocab_limit=tokenizer.VOCAB_SIZE,
    )
    dt = time.perf_counter() - t0
    print(
        f"# {cfg.log.name} step {step}: {model_cfg.attention}, {args.tokens} tokens x "
        f"{args.num_samples} in {dt:.2f} s (compilation included)",
        file=sys.stderr,
    )
    for i, row in enumerate(out.tolist()):
        if args.num_samples > 1:
            print(f"--- sample {i}")
        print(args.prompt + tokenizer.decode(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
