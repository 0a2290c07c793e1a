# Two commands for a fresh machine: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo check test test-fast lint sysdeps anchors kube-apiserver kube-scheduler dra-proto nvmlc bench bench-update reliability deb clean

# A fresh Debian 12 has no python3 venv module: install-sysdeps --base brings it (as root).
$(STAMP): pyproject.toml
	scripts/install-sysdeps --base
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

# NVIDIA's own tools the tests run on the simulated host (scripts/install-anchors: pinned, go install,
# into $(GPUD_ANCHORS)/bin; what the module proxy refuses is recorded there, and those tests say so).
GPUD_ANCHORS ?= /var/cache/gpud-anchors
export GPUD_ANCHORS
anchors:
	scripts/install-anchors

# A real kube-apiserver (v1.34.12) and etcd (v3.6.4) for the Kubernetes protocol tests, built once from
# the Go module proxy into $(GPUD_ANCHORS)/kube/ (cached; a failed build is recorded there and those tests
# skip with its reason).
kube-apiserver:
	scripts/install-kube-apiserver

# A real kube-apiserver and kube-scheduler of one release (v1.36.3) for the DRA tests (tests/dra/):
# the scheduler allocates claims from gpud's ResourceSlices. Built once into $(GPUD_ANCHORS)/kube/v1.36.3
# (about 25 minutes on 2 cores the first time; cached; a failed build is recorded and those tests skip).
kube-scheduler:
	scripts/install-kube-scheduler

# The kubelet's DRA and plugin-registration gRPC code, generated from k8s.io/kubelet's .proto files
# into gpud/kube_proto/ (ignored by git) with grpcio-tools.
dra-proto: $(STAMP)
	scripts/gen-dra-proto $(PY)

# The simulator's libnvidia-ml.so.1 (built into the gpud-sim cache; `gpud-sim exec` builds it on first use too).
nvmlc: $(STAMP)
	$(PY) -m gpud.sim.nvmlc.build

# The linter and the type checker (configured in pyproject.toml), before any test runs.
lint: $(STAMP) dra-proto
	$(VENV)/bin/ruff check gpud tests bench setup.py
	$(VENV)/bin/mypy

# The inner loop while developing: lint, then every test that runs no gpud process, compiled program,
# kube-apiserver, QEMU or nspawn (those families are pytest markers, pyproject.toml), on every core.
# Needs neither root nor apt nor the network once .venv exists; a few minutes on 2 cores.
CHECK_SKIPS := not (vm or nspawn or daemon or tools or apiserver or reliability or gpu)
check: $(STAMP) lint
	$(PY) -m pytest -q -p no:cacheprovider -n auto -m "$(CHECK_SKIPS)"

test: $(STAMP) dra-proto lint sysdeps anchors kube-apiserver kube-scheduler nvmlc
	$(PY) -m pytest -q -p no:cacheprovider

# Everything but the VM and nspawn boots: the inner loop while developing.
test-fast: $(STAMP) dra-proto lint anchors kube-apiserver kube-scheduler nvmlc
	$(PY) -m pytest -q -p no:cacheprovider -m "not vm and not nspawn"

# Benchmarks write to out/ (untracked); `make bench-update` refreshes the committed bench/results/
# that the README links and quotes.
BENCH_OUT ?= out
bench: $(STAMP) anchors nvmlc
	mkdir -p $(BENCH_OUT)
	$(PY) -m bench.mig_bench -o $(BENCH_OUT)/mig.md
	$(PY) -m bench.vgpu_bench -o $(BENCH_OUT)/vgpu.md
	$(PY) bench/client_startup.py -o $(BENCH_OUT)/client_startup.md
	$(PY) -m bench.status_bench -o $(BENCH_OUT)/status.md
	$(PY) -m bench.nvml_reads -o $(BENCH_OUT)/nvml-reads.md
	$(PY) -m bench.scale_bench -o $(BENCH_OUT)/scale.md
	$(PY) -m bench.check_bench -o $(BENCH_OUT)/check.md
	$(PY) -m bench.lease_bench -o $(BENCH_OUT)/leases.md
	$(PY) -m bench.daemon_memory -o $(BENCH_OUT)/daemon-memory.md

bench-update:
	$(MAKE) bench BENCH_OUT=bench/results

# The reliability soak at full scale: rewrites bench/results/reliability.md (`make test` runs it at CI scale).
reliability: $(STAMP)
	$(PY) -m bench.reliability

deb:
	packaging/build-deb.sh

clean:
	rm -rf $(VENV) build dist *.egg-info .hypothesis
