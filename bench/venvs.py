"""Virtual environments with gpud installed the way `pip install .` and `pip install -e .` do it,
built offline: for the start-up bench (bench/client_startup.py) and the test of the installed
script (tests/cli/test_pip_script.py).

pip's two steps, each done by the real tool: setuptools' PEP 517 hooks build the wheel (build_wheel
or build_editable, the hooks pip calls) from a copy of the tree, run by this interpreter with its
setuptools (the [test] extra); then pip installs that wheel into a fresh venv (`pip --python`,
no index). msgpack (what gpudctl reads the wire with) and msgspec (the wire structs, which it
imports only to fill a field an older gpud did not send) are copied into the venv from this
interpreter's site-packages with their dist-info: they are not what is under test, and the copy
needs no network.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import msgpack
import msgspec

REPO = Path(__file__).resolve().parents[1]
_SKIP = {".git", ".venv", "build", "dist", "out", "__pycache__", ".hypothesis", ".pytest_cache", "tests", "bench"}


def copy_source(dest: Path, source: Path = REPO) -> Path:
    """The files a build reads (the tree without VCS, venv, build outputs and tests), under dest."""
    shutil.copytree(source, dest, ignore=lambda d, names: [n for n in names if n in _SKIP or n.endswith(".egg-info")])
    return dest


def build_wheel(source: Path, out: Path, *, editable: bool = False) -> Path:
    """The wheel pip would build from `source`: `pip install -e` builds the editable one."""
    out.mkdir(parents=True, exist_ok=True)
    hook = "build_editable" if editable else "build_wheel"
    code = f"import setuptools.build_meta as b; print(b.{hook}({str(out)!r}))"
    r = subprocess.run([sys.executable, "-c", code], cwd=source, capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        raise RuntimeError(f"{hook} of {source} failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return out / r.stdout.strip().splitlines()[-1]


def make_venv(path: Path, wheel: Path) -> Path:
    """A fresh venv at `path` with `wheel` installed by pip and msgpack and msgspec beside it; returns its bin/."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, timeout=120)
    py = path / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, timeout=300, capture_output=True)
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               check=True, capture_output=True, text=True).stdout.strip())
    for module in (msgpack, msgspec):
        here = Path(module.__file__ or "").parent
        shutil.copytree(here, site / here.name, ignore=shutil.ignore_patterns("__pycache__"))
        for info in here.parent.glob(f"{here.name}-*.dist-info"):
            shutil.copytree(info, site / info.name)
        subprocess.run([str(py), "-m", "compileall", "-q", str(site / here.name)], check=True, timeout=120)
    return path / "bin"


def env_without_python_vars() -> dict[str, str]:
    """This environment without PYTHON* variables, so what runs sees only what was installed."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
