#!/usr/bin/env python
"""Train GPT-2 from a config file: ``python scripts/train.py CONFIG [section.key=value ...]``.

Multi-host: launch one process per host (SLURM and Open MPI are detected; see docs/training.md).
A failure ends with one line ``error: ...`` on stderr: exit 2 for a bad config or a refused
rerun, 1 for damaged data or checkpoints, a run directory another trainer holds or that cannot
be written, a missing device, a non-finite loss or out of memory (the table of exit codes is in
docs/training.md, "Failures"). ``--debug`` (or ``LINEAR_GPT2_DEBUG=1``) also prints the
traceback and third-party logs (XLA, absl, orbax). ``--help`` lists every attention variant's
options (``--help attention.name=my_lab.attn`` adds a variant of your own).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from linear_gpt2.platform import cli  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code (see ``linear_gpt2.platform.cli``)."""
    return cli.run(_main, argv)


def _main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        # --help attention.name=my_lab.attn: the options of a variant of one's own too.
        from linear_gpt2.attention import registry, schema

        own = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("attention.name=")]
        print(__doc__)
        print(schema.help_text([*registry.names(), *own]))
        return 0
    if not argv or argv[0].startswith("-") or "=" in argv[0]:
        got = f", got {argv[0]!r} first" if argv else ""
        raise cli.UsageError(
            "give a config file first: python scripts/train.py CONFIG [section.key=value ...] "
            f"(configs/default.yaml is the default run; --help for more){got}"
        )
    from linear_gpt2.training.config import load_config  # no JAX: a bad config fails in a second

    cfg = load_config(argv[0], argv[1:])

    from linear_gpt2.training import distributed

    distributed.initialize()  # before any other JAX call

    from linear_gpt2.training.trainer import train

    result = train(cfg)
    print(
        f"finished at step {result.last_step} ({result.stopped_by}); run directory {result.run_dir}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
