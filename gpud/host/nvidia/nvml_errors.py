"""NVML's failures as gpud reports them: one exception naming the call, the GPU and NVML's code."""

from __future__ import annotations

from typing import Any

import pynvml

# Answers that mean "this index or profile does not exist here": skipped while enumerating.
SKIP = (pynvml.NVML_ERROR_NOT_SUPPORTED, pynvml.NVML_ERROR_INVALID_ARGUMENT)


class NvmlError(Exception):
    """An NVML call failed: which call, on which GPU, with NVML's code and message."""

    def __init__(self, code: int, function: str, pci: str | None = None, message: str = ""):
        self.code = code
        self.function = function
        self.pci = pci
        self.message = message or _error_string(code)
        where = f" on {pci}" if pci else ""
        super().__init__(f"{function}{where}: {self.message} (NVML error {code})")


def _error_string(code: int) -> str:
    try:
        return str(pynvml.NVMLError(code))
    except Exception:  # noqa: BLE001 - the message is a nicety; the code is what matters
        return f"NVML error {code}"


def call(function: str, pci: str | None, fn: Any, *args: Any) -> Any:
    """fn(*args); NvmlError naming `function` and the GPU on failure."""
    try:
        return fn(*args)
    except pynvml.NVMLError as e:
        raise NvmlError(e.value, function, pci) from e
