# Two entry points for a fresh machine with only python3: `make demo` and `make test`.
# Both bootstrap .venv: torch is pinned first (the CPU wheel this machine holds; an
# unpinned torch would pull a multi-GB CUDA build), then the package with its extras.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed

.PHONY: demo test lint crash bench clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) demo/demo.py

test: $(STAMP)
	$(PY) -m ruff check src tests demo bench
	$(PY) -m mypy
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check src tests demo bench

# Longer fault-injection budgets than CI runs.
# ~3 s a kill (retention keeps the store small, so each check costs the same): a
# timeout that fits the budget, not pytest's 600 s default.
crash: $(STAMP)
	CKPTVAULT_CRASH_KILLS=200 $(PY) -m pytest -q --timeout 3600 tests/test_crash_safety.py

bench: $(STAMP)
	$(PY) -m bench.save_restore --size-gb 1 --reps 7
	$(PY) -m bench.s3_save --size-gb 1 --reps 3
	$(PY) -m bench.multirank_save --size-gb 1 --ranks 2 --reps 5

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info .pytest_cache
