"""The bottom layer: what the library runs and compiles for, and how it fails.

- :mod:`.errors`: the expected failures (usage errors exit 2, run errors exit 1) and the config
  checks every layer uses;
- :mod:`.env`: tool caches kept out of ``$HOME``;
- :mod:`.cli`: what every entry point shares (one-line errors, exit codes, ``--debug``);
- :mod:`.device`: which platform a program is traced for (a GPU compile target counts);
- :mod:`.memory`: out-of-memory detection and compiled memory;
- :mod:`.cards`: the GPU cards' facts (peaks, SMs, launch overhead), each with its origin;
- :mod:`.target`: compile targets (the H100, an 8-GPU node) without the device: memory, kernels.

Nothing here imports another layer of the package.
"""
