# The README's commands. PYTHON can point at a venv's interpreter: make test PYTHON=.venv/bin/python
PYTHON ?= python

.PHONY: test lint docs quickstart bench

test: lint
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m sdxl_trainer.schema_docs --check
	$(PYTHON) tools/check_structure.py

docs:
	$(PYTHON) -m sdxl_trainer.schema_docs

quickstart:
	$(PYTHON) train_sdxl.py --config configs/quickstart.json

bench:
	$(PYTHON) bench/run_all.py
