"""gpud.host.systemd.sd_notify, unit_drain and logind against a real systemd 252 (PID 1, D-Bus, logind) in a container: readiness
and STATUS, reload notifications, the watchdog, draining units, and the reboot request."""

from __future__ import annotations

import json
import os
import sys
import threading
from pathlib import Path

import pytest

from tests.systemd.nspawn import REPO

pytestmark = pytest.mark.nspawn

STANDIN = REPO / "tests" / "systemd" / "standin.py"
PROBE = REPO / "tests" / "systemd" / "drain_probe.py"


def unit(c, name: str, body: str) -> None:
    c.write(f"/run/systemd/system/{name}", body)
    c.run(["systemctl", "daemon-reload"])


def py_service(mode_args: str, extra: str = "", type_: str = "notify") -> str:
    return (f"[Service]\nType={type_}\nEnvironment=PYTHONPATH={REPO} PYTHONUNBUFFERED=1\n"
            f"ExecStart={sys.executable} {STANDIN} {mode_args}\n{extra}")


def open_fifo_for_writing(path: Path, timeout: float = 60.0) -> int:
    """Open blocks until the service opens its end: that is the signal it got there."""
    box: list = []
    t = threading.Thread(target=lambda: box.append(os.open(path, os.O_WRONLY)), daemon=True)
    t.start()
    t.join(timeout)
    if not box:
        raise TimeoutError(f"nobody opened {path} for reading within {timeout:g}s")
    return box[0]


def mkfifo(c, path: str) -> Path:
    p = c.path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if not p.exists():
        os.mkfifo(p)
    return p


def test_ready_only_after_ready_and_status_shown(container):
    c = container
    d = "/run/standin-notify"
    go = mkfifo(c, f"{d}/go")
    reload_go = mkfifo(c, f"{d}/reload-go")
    unit(c, "standin-notify.service", py_service(f"notify {d}", "ExecReload=/bin/kill -HUP $MAINPID\n"))
    c.run(["systemctl", "start", "--no-block", "standin-notify.service"])

    fd = open_fifo_for_writing(go)  # the service sent STATUS, passed its barrier, now waits
    try:
        st = c.show("standin-notify.service", "ActiveState", "SubState", "StatusText")
        assert (st["ActiveState"], st["SubState"]) == ("activating", "start")
        assert st["StatusText"] == "waiting for go"
        os.write(fd, b"go\n")
    finally:
        os.close(fd)
    c.run(["systemctl", "start", "standin-notify.service"], timeout=60)  # joins the start job
    st = c.show("standin-notify.service", "ActiveState", "StatusText")
    assert st == {"ActiveState": "active", "StatusText": "serving"}
    assert 'Status: "serving"' in c.run(["systemctl", "status", "--no-pager", "standin-notify.service"],
                                        check=False).stdout

    # RELOADING=1 (+MONOTONIC_USEC) puts the unit in "reloading" until READY=1.
    c.run(["systemctl", "kill", "-s", "HUP", "--kill-who=main", "standin-notify.service"])
    fd = open_fifo_for_writing(reload_go)
    try:
        st = c.show("standin-notify.service", "ActiveState", "StatusText")
        assert st == {"ActiveState": "reloading", "StatusText": "reloading"}
        cursor = c.journal_cursor()
        os.write(fd, b"go\n")
    finally:
        os.close(fd)
    c.follow_journal("standin-notify.service", "reload done", after=cursor)  # printed after READY's barrier
    st = c.show("standin-notify.service", "ActiveState", "StatusText")
    assert st == {"ActiveState": "active", "StatusText": "serving, reloaded"}
    c.run(["systemctl", "stop", "standin-notify.service"], timeout=60)
    r = c.run(["journalctl", "-o", "cat", "-u", "standin-notify.service", "--no-pager"])
    assert "Stopped standin-notify.service" in r.stdout or "standin-notify.service: Deactivated" in r.stdout


def test_watchdog_restarts_a_stalled_event_loop(container):
    c = container
    unit(c, "standin-watchdog.service",
         py_service("watchdog", "WatchdogSec=2\nRestart=on-watchdog\nRestartSec=100ms\nTimeoutAbortSec=5\n"))
    c.run(["systemctl", "start", "standin-watchdog.service"], timeout=60)
    first = c.show("standin-watchdog.service", "MainPID", "NRestarts")
    assert first["NRestarts"] == "0"
    cursor = c.journal_cursor()
    c.run(["systemctl", "kill", "-s", "USR2", "--kill-who=main", "standin-watchdog.service"])
    c.follow_journal("standin-watchdog.service", "Watchdog timeout", after=cursor)
    line = c.follow_journal("standin-watchdog.service", "started pid=", after=cursor)
    assert f"pid={first['MainPID']} " not in line
    c.run(["systemctl", "start", "standin-watchdog.service"], timeout=60)  # joins a pending start
    after = c.show("standin-watchdog.service", "MainPID", "NRestarts", "ActiveState")
    assert after["ActiveState"] == "active"
    assert int(after["NRestarts"]) >= 1 and after["MainPID"] != first["MainPID"]
    c.run(["systemctl", "stop", "standin-watchdog.service"])


