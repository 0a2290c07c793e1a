"""The read-only host adapters of `gpud qualify` on hand-made roots: what a real /proc, /sys, /run
and /lib/modules hold (layouts from the kernel's and systemd's documentation, named in
gpud/host/host_services.py), and the NVSwitch rule of NVIDIA's own driver."""

from __future__ import annotations

import socket

from gpud.engine.observe.discovery import Observation
from gpud.host.host_services import HostServices
from gpud.model import PciFunction
from gpud.qualify.checks import host_checks


def _services(tmp_path, **kw) -> HostServices:
    for d in ("proc", "sys/module", "sys/kernel/iommu_groups", "run", "lib/modules/6.1.0-test"):
        (tmp_path / d).mkdir(parents=True, exist_ok=True)
    return HostServices(proc_root=str(tmp_path / "proc"), sys_root=str(tmp_path / "sys"),
                        run_root=str(tmp_path / "run"), modules_root=str(tmp_path / "lib/modules"),
                        kernel_release="6.1.0-test", **kw)


def test_services_are_found_by_their_truncated_comm(tmp_path):
    hs = _services(tmp_path)
    for pid, comm in ((101, "nv-fabricmanage"), (102, "nvidia-persiste"), (103, "nv-hostengine"), (104, "bash")):
        (tmp_path / "proc" / str(pid)).mkdir()
        (tmp_path / "proc" / str(pid) / "comm").write_text(comm + "\n")
    got = hs.running(["nv-fabricmanager", "nvidia-persistenced", "nv-hostengine", "Xorg"])
    assert got == {"nv-fabricmanager": [101], "nvidia-persistenced": [102], "nv-hostengine": [103], "Xorg": []}


def test_module_loaded_and_available_from_sys_module_and_modules_dep(tmp_path):
    hs = _services(tmp_path)
    assert hs.module("vfio-pci").available is None  # no lists: unknown, not "missing"
    dep = tmp_path / "lib/modules/6.1.0-test/modules.dep"
    dep.write_text("kernel/drivers/vfio/pci/vfio-pci.ko.xz: kernel/drivers/vfio/pci/vfio-pci-core.ko.xz\n")
    m = hs.module("vfio-pci")
    assert (m.loaded, m.available) == (False, True)
    dep.write_text("kernel/drivers/vfio/pci/vfio-pci-core.ko.xz:\n")
    assert hs.module("vfio-pci").available is False  # vfio-pci-core is another module
    (tmp_path / "sys/module/vfio_pci").mkdir()
    assert hs.module("vfio_pci").loaded


def test_systemd_udev_and_a_listening_system_bus(tmp_path):
    hs = _services(tmp_path)
    assert not hs.systemd().present and not hs.udev().present and not hs.dbus().present
    (tmp_path / "run/systemd/system").mkdir(parents=True)
    (tmp_path / "run/udev").mkdir()
    (tmp_path / "run/udev/control").touch()
    (tmp_path / "run/dbus").mkdir()
    path = str(tmp_path / "run/dbus/system_bus_socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(path)
        assert not hs.dbus().present  # a socket nobody listens on refuses connections
        s.listen(1)
        assert hs.dbus().present
    assert hs.systemd().present and hs.udev().present


def _fn(address: str, vendor: int, class_code: int) -> PciFunction:
    return PciFunction(address=address, vendor=vendor, device=0x22A3, subsystem_vendor=vendor,
                       subsystem_device=0, class_code=class_code, driver="nvidia", iommu_group=None)


def test_an_nvidia_bridge_other_function_is_an_nvswitch(tmp_path):
    hs = _services(tmp_path)
    plain = host_checks(Observation(gpus=(), functions=(_fn("0000:05:00.0", 0x8086, 0x068000),)), hs)
    assert {c.name: c.status for c in plain}["NVSwitch"] == "ok"  # another vendor's bridge is not one
    hgx = host_checks(Observation(gpus=(), functions=(_fn("0000:05:00.0", 0x10DE, 0x068000),)), hs)
    switch = {c.name: c for c in hgx}["NVSwitch"]
    assert switch.status == "warn" and "0000:05:00.0" in switch.reason and "single-GPU reset" in switch.action
    fm = {c.name: c for c in hgx}["Fabric Manager"]
    assert fm.reason.startswith("not running") and fm.status == "warn"  # no GPU known: Ampere's rule applies
    assert {c.name: c for c in plain}["Fabric Manager"].status == "ok"


def test_kernel_module_against_nvml_driver_version(tmp_path):
    from gpud.qualify.checks import module_check

    hs = _services(tmp_path)
    assert module_check(hs, "580.159.04").status == "fail"  # no /proc/driver/nvidia: not loaded
    (tmp_path / "proc/driver/nvidia").mkdir(parents=True)
    # the first line as the real H200 host's module printed it (tests/fixtures/h200/nvml-sysfs-readonly.json)
    line = "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build  (nixbld@)  \n"
    (tmp_path / "proc/driver/nvidia/version").write_text(line + "GCC version:  gcc version 15.3.0 (GCC) \n")
    assert module_check(hs, "580.159.04").status == "ok"
    stale = module_check(hs, "580.95.05")  # library upgraded, old module still loaded
    assert stale.status == "fail" and stale.reason == "module 580.159.04, NVML library 580.95.05"


def test_nvidia_smi_q_of_the_real_h200_parses_into_nested_sections():
    from pathlib import Path

    from gpud.host.nvidia.smi_query import parse_query

    text = (Path(__file__).resolve().parents[1] / "fixtures/h200-qualify/nvidia-smi-q-2026-12-01.txt").read_text()
    top, gpus = parse_query(text)
    assert (top["Driver Version"], top["CUDA Version"], top["Attached GPUs"]) == ("580.159.04", "13.0", "1")
    gpu = gpus["0000:00:06.0"]  # "GPU 00000000:00:06.0" normalised as gpud writes addresses
    assert gpu["Product Name"] == "NVIDIA H200"
    assert gpu["MIG Mode"] == {"Current": "Disabled", "Pending": "Disabled"}
    assert gpu["GPU Virtualization Mode"]["Virtualization Mode"] == "Pass-Through"
    assert gpu["Fabric"]["State"] == "N/A" and gpu["Fabric"]["Health"]["Summary"] == "N/A"
    assert gpu["Processes"] == "None" and gpu["Capabilities"] == {"EGM": "disabled"}
    assert "GPU Reset Status" not in gpu  # driver 580 on this host prints no such section
