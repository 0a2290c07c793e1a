"""`gpud`: the daemon (gpud.daemon), `gpud qualify ...`, the host's qualification
(gpud.qualify.main), or `gpud check ...`, the daemon's check with no daemon running
(gpud.check_offline). Only this dispatch knows them all; none imports another."""

from __future__ import annotations

import sys

from gpud.asyncio_tls import daemon_needs_tls, import_asyncio_without_tls


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
    if not daemon_needs_tls(argv):  # before the daemon's imports, as gpud.daemon does under python -m
        import_asyncio_without_tls()
    from gpud.daemon import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
