# Two entry points for a fresh machine with only python3: `make demo` and `make test`.
# Both bootstrap .venv: torch is pinned first (the CPU wheel this machine holds; an
# unpinned torch would pull a multi-GB CUDA build), then the package with its extras.

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  := torch==2.13.0
STAMP  := $(VENV)/.installed
# Azurite, Microsoft's Azure Storage emulator (an npm package), for the Azure tests:
# installed once into .node/ (git-ignored), beside the venv rather than globally.
AZURITE         := azurite@3.37.0
NODE_DIR        := .node
AZURITE_STAMP   := $(NODE_DIR)/.installed-$(AZURITE)

.PHONY: demo test test-extended docs lint crash reliability fuzz bench bench-costs bench-scale clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# Azurite 3.37 declares node >= 22 but runs the blob service on node 20 (the suite's
# Azure tests pass on it); --loglevel=error keeps npm's engine warnings out of CI logs.
$(AZURITE_STAMP):
	npm install --no-audit --no-fund --loglevel=error --save-exact --prefix $(NODE_DIR) $(AZURITE)
	test -x $(NODE_DIR)/node_modules/.bin/azurite-blob
	touch $(AZURITE_STAMP)

demo: $(STAMP)
	$(PY) demo/demo.py

# Two pytest workers (pytest-xdist), one a core here: a test's ports, buckets, tmpfs
# mounts and fork servers are its own worker's. Bytecode is cached even where the
# environment says PYTHONDONTWRITEBYTECODE (this machine's does): otherwise every
# process the suite starts compiles ckptvault again, and every worker re-rewrites
# every test module (15 s of CPU a worker here, 8 s cached).
test: $(STAMP) $(AZURITE_STAMP)
	$(PY) -m ruff check src tests demo bench docs_hooks
	$(PY) -m mypy
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 -m "not extended"

# What make test leaves out to stay within 10 minutes on 2 cores: the rest of the
# engines matrix (every integration x FSDP1/FSDP2/ZeRO 1-3) and the benchmarks' smoke runs.
test-extended: $(STAMP) $(AZURITE_STAMP)
	PYTHONDONTWRITEBYTECODE= $(PY) -m pytest -q -n 2 -m extended

# The documentation site (mkdocs-material): built strictly into build/site, then served
# on http://127.0.0.1:8000 until Ctrl-C. make test builds it too (tests/docs).
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs serve --dev-addr 127.0.0.1:8000

lint: $(STAMP)
	$(PY) -m ruff check src tests demo bench docs_hooks

# The crash harness at its long budget (several hundred SIGKILLs over saves sync and
# async, POSIX and S3, one rank and two, restores, replication and gc; CI runs 64).
# About 600 kills, 7-13 minutes here; `make reliability` runs it too, with the rest.
crash: $(STAMP)
	CKPTVAULT_RELIABILITY_LONG=1 $(PY) -m pytest -q -s --timeout 3600 tests/reliability/test_crash_consistency.py

# Every reliability scenario (crash kills, simulated power loss, corruption, hostile
# generations, fuzzing) at its long budget, then the table of trials and failures
# (the README's Reliability section). Exits non-zero if any scenario failed.
RELIABILITY_LOG := $(CURDIR)/.reliability.jsonl
reliability: $(STAMP)
	rm -f $(RELIABILITY_LOG)
	status=0; \
	CKPTVAULT_RELIABILITY_LONG=1 CKPTVAULT_RELIABILITY_LOG=$(RELIABILITY_LOG) \
	  $(PY) -m pytest -q --timeout 3600 -m reliability tests || status=$$?; \
	$(PY) tests/support/reliability_table.py $(RELIABILITY_LOG) || status=1; \
	exit $$status

# Property-based fuzzing with a long budget (CI runs a bounded one in make test).
fuzz: $(STAMP)
	CKPTVAULT_RELIABILITY_LONG=1 $(PY) -m pytest -q --timeout 3600 -m fuzz tests

bench: $(STAMP)
	$(PY) -m bench.save_restore --size-gb 1 --reps 7
	$(PY) -m bench.s3_save --size-gb 1 --reps 3
	$(PY) -m bench.multirank_save --size-gb 1 --ranks 2 --reps 5
	$(PY) -m bench.memory_tier --size-gb 1 --reps 3
	$(PY) -m bench.memory_tier_ranks --size-gb 1 --reps 3
	$(PY) -m bench.scale
	$(MAKE) bench-costs

# What checkpointing costs the loop, the writer process, read-once and in-place
# restores, rank 0 at 1,024 ranks, a first save, restore against the disk, the GPU
# script (it says 'no CUDA device' and exits 0 without one). About 90 minutes here,
# most of it the training loop at a 30 s cadence.
bench-costs: $(STAMP)
	$(PY) -m bench.loop_overhead --state-mb 100 --cadences 2,30 --saves 10,2 --reps 3 --torch-threads 1
	$(PY) -m bench.writer_process --size-mb 256 --tensors 400 --reps 5
	$(PY) -m bench.read_once_ranks --size-mb 1024 --reps 3
	$(PY) -m bench.restore_rss --size-gb 1 --reps 3
	$(PY) -m bench.coordinator_scale
	$(PY) -m bench.first_save --reps 7
	$(PY) -m bench.restore_limit --size-gb 1 --reps 5 --profile
	$(PY) -m bench.gpu_check --size-gb 2 --reps 5

# How costs grow (about 10 minutes here): save and restore against tensor count
# (1k/10k/100k, disk and tmpfs), DCP metadata against simulated ranks (1-1,024),
# listing against generations (10-1,000), each against torch.save / DCP on the same
# sizes. Tables in bench-out/scale.md, plot in bench-out/scale.png.
bench-scale: $(STAMP)
	$(PY) -m bench.scale

clean:
	rm -rf $(VENV) $(NODE_DIR) build *.egg-info src/*.egg-info .pytest_cache
