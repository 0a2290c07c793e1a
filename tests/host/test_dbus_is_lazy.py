"""dbus-fast is loaded only when a drain or a reboot runs: a daemon that uses neither (no GPU
client units, no reboot policy) must not pay for importing it."""

from __future__ import annotations

import subprocess
import sys


def test_importing_the_systemd_adapters_does_not_load_dbus_fast():
    code = ("import sys; import gpud.host.systemd.sd_notify, gpud.host.systemd.unit_drain, gpud.host.systemd.logind, gpud.daemon; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'dbus_fast'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_drain_loads_dbus_fast():
    """The check above is not vacuous: asking a drainer for a unit's state reaches for dbus-fast
    (and fails on a bus that is not there)."""
    code = ("import asyncio, sys\n"
            "from gpud.host.systemd.unit_drain import UnitDrainer\n"
            "d = UnitDrainer(bus_address='unix:path=/nonexistent/gpud-test-bus')\n"
            "try:\n    asyncio.run(d.active_state('x.service'))\nexcept Exception as e:\n    print(type(e).__name__)\n"
            "print('dbus_fast' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "True"
