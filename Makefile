# The two commands a newcomer runs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-extra test-all test-bare test-py312 test-compile test-compile-gpu-stack bench lint docs clean wheel gpu-check-rehearsal example

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[test,notebooks]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m flexjax demo

# worksteal: a worker that runs out of tests takes queued ones from the other (a shorter tail).
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal

# Tests kept out of make test's 5-minute budget that CI still runs (marked ci_extra).
test-extra: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist worksteal -m ci_extra

# A bare `pip install .` (JAX and NumPy, no extras) into a fresh venv, then tests/bare_install.py --bare:
# README's examples, the paged, ragged, quantized and kernel_options calls against the reference, and
# the GPU backends refusing with the extra to install. Run outside the tree, so the installed copy is
# what imports. About 2 minutes on 2 cores.
BVENV := build/venv-bare
test-bare:
	rm -rf $(BVENV)
	$(PYTHON) -m venv $(BVENV)
	$(BVENV)/bin/python -m pip install -q .
	cd $(BVENV) && bin/python $(CURDIR)/tests/bare_install.py --bare

# make test on Python 3.12 with the newest JAX that pip gives it (JAX >= 0.11 needs Python >= 3.12), in a
# fresh venv: the leg that meets JAX's next change first, so it installs the newest JAX even past
# pyproject's upper bound (pip says so). JAX_SPEC=jax==0.11.2 pins the GPU machine's release instead.
# Then the two-process jax.distributed test on that JAX (its launcher kills both processes past 150 s, so a
# hang fails). Skipped, and said so, where this host has no Python 3.12. About 7 minutes on 2 cores.
P12VENV := build/venv-py312
JAX_SPEC ?= jax
PY312 ?= $(shell for p in python3.12 $$(pyenv root 2>/dev/null)/versions/3.12*/bin/python3.12; do \
	$$p -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null && { command -v $$p || echo $$p; } && break; done)
test-py312:
	@if test -z "$(PY312)"; then echo "test-py312: no Python 3.12 on this host; skipped"; exit 0; fi; \
	set -e; rm -rf $(P12VENV); $(PY312) -m venv $(P12VENV); \
	$(P12VENV)/bin/python -m pip install -q -e '.[test]'; \
	$(P12VENV)/bin/python -m pip install -q --upgrade "$(JAX_SPEC)" 2>&1 | grep -v "^WARNING: Location" || true; \
	$(P12VENV)/bin/python -c 'import jax, sys; print("test-py312: Python", sys.version.split()[0], "JAX", jax.__version__)'; \
	$(P12VENV)/bin/python -m pytest -q -n 2 --dist worksteal -p no:cacheprovider; \
	$(P12VENV)/bin/python -m pytest -q -p no:cacheprovider -m ci_extra tests/test_multiprocess.py

test-all: $(STAMP)
	FLEXJAX_HYPOTHESIS=all $(PY) -m pytest -q -n 2 -m 'not gpu and not tpu'

# The end-to-end example at a small size: examples/gpt.py for 40 steps (--check: exit 1 unless the loss is below
# the unigram baseline and the paged decode's logits match jax.nn.dot_product_attention's), then
# notebooks/07_gpt_end_to_end.ipynb at its small size (it asserts the same). About 1.5 minutes on 2 cores.
example: $(STAMP)
	$(PY) examples/gpt.py --steps 40 --new-tokens 24 --speed-lengths 256 --check
	$(PY) -m pytest -q tests/test_notebooks.py -m slow -k 07_gpt_end_to_end

# AOT compile suite (tests_compile/): its own venv, since the CUDA plugin it installs logs an
# error at every `import jax` on a host without a GPU, which `make test` must not see.
CVENV := build/venv-compile
CPY := $(CVENV)/bin/python
CSTAMP := $(CVENV)/.installed
COMPILE_JOBS ?= 2

$(CSTAMP): pyproject.toml
	test -x $(CPY) || $(PYTHON) -m venv $(CVENV)
	$(CPY) -m pip install -q --upgrade pip
	$(CPY) -m pip install -q -e '.[compile]'
	touch $(CSTAMP)

# Then the triton backend's: every kernel compiled for sm_90 and sm_80 with the same resource checks
# (triton_suite.py), and the tests marked `triton` (its generated mods and kernels under Triton's
# interpreter against the reference, the conformance suite included, and its lowering for cuda).
# The mosaic_gpu backend's: its kernels compiled for sm_90a with ptxas' registers and spills
# (mosaic_gpu_suite.py, which also checks that sm_100a is refused), and the tests marked `mosaic_gpu`
# (the catalog in Mosaic GPU's interpreter; with the tests marked `triton`, about 7 minutes on 2 cores).
#
# On this leg (JAX 0.10.2, CUDA 12 plugin): the pallas kernels for TPU v5e, all of them, and for sm_90 only
# at bfloat16 and D = 128 (PALLAS_CUDA_ONLY): Pallas' Triton lowering is deprecated from JAX 0.11, and
# backend=None reaches it on a GPU only where neither mosaic_gpu nor triton serves (the full sweep:
# PALLAS_CUDA_ONLY=.). The triton and mosaic_gpu suites run in full on the GPU machine's stack
# (test-compile-gpu-stack); here the mosaic_gpu suite's first configurations only, as a check of JAX 0.10.
PALLAS_CUDA_ONLY ?= /bfloat16/D128/
test-compile: $(CSTAMP)
	$(CPY) tests_compile/compile_suite.py --jobs $(COMPILE_JOBS) --only '^tpu/|^cuda/.*$(PALLAS_CUDA_ONLY)' \
	  --out tests_compile/last_table.md
	$(CPY) tests_compile/decode_suite.py > tests_compile/last_decode_table.txt || (cat tests_compile/last_decode_table.txt; exit 1)
	$(CPY) tests_compile/mosaic_gpu_suite.py --quick --out tests_compile/last_mosaic_gpu_table_jax010.md
	JAX_PLATFORMS=cpu $(CPY) -m pytest -q -n 2 -m '(triton or mosaic_gpu) and not slow' tests

