"""Runs ``train`` in its own process (device count and multi-process set by the caller's
environment) and writes the losses and final parameters for the test to compare.

usage: python tests/workers/train_worker.py OUT_PREFIX CONFIG [overrides...]
"""

import json
import sys


def main() -> None:
    out, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    from linear_gpt2.platform import process
    from linear_gpt2.training import distributed

    process.configure()  # the suite's process settings, before JAX starts

    distributed.initialize()
    import jax
    import numpy as np
    from jax.experimental import multihost_utils

    from linear_gpt2.training.config import load_config
    from linear_gpt2.training.trainer import train

    result = train(load_config(config, overrides))
    params = multihost_utils.process_allgather(result.state.params, tiled=True)
    if jax.process_index() == 0:
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
