# Both targets create .venv on first use and reinstall only when pyproject.toml changes.
PYTHON ?= python3.11
VENV := .venv
STAMP := $(VENV)/.installed

.PHONY: run test lint clean

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q -e '.[test,ray]'
	touch $(STAMP)

# The main job: the release gate on the built-in model (suites, mutation check, reports).
run: $(STAMP)
	$(VENV)/bin/kvpage verify --model builtin:tiny-llama --report reports/gate

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
