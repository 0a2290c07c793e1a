"""Issue 29 item 1: under --sim every host service gpud uses (systemd's unit manager for drains and
the CDI refresh, logind for a reboot) is the simulated host's (gpud/sim/services.py), counted in
`gpud-sim stats`, and nothing reaches the real machine's system bus.

The system bus here is a listening socket the test owns ($DBUS_SYSTEM_BUS_ADDRESS points at it):
any D-Bus client that tried would connect to it first. The nspawn test
(tests/systemd/test_daemon_service.py) shows the same with a real systemd and dbus-daemon.
"""

from __future__ import annotations

import json
import socket
import threading

import pytest

from tests.scenarios.definitions import layout, mig
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

GPU0 = "0000:18:00.0"
MIG_ON = layout(mig([0], {"7g.80gb": 1}), policy={"reboot": "allow", "drain-units": ["gpu-client.service"]})


class BusTrap:
    """A Unix socket standing where the system bus would be; counts the connections made to it."""

    def __init__(self, path) -> None:
        self.path = str(path)
        self.accepted = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(8)
        self.sock.settimeout(0.2)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()


@pytest.fixture
def bus_trap(tmp_path, monkeypatch):
    trap = BusTrap(tmp_path / "system_bus_socket")
    monkeypatch.setenv("DBUS_SYSTEM_BUS_ADDRESS", f"unix:path={trap.path}")
    yield trap
    trap.close()


def services(d) -> dict:
    r = d.sim("stats", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["services"]


def test_drain_cdi_refresh_and_reboot_go_to_the_simulated_host(daemon, bus_trap):
    """An A100 NVSwitch host whose Fabric Manager is stopped refuses the reset MIG needs: with
    `reboot: allow` gpud asks logind for a reboot, after draining gpu-client.service around the
    reset and restarting the CDI refresh unit after the MIG change."""
    d = daemon(["a100-80gb:2"], "version: v1\n", nvswitch=True, fabric_manager="stopped")
    for unit in ("gpu-client.service", "nvidia-cdi-refresh.service"):
        assert d.sim("unit", "add", unit).returncode == 0
    d.config.write_text(MIG_ON)
    assert d.ctl("reload").returncode == 0
    d.ctl("apply", "--wait", "--timeout", "60")
    wait_until(lambda: "reboot requested" in next(g for g in d.status()["gpus"] if g["pci"] == GPU0)["message"],
               what="the reboot request")
    # a pass may still be draining: read once every stop has had its start
    svc = wait_until(lambda: (s := services(d))["calls"].get("systemd1.StopUnit", 0) ==
                     s["calls"].get("systemd1.StartUnit") and s, what="the drained unit started again")
    events = d.events()
    assert d.stop() == 0  # no pass runs on while the records are compared
    svc = services(d)
    # each pass until the host goes down asks again (a real logind is already shutting down then)
    asked = [e for e in events if e["kind"] == "reboot" and "reboot requested" in e["message"]]
    assert svc["calls"]["login1.Reboot"] == len(svc["reboots"]) >= len(asked) >= 1
    assert all(r.startswith(f"{GPU0}: ") for r in svc["reboots"])
    # drained around the refused reset, started again afterwards
    assert svc["calls"]["systemd1.StopUnit"] >= 1
    assert svc["units"] == {"gpu-client.service": "active", "nvidia-cdi-refresh.service": "active"}
    assert any(e["kind"] == "drain" and "stopping gpu-client.service" in e["message"] for e in events)
    assert bus_trap.accepted == 0
    # gpud's own marker names the simulated boot: `gpud-sim reboot` settles the request
    marker = json.loads((d.state_dir / "reboot-request.json").read_text())
    assert marker["boot_id"] == d.sim_state()["boot_id"]


def test_cdi_refresh_restarts_the_simulated_unit_only(daemon, bus_trap):
    d = daemon(["h100-80gb"], "version: v1\n")
    assert d.sim("unit", "add", "nvidia-cdi-refresh.service").returncode == 0
    d.config.write_text(layout(mig([0], {"1g.10gb": 7})))
    assert d.ctl("reload").returncode == 0
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    wait_until(lambda: services(d)["calls"].get("systemd1.RestartUnit") == 1, what="the CDI refresh")
    assert bus_trap.accepted == 0


def test_without_the_unit_nothing_is_restarted_and_no_bus_is_asked(daemon, bus_trap):
    d = daemon(["h100-80gb"], layout(mig([0], {"1g.10gb": 7})))
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    svc = wait_until(lambda: (s := services(d))["calls"].get("systemd1.LoadUnit") and s, what="the CDI unit looked up")
    assert "systemd1.RestartUnit" not in svc["calls"] and svc["units"] == {}
    assert bus_trap.accepted == 0


def test_unit_names_are_checked(daemon):
    d = daemon(["h100-80gb"], "version: v1\n")
    r = d.sim("unit", "add", "no unit")
    assert r.returncode == 1 and "is not a unit name" in r.stderr
    r = d.sim("unit", "remove", "absent.service")
    assert r.returncode == 1 and "no unit absent.service" in r.stderr
