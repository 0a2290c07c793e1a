"""What every fake NVML function shares: the C calling convention as seen from Python.

A fake function (gpud.sim.nvml_lib, gpud.sim.nvml_mig, the replay in gpud.sim.replay_nvml) is
registered under its C symbols with `@nvml(...)`, reads its arguments through these helpers (a
pynvml caller passes ctypes objects and byref() arguments, a C caller through gpud.sim.nvmlc passes
pointers), and answers an NVML return code: returning one, or raising `Ret(code)` from any depth.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import pynvml

SUCCESS = pynvml.NVML_SUCCESS

# nvmlErrorString's words, as the real library (580.159.04) gives them for every code it has
# (tests/fixtures/h200/2026-12-04/nvml-real.json); any other code is "Unknown Error".
ERROR_STRINGS = {
    0: "Success",
    1: "Uninitialized",
    2: "Invalid Argument",
    3: "Not Supported",
    4: "Insufficient Permissions",
    5: "Already Initialized",
    6: "Not Found",
    7: "Insufficient Size",
    8: "Insufficient External Power",
    9: "Driver Not Loaded",
    10: "Timeout",
    11: "Interrupt Request Issue",
    12: "NVML Shared Library Not Found",
    13: "Function Not Found",
    14: "Corrupted infoROM",
    15: "GPU is lost",
    16: "GPU requires reset",
    17: "GPU access blocked by the operating system",
    18: "Driver/library version mismatch",
    19: "In use by another client",
    20: "Insufficient Memory",
    21: "No data",
    22: "vGPU ECC not supported",
    23: "Insufficient Resources",
    24: "Invalid Frequency",
    25: "Argument version mismatch",
    26: "Requested functionality has been deprecated",
    27: "System is not in ready state",
    28: "No supported GPUs were found",
    29: "Resource not in correct state to perform requested operation",
    999: "Unknown Error",
}


class Ret(Exception):
    """Raised inside a fake function to return an NVML error code."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


# --- ctypes helpers -----------------------------------------------------------------------------

_CArgObject = type(ctypes.byref(ctypes.c_int()))


def as_int(x: Any) -> int:
    return int(x.value) if hasattr(x, "value") else int(x)


def deref(ref: Any) -> Any:
    """The ctypes object an output/input pointer argument refers to (byref or pointer())."""
    if ref is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    if isinstance(ref, ctypes._Pointer):
        if not ref:
            raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
        return ref.contents
    if isinstance(ref, ctypes.Array):
        return ref
    raise TypeError(f"expected a pointer argument, got {type(ref).__name__}")


def c_array(ref: Any) -> Any:
    """A caller's array argument, indexable: a ctypes array (pynvml) or a pointer to its first
    element (a C caller, through gpud.sim.nvmlc)."""
    if ref is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if isinstance(ref, _CArgObject):
        return ref._obj  # type: ignore[attr-defined]
    return ref


def c_addr(handle: Any) -> int | None:
    if handle is None:
        return None
    if isinstance(handle, int):
        return handle
    if isinstance(handle, (ctypes._Pointer, ctypes.c_void_p)):
        return ctypes.cast(handle, ctypes.c_void_p).value
    raise TypeError(f"expected an NVML handle, got {type(handle).__name__}")


def set_ptr(obj: Any, addr: int, offset: int = 0) -> None:
    """Store a handle (pointer value) into a ctypes pointer object or a pointer-typed field."""
    ctypes.c_void_p.from_address(ctypes.addressof(obj) + offset).value = addr


def write_str(buf: Any, length: Any, text: str) -> None:
    data = text.encode() + b"\0"
    if buf is None:
        raise Ret(pynvml.NVML_ERROR_INVALID_ARGUMENT)
    if len(data) > as_int(length):
        raise Ret(pynvml.NVML_ERROR_INSUFFICIENT_SIZE)
    ctypes.memmove(buf, data, len(data))


def placement_arg(placement: Any) -> tuple[int, int]:
    """(start, size) of a placement the caller passed by pointer, as NVML's C API takes it."""
    if isinstance(placement, ctypes.Structure):
        raise TypeError("placement passed by value: the real libnvidia-ml reads a pointer here and crashes; "
                        "pass byref(placement)")
    pl = deref(placement)
    return int(pl.start), int(pl.size)


def check_version(info: Any, expected: int) -> None:
    if any(f[0] == "version" for f in type(info)._fields_) and info.version != expected:
        raise Ret(pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH)


# --- the registry of C symbols ----------------------------------------------------------------

F = TypeVar("F", bound=Callable[..., Any])

# C symbol -> the fake function that answers it (called as fn(lib, state, *C arguments)).
IMPLS: dict[str, Callable[..., Any]] = {}

# C symbols whose work waits (an event wait): counted and checked for faults under the host lock,
# run without it, so a wait never holds up other processes' NVML calls.
UNLOCKED: set[str] = set()


def nvml(*names: str, unlocked: bool = False, by_symbol: bool = False) -> Callable[[F], F]:
    """Register the decorated function under `names` (default: its own name). With `by_symbol`
    it is called with `symbol=` the C symbol it answers, for the calls whose versions differ."""

    def deco(fn: F) -> F:
        for n in names or (fn.__name__,):
            IMPLS[n] = functools.partial(fn, symbol=n) if by_symbol else fn
            if unlocked:
                UNLOCKED.add(n)
        return fn

    return deco


def function_names() -> list[str]:
    """C symbols the fake library implements (for `gpud-sim fault` validation)."""
    return sorted(IMPLS)


def fault_matches(fault_function: str, symbol: str) -> bool:
    """A fault named after the pynvml-level name also hits its versioned C symbol."""
    return symbol == fault_function or symbol in (fault_function + "_v2", fault_function + "_v3",
                                                  fault_function + "V")

