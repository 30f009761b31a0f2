"""The process settings linear_gpt2's programs run with, set by one explicit call.

Importing the package changes nothing in the process. :func:`configure` sets what JAX and XLA
read when their backends start, so it must run before the first device is used (JAX's import
alone is fine): every script calls it through :func:`linear_gpt2.platform.cli.run`, the trainer
at the start of ``train``, and the test suite in ``tests/conftest.py`` and in its worker
processes. A value the user set is kept in every case.

- **CUDA checks without a driver.** The CUDA plugin is installed on GPU-less machines too, to
  compile for the H100 (``target.py``). There its start-up check of the CUDA libraries fails
  ("Unable to load cuPTI") and, in jax 0.11.2, the first ``jax.devices()`` crashes the process;
  with the check skipped (``JAX_SKIP_CUDA_CONSTRAINTS_CHECK``) the plugin loads, finds no
  device, and the CPU stays the default backend. A machine with a driver keeps the check.
- **The allocator's share of the GPU.** JAX's GPU allocator takes 75% of the card by default
  (about 59.6 GiB of an 80 GB H100). The memory plans assume most of the card: the h100
  target's budget is 72 GiB, and on the device ``memory_plan``'s auto budget is the allocator's
  limit times 0.92. With the default share, auto rematerialised steps that fit, and
  ``LT_state_parallel`` at 16k ran out of memory (measured on an H100,
  ``benchmarks/results/step_time_h100_measured.md``). ``XLA_PYTHON_CLIENT_MEM_FRACTION=0.95``
  leaves ~4 GiB to the CUDA context and cuDNN/cuBLAS workspaces.
- **Collectives in order on several host devices.** With several host devices
  (``--xla_force_host_platform_device_count``, the CPU stand-in for a node), a program holding
  collectives over two mesh axes (data and seq, context parallelism) deadlocked in XLA:CPU
  0.11.2: its concurrency-optimised scheduler let devices reach independent all-reduces and
  all-gathers in different orders, and each rendezvous waited for threads blocked in another.
  ``--xla_cpu_enable_concurrency_optimized_scheduler=false`` is added to ``XLA_FLAGS`` then;
  one host device has no collectives, so the default run's program is untouched.
"""

from __future__ import annotations

import os

ALLOCATOR_SHARE = "0.95"
_SCHEDULER_FLAG = "--xla_cpu_enable_concurrency_optimized_scheduler"


def configure() -> dict[str, str]:
    """Set the process settings above that are not set yet; returns the variables it changed
    (name -> new value). Idempotent."""
    changed: dict[str, str] = {}
    if not any(os.path.exists(p) for p in ("/dev/nvidiactl", "/dev/nvidia0")):
        _set_default("JAX_SKIP_CUDA_CONSTRAINTS_CHECK", "1", changed)
    _set_default("XLA_PYTHON_CLIENT_MEM_FRACTION", ALLOCATOR_SHARE, changed)
    flags = os.environ.get("XLA_FLAGS", "")
    if "--xla_force_host_platform_device_count" in flags and _SCHEDULER_FLAG not in flags:
        os.environ["XLA_FLAGS"] = changed["XLA_FLAGS"] = f"{flags} {_SCHEDULER_FLAG}=false"
    return changed


def _set_default(name: str, value: str, changed: dict[str, str]) -> None:
    if name not in os.environ:
        os.environ[name] = changed[name] = value
