# The README's commands. `make quickstart` and `make test` set themselves up: tools/setup_venv.py
# creates the project venv (.venv) with python3, installs what is missing (torch, CPU or CUDA
# build, then requirements.txt; for test and lint also requirements-dev.txt,
# requirements-optimizers.txt and requirements-demo.txt where they exist) and does nothing when .venv is up to date (a stamp of
# the requirement files' hashes). Every target then runs .venv/bin/python.
# To use an environment you manage yourself, name its interpreter; then nothing is set up:
#     make test PYTHON=python
PYTHON3 ?= python3
ifeq ($(origin PYTHON),command line)
SETUP := @true
else
PYTHON := .venv/bin/python
SETUP := $(PYTHON3) tools/setup_venv.py
endif

.PHONY: test test-fast lint docs quickstart demo bench setup setup-dev

test: lint
	$(PYTHON) -m pytest -q -n auto --dist loadfile --no-loadscope-reorder

# The inner development loop: every test not marked `slow` (none of those trains a model), in
# one worker per core; CI runs everything (`make test`).
test-fast: setup-dev
	$(PYTHON) -m pytest -q -m "not slow" -n auto --dist loadfile --no-loadscope-reorder

lint: setup-dev
	$(PYTHON) -m ruff check .
	$(PYTHON) -m sdxl_trainer.schema_docs --check
	$(PYTHON) tools/check_structure.py

docs: setup
	$(PYTHON) -m sdxl_trainer.schema_docs

quickstart: setup
	$(PYTHON) train_sdxl.py --config configs/quickstart.json

demo: setup-dev
	$(PYTHON) demo_training_flow.py --config configs/quickstart.json

bench: setup
	$(PYTHON) bench/run_all.py

setup:
	$(SETUP)

setup-dev:
	$(SETUP) --dev
