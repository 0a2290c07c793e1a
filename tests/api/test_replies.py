"""Replies built from the engine's typed records (gpud.api.replies), compared with what the wire
format promises clients: field names and values written out here by hand, not derived from the code."""

from __future__ import annotations

import msgspec

from gpud.api import plan_replies, replies
from gpud.engine.binding import passthrough
from gpud.model import Gpu, Holder, PciFunction, Placement
from gpud.plan.binding import BindStep
from gpud.plan.mig import Destroyed, Step
from gpud.wire import replies as wire_replies
from gpud.wire import tables as wire_tables

GPU0 = "0000:3b:00.0"


def _fn(addr, device=0x2335, cls=0x030200, driver="vfio-pci", group=7, numa=1):
    return PciFunction(addr, 0x10DE, device, 0x10DE, 0x18BF, cls, driver=driver, iommu_group=group, numa_node=numa)


def test_passthrough_device_as_clients_read_it(tmp_path):
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "7").touch()
    gpu = Gpu(index=0, function=_fn(GPU0), companions=(_fn("0000:3b:00.1", device=0x22BA, cls=0x040300),))
    reply = replies.passthrough_reply(passthrough.entries([gpu], dev_root=str(tmp_path)))
    as_json = msgspec.json.decode(msgspec.json.encode(reply))
    [device] = as_json["devices"]
    assert {k: v for k, v in device.items() if k != "libvirt_hostdev"} == {
        # kubevirt-gpu-device-plugin's name from its pci.ids: "2335  GH100 [H200 SXM 141GB]"
        "pci": GPU0, "vendor_device": "10DE:2335", "resource_name": "nvidia.com/GH100_H200_SXM_141GB",
        "iommu_group": 7, "vfio_device": "/dev/vfio/7", "numa_node": 1,
        "kubevirt": {"pciVendorSelector": "10DE:2335", "resourceName": "nvidia.com/GH100_H200_SXM_141GB",
                     "externalResourceProvider": True},
    }
    assert "0000:3b:00.1" in device["libvirt_hostdev"]  # the companion is named in the comment


def test_passthrough_kubevirt_configuration_has_one_entry_per_resource():
    """Eight H200s on vfio-pci are one KubeVirt resource; a second model is a second entry; no vGPU,
    so KubeVirt's own mdev handling is left as the cluster set it."""
    gpus = [Gpu(index=i, function=_fn(f"0000:{0x10 + i:02x}:00.0", group=i)) for i in range(8)]
    gpus.append(Gpu(index=8, function=_fn("0000:a0:00.0", device=0x2331, group=8)))
    reply = replies.passthrough_reply(passthrough.entries(gpus, dev_root="/nonexistent"))
    assert len(reply.devices) == 9
    assert msgspec.to_builtins(reply)["kubevirt_configuration"] == {"permittedHostDevices": {"pciHostDevices": [
        {"pciVendorSelector": "10DE:2335", "resourceName": "nvidia.com/GH100_H200_SXM_141GB",
         "externalResourceProvider": True},
        # the plugin's pci.ids: "2331  GH100 [H100 PCIe]"
        {"pciVendorSelector": "10DE:2331", "resourceName": "nvidia.com/GH100_H100_PCIE",
         "externalResourceProvider": True}]}}


