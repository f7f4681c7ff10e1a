# Two commands on a fresh machine: `make demo` and `make test`; `make docs` builds the site.
# All share one environment: the first creates .venv and installs jacmem with its dev and docs
# extras, pinned by constraints.txt; the others find it ready.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow conformance lint bench docs clean

# The torchvision shim goes in only where `import torchvision` fails for want of its C++
# ops (PyPI's CUDA-linked wheel beside the CPU torch); see tools/torchvision_cpu_shim.py.
# The docs extra is in the one install because the gallery's examples import what dev
# installs and the suite's tests/docs/test_docs.py reads the docs' own Sphinx extension (docutils).
# The Makefile is a prerequisite: it says which extras go in.
$(STAMP): Makefile pyproject.toml constraints.txt tools/torchvision_cpu_shim.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,docs]"
	$(PY) tools/torchvision_cpu_shim.py install
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/plot_save_memory.py

# `make test` is the cheap slice, on two workers (pytest-xdist); the tests marked slow (peers'
# whole suites, several ranks, compiled models, benchmark processes) run in `make test-slow`,
# the conformance matrix beyond its slice in `make conformance`.
test: $(STAMP) lint
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "not slow and not conformance_full"

test-slow: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "slow"

# The whole conformance matrix (tests/conformance/): models x settings x quantities against one
# float64 oracle; `make test` runs its cheap slice only (marker `conformance`).
conformance: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadgroup -m "conformance or conformance_full" tests/conformance

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) -m benchmarks
	$(PY) -m benchmarks.second_order
	$(PY) -m benchmarks.dp
	$(PY) -m benchmarks.lm
	$(PY) -m benchmarks.fsdp
	$(PY) -m benchmarks.compile
	$(PY) -m benchmarks.attribution

# Offline, warnings as errors, every page read afresh (-E: the generated pages follow the
# registry and the docstrings, which Sphinx does not track); the gallery runs examples/plot_*.py in quick mode
# (JACMEM_QUICK=1, set by docs/conf.py), then docs/check_site.py checks the HTML.
docs: $(STAMP)
	$(PY) -m sphinx -E -W --keep-going -b html docs docs/_build/html
	$(PY) docs/check_site.py docs/_build/html

clean:
	rm -rf $(VENV) build *.egg-info docs/_build docs/auto_examples docs/sg_execution_times.rst
