"""Build the simulated libnvidia-ml.so.1 with the machine's C compiler, once per source and Python.

    python -m gpud.sim.nvmlc.build [--header NVML_H] [--print-path]

NVML's header is not part of this project: it comes from an explicit path (`--header`, or
NVML_HEADER, e.g. a CUDA install's include/nvml.h) or, by default, from the Go module proxy as
github.com/NVIDIA/go-nvml at GO_NVML_VERSION (the version nvidia-mig-parted v0.15.0's go.mod
requires), whose pkg/nvml/nvml.h is the header NVIDIA's Go tools are compiled against. The
library is written to CACHE/<key>/ where the key hashes the generator, the C runtime, the header
and the Python it embeds, so a changed source or interpreter gets a new build and an unchanged one
is reused by every test and `gpud-sim exec` (CACHE: GPUD_SIM_CACHE, else $XDG_CACHE_HOME/gpud-sim,
else ~/.cache/gpud-sim). Builds take a lock, so concurrent first uses build once.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass
from pathlib import Path

import gpud.sim.nvmlc.gen as gen

GO_NVML = "github.com/NVIDIA/go-nvml"
GO_NVML_VERSION = "v0.13.3-1"  # required by github.com/NVIDIA/mig-parted v0.15.0 (its go.mod)
SONAME = "libnvidia-ml.so.1"
_HERE = Path(__file__).resolve().parent
_SOURCES = ("gen.py", "runtime.c", "gpud_nvmlc.h")


class BuildError(RuntimeError):
    pass


@dataclass(frozen=True)
class Python:
    """What the library embeds: the interpreter running this build."""

    version: str  # LDVERSION, e.g. "3.11"
    include: Path
    libdir: Path

    @staticmethod
    def current() -> Python:
        ver = sysconfig.get_config_var("LDVERSION") or sysconfig.get_python_version()
        include = Path(sysconfig.get_paths()["include"])
        name = f"libpython{ver}.so"
        dirs = [sysconfig.get_config_var(v) for v in ("LIBDIR", "LIBPL")]
        libdir = next((Path(d) for d in dirs if d and (Path(d) / name).exists()), None)
        if libdir is None or not (include / "Python.h").is_file():
            raise BuildError(f"the simulated libnvidia-ml embeds Python {ver} and needs its headers and {name} "
                             f"(Debian: apt-get install python3-dev; looked in {include} and {', '.join(d for d in dirs if d)})")
        return Python(ver, include, libdir)


def go_binary() -> str | None:
    """This machine's Go, else the toolchain scripts/install-go fetched (make anchors runs it first)."""
    cached = os.path.join(os.environ.get("GPUD_GO_CACHE", "/var/cache/gpud-go"), "go", "bin", "go")
    for cand in ("/usr/local/go/bin/go", cached, shutil.which("go")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


def header_from_go_proxy() -> Path:
    """nvml.h of go-nvml at GO_NVML_VERSION, downloaded into Go's module cache by `go mod download`."""
    go = go_binary()
    if go is None:
        raise BuildError(f"no NVML header: give one with --header or NVML_HEADER (a CUDA install's nvml.h), or "
                         f"install Go so that {GO_NVML}@{GO_NVML_VERSION} can be fetched from the module proxy")
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run([go, "mod", "download", "-json", f"{GO_NVML}@{GO_NVML_VERSION}"], cwd=tmp,
                             capture_output=True, text=True)
    try:
        info = json.loads(out.stdout)
    except json.JSONDecodeError:
        raise BuildError(f"go mod download {GO_NVML}@{GO_NVML_VERSION} failed: {out.stderr.strip()}") from None
    if info.get("Error") or not info.get("Dir"):
        raise BuildError(f"go mod download {GO_NVML}@{GO_NVML_VERSION}: {info.get('Error', 'no directory')}")
    header = Path(info["Dir"]) / "pkg" / "nvml" / "nvml.h"
    if not header.is_file():
        raise BuildError(f"{header}: missing from {GO_NVML}@{GO_NVML_VERSION}")
    return header


def find_header(explicit: str | os.PathLike | None = None) -> Path:
    given = explicit or os.environ.get("NVML_HEADER")
    if given:
        p = Path(given)
        if not p.is_file():
            raise BuildError(f"{p}: no such NVML header")
        return p
    return header_from_go_proxy()


def cache_root() -> Path:
    if os.environ.get("GPUD_SIM_CACHE"):
        return Path(os.environ["GPUD_SIM_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "gpud-sim"


def _key(header: Path, py: Python, cc: str) -> str:
    h = hashlib.sha256()
    for name in _SOURCES:
        h.update((_HERE / name).read_bytes())
    h.update(header.read_bytes())
    h.update(f"{py.version}\0{py.include}\0{py.libdir}\0{cc}".encode())
    return h.hexdigest()[:16]


def compiler() -> str:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BuildError("no C compiler (Debian: apt-get install gcc)")
    return cc


def build(header: str | os.PathLike | None = None) -> Path:
    """The path of the library (built now if this source, header and Python have none yet)."""
    hdr = find_header(header)
    py = Python.current()
    cc = compiler()
    out_dir = cache_root() / "nvmlc" / _key(hdr, py, cc)
    lib = out_dir / SONAME
    if lib.is_file():
        return lib
    out_dir.mkdir(parents=True, exist_ok=True)
    with open(out_dir / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if lib.is_file():
            return lib
        functions = gen.parse(gen.preprocess(hdr, cc))
        (out_dir / "nvml_trampolines.c").write_text(gen.emit(functions))
        (out_dir / "functions.txt").write_text("".join(f.name + "\n" for f in functions))
        tmp = out_dir / f".{SONAME}.{os.getpid()}"
        cmd = [cc, "-shared", "-fPIC", "-O1", "-fvisibility=hidden", "-Wall", "-Wno-deprecated-declarations",
               f"-Wl,-soname,{SONAME}", f"-I{hdr.parent}", f"-I{_HERE}", f"-I{py.include}",
               str(out_dir / "nvml_trampolines.c"), str(_HERE / "runtime.c"),
               f"-L{py.libdir}", f"-lpython{py.version}", f"-Wl,-rpath,{py.libdir}", "-ldl", "-lpthread",
               "-o", str(tmp)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise BuildError(f"compiling the simulated libnvidia-ml failed:\n{' '.join(cmd)}\n{res.stderr}")
        os.replace(tmp, lib)
        link = out_dir / "libnvidia-ml.so"
        if not link.is_symlink():
            link.symlink_to(SONAME)
    return lib


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gpud.sim.nvmlc.build", description=__doc__.split("\n")[0])
    ap.add_argument("--header", help="NVML's nvml.h (default: go-nvml's, from the Go module proxy)")
    ap.add_argument("--print-path", action="store_true", help="print only the library's path")
    args = ap.parse_args(argv)
    try:
        lib = build(args.header)
    except BuildError as e:
        print(f"gpud-sim: {e}", file=sys.stderr)
        return 1
    print(lib if args.print_path else f"built {lib}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
