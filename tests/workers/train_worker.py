"""Runs ``train`` in its own process (device count and multi-process set by the caller's
environment) and writes the losses and final parameters for the test to compare.

usage: python tests/workers/train_worker.py OUT_PREFIX CONFIG [overrides...]
           [--then OUT_PREFIX [overrides...]]...

Each ``--then`` trains another run of CONFIG in the same process (the same devices; one JAX
start-up for several runs).
"""

import json
import sys


def runs(argv: list[str]) -> tuple[str, list[tuple[str, list[str]]]]:
    """CONFIG and each run's (OUT_PREFIX, overrides) from the command line."""
    config, groups = argv[1], [[argv[0]]]
    for arg in argv[2:]:
        if arg == "--then":
            groups.append([])
        else:
            groups[-1].append(arg)
    return config, [(g[0], g[1:]) for g in groups]


def main() -> None:
    config, todo = runs(sys.argv[1:])
    from linear_gpt2.platform import process
    from linear_gpt2.training import distributed

    process.configure()  # the suite's process settings, before JAX starts

    distributed.initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from linear_gpt2.training.config import load_config
    from linear_gpt2.training.trainer import train

    for out, overrides in todo:
        result = train(load_config(config, overrides))
        params = multihost_utils.process_allgather(result.state.params, tiled=True)
        if jax.process_index() != 0:
            continue
        flat = {
            jax.tree_util.keystr(k): np.asarray(v)
            for k, v in jax.tree_util.tree_leaves_with_path(params)
        }
        np.savez(out + ".npz", **flat)
        with open(out + ".json", "w") as f:
            json.dump(
                {
                    "losses": {str(k): v for k, v in result.losses.items()},
                    "devices": jax.device_count(),
                    "processes": jax.process_count(),
                    "stopped_by": result.stopped_by,
                },
                f,
            )


if __name__ == "__main__":
    main()