# The compile suites on the GPU machine's stack: Python 3.12, JAX 0.11.2 with jax-cuda13-plugin and CUDA
# 13.0's ptxas, Triton 3.6 with jax-triton 0.3.1 (pyproject's `compile` extra on Python >= 3.12), in
# build/venv-compile-gpu: the triton backend's kernels for sm_90 and sm_80 (triton_suite.py) and the
# mosaic_gpu kernels for sm_90a and sm_100a (mosaic_gpu_suite.py), every configuration. Skipped, and said
# so, where this host has no Python 3.12. The triton suite at float16 on sm_90 and outside bfloat16 on sm_80
# is left to TRITON_ONLY=. (the full 386 entries: 757 s with 2 workers, 0 failing on 2026-12-05): float16's
# kernels are bfloat16's with another element type (the same tiles, registers and shared memory in that run).
# float32 on sm_90 takes GQA only, as sm_80 does: its MHA kernels differ only in G = 1 (174 of the 216
# entries). About 11 minutes on 2 cores (the two mosaic_gpu arch processes side by side: 4 min).
GVENV := build/venv-compile-gpu
GPU_JAX ?= 0.11.2
TRITON_ONLY ?= ^sm_90/.*/bfloat16/|^sm_90/.*/float32/.*/gqa$$|^sm_80/.*/bfloat16/
test-compile-gpu-stack:
	@if test -z "$(PY312)"; then echo "test-compile-gpu-stack: no Python 3.12 on this host; skipped"; exit 0; fi; \
	set -e; test -x $(GVENV)/bin/python || $(PY312) -m venv $(GVENV); \
	$(GVENV)/bin/python -m pip install -q "jax==$(GPU_JAX)" "jaxlib==$(GPU_JAX)" "jax-cuda13-plugin==$(GPU_JAX)" \
	  "jax-cuda13-pjrt==$(GPU_JAX)" -e '.[compile]' 2>&1 | grep -v "^WARNING: Location" || true; \
	$(GVENV)/bin/python -c 'import jax, sys; print("test-compile-gpu-stack: Python", sys.version.split()[0], "JAX", jax.__version__)'; \
	$(GVENV)/bin/python tests_compile/triton_suite.py --jobs $(COMPILE_JOBS) --only '$(TRITON_ONLY)' \
	  --out tests_compile/last_triton_table.md; \
	$(GVENV)/bin/python tests_compile/mosaic_gpu_suite.py --out tests_compile/last_mosaic_gpu_table.md

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run --suite full --torch

# The jax-triton wheel the GPU machine lacks (it has no network), and absl-py, which jax-triton imports
# and neither JAX nor Triton installs: pure Python, so one wheel serves every Python there;
# benchmarks/gpu_check.sh puts those whose module does not import on PYTHONPATH as they are.
# Carry .whl/ with the tree (README, "GPU").
wheel: $(STAMP)
	$(PY) -m pip wheel -q --no-deps jax-triton==0.3.1 absl-py==2.5.1 -w .whl

# benchmarks/gpu_check.sh end to end on CPU: tiny shapes, the kernels in their interpreters, XLA in
# cuDNN's place (about 2 minutes on 2 cores), with a backend that hangs: FLEXJAX_GPU_INJECT_HANG
# makes mosaic_gpu's processes sleep forever, so its smoke test (step 0) times out (30 s) and drops
# it, and the run must still pass (the script checks that its summary shows the drop, with the
# reason) with the others' figures. pallas takes mosaic_gpu's late path (its tests and timings in
# processes of their own, after triton's and XLA's figures; the ratios against XLA's from those).
# Triton's interpreter needs make test-compile's venv; without it triton is left out and said so.
REHEARSAL_OUT := build/gpu_check_rehearsal
REHEARSAL_ENV := JAX_PLATFORMS=cpu FLEXJAX_GPU_CHECK_ALLOW_CPU=1 FLEXJAX_GPU_INJECT_HANG=mosaic_gpu
gpu-check-rehearsal: $(if $(wildcard $(CPY)),,$(STAMP))
	@if test -x $(CPY); then \
	  $(REHEARSAL_ENV) FLEXJAX_GPU_BACKENDS=mosaic_gpu,triton,pallas FLEXJAX_GPU_LATE_BACKENDS=mosaic_gpu,pallas \
	    PYTHON=$(CPY) bash benchmarks/gpu_check.sh $(REHEARSAL_OUT); \
	else \
	  echo "gpu-check-rehearsal: no $(CPY) (make test-compile's venv), so no Triton interpreter: pallas only"; \
	  $(REHEARSAL_ENV) FLEXJAX_GPU_BACKENDS=mosaic_gpu,pallas PYTHON=$(PY) bash benchmarks/gpu_check.sh $(REHEARSAL_OUT); \
	fi

# ruff pinned: a new release's rules would otherwise fail CI on unchanged code.
lint: $(STAMP)
	$(PY) -m pip install -q ruff==0.17.6
	$(VENV)/bin/ruff check flexjax tests tests_compile benchmarks notebooks docs examples

# The documentation site (docs/, Sphinx + MyST + myst-nb) into build/docs/index.html. Warnings are errors, and -E
# rereads every page, so a warning in a page left unchanged since the last build still fails it.
DOCS_STAMP := $(VENV)/.installed-docs
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	$(PY) -m sphinx -W --keep-going -E -q -b html docs build/docs
	@echo "docs: build/docs/index.html"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
