"""gpudctl started as a program of its own: what the installed scripts run (pip's, from
packaging/gpudctl-pip.in, and the package's launcher, packaging/gpudctl.in).

Two things happen before the client is imported, and only in a process that is gpudctl alone.

The cyclic garbage collector is off while the client's modules are imported, and on again before
it runs: an import allocates thousands of objects (code, functions, classes, argparse's and re's
tables) and none of them is garbage, yet every 700 allocations start a collection that walks the
young ones: about 1 ms of a `gpudctl status` on a 2-core host, a tenth of what it adds to the bare
interpreter (bench/results/client_startup.md). Reference counting frees as always; `events -f` and
`apply --wait`, which run for long, collect as any program does.

typing_extensions is marked absent. gpudctl imports msgspec only to fill a field an older gpud did
not send (gpud.cli.view), and then msgspec's `_utils` (imported by its C core at every import of
msgspec, 0.18 to 0.23) takes `get_type_hints`, `Required` and `NotRequired` from typing_extensions
when it can and from `typing` otherwise; typing_extensions itself imports `inspect` (with ast, dis
and tokenize), about 12 ms of a gpudctl run on a 2-core host when some other package of the
environment installed it. The client's types use `typing` alone (it imports only the standard
library, msgpack, msgspec and the protocol modules: tests/test_layering.py), so `typing`'s answers are the same.
"""

from __future__ import annotations

import gc
import sys


def run() -> None:
    if "typing_extensions" not in sys.modules:
        # None in sys.modules: `import typing_extensions` raises ModuleNotFoundError (the import system's rule)
        sys.modules["typing_extensions"] = None  # type: ignore[assignment]
    collecting = gc.isenabled()
    gc.disable()
    try:
        from gpud.cli.gpudctl import run as run_gpudctl
    finally:
        if collecting:
            gc.enable()
    run_gpudctl()
