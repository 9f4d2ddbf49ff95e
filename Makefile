# dpsgd — reproduction of Abadi et al. 2016, "Deep Learning with Differential Privacy".
# Every target sets itself up: the first use builds .venv from requirements.txt.
SHELL := /bin/bash
.DEFAULT_GOAL := help
PYTHON ?= python3
# The venv and what goes into it; overridable on the command line (tests/project/test_makefile.py builds a
# throwaway venv with a fake interpreter). requirements*.txt pin the direct dependencies, LOCK (a pip
# constraints file, rewritten by `make lock`) pins every transitive one.
VENV := .venv
REQUIREMENTS := requirements.txt requirements-test.txt
LOCK := requirements.lock
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
SWEEPS := $(basename $(notdir $(wildcard conf/sweep/*.yaml)))
# LAUNCHER=joblib|submitit_local|submitit_slurm|slurm runs the jobs of `make paper`, `make seeds` and
# `make sweep-NAME` through that Hydra launcher (docs/SCALING.md); unset: one job after another
# (make paper: its own processes, 2 at a time).
LAUNCHER ?=
LAUNCH_FLAG = $(if $(LAUNCHER),--launcher $(LAUNCHER))

# The CIFAR-10 runs (paper §5.3) load convolutions pretrained on CIFAR-100 (public data) from this
# artifact, built by `python -m dpsgd.pretrain` when it is missing. DOWNLOAD=0: never use the network.
PRETRAINED := data/pretrained/cifar100_convs.pt
NO_DOWNLOAD := $(if $(filter 0 no false,$(DOWNLOAD)),--no-download,)

.PHONY: help install lock data mnist mnist-all cifar-data cifar10 cifar10-all seeds test test-all test-other-cpu bench wheelhouse gpu-check figures paper frontier finetune correlated-noise tune-frontier audit clean $(addprefix sweep-,$(SWEEPS))

help: ## list targets
	@grep -hE '^[a-zA-Z0-9_-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'
	@echo "  make sweep-NAME   run one Figure-5 sweep (NAME in: $(SWEEPS))"
	@echo "  LAUNCHER=joblib|submitit_local|submitit_slurm|slurm: paper, seeds and sweeps through a Hydra launcher"

# Safe when several `make` start at once on a fresh clone: the whole build holds an exclusive flock on
# $(VENV).lock, and re-checks the stamp once it has the lock (a concurrent make may have finished it).
# $(VENV)/.created is written only after `python -m venv` and the pip upgrade succeeded, so a venv
# left half built by an interrupted make is removed and rebuilt, never installed into; the stamp is
# written last, so it only ever marks a finished install.
$(STAMP): $(REQUIREMENTS) $(LOCK)
	@mkdir -p $(dir $(VENV)); exec 9> $(VENV).lock; \
	if command -v flock > /dev/null; then flock 9; else echo "warning: no flock, $(VENV) build not locked" >&2; fi; \
	set -e; \
	if [ -e $(STAMP) ] && [ -z "$$(find $^ -newer $(STAMP))" ]; then echo "$(VENV) is up to date"; exit 0; fi; \
	if [ -e $(STAMP) ]; then touch $(VENV)/.created; fi; \
	if [ ! -e $(VENV)/.created ]; then \
		echo "creating $(VENV) with $(PYTHON)"; rm -rf $(VENV); $(PYTHON) -m venv $(VENV); \
		$(PY) -m pip install -q -c $(LOCK) --upgrade pip; touch $(VENV)/.created; fi; \
	rm -f $(STAMP); \
	echo "installing $(REQUIREMENTS) into $(VENV), constrained by $(LOCK)"; \
	$(PY) -m pip install -q -c $(LOCK) $(addprefix -r ,$(REQUIREMENTS)); \
	touch $(STAMP)

install: $(STAMP) ## build the virtual environment (.venv) from the pinned requirements and the lock

# Updating a pin: edit requirements*.txt, then `make lock` re-resolves them in the existing .venv
# WITHOUT the lock (only what the new pins demand moves) and rewrites the lock from pip freeze, keeping
# its comment header; then `make test-all` and commit both files.
lock: ## after editing a pin in requirements*.txt: re-resolve it in .venv and rewrite requirements.lock
	@test -e $(VENV)/.created || test -e $(STAMP) || { echo "lock: no finished $(VENV); run make install first" >&2; exit 2; }
	@exec 9> $(VENV).lock; command -v flock > /dev/null && flock 9; set -e; \
	$(PY) -m pip install -q $(addprefix -r ,$(REQUIREMENTS)); \
	{ grep '^#' $(LOCK); $(PY) -m pip freeze --all --exclude-editable; } > $(LOCK).tmp; \
	mv $(LOCK).tmp $(LOCK); echo "rewrote $(LOCK): $$(grep -vc '^#' $(LOCK)) packages"

data: $(STAMP) ## seed the git-ignored data root (copies local archives, else downloads; CIFAR when present locally)
	$(PY) -m dpsgd.data

mnist: $(STAMP) data ## train the paper's medium-noise MNIST model (eps = 2, delta = 1e-5)
	$(PY) -m dpsgd.train experiment=mnist_medium

mnist-all: $(STAMP) data ## the four paper presets: small, medium, large noise and non-private
	for e in mnist_small mnist_medium mnist_large mnist_nonprivate; do $(PY) -m dpsgd.train experiment=$$e || exit 1; done

# CIFAR-10 first: without it nothing else is worth building (one line naming it, exit 2).
cifar-data: $(STAMP) ## seed CIFAR-10 and CIFAR-100 (from $DPSGD_DATA_SOURCE, else download; DOWNLOAD=0: never)
	$(PY) -m dpsgd.data cifar10 $(NO_DOWNLOAD)
	$(PY) -m dpsgd.data cifar100 $(NO_DOWNLOAD)

$(PRETRAINED): | $(STAMP) cifar-data
	$(PY) -m dpsgd.pretrain --out $@

cifar10: $(STAMP) cifar-data $(PRETRAINED) ## train the paper's CIFAR-10 model at eps = 2 (pretrains the convs on CIFAR-100 first if needed)
	$(PY) -m dpsgd.train experiment=cifar10_eps2

cifar10-all: $(STAMP) cifar-data $(PRETRAINED) ## the CIFAR-10 presets: eps = 2, 4, 8 and non-private
	for e in cifar10_eps2 cifar10_eps4 cifar10_eps8 cifar10_nonprivate; do $(PY) -m dpsgd.train experiment=$$e || exit 1; done

seeds: $(STAMP) data ## the four presets over seeds 0-4, merged into results/seeds.csv (SEEDS=0-4 DEVICE=auto LAUNCHER=)
	$(PY) -m experiments.seeds run --seeds $(or $(SEEDS),0-4) --device $(or $(DEVICE),auto) $(LAUNCH_FLAG)
	$(PY) -m experiments.seeds collect
	$(PY) -m experiments.figures

# pytest-xdist workers (each test runs one torch thread, tests/conftest.py): 2 halves the suite's
# time on a 2-core machine (19.8 -> 10.7 min on the AMD EPYC, docs/DEVELOPMENT.md); TEST_JOBS=0 runs
# it in this process, one test after another.
TEST_JOBS ?= 2

test: $(STAMP) data ## run the test suite (slow end-to-end tests excluded), TEST_JOBS=2 workers
	$(PY) -m pytest -m "not slow" -q -n $(TEST_JOBS)

test-all: $(STAMP) data ## run every test, slow ones included
	$(PY) -m pytest -q -n $(TEST_JOBS)

# The fast suite again, as a CPU without AVX2 or AVX-512 computes it: numpy's exp/log kernels at its
# X86_V2 baseline, torch's scalar kernels, MKL's compatible code path. Their last bits differ from this
# machine's, so a tolerance pinned to one CPU fails here, not on a newcomer's machine
# (docs/DEVELOPMENT.md#tolerances; tests/project/test_cpu_profile.py checks the switches are in force).
# OPENBLAS_CORETYPE is left as the machine sets it. CI runs it after `make test`.
OTHER_CPU := DPSGD_CPU_PROFILE=baseline NPY_DISABLE_CPU_FEATURES=X86_V3,X86_V4,AVX512_ICL,AVX512_SPR \
	ATEN_CPU_CAPABILITY=default MKL_CBWR=COMPATIBLE
test-other-cpu: $(STAMP) data ## the fast suite again as a CPU without AVX2/AVX-512 computes it (tolerances not pinned to one CPU)
	env $(OTHER_CPU) $(PY) -m pytest -m "not slow" -q -p no:cacheprovider -n $(TEST_JOBS)

bench: $(STAMP) data ## benchmarks: today's models and the DP step vs a plain step and Opacus, norm routes, a whole run by phase, the floor under make mnist, evaluation chunks, GEMM orientation, accountant speed, frozen layers, threads, torch.distributed, CIFAR-10 epoch
	$(PY) -m pip install -q opacus==1.6.0
	$(PY) -m bench.bench_models
	$(PY) -m bench.bench_routes
	$(PY) -m bench.bench_step
	$(PY) -m bench.bench_api
	$(PY) -m bench.bench_run
	$(PY) -m bench.bench_floor
	$(PY) -m bench.bench_eval
	$(PY) -m bench.bench_gemm
	$(PY) -m bench.bench_accountant
	$(PY) -m bench.bench_frozen
	$(PY) -m bench.bench_threads
	$(PY) -m bench.bench_distributed
	$(PY) -m bench.bench_cifar_epoch

# The GPU check (docs/PERFORMANCE.md#gpu-check). `make wheelhouse` (here, with network) fills the
# git-ignored .whl/ with the wheels a stock CUDA PyTorch image lacks and the MNIST archives;
# `make gpu-check` needs no venv and no network: it runs with GPU_PYTHON (this checkout's .venv when
# present, else the image's python3, which has torch). DEVICE=cpu: the CPU rehearsal, tiny settings.
# GPU_OUT=dir: the log and CSVs are copied there too.
GPU_PYTHON ?= $(if $(wildcard $(PY)),$(PY),python3)
wheelhouse: $(STAMP) ## download the wheels gpu-check installs offline (+ MNIST archives) into .whl/; prints its size
	$(PY) -m bench.wheelhouse

gpu-check: ## GPU results from a bare checkout, offline, in <= 8 min (needs .whl/; DEVICE=cpu rehearses, GPU_OUT=dir)
	$(GPU_PYTHON) -m bench.gpu_check --device $(or $(DEVICE),cuda) $(if $(GPU_OUT),--out-dir $(GPU_OUT))

figures: $(STAMP) ## redraw every figure from the committed CSVs in results/ (no training)
	$(PY) -m experiments.figures

paper: $(STAMP) data ## rerun every experiment, collect results/ and redraw (hours; see README; LAUNCHER=)
	$(PY) -m experiments.paper $(LAUNCH_FLAG)

frontier: $(STAMP) data ## privacy-utility frontier: plan + time estimate, runs, frontier.csv, figure, table
	$(PY) -m experiments.frontier

finetune: $(STAMP) data ## public pretraining (Fashion-MNIST), private fine-tuning (MNIST) of a small ViT: plan, tuning, runs, Opacus beside, finetune.csv, figure (hours; needs peft, opacus)
	$(PY) -m experiments.finetune

correlated-noise: $(STAMP) data ## DP-SGD vs BandMF/BLT at equal ε and lots, 3 seeds (hours): correlated_noise.csv, figure, table
	$(PY) -m experiments.correlated_noise
	$(PY) -m experiments.figures

audit: $(STAMP) data ## one-run privacy audits: the quick rows of docs/AUDIT.md (mnist_large, σ = 4 mechanisms), audit.csv, figure
	$(PY) -m experiments.audit_table --rows quick

tune-frontier: $(STAMP) data ## the tuned frontier row charged: private selection of T at total ε 1.2, 3 seeds (docs/TUNING.md)
	$(PY) -m experiments.private_selection run
	$(PY) -m experiments.private_selection collect
	$(PY) -m experiments.figures

$(addprefix sweep-,$(SWEEPS)): sweep-%: $(STAMP) data
	$(PY) -m dpsgd.train -m +sweep=$* $(if $(LAUNCHER),hydra/launcher=$(LAUNCHER))

clean: ## remove outputs of runs (keeps data, venv and results/)
	rm -rf outputs multirun .pytest_cache
