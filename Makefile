# Two commands on a fresh machine: `make demo` and `make test`.
# Each creates .venv if missing and installs what it needs, pinned by constraints.txt.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

# The torchvision shim goes in only where `import torchvision` fails for want of its C++
# ops (PyPI's CUDA-linked wheel beside the CPU torch); see tools/torchvision_cpu_shim.py.
$(STAMP): pyproject.toml constraints.txt tools/torchvision_cpu_shim.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints.txt -e ".[dev]"
	$(PY) tools/torchvision_cpu_shim.py install
	touch $(STAMP)

demo: $(STAMP)
	$(PY) examples/plot_save_memory.py

test: $(STAMP) lint
	$(PY) -m pytest -q

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

bench: $(STAMP)
	$(PY) -m benchmarks
	$(PY) -m benchmarks.dp

clean:
	rm -rf $(VENV) build *.egg-info
