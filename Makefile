# Two commands on a fresh machine (each installs what it needs into .venv first):
#   make run    the main job: a real asynchronous GRPO run (resumes if interrupted)
#   make test   the whole test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/arith.yaml
ARGS   ?=

.PHONY: install run test bench chaos lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned in the same command as everything that depends on it (CPU build).
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(PY) -m rollkeep train $(CONFIG) $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15

bench: $(STAMP)
	$(PY) -m rollkeep bench $(ARGS)

chaos: $(STAMP)
	$(PY) -m rollkeep chaos configs/toy.yaml --kills 10 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

clean:
	rm -rf runs .pytest_cache .hypothesis
