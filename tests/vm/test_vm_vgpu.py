"""gpud's vGPU adapter, planner and executor on a real kernel (the same single boot as the binding
tests; the guest side is tests/vm/guest_vgpu.py): the kernel's mdev core through its mtty sample,
and SR-IOV through QEMU 7.2's nvme `sriov_max_vfs`."""

from __future__ import annotations

import pytest

from gpud.plan.vgpu import derived_uuid
from tests.support.vm_results import phase

# The session's one boot bounds itself (vm.boot); this module may be the first to ask for it.
pytestmark = [pytest.mark.vm, pytest.mark.timeout(1800)]

TYPE = "Dual port serial"


def mdev(guest):
    assert "vgpu" not in guest["phases"] or "error" not in guest["phases"]["vgpu"], guest["phases"]["vgpu"]
    p = phase(guest, "mdev")
    assert p["insmod_rc"] == 0, (p, guest.get("mtty_build"))
    return p


def test_mdev_types_are_listed_from_the_kernel(guest):
    p = mdev(guest)
    assert p["interface"] == "mdev"
    assert p["types"] == {"Single port serial": ["mtty-1", 24], TYPE: ["mtty-2", 12]}


def test_gpud_creates_mdevs_with_uuids_it_chose(guest):
    p = mdev(guest)
    first = [derived_uuid("mtty-test-gpu", TYPE, n) for n in (0, 1)]
    assert [c[2] for c in p["plan_creations"]] == first
    assert p["create_state"] == "done", p["create_message"]
    assert p["bus_devices"] == sorted(first)
    assert sorted(d[1] for d in p["read_devices"]) == sorted(first)
    assert all(d[0] == TYPE and d[2] is not None for d in p["read_devices"])  # each in its own vfio group
    # the kernel counts what is left: 24 ports - 2 x 2
    assert p["types_after"] == {"Single port serial": ["mtty-1", 20], TYPE: ["mtty-2", 10]}
    assert p["replan_steps"] == 0 and sorted(p["kept"]) == sorted(first)


def test_kernel_errors_come_back_named(guest):
    p = mdev(guest)
    assert p["duplicate"] == "EEXIST"
    assert p["bad_uuid"] == "EINVAL"


def test_a_held_mdev_is_never_removed_and_the_kernel_would_block(guest):
    p = mdev(guest)
    held, other = p["plan_creations"][0][2], p["plan_creations"][1][2]
    assert p["holder_ready"].startswith("ready device fd"), p["holder_ready"]
    assert dict((u, pids) for u, pids in p["holders"]) == {held: [p["holder_pid"]], other: []}
    assert p["shrink_kept"] == [held] and p["shrink_removals"] == [other]  # the idle one would go
    assert p["remove_all_state"] == "blocked" and p["remove_all_holders"] == [p["holder_pid"]]
    assert p["still_there"] == sorted([held, other])  # gpud wrote nothing
    # what gpud avoids: the kernel's remove of a held mdev waits for the holder instead of failing
    assert p["raw_remove_blocked_while_held"] is True
    assert p["raw_remove_after_release"] == "rc=0"
    assert p["after_release"] == [other]


def test_recorded_identities_come_back(guest):
    p = mdev(guest)
    assert p["cleared"] == "done" and p["empty"] == []
    assert p["rebuild_state"] == "done" and p["rebuilt"] == p["first"]


def test_sriov_numvfs_on_a_real_kernel(guest):
    p = phase(guest, "sriov")
    assert p["present"] is True, p
    assert p["total"] == 2
    assert p["too_many"] == "ERANGE"
    assert p["enable"] == "ok" and len(p["vfs"]) == 2
    assert set(p["physfn"].values()) == {"0000:00:12.0"}
    assert p["change_nonzero"] == "EBUSY"
    assert p["vfs_in_gpu_scan"] == []  # VFs are not GPUs to manage
    assert p["disable"] == "ok" and p["vfs_after_disable"] == []
