"""The Python half of the simulated libnvidia-ml.so.1: raw C arguments -> FakeNvmlLib.

runtime.c calls `setup` once with the generated signature table ("name|ctype|ctype...") and the C
size of every type a parameter points to, then `call(index, args)` for each NVML call, with each
argument as the unsigned integer its bits make (an address, a handle, an enum, a count). Each
argument is wrapped the way nvidia-ml-py would have passed it: a pointer to a struct becomes a
ctypes pointer to nvidia-ml-py's own structure class for that C type, a pointer to a scalar a
pointer to the ctypes scalar, `const char *` a c_char_p, a handle its address. FakeNvmlLib (one
per process, serving GPUD_SIM_DIR) then runs exactly as under pynvml, so there is one simulator.

A function FakeNvmlLib does not implement answers NVML_ERROR_NOT_SUPPORTED and is still counted in
the host's call counters (`gpud-sim stats`), so a tool's unserved calls show up. A function whose
nvidia-ml-py structure differs in size from the header's answers NVML_ERROR_UNKNOWN (and says so
once on stderr) rather than write past the caller's buffer; `mismatches()` lists them for tests.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pynvml

import gpud.sim.nvml_lib as nvml_lib
from gpud.sim.state import locked

NOT_SUPPORTED = pynvml.NVML_ERROR_NOT_SUPPORTED
UNKNOWN = pynvml.NVML_ERROR_UNKNOWN

_SCALARS: dict[str, type] = {
    "char": ctypes.c_char,
    "int": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "unsigned long": ctypes.c_ulong,
    "unsigned long long": ctypes.c_ulonglong,
}
# nvidia-ml-py classes whose names do not follow its c_<C type> rule.
_ALIASES = {"nvmlDeviceAttributes_t": "c_nvmlDeviceAttributes",
            # the header's V type is the v3 struct; nvidia-ml-py's V alias is still v2
            "nvmlGpuFabricInfoV_t": "c_nvmlGpuFabricInfo_v3_t"}


class _ProcessInfoV1(ctypes.Structure):
    """nvmlProcessInfo_v1_t (the unversioned nvmlDeviceGetComputeRunningProcesses's), which
    nvidia-ml-py does not define: its fields as NVML's header declares them."""

    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]


# Header types nvidia-ml-py has no class for.
_OWN: dict[str, type] = {"nvmlProcessInfo_v1_t": _ProcessInfoV1}

Maker = Callable[[int], Any]


@dataclass
class _Function:
    name: str
    makers: list[Maker]
    problem: str | None  # why the function cannot be served safely (a size mismatch)


_functions: list[_Function] = []
_lib: nvml_lib.FakeNvmlLib | None = None
_reported: set[str] = set()


def ctypes_type(ctype: str, c_sizes: dict[str, int]) -> tuple[type | None, str | None]:
    """The ctypes type nvidia-ml-py uses for a pointed-to C type, or (None, why not)."""
    if ctype in _SCALARS:
        return _SCALARS[ctype], None
    names = [_ALIASES[ctype]] if ctype in _ALIASES else [f"c_{ctype}", ctype]
    cls = _OWN.get(ctype) or next((getattr(pynvml, n) for n in names if hasattr(pynvml, n)), None)
    size = c_sizes.get(ctype)
    if cls is None:
        # An enum or integer typedef: nvidia-ml-py passes those as c_uint / c_ulonglong.
        cls = {4: ctypes.c_uint, 8: ctypes.c_ulonglong}.get(size or 0)
        if cls is None:
            return None, f"nvidia-ml-py has no type for {ctype} ({size} bytes)"
    if size is not None and ctypes.sizeof(cls) != size:
        return None, f"{ctype} is {size} bytes in the header, nvidia-ml-py's {cls.__name__} {ctypes.sizeof(cls)}"
    return cls, None


def _maker(ctype: str, c_sizes: dict[str, int]) -> tuple[Maker, str | None]:
    if not ctype.endswith("*"):
        if ctype == "int":
            return (lambda v: v - (1 << 32) if v >= 1 << 31 else v), None
        return (lambda v: v), None
    base = ctype[:-1].replace("const ", "").strip()
    if base == "char":
        if ctype.startswith("const "):
            return (lambda v: ctypes.c_char_p(v) if v else None), None
        return (lambda v: v or None), None
    if base == "void":
        return (lambda v: v or None), None
    cls, problem = ctypes_type(base, c_sizes)
    if cls is None:
        return (lambda v: None), problem
    ptr: Any = ctypes.POINTER(cls)
    return (lambda v: ctypes.cast(v, ptr) if v else None), None


def setup(signatures: list[str], c_sizes: dict[str, int]) -> None:
    """Called once by runtime.c with the generated tables."""
    global _lib
    implemented = set(nvml_lib.function_names())
    _functions.clear()
    for sig in signatures:
        name, *ctypes_ = sig.split("|")
        makers: list[Maker] = []
        problems: list[str] = []
        for ct in ctypes_:
            m, problem = _maker(ct, c_sizes)
            makers.append(m)
            if problem:
                problems.append(problem)
        _functions.append(_Function(name, makers, "; ".join(problems) if problems and name in implemented else None))
    if _lib is None:
        _lib = nvml_lib.FakeNvmlLib(os.environ["GPUD_SIM_DIR"])


def mismatches() -> dict[str, str]:
    """Implemented functions that cannot be served because a type differs from the header's."""
    return {f.name: f.problem for f in _functions if f.problem}


def _count_unserved(name: str) -> None:
    assert _lib is not None
    with locked(_lib.host_dir) as state:
        state.calls[name] = state.calls.get(name, 0) + 1


def call(index: int, raw: tuple[int, ...]) -> int:
    f = _functions[index]
    assert _lib is not None
    if f.problem is not None:
        if f.name not in _reported:
            _reported.add(f.name)
            print(f"libnvidia-ml.so.1 (gpud-sim): {f.name} not served: {f.problem}", file=sys.stderr)
        return UNKNOWN
    try:
        fn = getattr(_lib, f.name)
    except AttributeError:
        _count_unserved(f.name)
        return NOT_SUPPORTED
    try:
        return int(fn(*(m(v) for m, v in zip(f.makers, raw, strict=True))))
    except Exception as exc:  # noqa: BLE001 - a bug of the simulator must not take the host program down
        if f.name not in _reported:
            _reported.add(f.name)
            print(f"libnvidia-ml.so.1 (gpud-sim): {f.name} failed: {exc!r}", file=sys.stderr)
        return UNKNOWN


def error_string(code: int) -> bytes:
    assert _lib is not None
    return bytes(_lib.nvmlErrorString(code))
