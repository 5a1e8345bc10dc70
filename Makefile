# The two commands of the README:
#   make run    set up .venv and run the built-in default job on configs/tiny_cpu.yaml
#   make test   set up .venv and run the default (CPU) test suite
# Variables: ACCEL=auto|cpu|gpu (setup extra), CONFIG=<yaml> (run), PYTEST_ARGS (test).
VENV ?= .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/tiny_cpu.yaml
PYTEST_ARGS ?= -m "not gpu and not slow"
# The main job: the RL run of the built-in default (`smoke` only generates and scores a few prompts).
RUN_COMMAND ?= train

.PHONY: setup run test test-all clean

setup:
	@VENV=$(VENV) bash tools/setup_env.sh

run: setup
	$(PY) -m megatron_sortedrl $(RUN_COMMAND) $(CONFIG)

test: setup
	$(PY) -m pytest $(PYTEST_ARGS)

test-all: setup
	$(PY) -m pytest -m "not gpu"

clean:
	rm -rf $(VENV) runs .pytest_cache
