"""linear_gpt2: GPT-2 in JAX/Flax with pluggable softmax and linear attention.

The data path, one module per step: ``config`` -> ``tokenizer`` -> ``model`` -> ``attention``
-> (train step, logs: the trainer). ``interop`` converts weights to and from nanoGPT and
Hugging Face. ``target`` compiles the training step for a GPU (the H100) on a machine without one.
"""

import os as _os

__version__ = "0.1.0"


def _skip_cuda_checks_without_a_driver() -> None:
    # The CUDA plugin is installed on GPU-less machines too, to compile for the H100 (target.py).
    # There its start-up check of the CUDA libraries fails ("Unable to load cuPTI") and, in jax
    # 0.11.2, the first jax.devices() crashes the process; with the check skipped the plugin
    # loads, finds no device, and the CPU stays the default backend. JAX reads the variable when
    # its backends start, so setting it at import of this package is early enough unless the
    # caller has already used a device. A machine with a driver keeps the check.
    if not any(_os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")):
        _os.environ.setdefault("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1")


_skip_cuda_checks_without_a_driver()


def _let_the_allocator_use_the_gpu() -> None:
    # JAX's GPU allocator takes 75% of the card by default (about 59.6 GiB of an 80 GB H100).
    # The memory plans assume most of the card: the h100 target's budget is 72 GiB, and on the
    # device memory_plan's auto budget is the allocator's limit times 0.92. With the default
    # share, auto rematerialised steps that fit, and LT_state_parallel at 16k ran out of memory
    # (measured on an H100, benchmarks/results/step_time_h100_measured.md). 0.95 leaves ~4 GiB to
    # the CUDA context and cuDNN/cuBLAS workspaces; a value the user set is kept.
    _os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.95")


_let_the_allocator_use_the_gpu()


def _keep_host_collectives_in_order() -> None:
    # With several host devices (--xla_force_host_platform_device_count, the CPU stand-in for a
    # node), a program holding collectives over two mesh axes (data and seq, context
    # parallelism) deadlocked in XLA:CPU 0.11.2: its concurrency-optimised scheduler let devices
    # reach independent all-reduces and all-gathers in different orders, and each rendezvous
    # waited for threads blocked in another. One host device has no collectives, so the default
    # run's program is untouched; a flag the user set is kept.
    flags = _os.environ.get("XLA_FLAGS", "")
    name = "--xla_cpu_enable_concurrency_optimized_scheduler"
    if "--xla_force_host_platform_device_count" in flags and name not in flags:
        _os.environ["XLA_FLAGS"] = f"{flags} {name}=false"


_keep_host_collectives_in_order()
