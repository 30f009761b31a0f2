# Two commands on a fresh machine: `make train` and `make test`. Both create the virtual
# environment on first use (python3.12 + the pinned packages) and reuse it afterwards.
SHELL := /bin/bash
VENV ?= .venv
PY := $(VENV)/bin/python
EXTRAS ?= test,parity,cuda,experiments

# python3.12 may be a pyenv shim that refuses to run when another version is selected,
# so try the candidates until one really is 3.12.
PYTHON312 ?= $(shell for c in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3.12 /usr/local/bin/python3.12 /usr/bin/python3.12; do \
	$$c -c 'import sys; assert sys.version_info[:2] == (3, 12)' >/dev/null 2>&1 && { echo $$c; break; }; done)

# Keeps tests and tools from writing to $HOME.
export WANDB_MODE ?= offline
export MPLCONFIGDIR ?= $(CURDIR)/.cache/matplotlib
export XDG_CACHE_HOME ?= $(CURDIR)/.cache

.PHONY: setup train test test-fast lint format clean compile frontier reports

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	@test -n "$(PYTHON312)" || { echo "error: python3.12 not found; install Python 3.12 or pass PYTHON312=/path/to/python3.12"; exit 1; }
	@test -x $(PY) || $(PYTHON312) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
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
# files beside them (linear_gpt2/experiments/reports). `make test` checks them (tests/test_reports.py).
reports: setup
	$(PY) scripts/render_reports.py

test: setup
	$(PY) -m pytest -n 2 --dist loadgroup -q --durations=15

test-fast: setup
	$(PY) -m pytest -n 2 --dist loadgroup -q -m "not slow"

# The layers (pyproject.toml, [tool.importlinter]): platform -> kernels -> attention -> model ->
# training -> experiments, no cycles. tests/test_layers.py runs the same check in CI.
LINT_PATHS := linear_gpt2 scripts tests benchmarks docs/examples
lint: setup
	$(VENV)/bin/ruff check $(LINT_PATHS)
	$(VENV)/bin/ruff format --check $(LINT_PATHS)
	$(VENV)/bin/lint-imports --no-cache --no-logo

format: setup
	$(VENV)/bin/ruff check --fix $(LINT_PATHS)
	$(VENV)/bin/ruff format $(LINT_PATHS)

clean:
	rm -rf $(VENV) .cache .pytest_cache
