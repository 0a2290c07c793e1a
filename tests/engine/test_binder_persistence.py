"""Boot persistence rules file and the passthrough inventory (udev_rules.py, passthrough.py)."""

from __future__ import annotations

import os

import pytest

from gpud.engine.binding import passthrough, udev_rules
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, NvmlGpu, PciFunction

GPU0, GPU1 = "0000:3b:00.0", "0000:5d:00.0"


def fn(addr, device=0x2335, cls=0x030200, driver="nvidia", group=7, numa=1):
    return PciFunction(addr, 0x10DE, device, 0x10DE, 0x18BF, cls, driver=driver, iommu_group=group, numa_node=numa)


def gpus():
    audio = fn("0000:3b:00.1", device=0x22BA, cls=0x040300, driver="snd_hda_intel")
    bridge = fn("0000:3a:00.0", device=0x1AF1, cls=0x060400, driver="pcieport")
    return [Gpu(index=0, function=fn(GPU0), companions=(audio, bridge)),
            Gpu(index=1, function=fn(GPU1, group=9))]


def desired(**workloads):
    return {pci: DesiredGpu(pci=pci, index=i, entry="layouts.x[0]", workload=w)
            for i, (pci, w) in enumerate(workloads.items())}


def test_rules_cover_group_endpoints_but_not_bridges():
    eps = udev_rules.passthrough_endpoints(gpus(), desired(**{GPU0: "vm-passthrough", GPU1: "container"}))
    assert eps == [GPU0, "0000:3b:00.1"]
    text = udev_rules.render(eps)
    lines = [ln for ln in text.splitlines() if not ln.startswith("#")]
    assert lines == [
        f'ACTION=="add", SUBSYSTEM=="pci", KERNEL=="{a}", ATTR{{driver_override}}="vfio-pci", '
        f'RUN{{builtin}}+="kmod load vfio-pci"' for a in eps]


def test_nothing_loads_vfio_pci_where_no_layout_needs_it():
    """Issue 29 item 16: vfio-pci is loaded at boot only by the rules of pinned GPUs (each rule
    loads it); the package ships no modules-load.d file and its scripts run no modprobe."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    assert not (repo / "packaging/modules-load.d").exists()
    for f in [repo / "packaging/build-deb.sh", *sorted((repo / "packaging/debian").iterdir())]:
        text = f.read_text()
        assert "modules-load" not in text and "modprobe" not in text, f
    assert udev_rules.render([]) == ""


def test_absent_desired_gpu_keeps_its_entry():
    eps = udev_rules.passthrough_endpoints([], desired(**{GPU1: "vm-passthrough"}))
    assert eps == [GPU1]


def test_render_refuses_malformed_addresses():
    with pytest.raises(ValueError):
        udev_rules.render(['0000:3b:00.0", RUN+="/bin/sh'])


def test_writer_is_atomic_idempotent_and_removes(tmp_path):
    path = tmp_path / "rules.d" / "70-gpud-vfio.rules"
    w = udev_rules.UdevRules(str(path))
    assert w.sync(gpus(), desired(**{GPU0: "vm-passthrough"})) is True
    first = path.stat()
    assert w.sync(gpus(), desired(**{GPU0: "vm-passthrough"})) is False
    assert path.stat().st_ino == first.st_ino  # not rewritten
    assert w.sync(gpus(), desired(**{GPU0: "vm-passthrough", GPU1: "vm-passthrough"})) is True
    assert GPU1 in path.read_text() and path.stat().st_ino != first.st_ino  # replaced, not edited
    assert oct(path.stat().st_mode & 0o777) == "0o644"
    assert w.sync(gpus(), desired(**{GPU0: "container", GPU1: "container"})) is True
    assert not path.exists()
    assert w.sync(gpus(), desired(**{GPU0: "container"})) is False
    assert [n for n in os.listdir(path.parent) if n.startswith(".gpud-")] == []


def test_writer_read_only(tmp_path):
    from gpud.host.readonly import ReadOnlyError

    w = udev_rules.UdevRules(str(tmp_path / "r.rules"), read_only=True)
    with pytest.raises(ReadOnlyError):
        w.sync(gpus(), desired(**{GPU0: "vm-passthrough"}))


def test_inventory_lists_only_vfio_gpus_with_the_plugins_names(tmp_path):
    """Names as kubevirt-gpu-device-plugin gives them from its own pci.ids (2025.07.11):
    "2331  GH100 [H100 PCIe]", "22ba  AD102 High Definition Audio Controller"."""
    (tmp_path / "dev" / "vfio").mkdir(parents=True)
    (tmp_path / "dev" / "vfio" / "7").touch()
    g = [Gpu(index=0, function=fn(GPU0, device=0x2331, driver="vfio-pci"),
             companions=(fn("0000:3b:00.1", device=0x22BA, cls=0x040300, driver="vfio-pci"),)),
         Gpu(index=1, function=fn(GPU1, driver="nvidia", group=9))]
    [e] = passthrough.entries(g, dev_root=str(tmp_path / "dev"))
    assert e.vendor_device == "10DE:2331" and e.resource_name == "nvidia.com/GH100_H100_PCIE"
    assert e.device_name == "GH100 [H100 PCIe]"
    assert e.name_source == "pci.ids 2025.07.11" and e.vfio_device == "/dev/vfio/7" and e.numa_node == 1
    assert e.companions == ("0000:3b:00.1",)
    assert "<address domain='0x0000' bus='0x3b' slot='0x00' function='0x0'/>" in e.libvirt_hostdev
    assert "managed='no'" in e.libvirt_hostdev
    assert passthrough.kubevirt_entry(e) == {"pciVendorSelector": "10DE:2331",
                                             "resourceName": "nvidia.com/GH100_H100_PCIE",
                                             "externalResourceProvider": True}


def test_name_is_the_plugins_whatever_the_host_knows(tmp_path):
    """Debian 12's pci.ids has no H200 and gpud's model name is "NVIDIA H200"; the plugin still
    advertises the name from its own file. An id the plugin's file lacks falls back to the bare
    id, as the plugin does, even when NVML knows a name."""
    h200 = Gpu(index=0, function=fn(GPU0, device=0x2335, driver="vfio-pci"))
    [e] = passthrough.entries([h200], dev_root=str(tmp_path))
    assert e.resource_name == "nvidia.com/GH100_H200_SXM_141GB" and e.device_name == "GH100 [H200 SXM 141GB]"
    assert e.vfio_device is None  # node absent: not usable yet, said so
    named = Gpu(index=0, function=fn(GPU0, device=0x2bff, driver="vfio-pci"),
                nvml=NvmlGpu(pci=GPU0, uuid="GPU-x", name="NVIDIA Future GPU"))
    [e] = passthrough.entries([named])
    assert (e.resource_name, e.name_source, e.device_name) == ("nvidia.com/2bff", "device-id", "NVIDIA Future GPU")
