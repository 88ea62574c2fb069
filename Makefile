# Two commands do all the set-up and work: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
VLLM_STAMP := $(VENV)/.vllm-installed
VLLM_REQS := requirements-vllm-nodeps.txt requirements-vllm.txt
# WITH_VLLM=0 skips installing vLLM; the `vllm`-marked tests then skip themselves.
WITH_VLLM ?= 1
# Ceph RGW, the real S3 server of the shared-tier tests (tools/rgw_server.sh): installed
# from Debian's packages when missing and make runs as root with apt-get; elsewhere those
# tests skip, saying how to get it. WITH_RGW=0 skips the install.
WITH_RGW ?= 1
RGW_STAMP := $(VENV)/.rgw-installed
RGW_PACKAGES := ceph-mon ceph-osd radosgw ceph-common
# Mooncake Store, the shared tier's second backend: its wheel (the test extra) needs
# Debian's RDMA libraries even over TCP; installed when missing as for Ceph, else the
# Mooncake tests skip, saying how to get them. WITH_MOONCAKE=0 skips the install.
WITH_MOONCAKE ?= 1
MOONCAKE_STAMP := $(VENV)/.mooncake-installed
MOONCAKE_PACKAGES := libibverbs1 librdmacm1
TEST_DEPS := $(STAMP) $(if $(filter 1,$(WITH_VLLM)),$(VLLM_STAMP)) $(if $(filter 1,$(WITH_RGW)),$(RGW_STAMP)) \
	$(if $(filter 1,$(WITH_MOONCAKE)),$(MOONCAKE_STAMP))
DEMO_DIR ?= .tiered-kv-demo

.PHONY: demo test test-faults venv clean rgw mooncake

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first, pinned to the CPU wheel the machine provides; the project's range admits it.
	$(PY) -m pip install --quiet "torch==2.13.0" || $(PY) -m pip install --quiet "torch>=2.4"
	$(PY) -m pip install --quiet -e ".[test,bench]"
	touch $(STAMP)

# vLLM for the integration tests, without its dependencies (it pins torch 2.14 and CUDA
# wheels): the venv's torch is held by a constraint and checked afterwards, and the
# resolver's complaints about vLLM's unmet pins are expected, hence silenced. A separate
# stamp, so it re-runs only when the requirement files (or the base venv) change.
$(VLLM_STAMP): $(STAMP) $(VLLM_REQS)
	$(PY) -c "import torch; print('torch==' + torch.__version__)" > $(VENV)/torch-constraint.txt
	$(PY) -m pip install --quiet --no-deps --no-warn-conflicts -r requirements-vllm-nodeps.txt
	$(PY) -m pip install --quiet --no-warn-conflicts -r requirements-vllm.txt -c $(VENV)/torch-constraint.txt
	$(PY) -c "import torch, sys; want = open('$(VENV)/torch-constraint.txt').read().split('==')[1].strip(); \
		sys.exit(0 if torch.__version__ == want else f'vLLM install changed torch to {torch.__version__}, expected {want}')"
	$(PY) -c "import vllm.v1.kv_offload.base, vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector"
	touch $(VLLM_STAMP)

# Touched only once the daemons are there, so a machine that could not install them
# checks again next time (a few `command -v`), and one that has them never re-runs apt.
$(RGW_STAMP):
	@mkdir -p $(VENV); if command -v radosgw >/dev/null && command -v ceph-mon >/dev/null && command -v ceph-osd >/dev/null \
		&& command -v ceph >/dev/null; then \
		touch $@; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Ceph RGW for the shared-tier tests: $(RGW_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		if apt-get install -y -q --no-install-recommends $(RGW_PACKAGES) >/dev/null \
			|| { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(RGW_PACKAGES) >/dev/null; }; \
		then touch $@; else echo "make: could not install $(RGW_PACKAGES); the shared-tier tests will skip"; fi; \
	else \
		echo "make: Ceph RGW ($(RGW_PACKAGES)) is not installed and needs root with apt-get; the shared-tier tests will skip"; \
	fi

rgw: $(RGW_STAMP)

$(MOONCAKE_STAMP):
	@mkdir -p $(VENV); if /sbin/ldconfig -p 2>/dev/null | grep -q 'libibverbs\.so\.1 ' \
		&& /sbin/ldconfig -p 2>/dev/null | grep -q 'librdmacm\.so\.1 '; then \
		touch $@; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		echo "Installing Mooncake's libraries for the shared-tier tests: $(MOONCAKE_PACKAGES)"; \
		export DEBIAN_FRONTEND=noninteractive; \
		if apt-get install -y -q --no-install-recommends $(MOONCAKE_PACKAGES) >/dev/null \
			|| { apt-get update -q >/dev/null && apt-get install -y -q --no-install-recommends $(MOONCAKE_PACKAGES) >/dev/null; }; \
		then touch $@; else echo "make: could not install $(MOONCAKE_PACKAGES); the Mooncake tests will skip"; fi; \
	else \
		echo "make: $(MOONCAKE_PACKAGES) are not installed and need root with apt-get; the Mooncake tests will skip"; \
	fi

mooncake: $(MOONCAKE_STAMP)

venv: $(TEST_DEPS)

demo: $(STAMP)
	$(VENV)/bin/tiered-kv demo --cache-dir $(DEMO_DIR)

test: $(TEST_DEPS)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV) $(DEMO_DIR)
