# Two commands do all the set-up and work: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_DIR ?= .tiered-kv-demo

.PHONY: demo test test-faults venv clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU wheel the machine provides; the project's range admits it.
	$(PY) -m pip install --quiet "torch==2.13.0" || $(PY) -m pip install --quiet "torch>=2.4"
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/tiered-kv demo --cache-dir $(DEMO_DIR)

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO_DIR)
