# The two commands of the README:
#   make run    set up .venv and run the built-in default job on configs/tiny_cpu.yaml
#   make test   set up .venv and run the default (CPU) test suite
#   make gpu-check  on a machine with an NVIDIA GPU: the gpu-marked tests and GPU benchmark (docs/gpu.md)
# Variables: ACCEL=auto|cpu|gpu (setup extra), CONFIG=<yaml> (run), PYTEST_ARGS (test), GPU_PY and GPU_CHECK_ARGS
# (gpu-check: e.g. --out-dir DIR, --budget-s S, --cpu-smoke).
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny_cpu.yaml
PYTEST_ARGS ?= -m "not gpu and not slow"
# The main job: the RL run of the built-in default (`smoke` only generates and scores a few prompts).
RUN_COMMAND ?= train

# GPU machines may have no .venv (and no package index): use it when present, else the system Python.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)

.PHONY: setup run test test-all gpu-check clean

setup:
	@VENV=$(VENV) bash tools/setup_env.sh

run: setup
	$(PY) -m megatron_sortedrl $(RUN_COMMAND) $(CONFIG)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -m "not gpu"

# No `setup` prerequisite: it needs a package index. Exits 2 after one line where there is no GPU. Results go to
# $OUT when set, else docs/benchmarks; the whole check keeps to its budget (420 s by default; docs/gpu.md).
gpu-check:
	@$(GPU_PY) tools/gpu_check.py $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) runs .pytest_cache .gpu-check
