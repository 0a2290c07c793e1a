"""gpud's binder in a real kernel: one QEMU (TCG) boot of Debian's kernel per test session.

The guest (tests/vm/guest_binding.py) runs every phase and writes results.json; each test here
judges one phase, so a failure names what broke without booting again. Skipped only when QEMU,
a kernel or virtme-ng is missing and cannot be installed.
"""

from __future__ import annotations

import pytest

from tests.support.vm_results import phase

# The session's one boot bounds itself (vm.boot: 1500 s, the binding and vGPU phases together); pytest's per-test 300 s would cut a slow
# TCG boot short in the fixture's setup and report nine errors instead of the boot's own outcome.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]

NIC0, AUDIO, NIC1 = "0000:00:10.0", "0000:00:10.1", "0000:00:11.0"


def test_guest_topology_is_the_one_the_checks_assume(guest):
    env = phase(guest, "env")
    g = env["groups"]
    assert g[NIC0] == g[AUDIO] != g[NIC1], g
    assert env["before"][NIC0]["driver"] == "e1000" and env["before"][AUDIO]["driver"] == "snd_hda_intel"
    assert env["vfio_loaded"] is False  # the binder loads it


def test_native_to_vfio_moves_the_whole_group(guest):
    p = phase(guest, "to_vfio")
    for pci in (NIC0, NIC1):
        assert p["outcomes"][pci]["state"] == "converged", p["outcomes"][pci]
    assert p["outcomes"][NIC0]["companions"] == [AUDIO]
    assert p["outcomes"][NIC0]["steps"][0].startswith("load-module vfio-pci")
    for pci in (NIC0, AUDIO, NIC1):
        assert p["after"][pci] == {"driver": "vfio-pci", "override": "vfio-pci"}
    assert all(p["vfio_nodes"].values()), p["vfio_nodes"]
    assert p["vfio_add_event"] is not None  # udev told us about /dev/vfio/N
    # idempotent in a real kernel too
    assert all(o["state"] == "converged" and o["steps"] == [] for o in p["second_pass"].values())


def test_inventory_for_vm_managers(guest):
    p = phase(guest, "inventory")
    e = {x["pci"]: x for x in p["entries"]}
    assert set(e) == {NIC0, NIC1}
    assert e[NIC0]["vendor_device"] == "8086:100E"
    # kubevirt-gpu-device-plugin advertises NVIDIA functions only (its names come from its own
    # pci.ids, gpud/kubevirt_names.py): the guest's Intel stand-ins get no resource name in the
    # passthrough reply's permittedHostDevices entries, while libvirt's <hostdev> and the vfio node
    # are theirs as for a GPU
    assert e[NIC0]["resource_name"] == "" and e[NIC1]["resource_name"] == ""
    assert e[NIC0]["vfio_device"].startswith("/dev/vfio/") and e[NIC0]["companions"] == [AUDIO]
    assert "slot='0x10' function='0x0'" in e[NIC0]["libvirt"]
    assert [k["resourceName"] for k in p["kubevirt"]] == ["", ""]
    assert {k["pciVendorSelector"] for k in p["kubevirt"]} == {x["vendor_device"] for x in p["entries"]}


def test_remove_rescan_udev_rule_restores_override_and_gpud_reconciles(guest):
    p = phase(guest, "remove_rescan")
    assert p["rules_written"] and p["rules_unchanged_second_time"]
    assert f'KERNEL=="{NIC1}", ATTR{{driver_override}}="vfio-pci"' in p["rules"]
    assert p["removed_event"] and p["gone"] and p["add_event"]
    # driver_override dies with the device object: only the udev rule can have set it again
    assert p["after_rescan"]["override"] == "vfio-pci", p["after_rescan"]
    assert p["reconcile"][NIC1]["state"] == "converged", p["reconcile"][NIC1]
    assert p["after"][NIC1] == {"driver": "vfio-pci", "override": "vfio-pci"}


def test_held_vfio_device_waiting_then_stuck_without_hanging(guest):
    p = phase(guest, "holder")
    assert p["ready"].startswith("ready device fd"), p["ready"]  # a real VFIO device user, like QEMU
    w = p["waiting"][NIC1]
    assert w["state"] == "waiting" and [p["holder_pid"], "python", "/dev/vfio/" + w["steps"][-1].split()[-1]] in w["holders"]
    s = p["stuck"][NIC1]
    assert s["state"] == "stuck", s
    assert "vfio_unregister_group_dev" in s["message"]  # the kernel's own reason
    assert p["ticks_during_stuck"] > 0  # the guest's event loop kept running meanwhile
    assert p["while_stuck"][NIC1]["state"] == "stuck" and "still blocked" in p["while_stuck"][NIC1]["message"]
    assert p["abandoned_write_finished"]
    assert p["final"][NIC1]["state"] == "converged"
    assert p["after"][NIC1]["driver"] == "e1000"


def test_back_to_native_drivers_and_vfio_node_goes(guest):
    p = phase(guest, "to_native")
    assert p["outcomes"][NIC0]["state"] == "converged", p["outcomes"][NIC0]
    assert p["after"][NIC0] == {"driver": "e1000", "override": None}
    assert p["after"][AUDIO] == {"driver": "snd_hda_intel", "override": None}
    assert p["after"][NIC1]["driver"] == "e1000"
    assert not any(p["vfio_nodes"].values()) and p["vfio_remove_event"] is not None
    assert p["rules_removed"]


def test_hand_unbind_is_noticed_through_udev_and_reconciled(guest):
    p = phase(guest, "hand_unbind")
    assert p["event"] is not None and p["event"][:3] == ["unbind", "pci", NIC1]
    assert p["seen_after_event"]["driver"] is None
    assert p["reconcile"][NIC1]["state"] == "converged"
    assert p["after"][NIC1]["driver"] == "e1000"


def test_kernel_uevents_arrive_in_the_guest_too(guest):
    """Without udevd (containers) only kernel-source netlink events exist: they do arrive here."""
    assert any(e[0] == "bind" and e[1] == "pci" for e in guest["kernel_events"]), guest["kernel_events"][:10]


def test_the_daemon_itself_converges_notices_an_outside_unbind_and_follows_an_edit(guest):
    p = guest["phases"].get("daemon")
    assert p is not None, "phase daemon did not run"
    assert "error" not in p, {k: v for k, v in p.items() if k in ("error", "log", "apply_out", "status_out")}
    assert p["up"], p["log"]
    assert p["apply_rc"] == 0, p["apply_out"] + p["log"]
    gpus = {g["pci"]: g for g in p["status_after_apply"]["gpus"]}
    assert set(gpus) == {NIC0, NIC1}  # match: made gpud manage the e1000s; the audio function is a companion
    for pci in (NIC0, NIC1):
        g = gpus[pci]
        assert g["driver"] == "vfio-pci" and g["converged"] and g["vfio_device"] == f"/dev/vfio/{g['iommu_group']}"
    assert gpus[NIC0]["group"] == [{"pci": AUDIO, "driver": "vfio-pci", "class": "0x040300"}]
    assert NIC0 in p["rules"] and AUDIO in p["rules"] and NIC1 in p["rules"]
    assert p["rebound_after_hand_unbind"], p["events"] + p["log"]
    assert p["back_to_native_after_edit"], p["events"] + p["log"]
    after = {g["pci"]: g for g in p["status_after_edit"]["gpus"]}
    assert all(g["vfio_device"] is None and g["converged"] for g in after.values())
    assert p["exit"] == 0
