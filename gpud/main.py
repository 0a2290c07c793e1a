"""`gpud`: the daemon (gpud.daemon), `gpud qualify ...`, the host's qualification
(gpud.qualify.main), or `gpud check ...`, the daemon's check with no daemon running
(gpud.check_offline). Only this dispatch knows them all; none imports another."""

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
    """Import asyncio as on a Python built without `ssl`: asyncio imports ssl at its own import only
    to offer TLS, and ssl maps OpenSSL's libcrypto and libssl (about 4.5 MiB resident here, 3.7 MiB
    on the H200, more than a fifth of the daemon's memory above Python + NVML; docs/internals.md,
    bench/results/daemon-memory.md). asyncio's modules then hold `ssl = None` (their own fallback:
    a TLS connection would fail with "Python ssl module is not available"); `import ssl` itself
    works again afterwards, for whatever else wants it. False when asyncio or ssl is already
    imported (nothing to save)."""
    if "asyncio" in sys.modules or "ssl" in sys.modules:
        return False
    sys.modules["ssl"] = None  # type: ignore[assignment]  # `import ssl` raises ImportError meanwhile
    try:
        import asyncio  # noqa: F401
    finally:
        del sys.modules["ssl"]
    return True


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["qualify"]:
        from gpud.qualify.main import main as qualify_main

        return qualify_main(argv[1:])
    if argv[:1] == ["check"]:
        from gpud.check_offline import main as check_main

        return check_main(argv[1:])
    from gpud.host.systemd.early_signals import hold_sighup

    hold_sighup()  # before the daemon's imports: a reload asked for during start-up must not kill it
    if not daemon_needs_tls(argv):
        import_asyncio_without_tls()
    from gpud.daemon import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
