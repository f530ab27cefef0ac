# Two commands for a fresh machine:
#   make demo   set up .venv, build the tiny default, run the SFT notebook with papermill into runs/
#   make test   set up .venv, run the whole test suite (kernels, models, data, browser), then every notebook (nbmake)
#   make dist   build notebookkit's wheel and sdist into dist/ and check them (the wheel a Colab user uploads)
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.notebookkit-installed
# On a machine without an NVIDIA GPU we install PyTorch's CPU build (about 200 MB) instead of the
# multi-GB CUDA build pip would pick by default. A local wheel (pip find-links) is used when present.
TORCH_CPU_VERSION ?= 2.13.0+cpu
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu
HAS_GPU := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo 1)
CONSTRAINTS := $(if $(HAS_GPU),,-c constraints/ci-cpu.txt)
PYTEST_ARGS ?=

.PHONY: setup demo test test-fast test-gpu test-gpu-1 test-gpu-2 test-notebooks notebooks-sync dist tiny browser-deps llama-cpp lock clean help

help:
	@sed -n '1,5p' Makefile

setup: $(STAMP)

$(STAMP): pyproject.toml constraints/ci-cpu.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) install -q --upgrade pip >/dev/null
ifeq ($(HAS_GPU),)
	@echo "notebookkit: no NVIDIA GPU found, installing PyTorch's CPU build"
	@$(PIP) install -q "torch==$(TORCH_CPU_VERSION)" 2>/dev/null || \
	  $(PIP) install -q "torch==$(TORCH_CPU_VERSION)" --extra-index-url $(TORCH_CPU_INDEX)
endif
	$(PIP) install -q -e ".[dev]" $(CONSTRAINTS)
	@$(MAKE) --no-print-directory llama-cpp
	@touch $(STAMP)

# llama-cpp-python (the `gguf` extra): K-quant exports and the GGUF checks of tests/export. PyPI has
# only its source, so the first install compiles llama.cpp (~6 min on 2 idle cores; CPU only, no
# examples or tools) and pip's wheel cache serves every later install. GGML_NATIVE=OFF builds for
# any x86-64 with AVX2 rather than for the build machine's exact CPU, so a cached wheel carried to
# another machine still runs.
LLAMA_CPP ?= llama-cpp-python==0.3.36
LLAMA_CPP_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DLLAVA_BUILD=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF
llama-cpp:
	@$(PY) -c "import llama_cpp" 2>/dev/null || { \
	  echo "notebookkit: installing llama-cpp-python (first time: compiles llama.cpp, about 6 minutes)"; \
	  CMAKE_ARGS="$(LLAMA_CPP_CMAKE_ARGS)" CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) $(PIP) install -q "$(LLAMA_CPP)" $(CONSTRAINTS); }

tiny: setup
	$(PY) -m notebookkit.embedded

demo: setup
	$(PY) scripts/run_demo.py

# Chromium for tests/browser, and the widget manager nbconvert's HTML loads (html-manager's embed-amd.js and
# require.js, from npm into .cache/widget-js: the browser test renders executed notebooks without a CDN).
WIDGET_JS := .cache/widget-js
HTML_MANAGER ?= @jupyter-widgets/html-manager@1.0.15
REQUIREJS ?= requirejs@2.3.8
browser-deps: setup
	@command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || \
	  ( (apt-get -qq update && DEBIAN_FRONTEND=noninteractive apt-get -qq install -y chromium >/dev/null) || \
	    echo "notebookkit: could not install chromium; the browser test will say so" )
	@test -f $(WIDGET_JS)/embed-amd.js -a -f $(WIDGET_JS)/require.js || { \
	  mkdir -p $(WIDGET_JS)/npm && cd $(WIDGET_JS)/npm && \
	  npm pack -q $(HTML_MANAGER) $(REQUIREJS) >/dev/null && \
	  for f in *.tgz; do tar xzf $$f && mv package $${f%.tgz}; done && \
	  cp jupyter-widgets-html-manager-*/dist/embed-amd.js requirejs-*/require.js .. && cd .. && rm -rf npm; } || \
	  echo "notebookkit: could not fetch the widget manager's JavaScript (npm); the browser test will say so"

# The notebooks run under nbmake, two at a time (pytest-xdist; each writes its own outputs/ folder beside
# itself), after the rest of the suite; each ends in the cell that fails when nothing was learned.
NBMAKE_ARGS ?= -n 2 --nbmake-timeout=900
# both cores of a CI machine (pytest-xdist); TEST_WORKERS= runs the tests one at a time
TEST_WORKERS ?= -n 2
# one OpenMP thread per worker or notebook kernel: two of them with two threads each on two cores spin in
# OpenMP's barriers (the GRPO notebook's training cell, 79 s alone, ran past nbmake's 900 s; all six notebooks
# take about 4 minutes with one thread each)
WORKER_THREADS ?= OMP_NUM_THREADS=1
test: setup browser-deps
	$(PY) -m notebookkit.embedded
	$(WORKER_THREADS) NOTEBOOKKIT_REQUIRE_LLAMA_CPP=1 $(PY) -m pytest $(TEST_WORKERS) tests $(PYTEST_ARGS)
	@$(MAKE) --no-print-directory test-notebooks

test-notebooks: setup
	$(PY) -m notebookkit.embedded
	$(WORKER_THREADS) $(PY) -m pytest --nbmake $(NBMAKE_ARGS) notebooks $(PYTEST_ARGS)

