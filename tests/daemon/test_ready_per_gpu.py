"""Issue 33 item 4, READY: after a reboot READY=1 (what lets libvirtd's autostart and the kubelet
start) must mean every GPU's boot work is done or failed and reported. Two L40S on one simulated
host, both vm-vgpu; after a reboot (VFs and vGPUs gone) the second GPU's VF enabling is made slow
(the simulator's sriov-manage behind a gate the test opens) or failing. What holds at READY is read
from the simulator's state file and the notify datagrams, not from gpud's view."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from gpud.sim import vgpu as sim_vgpu
from gpud.sim.state import load, locked
from gpud.sim.sysfs_tree import render
from tests.support.daemon import notified, start_until_ready, until_ready, wait_until

pytestmark = pytest.mark.daemon

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
LAYOUT = """\
version: v1
layouts:
  vms:
    - devices: [0, 1]
      workload: vm-vgpu
      vgpu-devices: {"L40S-12Q": 2}
"""

# The simulator's own sriov-manage, with the second GPU's `-e` held at a gate (slow) or refused.
GATED = """#!/bin/sh
if [ "$1" = "-e" ] && [ "$2" = "{gpu}" ]; then
  touch {dir}/enabling-started
  i=0
  while [ ! -e {dir}/gate ] && [ $i -lt 1800 ]; do sleep 0.1; i=$((i + 1)); done
fi
exec {dir}/bin/sriov-manage.sim "$@"
"""
FAILING = """#!/bin/sh
if [ "$1" = "-e" ] && [ "$2" = "{gpu}" ]; then
  echo "GPU at {gpu}: pci-pf-stub new_id: Device or resource busy" >&2
  exit 1
fi
exec {dir}/bin/sriov-manage.sim "$@"
"""


def _vgpus(host: Path, pf: str) -> int:
    return sum(1 for vf in load(host).vgpu[pf].vfs if vf.vgpu_type)


def _rebooted_with(d, script: str) -> None:
    assert d.ctl("apply", "--wait", "--timeout", "180").returncode == 0
    assert _vgpus(d.host, GPU0) == _vgpus(d.host, GPU1) == 2
    d.stop()
    with locked(d.host) as st:  # what a reboot does to vGPUs: VFs and mdevs gone
        sim_vgpu.clear_for_reboot(st)
        render(d.host, st)
    tool = d.host / "bin" / "sriov-manage"
    tool.rename(tool.with_name("sriov-manage.sim"))
    tool.write_text(script.format(gpu=GPU1, dir=d.host))
    tool.chmod(0o755)


def _datagrams(sock: socket.socket) -> list[str]:
    """Every datagram sent so far (none waited for)."""
    out = []
    sock.setblocking(False)
    try:
        while True:
            out.append(sock.recv(4096).decode())
    except BlockingIOError:
        return out
    finally:
        sock.setblocking(True)


def test_ready_waits_for_a_gpu_whose_boot_work_is_slow(daemon) -> None:
    d = daemon(["l40s", "l40s"], LAYOUT, vgpu="vfio")
    _rebooted_with(d, GATED)
    with notified(d) as sock:
        wait_until(lambda: (d.host / "enabling-started").exists(), 120, "the second GPU's VF enabling to start")
        messages = _datagrams(sock)
        assert not any("READY=1" in m.split("\n") for m in messages), messages  # its work is under way
        assert _vgpus(d.host, GPU1) == 0
        (d.host / "gate").touch()
        until_ready(d, sock, messages, 180)
        at_ready = _vgpus(d.host, GPU0), _vgpus(d.host, GPU1)
    assert at_ready == (2, 2), messages


def test_ready_comes_when_a_gpus_boot_work_fails_and_names_it(daemon) -> None:
    d = daemon(["l40s", "l40s"], LAYOUT, vgpu="vfio")
    _rebooted_with(d, FAILING)
    with notified(d) as sock:
        messages: list[str] = []
        until_ready(d, sock, messages, 180)
        at_ready = _vgpus(d.host, GPU0), _vgpus(d.host, GPU1)
    assert at_ready == (2, 0)  # the other GPU's work is done; this one's failed
    ready = next(m for m in messages if "READY=1" in m.split("\n"))
    status_lines = [line for m in messages[:messages.index(ready) + 1] for line in m.split("\n")
                    if line.startswith("STATUS=")]
    assert "fail" in status_lines[-1], messages  # the status READY came with says a GPU failed
    # A failed GPU is tried again by later passes (applying, then failed again: the fault stays), so
    # status is read until it shows the failure rather than at one instant.
    def gpu1_failed() -> dict | None:
        row = next(g for g in d.status()["gpus"] if g["pci"] == GPU1)
        return row if row["state"] == "failed" else None

    row = wait_until(gpu1_failed, 120, "GPU 1 shown failed")
    assert "sriov-manage" in row["message"] and "busy" in row["message"], row
    failed = [e for e in d.events() if e.get("gpu") == GPU1 and e["kind"] == "failed"]
    assert failed and "sriov-manage" in failed[0]["message"], d.events()[-10:]
    assert not [e for e in d.events() if e.get("gpu") == GPU0 and e["kind"] == "failed"]


def test_ready_past_its_limit_names_the_gpu_still_at_work(daemon) -> None:
    """READY waits at most DaemonConfig.first_pass_wait_s (60 s, inside systemd's start timeout):
    a GPU whose boot work outlasts it is named as still at work when READY comes anyway."""
    d = daemon(["l40s", "l40s"], LAYOUT, vgpu="vfio")
    _rebooted_with(d, GATED)
    start_until_ready(d, 180)  # the gate stays shut: READY comes at the limit
    assert (d.host / "enabling-started").exists() and _vgpus(d.host, GPU1) == 0
    warning = [e["message"] for e in d.events() if e["kind"] == "warning" and "ready anyway" in e["message"]]
    assert warning and f"still at work: GPU 1 ({GPU1}) applying" in warning[0], warning
    (d.host / "gate").touch()
    wait_until(lambda: _vgpus(d.host, GPU1) == 2, 120, "the second GPU's vGPUs after the gate")
