"""gpud.host.systemd.sd_notify, unit_drain and logind without a service manager: the notify protocol on a socket of our own,
socket activation through systemd-socket-activate, the JobRemoved buffer, the reboot marker."""

from __future__ import annotations

import array
import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time

import pytest

from gpud.host.systemd import logind, sd_notify
from gpud.host.systemd.sd_notify import Notifier, child_env, watchdog_interval
from gpud.host.systemd.unit_drain import SystemdError, _JobTracker
from tests.support.present import present
from tests.systemd.nspawn import REPO


@pytest.fixture
def manager(tmp_path):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    s.bind(path)
    s.settimeout(10)
    yield path, s
    s.close()


@pytest.fixture
def notifier():
    """Notifier(env), closed at the end of the test (it keeps its socket once it has sent)."""
    made: list[Notifier] = []

    def make(env: dict[str, str]) -> Notifier:
        made.append(Notifier(env))
        return made[-1]

    yield make
    for n in made:
        n.close()


def recv(s: socket.socket) -> list[str]:
    return s.recv(4096).decode().split("\n")


def test_messages(manager, notifier):
    path, s = manager
    n = notifier({"NOTIFY_SOCKET": path})
    assert n.enabled
    assert n.ready("2 GPUs: 2 converged")
    assert recv(s) == ["READY=1", "STATUS=2 GPUs: 2 converged"]
    n.status("line one\nline two")  # STATUS is one line
    assert recv(s) == ["STATUS=line one line two"]
    n.stopping()
    assert recv(s) == ["STOPPING=1"]
    n.watchdog()
    assert recv(s) == ["WATCHDOG=1"]
    n.extend_timeout(120_000_000)
    assert recv(s) == ["EXTEND_TIMEOUT_USEC=120000000"]
    before = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    n.reloading("re-reading layout.yaml")
    after = time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000
    msg = recv(s)
    assert msg[0] == "RELOADING=1" and msg[2] == "STATUS=re-reading layout.yaml"
    key, usec = msg[1].split("=")
    assert key == "MONOTONIC_USEC" and before <= int(usec) <= after


def test_abstract_socket_and_unset(notifier):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"gpud-test-{os.getpid()}"
    s.bind("\0" + name)
    s.settimeout(10)
    try:
        assert notifier({"NOTIFY_SOCKET": "@" + name}).ready()
        assert s.recv(100) == b"READY=1"
    finally:
        s.close()
    off = Notifier({})
    assert not off.enabled and off.ready() is False and off.watchdog() is False and off.barrier() is False


def test_send_failure_is_reported_not_raised(tmp_path, notifier):
    assert notifier({"NOTIFY_SOCKET": str(tmp_path / "gone")}).ready() is False


def test_barrier_waits_for_the_manager_to_close_the_fd(manager, notifier):
    path, s = manager
    n = notifier({"NOTIFY_SOCKET": path})
    seen = []

    def fake_manager():
        msg, anc, _, _ = s.recvmsg(100, socket.CMSG_SPACE(4))
        fds = array.array("i")
        for _level, _type, data in anc:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
        seen.append((msg, list(fds)))
        for fd in fds:
            os.close(fd)

    t = threading.Thread(target=fake_manager)
    t.start()
    assert n.barrier(timeout=10) is True
    t.join(10)
    assert seen and seen[0][0] == b"BARRIER=1" and len(seen[0][1]) == 1
    # nobody closes it: a bounded wait that reports failure
    assert n.barrier(timeout=0.2) is False


