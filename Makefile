# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test test-fast sysdeps bench deb clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $@

venv: $(STAMP)

demo: $(STAMP)
	scripts/demo

# System packages the real-kernel (QEMU) and real-systemd (nspawn) tests need.
sysdeps:
	scripts/install-sysdeps

test: $(STAMP) sysdeps
	$(PY) -m pytest -q -p no:cacheprovider

# Everything but the VM and nspawn boots: the inner loop while developing.
test-fast: $(STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -m "not vm and not nspawn"

bench: $(STAMP)
	$(PY) -m bench.mig_bench
	$(PY) -m bench.vgpu_bench
	$(PY) bench/client_startup.py

deb:
	packaging/build-deb.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .hypothesis
