"""The packaged gpud.service under a real systemd, on a simulated host (gpud --sim): readiness,
STATUS, socket permissions, a MIG change triggered by a reload that drains the simulated host's GPU
client and never the real one (nothing of a simulated host reaches the real system bus: a
dbus-monitor of that bus sees no call of gpud's), the watchdog, and a stop that leaves the hardware
as it is.

The only change to the shipped unit is a drop-in pointing ExecStart at the simulator (kept in
the state directory, which the sandbox lets gpud write)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.nspawn

PROC_CHILDREN = (Path(__file__).resolve().parents[1] / "support" / "proc_children.py").read_text()

SIM = "/var/lib/gpud/sim"
DROPIN = f"""[Service]
ExecStart=
ExecStart=/usr/bin/gpud --config /etc/gpud/layout.yaml --socket /run/gpud/gpud.sock --state-dir /var/lib/gpud --sim {SIM}
# a stalled daemon is killed soon after the watchdog fires (the test stalls its event loop)
TimeoutAbortSec=5s
"""
# A GPU client as kubelet is, ordered after gpud. The real one in the container must stay untouched:
# gpud on a simulated host drains the simulated host's unit of the same name.
CLIENT = "[Unit]\nAfter=gpud.service\n[Service]\nExecStart=/usr/bin/sleep infinity\n"
# every message on the container's system bus, in the journal of this unit
BUS_MONITOR = ["systemd-run", "--unit=bus-monitor", "dbus-monitor", "--system"]
# the D-Bus methods gpud calls on a real host's systemd and logind
HOST_METHODS = ("member=StopUnit", "member=StartUnit", "member=RestartUnit", "member=Subscribe", "member=Reboot")
SPLIT = """version: v1
selected: split
layouts:
  split:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 7}
policy:
  drain-units: [gpu-client.service]
"""


@pytest.fixture(scope="module")
def gpud(installed):
    c = installed
    c.run(["gpud-sim", "create", SIM, "--gpu", "h100-80gb:2"])
    for unit in ("gpu-client.service", "nvidia-cdi-refresh.service"):
        c.run(["gpud-sim", "unit", SIM, "add", unit])
    c.write("/etc/systemd/system/gpud.service.d/sim.conf", DROPIN)
    c.write("/etc/systemd/system/gpu-client.service", CLIENT)
    c.run(["systemctl", "daemon-reload"])
    c.run(["systemctl", "start", "gpu-client.service"])
    r = c.run(["systemctl", "start", "gpud.service"], check=False, timeout=120)
    if r.returncode != 0:
        log = c.run(["journalctl", "-u", "gpud.service", "-o", "cat", "--no-pager"], check=False).stdout
        pytest.fail(f"gpud.service did not start:\n{log[-3000:]}")
    yield c
    c.run(["systemctl", "stop", "gpud.service", "gpu-client.service", "bus-monitor.service"], check=False)


def sim_show(c) -> str:
    return c.run(["gpud-sim", "show", SIM]).stdout


def wait_status_text(c, unit: str, expected: str, timeout: float = 60.0) -> dict[str, str]:
    """Poll the unit's StatusText until it is `expected` (the daemon updates STATUS= as its first
    pass moves on: "2 GPUs: starting" first); fails with the last text seen after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        st = c.show(unit, "ActiveState", "StatusText", "Type", "NotifyAccess")
        if st.get("StatusText") == expected or time.monotonic() >= deadline:
            return st
        time.sleep(0.5)


def procs(c, needle: str) -> list[tuple[int, int, int]]:
    """(pid, parent, nice) of the container's processes whose command line has `needle`, read from
    its /proc (tests/support/proc_children.py: a minimal Debian has no pgrep or ps)."""
    out = c.run(["python3", "-c", PROC_CHILDREN, "any", needle]).stdout
    return [(int(a), int(b), int(n)) for a, b, n in (line.split() for line in out.splitlines())]


def replicas(c) -> list[tuple[int, int, int]]:
    return procs(c, "gpud.api.status_replica")