def test_child_env_and_watchdog_interval():
    env = {"NOTIFY_SOCKET": "/run/systemd/notify", "WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1",
           "LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "x", "PATH": "/usr/bin", "INVOCATION_ID": "i"}
    assert child_env(env) == {"PATH": "/usr/bin", "INVOCATION_ID": "i"}
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": str(os.getpid())}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "30000000", "WATCHDOG_PID": "1"}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "0"}) is None and watchdog_interval({}) is None
    assert Notifier({"NOTIFY_SOCKET": "/x", "WATCHDOG_USEC": "4000000"}).watchdog_interval() == 2.0


@pytest.mark.skipif(shutil.which("systemd-socket-activate") is None, reason="systemd-socket-activate missing")
def test_listen_socket_from_socket_activation(tmp_path):
    sock_path = str(tmp_path / "gpud.sock")
    child = ("import os, sys; from gpud.host.systemd.sd_notify import listen_socket; s = listen_socket(); "
             "assert s is not None and 'LISTEN_FDS' not in os.environ; c, _ = s.accept(); "
             "c.sendall(b'served by fd %d' % s.fileno())")
    p = subprocess.Popen(["systemd-socket-activate", "-l", sock_path, sys.executable, "-c", child],
                         env=dict(os.environ, PYTHONPATH=str(REPO)), stderr=subprocess.PIPE)
    try:
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.settimeout(30)
        for _ in range(3000):  # the listener appears once systemd-socket-activate has bound it
            try:
                c.connect(sock_path)
                break
            except (FileNotFoundError, ConnectionRefusedError):
                time.sleep(0.01)
        assert c.recv(100) == b"served by fd 3"
        c.close()
    finally:
        p.terminate()
        p.wait(10)
        present(p.stderr).close()
    assert sd_notify.listen_socket({}) is None
    assert sd_notify.listen_socket({"LISTEN_PID": "1", "LISTEN_FDS": "1"}) is None


async def test_job_removed_before_the_reply_is_not_lost():
    t = _JobTracker()
    t.watch("kubelet.service")
    t.feed("/org/freedesktop/systemd1/job/7", "kubelet.service", "done")  # signal first
    assert await t.wait("/org/freedesktop/systemd1/job/7", 1) == "done"  # then the reply
    # a job of a unit nobody operates on is not kept
    t.feed("/org/freedesktop/systemd1/job/8", "other.service", "done")
    assert "/org/freedesktop/systemd1/job/8" not in t._results
    # the normal order: waiting first
    w = asyncio.ensure_future(t.wait("/org/freedesktop/systemd1/job/9", 5))
    await asyncio.sleep(0)
    t.feed("/org/freedesktop/systemd1/job/9", "kubelet.service", "failed")
    assert await w == "failed"
    # leftovers of a unit are dropped when the last operation on it ends
    t.feed("/org/freedesktop/systemd1/job/10", "kubelet.service", "done")
    t.unwatch("kubelet.service")
    assert t._results == {}
    with pytest.raises(TimeoutError):
        await t.wait("/org/freedesktop/systemd1/job/11", 0.01)


async def test_reboot_marker_prevents_a_loop(tmp_path):
    boot = tmp_path / "boot_id"
    boot.write_text("bbbb\n")
    state = tmp_path / "state"
    state.mkdir()
    assert logind.reboot_outcome(str(state), boot_id_path=str(boot)) is None
    (state / logind.REBOOT_MARKER).write_text(json.dumps({"reason": "mode change", "boot_id": "aaaa", "requested_at": 1.0}))
    rec = logind.reboot_outcome(str(state), boot_id_path=str(boot))
    assert rec == logind.RebootRecord(reason="mode change", boot_id="aaaa", requested_at=1.0, rebooted=True)
    # a reboot already happened for a marked change: no second one (and no bus is touched)
    assert await logind.request_reboot(str(state), "mode change", boot_id_path=str(boot),
                                   bus_address="unix:path=/nonexistent") is False
    logind.clear_reboot_request(str(state))
    assert logind.reboot_outcome(str(state), boot_id_path=str(boot)) is None
    # the logind call fails: the marker is removed again and the error says why
    with pytest.raises(SystemdError, match="logind refused the reboot"):
        await logind.request_reboot(str(state), "mode change", boot_id_path=str(boot),
                                bus_address=f"unix:path={tmp_path}/no-bus", call_timeout=5)
    assert not (state / logind.REBOOT_MARKER).exists()
    # a corrupt marker counts as a past reboot
    (state / logind.REBOOT_MARKER).write_text("{")
    assert present(logind.reboot_outcome(str(state), boot_id_path=str(boot))).rebooted is True
