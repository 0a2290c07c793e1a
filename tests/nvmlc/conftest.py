"""Fixtures for programs that are not Python on the simulated host: the simulator's
libnvidia-ml.so.1 (built once per source and Python, in the gpud-sim cache), a Go program that
speaks NVML only through NVIDIA's go-nvml and go-nvlib (goprobe/), and `gpud-sim exec`."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest

from gpud.sim.cli import create
from gpud.sim.nvmlc import build

GOPROBE = Path(__file__).resolve().parent / "goprobe"


@pytest.fixture(scope="session")
def nvml_so() -> Path:
    """The library; a build that fails is a test failure (make test installs the compiler and
    Python's headers, scripts/install-sysdeps)."""
    return build.build()


@pytest.fixture(scope="session")
def goprobe() -> Path:
    go = build.go_binary()
    if go is None:
        pytest.fail("Go >= 1.26 is needed to build tests/nvmlc/goprobe (scripts/install-anchors says where)")
    h = hashlib.sha256()
    for name in ("main.go", "go.mod", "go.sum"):
        h.update((GOPROBE / name).read_bytes())
    out = build.cache_root() / "goprobe" / h.hexdigest()[:16] / "goprobe"
    if not out.is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(f".goprobe.{os.getpid()}")
        res = subprocess.run(["nice", go, "build", "-ldflags=-extldflags=-Wl,-z,lazy", "-o", str(tmp), "."],
                             cwd=GOPROBE, capture_output=True, text=True, env={**os.environ, "CGO_ENABLED": "1"})
        assert res.returncode == 0, res.stderr
        os.replace(tmp, out)
    return out


@pytest.fixture
def sim_dir(tmp_path):
    """Factory: a simulated host directory (not installed into pynvml: the programs bring their own NVML)."""
    made: list[Path] = []

    def make(*gpus: str, mig_on=()) -> Path:
        d = tmp_path / f"host{len(made)}"
        create(d, list(gpus), list(mig_on))
        made.append(d)
        return d

    return make