# After editing a notebook's .py (jupytext percent script) or its .ipynb, bring the other side in step.
notebooks-sync: setup
	$(VENV)/bin/jupytext --sync notebooks/*/*.ipynb

# The wheel and sdist a Colab/Kaggle user installs from (README, "On Colab / Kaggle"), checked by twine and
# by installing the wheel (without its dependencies) into a clean venv and importing it.
dist: setup
	rm -rf dist
	$(PY) -m build --no-isolation --outdir dist .
	$(PY) -m twine check --strict dist/*
	rm -rf build/dist-check && $(PYTHON) -m venv --without-pip build/dist-check
	$(PIP) --python build/dist-check/bin/python install -q --no-deps dist/notebookkit-*.whl
	cd build && dist-check/bin/python -c "import notebookkit; print('dist: notebookkit', notebookkit.__version__, 'imports from', notebookkit.__file__)"
	@ls -l dist

test-fast: setup
	$(PY) -m pytest -x -q -m "not gpu and not slow and not browser" $(PYTEST_ARGS)

# The whole GPU suite (`pytest -m gpu`, the T4-emulation notebook cases included) in two halves. On an H100
# (session 48, 8 + 6 workers): half 1 741 passed in 257 s, half 2 22 passed in 282 s (the vision T4 notebook alone
# 234 s): give `make test-gpu` a whole 600 s device call. Sessions 15-17 saw half 1 pass 500 s, most likely because a
# test module had set TRITON_INTERPRET=1 at import, so every worker ran the kernels interpreted. On the GPU machine nothing is
# installed: `bash ../shared/tools/gpu_site.sh .site --notebooks` here, carry .site, then there
#   PYTHONPATH=$PWD/.site:$PWD make test-gpu-1   (and test-gpu-2; `make test-gpu` runs both)
# Each half writes its log to runs/gpu-suite-<half>.log.
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
# GPU test files of half 2's folders that run in half 1, the shorter one (s24: 252 s against 301 s)
GPU_1_EXTRA := tests/export/test_moe_export_gpu.py
# Each half's temporary folders, removed when the next half starts (session 47: half 1 failed once and left 39 GiB
# under pytest's default folder, which it keeps after a failed run, so half 2 stopped on the disk check)
GPU_BASETEMP := $(or $(TMPDIR),/tmp)/notebookkit-gpu-suite
# tmp_path_retention_policy=failed: a passing test's tmp_path is deleted (half 1 otherwise leaves ~28 GiB of
# checkpoints in its temporary folder, and half 2 then stops on the disk check: session 30); --durations: the
# slowest tests in the log, where the suite's device time goes; --dist loadgroup: the tests marked large_memory run
# on one worker, one after another (tests/conftest.py); scripts/pytest_failure_log.py: each failure's traceback in
# runs/gpu-failures-N.log as it comes (an xdist INTERNALERROR loses the summary), and each test's start and outcome
# in runs/gpu-progress-N.log (`python scripts/pytest_failure_log.py runs/gpu-progress-N.log` names the tests a half
# killed at its time limit cut off)
GPU_PYTEST := $(GPU_PY) -m pytest -m gpu -q -p no:cacheprovider --basetemp=$(GPU_BASETEMP) -p scripts.pytest_failure_log -rfEs -o tmp_path_retention_policy=failed --durations=25 --dist loadgroup
# free disk the suite needs (scripts/check_free_disk.py says why), and the benchmark checkpoints that fill it
GPU_DISK_GIB ?= 56
GPU_DISK_CHECK := $(GPU_PY) scripts/check_free_disk.py $(GPU_DISK_GIB) $(HOME)/.cache/notebookkit/bench \
  $(or $(TMPDIR),/tmp)/pytest-of-$(shell id -un)
# one half: $(1) its number, $(2) xdist workers, $(3) the per-test timeout, $(4) its test paths and options
define gpu_half
	@rm -rf $(GPU_BASETEMP); $(GPU_DISK_CHECK)
	@mkdir -p runs; rm -f runs/gpu-failures-$(1).log runs/gpu-progress-$(1).log; set -o pipefail; \
	  NOTEBOOKKIT_FAILURE_LOG=runs/gpu-failures-$(1).log NOTEBOOKKIT_PROGRESS_LOG=runs/gpu-progress-$(1).log \
	  $(GPU_PYTEST) -n $(2) --timeout $(3) $(4) $(PYTEST_ARGS) 2>&1 | tee runs/gpu-suite-$(1).log
endef

# both halves, the second one even when the first failed (session 48: `make test-gpu` stopped after half 1)
test-gpu:
	@$(MAKE) --no-print-directory test-gpu-1; first=$$?; $(MAKE) --no-print-directory test-gpu-2; exit $$((first || $$?))

test-gpu-1:
	$(call gpu_half,1,8,420,tests/kernels tests/models tests/memory $(GPU_1_EXTRA))

test-gpu-2:
	$(call gpu_half,2,6,540,tests/train tests/export tests/notebooks tests/benchmarks $(GPU_1_EXTRA:%=--ignore=%))

lock:
	$(PIP) freeze --exclude-editable | grep -v '^-e ' > constraints/ci-cpu.txt

clean:
	rm -rf runs .pytest_cache .hypothesis
