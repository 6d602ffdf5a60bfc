# The two commands a newcomer runs: `make demo` and `make test`. Both create .venv first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-all test-compile bench lint clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test,notebooks]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m flexjax demo

test: $(STAMP)
	$(PY) -m pytest -q -n 2

test-all: $(STAMP)
	FLEXJAX_HYPOTHESIS=all $(PY) -m pytest -q -n 2 -m 'not gpu and not tpu'

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
test-compile: $(CSTAMP)
	$(CPY) tests_compile/compile_suite.py --jobs $(COMPILE_JOBS) --out tests_compile/last_table.md
	$(CPY) tests_compile/triton_suite.py --jobs $(COMPILE_JOBS) --out tests_compile/last_triton_table.md
	$(CPY) tests_compile/decode_suite.py > tests_compile/last_decode_table.txt || (cat tests_compile/last_decode_table.txt; exit 1)
	JAX_PLATFORMS=cpu $(CPY) -m pytest -q -n 2 -m triton tests

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[bench]'
	$(PY) -m benchmarks.run --suite full --torch

# ruff pinned: a new release's rules would otherwise fail CI on unchanged code.
lint: $(STAMP)
	$(PY) -m pip install -q ruff==0.17.6
	$(VENV)/bin/ruff check flexjax tests tests_compile benchmarks notebooks

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache
