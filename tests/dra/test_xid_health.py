"""The nvidia driver's Xid reports as gpud follows them: the simulator logs NVRM's record in its
DIR/dev/kmsg (`gpud-sim xid`), gpud's follower hands out each new record once, and the marks
follow NVIDIA's DRA driver (device_health.go): NoSchedule, or None for its application Xids."""

from __future__ import annotations

import asyncio

import pytest

from gpud.engine.dra.health import XidHealth
from gpud.host.kernel.kmsg import follow, parse_record, parse_xid
from gpud.model import Gpu, PciFunction
from gpud.sim import cli as simcli
from gpud.sim import kernel
from gpud.sim import state as simstate
from tests.support.present import present


def test_a_real_nvrm_line_and_a_kmsg_record_parse():
    # the form dmesg shows (NVIDIA's Xid catalogue; leptonai/gpud's documentation quotes one)
    line = "NVRM: Xid (PCI:0000:CB:00): 13, pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7"
    assert parse_xid(line) == ("0000:cb:00", 13, "pid='<unknown>', name=<unknown>, Graphics SM Warp Exception on (GPC 7")
    assert parse_xid("NVRM: loading NVIDIA UNIX x86_64 Kernel Module") is None
    assert parse_record("3,17,1234567,-;NVRM: Xid (PCI:0000:18:00): 79, x") == (17, "NVRM: Xid (PCI:0000:18:00): 79, x")
    assert parse_record("3,17,1234567,c,caller=T1;text\n SUBSYSTEM=pci") == (17, "text")
    assert parse_record("no record") is None


async def test_the_simulator_logs_and_gpud_follows_each_record_once(tmp_path):
    simcli.create(tmp_path, ["h100-80gb:2"])
    a, b = sorted(simstate.load(tmp_path).gpus)
    kernel.xid(tmp_path, a, 48, "before gpud follows")  # history: never handed out

    got: list[str] = []

    async def reader():
        async for text in follow(str(tmp_path / "dev" / "kmsg")):
            got.append(text)

    task = asyncio.create_task(reader())
    try:
        # the follower starts watching at some point: log until it has seen a record (bounded)
        for _ in range(60):
            kernel.xid(tmp_path, a, 79, "GPU has fallen off the bus.")
            await asyncio.sleep(0.5)
            if got:
                break
        kernel.xid(tmp_path, b, 13)
        for _ in range(60):
            if present(parse_xid(got[-1])).code == 13:
                break
            await asyncio.sleep(0.5)
    finally:
        task.cancel()
    # what it handed out is exactly the records logged after it started, each once, in order
    logged = [r.split(";", 1)[1] for r in simstate.load(tmp_path).kmsg]
    assert got and got == logged[len(logged) - len(got):] and len(got) < len(logged)
    assert [present(parse_xid(x))[:2] for x in got][-1] == (b.rsplit(".", 1)[0], 13)
    assert {present(parse_xid(t))[:2] for t in got[:-1]} == {(a.rsplit(".", 1)[0], 79)}
    assert [present(parse_record(r))[0] for r in simstate.load(tmp_path).kmsg] == list(range(len(logged)))


def test_the_driver_logs_xids_only_for_its_gpus(tmp_path):
    simcli.create(tmp_path, ["h100-80gb:1"])
    (a,) = simstate.load(tmp_path).gpus
    kernel.unplug(tmp_path, a)
    with pytest.raises(LookupError, match="no GPU on the nvidia driver"):
        kernel.xid(tmp_path, a, 79)
    assert simstate.load(tmp_path).kmsg == []


def _gpu(pci: str, driver: str | None = "nvidia", present: bool = True) -> Gpu:
    return Gpu(0, PciFunction(pci, 0x10DE, 0x2330, 0x10DE, 0x16C1, 0x030200, driver=driver), present=present)


def test_marks_fatal_and_application_xids_and_forgets_them_when_the_gpu_is_initialised_afresh():
    h = XidHealth()
    g = _gpu("0000:18:00.0")
    assert h.record(present(parse_xid("NVRM: Xid (PCI:0000:99:00): 79, x")), [g]) is None  # no such GPU
    assert present(h.record(present(parse_xid("NVRM: Xid (PCI:0000:18:00): 13, x")), [g])).fatal is False
    assert h.taints("gpu.gpud.io") == {g.pci: ({"key": "gpu.gpud.io/xid", "value": "13", "effect": "None"},)}
    assert present(h.record(present(parse_xid("NVRM: Xid (PCI:0000:18:00): 79, x")), [g])).fatal is True
    assert present(h.record(present(parse_xid("NVRM: Xid (PCI:0000:18:00): 31, x")), [g])).code == 79  # not softened
    assert h.observe([g]) == [] and h.marks
    assert [m.code for m in h.observe([_gpu(g.pci, driver=None)])] == [79]  # off nvidia: forgotten
    assert h.taints("gpu.gpud.io") == {}


def test_marks_outlive_a_gpud_restart_in_the_same_boot_only(tmp_path):
    path = str(tmp_path / "state" / "dra-xids.json")
    g = _gpu("0000:18:00.0")
    h = XidHealth(path, "boot-a")
    h.record(present(parse_xid("NVRM: Xid (PCI:0000:18:00): 79, x")), [g])
    assert XidHealth(path, "boot-a").taints("d") == h.taints("d") != {}  # a restarted gpud
    assert XidHealth(path, "boot-b").marks == {}  # after a reboot: initialised afresh
    assert XidHealth(path, None).marks == {}  # boot unknown: nothing claimed
    h.observe([_gpu(g.pci, driver=None)])
    assert XidHealth(path, "boot-a").marks == {}

