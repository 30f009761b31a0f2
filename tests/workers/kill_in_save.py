"""Trains with ``train`` and SIGKILLs itself at the moment orbax renames the finished temporary
directory of checkpoint ``STEP`` to its final name: the state a preemption (or an OOM kill) leaves
when it lands during a save.

usage: python tests/workers/kill_in_save.py STEP CONFIG [overrides...]
"""

import os
import signal
import sys


def main() -> None:
    step, config, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
    from orbax.checkpoint._src.path import async_path

    real_rename = async_path.rename

    async def rename(src, dst):
        if str(dst).rstrip("/").endswith(f"/checkpoints/{step}"):
            os.kill(os.getpid(), signal.SIGKILL)
        return await real_rename(src, dst)

    async_path.rename = rename

    from linear_gpt2.training.config import load_config
    from linear_gpt2.training.trainer import train

    train(load_config(config, overrides))
    raise SystemExit("the process was not killed")


if __name__ == "__main__":
    main()
