"""`gpud`: the daemon (gpud.daemon), or `gpud qualify ...`, the host's qualification
(gpud.qualify.main). Only this dispatch knows both; neither imports the other."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["qualify"]:
        from gpud.qualify.main import main as qualify_main

        return qualify_main(argv[1:])
    from gpud.daemon import main as daemon_main

    return daemon_main(argv)


if __name__ == "__main__":
    sys.exit(main())