def wait_until_ok(c, argv: list[str], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while c.run(argv, check=False).returncode != 0:
        assert time.monotonic() < deadline, argv
        time.sleep(0.2)


def test_active_only_after_ready_with_status_and_socket(gpud):
    c = gpud
    st = c.show("gpud.service", "ActiveState", "Type")
    assert st["ActiveState"] == "active" and st["Type"] == "notify"
    # The shipped layout (as-is, no entries) leaves both simulated GPUs untouched; the text is
    # compared with `systemctl status` only once it has settled on that, so it cannot change between.
    st = wait_status_text(c, "gpud.service", "2 GPUs: 2 unmanaged")
    assert st["StatusText"] == "2 GPUs: 2 unmanaged", st
    assert st["ActiveState"] == "active", st
    # READY=1 came after the socket was bound: it answers at once, no retry
    assert c.run(["gpudctl", "status"]).returncode == 0
    assert f'Status: "{st["StatusText"]}"' in c.run(["systemctl", "status", "--no-pager", "gpud.service"],
                                                    check=False).stdout
    mode = c.run(["stat", "-c", "%a %U %G", "/run/gpud/gpud.sock"]).stdout.split()
    assert mode == ["660", "root", "gpud"]
    # the status replica runs in the unit's sandbox, beside it, no more open (gpud/api/status_feed.py)
    wait_until_ok(c, ["stat", "/run/gpud/gpud-status.sock"])
    assert c.run(["stat", "-c", "%a %U %G", "/run/gpud/gpud-status.sock"]).stdout.split() == mode
    main = c.show("gpud.service", "MainPID")["MainPID"]
    ((_, parent, nice),) = replicas(c)
    (daemon,) = [row for row in procs(c, "") if row[0] == int(main)]
    assert parent == int(main) and nice == daemon[2] - 5, (nice, daemon)  # the unit lets it (CAP_SYS_NICE)


def test_group_member_may_read_but_not_change(gpud):
    c = gpud
    gid = c.run(["getent", "group", "gpud"]).stdout.split(":")[2]
    member = ["setpriv", "--reuid=4242", "--regid=4242", f"--groups={gid}", "--inh-caps=-all"]
    stranger = ["setpriv", "--reuid=4243", "--regid=4243", "--clear-groups", "--inh-caps=-all"]
    assert c.run([*member, "gpudctl", "status"], check=False).returncode == 0
    r = c.run([*member, "gpudctl", "apply"], check=False)
    assert r.returncode != 0 and "gpudctl: " in (r.stdout + r.stderr)
    r = c.run([*stranger, "gpudctl", "status"], check=False)
    assert r.returncode != 0 and "ermission denied" in r.stderr


def test_reload_drains_the_simulated_client_and_nothing_reaches_the_system_bus(gpud):
    c = gpud
    pid_before = c.show("gpu-client.service", "MainPID")["MainPID"]
    cursor = c.journal_cursor()
    c.run(BUS_MONITOR)
    c.follow_journal("bus-monitor.service", "NameAcquired", after=cursor, timeout=60)  # monitoring now
    c.write("/etc/gpud/layout.yaml", SPLIT)
    # The reload job must end once the file is re-read (a start job of a unit ordered after gpud
    # waits for any job of gpud.service), whatever the apply does after it.
    c.run(["systemctl", "reload", "gpud.service"], timeout=60)
    r = c.run(["gpudctl", "apply", "--wait", "--timeout", "120"], check=False, timeout=180)
    assert r.returncode == 0, r
    gpu0 = next(ln for ln in sim_show(c).splitlines() if ln.startswith("GPU 0 "))
    assert "MIG 1" in gpu0, gpu0
    # the simulated host's unit manager did the drain and the CDI refresh
    stats = c.run(["gpud-sim", "stats", SIM]).stdout
    for counted in ("systemd1.StopUnit", "systemd1.StartUnit", "systemd1.RestartUnit"):
        assert any(ln.split()[-1] == counted and int(ln.split()[0]) >= 1 for ln in stats.splitlines()), stats
    # a control call of the test's own shows the monitor sees method calls on this bus
    c.run(["busctl", "call", "org.freedesktop.systemd1", "/org/freedesktop/systemd1",
           "org.freedesktop.systemd1.Manager", "LoadUnit", "s", "gpu-client.service"])
    c.follow_journal("bus-monitor.service", "member=LoadUnit", after=cursor, timeout=60)
    c.run(["systemctl", "stop", "bus-monitor.service"])
    seen = c.run(["journalctl", "-u", "bus-monitor.service", f"--after-cursor={cursor}", "-o", "cat",
                  "--no-pager"]).stdout
    assert [m for m in HOST_METHODS if m in seen] == [], seen[-3000:]
    # the real client never stopped
    after = c.show("gpu-client.service", "ActiveState", "MainPID")
    assert after == {"ActiveState": "active", "MainPID": pid_before}
    assert "Stopped gpu-client.service" not in c.run(
        ["journalctl", "-u", "gpu-client.service", f"--after-cursor={cursor}", "-o", "cat", "--no-pager"]).stdout


def test_watchdog_restarts_a_stalled_daemon_without_touching_the_hardware(gpud):
    c = gpud
    before = sim_show(c)
    first = c.show("gpud.service", "MainPID", "NRestarts")
    cursor = c.journal_cursor()
    # The simulator's fault: SIGUSR2 blocks the event loop while every other thread runs on, so
    # only pings that come from the loop itself stop.
    c.run(["systemctl", "kill", "-s", "SIGUSR2", "--kill-who=main", "gpud.service"])
    c.follow_journal("gpud.service", "Watchdog timeout", after=cursor, timeout=90)
    c.run(["systemctl", "start", "gpud.service"], timeout=120)  # joins the restart; returns at READY
    after = c.show("gpud.service", "MainPID", "NRestarts", "ActiveState")
    assert after["ActiveState"] == "active" and after["MainPID"] != first["MainPID"]
    assert int(after["NRestarts"]) > int(first["NRestarts"])
    assert c.run(["gpudctl", "status"]).returncode == 0
    # the stalled daemon's status replica went with it: one runs, the new daemon's
    wait_until_ok(c, ["stat", "/run/gpud/gpud-status.sock"])
    assert [parent for _, parent, _ in replicas(c)] == [int(after["MainPID"])]
    assert sim_show(c) == before


def test_stop_leaves_the_hardware_as_it_is(gpud):
    c = gpud
    before = sim_show(c)
    c.run(["systemctl", "stop", "gpud.service"], timeout=120)
    assert c.show("gpud.service", "ActiveState")["ActiveState"] == "inactive"
    assert c.show("gpud.service", "Result")["Result"] == "success"
    assert sim_show(c) == before
    assert c.show("gpu-client.service", "ActiveState")["ActiveState"] == "active"
