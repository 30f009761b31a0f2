#!/usr/bin/env python
"""Train GPT-2 from a config file: ``python scripts/train.py CONFIG [section.key=value ...]``.

Multi-host: launch one process per host (SLURM and Open MPI are detected; see docs/training.md).
"""

import sys

from linear_gpt2 import distributed


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0 if argv else 2
    distributed.initialize()  # before any other JAX call

    from linear_gpt2.config import ConfigError, load_config
    from linear_gpt2.trainer import NonFiniteLossError, train

    try:
        cfg = load_config(argv[0], argv[1:])
        result = train(cfg)
    except ConfigError as e:
        print(f"config error: {e}", file=sys.stderr)
        return 2
    except (NonFiniteLossError, MemoryError, FileExistsError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(
        f"finished at step {result.last_step} ({result.stopped_by}); run directory {result.run_dir}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
