"""The simulator's NVML as a C library (`libnvidia-ml.so.1`) for programs that are not Python.

Every function NVML's public header declares is exported by a generated trampoline (gen.py) that
hands its raw arguments to an embedded CPython (runtime.c), where bridge.py wraps them in
nvidia-ml-py's own ctypes types and calls the one simulator implementation, FakeNvmlLib
(gpud/sim/nvml_lib.py). build.py finds the header, generates, compiles and caches the library;
`gpud-sim exec` (gpud/sim/exec.py) runs a program with it. docs/nvml-c-library.md has the design.
"""