def test_plan_steps_keep_their_wire_field_names():
    mig = Step(action="create-gi", pci=GPU0, profile="3g.71gb", profile_id=9, placement=Placement(4, 4))
    assert msgspec.to_builtins(plan_replies.mig_step(mig)) == {
        "action": "create-gi", "profile": "3g.71gb", "placement": {"start": 4, "size": 4}, "uuid": None,
        "gi": None, "ci": None, "enabled": None, "driver": None, "pci": GPU0, "module": None, "group": None,
        "message": "", "ci_placement": None, "type": None, "vf": None, "count": None}
    ci = Step(action="create-ci", pci=GPU0, profile="1c.3g.71gb", profile_id=9, placement=Placement(4, 4),
              ci_profile_id=0, ci_placement=Placement(2, 1))
    assert msgspec.to_builtins(plan_replies.mig_step(ci))["ci_placement"] == {"start": 2, "size": 1}
    bind = plan_replies.bind_step(BindStep(action="bind", pci=GPU0, driver="vfio-pci"))
    assert (bind.action, bind.pci, bind.driver, bind.group) == ("bind", GPU0, "vfio-pci", None)
    gone = Destroyed(pci=GPU0, profile="1g.18gb", placement=Placement(0, 1), uuid="MIG-1",
                     holders=[Holder(pid=7, name="python3", device="MIG-1")])
    assert msgspec.to_builtins(plan_replies.destroyed(gone)) == {
        "pci": GPU0, "profile": "1g.18gb", "placement": {"start": 0, "size": 1}, "uuid": "MIG-1",
        "holders": [{"pid": 7, "name": "python3", "device": "MIG-1", "vm": None}]}


def test_plan_with_errors_is_empty_and_says_why():
    reply = plan_replies.plan_reply(errors=["layout.yaml:1 version: must be v1"])
    assert msgspec.to_builtins(reply) == {
        "gpus": [], "disruption": {"destroyed": [], "vgpus_removed": [], "vfs_disabled": [], "mode_changes": [],
                                   "resets": [], "reset_with": [], "rebinds": []},
        "errors": ["layout.yaml:1 version: must be v1"], "warnings": [], "errors_omitted": 0,
        "warnings_omitted": 0}
    assert isinstance(reply, wire_replies.RESULTS["plan"])


def test_mig_profiles_of_a_gpu_nvml_cannot_see_come_from_the_table_with_unknowns_named():
    """An RTX PRO 6000 (complete table) and a B200 (partial table) on vfio-pci, an L40S (no MIG):
    the table's rows are sent with `source: table`, free counts unknown, and the B200's rows name
    exactly the fields gpud.profiles has no source for."""
    from gpud.profiles import MODELS

    gpus = [Gpu(0, _fn("0000:18:00.0", device=0x2BB5)), Gpu(1, _fn("0000:2a:00.0", device=0x2901)),
            Gpu(2, _fn("0000:3a:00.0", device=0x26B9))]
    reply = msgspec.convert(msgspec.to_builtins(replies.mig_profiles_reply(gpus)), wire_tables.MigProfilesReply)
    assert [(g.index, g.source, g.model) for g in reply.gpus] == [
        (0, "table", "NVIDIA RTX PRO 6000 Blackwell Server Edition"), (1, "table", "NVIDIA B200")]
    rtx, b200 = reply.gpus
    assert {p.name: p.unknown for p in rtx.profiles} == {p.name: ["free"] for p in MODELS["rtx-pro-6000"].profiles}
    row = {p.name: p for p in b200.profiles}
    assert row["1g.23gb"].unknown == ["free", "placements"] and row["1g.23gb"].memory_mb == 20992
    assert set(row["3g.90gb"].unknown) == {"free", "memory_mb", "sms", "placements", "ce", "dec", "enc",
                                           "jpg", "ofa", "p2p"}
    assert row["3g.90gb"].total == 2  # the instance count NVIDIA's default MIG config gives
    assert row["3g.90gb"].id == 9  # the id GKE's MIG partitioner passes to nvidia-smi mig -cgi


def test_what_the_device_plugins_advertise_is_worked_out_once_per_observation():
    """Every status answer carries it; fifty clients must not each walk every GPU again."""
    from gpud.api.status_snapshot import StatusSnapshot
    from gpud.plan.node_labels import advertised

    gpus = tuple(Gpu(i, _fn(f"0000:{0x10 + i:02x}:00.0", group=i)) for i in range(4))
    snap = StatusSnapshot()
    first = snap.advertised(gpus, "mixed")
    assert first == advertised(gpus, mig_strategy="mixed") and first.sandbox  # vfio-pci: the sandbox plugin
    assert snap.advertised(gpus, "mixed") is first  # the same observation: kept
    fewer = gpus[:2]  # a new observation: worked out again
    assert snap.advertised(fewer, "mixed") == advertised(fewer, mig_strategy="mixed") != first
