"""linear_gpt2: GPT-2 in JAX/Flax with pluggable softmax and linear attention.

Six layers, each importing only those below it (``docs/design.md``): ``platform`` (errors,
command lines, the process settings, compile targets) -> ``kernels`` (one folder per op: the
Pallas kernels beside their plain-JAX oracle) -> ``attention`` (one module per variant, each
exporting its spec) -> ``model`` (``ModelConfig``, the Flax GPT-2, weight interop, sampling) ->
``training`` (config, data, the step, checkpoints, the trainer) -> ``experiments`` (the
benchmarks' and studies' harness).

Importing the package changes nothing in the process: programs that run JAX call
:func:`linear_gpt2.platform.process.configure` first (the scripts do, through their command
line).
"""

__version__ = "0.1.0"
