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

# The main job: the release gate over the default matrix (kvpage/verify/matrix.py: two built-in
# models, float32 and bfloat16, every KV format, TP 1 and 2; the mutation check on the main cell),
# two cells at a time; one report for all of it.
run: $(STAMP)
	$(VENV)/bin/kvpage verify --report reports/gate

test: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/python -m pytest -q --durations=15  # the slowest, to keep the suite near 10 minutes

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