DRAIN_UNITS = {
    "drain-a.service": "[Service]\nExecStart=/usr/bin/sleep infinity\n",
    "drain-b.service": "[Service]\nExecStart=/usr/bin/sleep infinity\n",  # left inactive
    "drain-c.service": "[Unit]\nAfter=drain-a.service\n[Service]\nExecStart=/usr/bin/sleep infinity\n",
    "drain-refuse.service": "[Unit]\nRefuseManualStop=yes\n[Service]\nExecStart=/usr/bin/sleep infinity\n",
    "drain-fails.service": "[Service]\nType=oneshot\nExecStart=/bin/false\n",
}


@pytest.fixture(scope="module")
def drain_units(container):
    for name, body in DRAIN_UNITS.items():
        container.write(f"/run/systemd/system/{name}", body)
    container.run(["systemctl", "daemon-reload"])
    container.run(["systemctl", "start", "drain-a.service", "drain-c.service", "drain-refuse.service"])
    return container


def probe(c, *args: str) -> dict:
    r = c.python([str(PROBE), *args], timeout=120)
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_drained_stops_running_units_and_restarts_them_also_after_a_failure(drain_units):
    c = drain_units
    pid_a = c.show("drain-a.service", "MainPID")["MainPID"]
    units = ["drain-c.service", "drain-a.service", "drain-b.service", "not-installed.service"]
    out = probe(c, "drain", *units)
    assert out["before"] == {"drain-c.service": "active", "drain-a.service": "active",
                             "drain-b.service": "inactive", "not-installed.service": "inactive"}
    assert out["stopped"] == ["drain-c.service", "drain-a.service"]
    assert out["inside"] == {u: "inactive" for u in units}
    assert out["after"] == out["before"]  # only what was stopped came back
    assert out["inside_failing"] == {u: "inactive" for u in units}
    assert out["body_error"] == "disruptive step failed"
    assert out["after_failing"] == out["before"]
    assert c.show("drain-a.service", "MainPID")["MainPID"] != pid_a  # really restarted


def test_cancelled_step_queues_the_restart_without_waiting(drain_units):
    """While gpud.service stops, a start job of a unit ordered after it would wait for gpud's own
    stop job: the drainer must queue the start and return, and systemd runs it afterwards."""
    c = drain_units
    out = probe(c, "cancelled", "drain-a.service")
    assert out["inside"] == {"drain-a.service": "inactive"} and out["cancelled"] is True
    assert out["after"]["drain-a.service"] in ("activating", "active")
    c.run(["systemctl", "start", "drain-a.service"])  # joins the queued job
    assert c.show("drain-a.service", "ActiveState")["ActiveState"] == "active"


def test_a_refused_stop_restarts_what_was_already_stopped(drain_units):
    c = drain_units
    out = probe(c, "stop-refused", "drain-a.service", "drain-refuse.service")
    assert "body_ran" not in out
    assert out["unit"] == "drain-refuse.service" and "drain-refuse.service" in out["error"]
    assert out["stopped_before_error"] == ["drain-a.service"]
    assert out["after"] == {"drain-a.service": "active", "drain-refuse.service": "active"}


def test_start_reports_the_failed_unit_and_still_starts_the_others(drain_units):
    c = drain_units
    out = probe(c, "start", "drain-fails.service", "drain-b.service")
    assert out["unit"] == "drain-fails.service" and out["result"] == "failed"
    assert out["after"]["drain-b.service"] == "active"
    c.run(["systemctl", "stop", "drain-b.service"])


def test_restart_if_present(drain_units):
    c = drain_units
    unit(c, "nvidia-cdi-refresh.service",
         "[Service]\nType=oneshot\nExecStart=/bin/sh -c 'echo refreshed >> /run/cdi-refresh.log'\n")
    out = probe(c, "restart-if-present", "nvidia-cdi-refresh.service", "absent-cdi.service")
    assert out == {"nvidia-cdi-refresh.service": True, "absent-cdi.service": False}
    assert c.path("/run/cdi-refresh.log").read_text() == "refreshed\n"


def test_reboot_request_reaches_logind_once(container, tmp_path):
    """The real logind is replaced by a stand-in on the container's system bus, so the call goes
    through D-Bus exactly as it would and nothing reboots."""
    c = container
    c.run(["systemctl", "mask", "--runtime", "--now", "systemd-logind.service"])
    try:
        unit(c, "fake-logind.service", py_service("fake-logind /run/fake-logind.log"))
        c.run(["systemctl", "start", "fake-logind.service"], timeout=60)
        c.run(["mkdir", "-p", "/run/gpud-state"])
        out = probe(c, "reboot", "/run/gpud-state", "MIG mode change needs a reboot")
        assert out["requested"] is True
        rec = out["record"]
        assert rec["reason"] == "MIG mode change needs a reboot" and rec["rebooted"] is False
        assert rec["boot_id"] == c.path("/proc/sys/kernel/random/boot_id").read_text().strip()
        assert c.path("/run/fake-logind.log").read_text() == "Reboot interactive=False\n"

        # After "a reboot" (another boot id in the marker) the same request is refused.
        marker = c.path("/run/gpud-state/reboot-request.json")
        data = json.loads(marker.read_text())
        data["boot_id"] = "00000000-0000-0000-0000-000000000000"
        marker.write_text(json.dumps(data))
        out = probe(c, "reboot", "/run/gpud-state", "MIG mode change needs a reboot")
        assert out["requested"] is False and out["record"]["rebooted"] is True
        assert c.path("/run/fake-logind.log").read_text() == "Reboot interactive=False\n"
    finally:
        c.run(["systemctl", "stop", "fake-logind.service"], check=False)
        c.run(["systemctl", "unmask", "--runtime", "systemd-logind.service"], check=False)
