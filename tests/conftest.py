"""Test-wide settings: nothing is written to $HOME, nothing reaches the network, and GPU-only
tests are skipped on CPU with the reason."""

import atexit
import os
import shutil
import tempfile

_tmp = tempfile.mkdtemp(prefix="linear_gpt2_tests_")
# Each process that imports this file (the controller and every xdist worker) removes its own
# directory when it exits; the controller's holds the shared compilation cache and outlives the
# workers. Left behind, a run's caches cost tens of MB each and filled the CI machine's disk.
atexit.register(shutil.rmtree, _tmp, ignore_errors=True)
# One compilation cache for the whole run: pytest-xdist's workers inherit the controller's
# environment (it imports this file first), so a program one worker compiled is a hit in the
# other and in every subprocess either starts.
_jax_cache = os.environ.setdefault("LINEAR_GPT2_TEST_JAX_CACHE", os.path.join(_tmp, "jax_cache"))
for var, value in {
    "WANDB_MODE": "offline",
    "WANDB_DIR": os.path.join(_tmp, "wandb"),
    "WANDB_SILENT": "true",
    "MPLCONFIGDIR": os.path.join(_tmp, "mpl"),
    "XDG_CACHE_HOME": os.path.join(_tmp, "cache"),
    "XDG_CONFIG_HOME": os.path.join(_tmp, "config"),
    "HF_HOME": os.path.join(_tmp, "hf"),
    # The parity tests' PyTorch (its compiler's cache) and anything reaching tiktoken's loader.
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_tmp, "torchinductor"),
    "TIKTOKEN_CACHE_DIR": os.path.join(_tmp, "tiktoken"),
    "LINEAR_GPT2_CACHE": os.path.join(_tmp, "linear_gpt2_cache"),
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
    # JAX's persistent compilation cache, shared by the run (subprocesses inherit it): the many
    # tiny training runs of the trainer, checkpoint and sweep tests compile the same programs, and
    # a hit costs ~0.1 s instead of seconds. Numerics are unchanged (the key is the program).
    "JAX_COMPILATION_CACHE_DIR": _jax_cache,
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}.items():
    os.environ[var] = value

# XLA's CPU backend at LLVM -O0: the suite is mostly compilation of small programs, and this
# cuts its compile time by about a third (measured: tests/test_model_options.py 40 s -> 26 s)
# without slowing the long-sequence tests. Programs compiled for the H100 (linear_gpt2.platform.target)
# set the real optimisation level explicitly. Subprocesses inherit it; a user's flags stay.
_FAST_CPU_COMPILE = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FAST_CPU_COMPILE).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

from linear_gpt2.platform import process  # noqa: E402

# The process settings every entry point makes (platform/process.py: the CUDA plugin without a
# driver, the GPU allocator's share), before JAX starts; subprocesses inherit them.
process.configure()


def _has_gpu() -> bool:
    try:
        return any(d.platform == "gpu" for d in jax.devices())
    except RuntimeError:
        return False


def pytest_collection_modifyitems(config, items):
    _heaviest_modules_first(items)
    if _has_gpu():
        return
    skip = pytest.mark.skip(
        reason="needs a CUDA GPU (jax.devices() has none); runs on the lent device"
    )
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _heaviest_modules_first(items) -> None:
    """The modules with the most slow tests first, each module's tests kept together and in
    order (a module fixture is set up once per worker). pytest-xdist hands the tests out in this
    order: with the heavy ones late (test_target, test_trainer: alphabetical) the run ended on
    one busy worker beside idle ones."""
    slow: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        first.setdefault(module, i)
        slow[module] = slow.get(module, 0) + ("slow" in item.keywords)
    items.sort(key=lambda item: (-slow[m := item.nodeid.split("::")[0]], first[m]))


@pytest.fixture
def full_precision_matmuls():
    """float32 matmuls at full precision: on GPUs XLA's default is TF32 (10-bit significand),
    far from the 1e-5 tolerances of the reference comparisons."""
    with jax.default_matmul_precision("highest"):
        yield
