"""asyncio without TLS for a daemon that talks TLS to no one.

asyncio imports `ssl` at its own import, only to offer TLS connections; ssl maps OpenSSL's libcrypto
and libssl, about 4 MiB resident (3.7 MiB on the lent H200: bench/results/h200-status-timing.md),
a fifth of what the daemon holds above Python + NVML. In its default mode gpud serves a Unix socket
and talks to local services only (NVML, sysfs, udev, D-Bus, inotify, its hooks), so both entry
points (gpud.main, the program /usr/bin/gpud runs, and `python -m gpud.daemon`) import asyncio
the way a Python built without ssl has it, unless an option of Kubernetes mode is given.
What the daemon loads when: docs/internals.md.
"""

from __future__ import annotations

import sys

# The daemon's options that reach a cluster over TLS (and their argparse abbreviations, `=VALUE`
# forms): --kube-node, --kubeconfig, --kube-namespace, --dra, --dra-driver. Any argument starting
# so keeps TLS: a false match costs only the memory below, a missed one would cost the cluster.
TLS_OPTION_PREFIXES = ("--k", "--dr")


def daemon_needs_tls(argv: list[str]) -> bool:
    """Whether a daemon started with `argv` may talk TLS (Kubernetes mode): otherwise it serves a
    Unix socket and talks to local services only (NVML, sysfs, udev, D-Bus, inotify)."""
    return any(arg.startswith(TLS_OPTION_PREFIXES) for arg in argv)


def import_asyncio_without_tls() -> bool:
    """Import asyncio as on a Python built without `ssl`: its modules then hold `ssl = None`, their
    own fallback (a TLS connection would fail with "Python ssl module is not available"); `import
    ssl` itself works again afterwards, for whatever else wants it. False when asyncio or ssl is
    already imported (nothing to save)."""
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        return False
    sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` raises ImportError meanwhile
    try:
        import asyncio  # noqa: F401
    finally:
        del sys.modules["ssl"]
    return True
