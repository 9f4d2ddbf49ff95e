# dpsgd — reproduction of Abadi et al. 2016, "Deep Learning with Differential Privacy".
# Every target sets itself up: the first use builds .venv from requirements.txt.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SWEEPS := $(basename $(notdir $(wildcard conf/sweep/*.yaml)))

.PHONY: help install data mnist mnist-all seeds test test-all bench figures paper clean $(addprefix sweep-,$(SWEEPS))

help: ## list targets
	@grep -hE '^[a-zA-Z_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'
	@echo "  make sweep-NAME   run one Figure-5 sweep (NAME in: $(SWEEPS))"

$(STAMP): requirements.txt requirements-test.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt -r requirements-test.txt
	touch $(STAMP)

install: $(STAMP) ## build the virtual environment (.venv)

data: $(STAMP) ## seed the git-ignored data root (copies local archives, else downloads)
	$(PY) -m dpsgd.data

mnist: $(STAMP) data ## train the paper's medium-noise MNIST model (eps = 2, delta = 1e-5)
	$(PY) -m dpsgd.train experiment=mnist_medium

mnist-all: $(STAMP) data ## the four paper presets: small, medium, large noise and non-private
	for e in mnist_small mnist_medium mnist_large mnist_nonprivate; do $(PY) -m dpsgd.train experiment=$$e || exit 1; done

seeds: $(STAMP) data ## the four presets over seeds 0-4, merged into results/seeds.csv (SEEDS=0-4 DEVICE=auto)
	$(PY) -m experiments.seeds run --seeds $(or $(SEEDS),0-4) --device $(or $(DEVICE),auto)
	$(PY) -m experiments.seeds collect
	$(PY) -m experiments.figures

test: $(STAMP) data ## run the test suite (slow end-to-end tests excluded)
	$(PY) -m pytest -m "not slow" -q

test-all: $(STAMP) data ## run every test, slow ones included
	$(PY) -m pytest -q

bench: $(STAMP) data ## benchmarks: DP step vs non-private vs Opacus, GEMM orientation, accountant speed
	$(PY) -m pip install -q opacus==1.6.0
	$(PY) -m bench.bench_step
	$(PY) -m bench.bench_gemm
	$(PY) -m bench.bench_accountant

figures: $(STAMP) ## redraw every figure from the committed CSVs in results/ (no training)
	$(PY) -m experiments.figures

paper: $(STAMP) data ## rerun every experiment, collect results/ and redraw (hours; see README)
	$(PY) -m experiments.paper

$(addprefix sweep-,$(SWEEPS)): sweep-%: $(STAMP) data
	$(PY) -m dpsgd.train -m +sweep=$*

clean: ## remove outputs of runs (keeps data, venv and results/)
	rm -rf outputs multirun .pytest_cache
