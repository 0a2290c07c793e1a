"""nvidia-smi, asked read-only: `nvidia-smi -q` for what NVML does not say as plainly.

gpud runs nvidia-smi only to read: the driver version it prints, and per GPU the sections a
qualification reads (`Persistence Mode`, `MIG Mode`, `GPU Reset Status` where the driver prints it,
`Fabric`). `-q` prints a tree of `Key : Value` lines indented by four spaces per level, one
`GPU 00000000:00:06.0` section per GPU (tests/fixtures/h200-qualify/nvidia-smi-q.txt is a real
H200 answer, driver 580.159.04). A section the driver does not print is absent, never guessed.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from typing import Any

from msgspec import Struct

from gpud.pci import normalize_pci

_GPU_HEADING = re.compile(r"^GPU ([0-9A-Fa-f]+:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2}\.[0-7])$")
Tree = dict[str, Any]  # key -> str value or a nested Tree


class SmiQuery(Struct, frozen=True):
    path: str
    driver_version: str | None
    cuda_version: str | None
    gpus: dict[str, Tree]  # normalized PCI address -> that GPU's section


class NvidiaSmiError(Exception):
    pass


def parse_query(text: str) -> tuple[Tree, dict[str, Tree]]:
    """`nvidia-smi -q` text -> (top-level keys, {pci: GPU section}). The first of a repeated key wins."""
    top: Tree = {}
    gpus: dict[str, Tree] = {}
    stack: list[tuple[int, Tree]] = [(-1, top)]
    for raw in text.splitlines():
        if not raw.strip() or raw.lstrip().startswith("="):
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        line = raw.strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else top
        key, sep, value = line.partition(":")
        heading = _GPU_HEADING.match(line)
        if heading and indent == 0:
            section: Tree = {}
            gpus[normalize_pci(heading.group(1)) or heading.group(1).lower()] = section
            stack = [(-1, top), (indent, section)]
            continue
        if sep and value.strip():
            parent.setdefault(key.strip(), value.strip())
        elif sep and not value.strip() and key.strip() and not line.endswith(":"):
            parent.setdefault(key.strip(), "")
        else:
            section = {}
            name = key.strip() if sep else line
            if name not in parent:
                parent[name] = section
            stack.append((indent, section))
    return top, gpus


class NvidiaSmi:
    def __init__(self, path: str | None = None, *, timeout: float = 60.0):
        self.configured = path
        self.timeout = timeout

    def find(self) -> str | None:
        if self.configured:
            return self.configured if os.access(self.configured, os.X_OK) else None
        return shutil.which("nvidia-smi")

    def query(self) -> SmiQuery:
        """Run `nvidia-smi -q` (reads only); NvidiaSmiError with its message when it fails."""
        path = self.find()
        if path is None:
            raise NvidiaSmiError(f"nvidia-smi not found ({self.configured or 'not on PATH'})")
        try:
            r = subprocess.run([path, "-q"], capture_output=True, text=True, timeout=self.timeout,
                               errors="replace")
        except subprocess.TimeoutExpired as e:
            raise NvidiaSmiError(f"{path} -q did not answer within {self.timeout:g} s") from e
        except OSError as e:
            raise NvidiaSmiError(f"{path} -q: {e}") from e
        if r.returncode != 0:
            msg = (r.stdout.strip() or r.stderr.strip()).splitlines()
            raise NvidiaSmiError(f"{path} -q exited {r.returncode}: {msg[0] if msg else 'no output'}")
        top, gpus = parse_query(r.stdout)
        driver = top.get("Driver Version")
        cuda = top.get("CUDA Version")
        return SmiQuery(path=path, driver_version=driver if isinstance(driver, str) else None,
                        cuda_version=cuda if isinstance(cuda, str) else None, gpus=gpus)
