"""The vGPU sysfs adapter: real formats parsed (lines as kubevirt#17642 and gpu-operator#2594 quote
them), the interface found per GPU at run time, and what it reads compared with the simulator's
state file."""

from __future__ import annotations

import os

import pytest

from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs, parse_creatable, qemu_vm_name
from gpud.sim import host as sim_paths
from gpud.sim.cli import create, hold
from gpud.sim.state import load
from tests.sim.vfs import set_vfs
from tests.support.vgpu_host import adapter

L40S, A100, T4 = "0000:18:00.0", "0000:2a:00.0", "0000:5d:00.0"


def test_parse_creatable_real_format() -> None:
    text = "ID    : vGPU Name\n1145  : NVIDIA L40S-1B\n1414 : NVIDIA H200X-1-18C\n"
    assert parse_creatable(text) == [(1145, "L40S-1B"), (1414, "H200X-1-18C")]
    assert parse_creatable("ID    : vGPU Name\n") == []


def test_qemu_vm_name(tmp_path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cmdline").write_bytes(b"/usr/bin/qemu-system-x86_64\0-name\0guest=db-2,debug-threads=on\0-m\0")
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cmdline").write_bytes(b"qemu-system-x86_64\0-name\0legacy-vm\0")
    assert qemu_vm_name(str(tmp_path), 7) == "db-2"
    assert qemu_vm_name(str(tmp_path), 8) == "legacy-vm"
    assert qemu_vm_name(str(tmp_path), 9) is None


def test_reads_agree_with_the_state_file(tmp_path) -> None:
    d = tmp_path / "h"
    create(d, ["l40s", "a100-pcie-40gb", "h200", "t4"], vgpu="vfio")
    a = adapter(d)
    assert [a.interface(p) for p in (L40S, A100, T4)] == ["sriov", "sriov", "mdev"]
    set_vfs(d, L40S, 8)
    assert a.interface(L40S) == "vfio"
    vfs = [vf.address for vf in load(d).vgpu[L40S].vfs]
    first = a.read(L40S)
    assert first.vfs == tuple(vfs) and first.total_vfs == 32
    assert {o.type: o.creatable for o in first.offers}["L40S-12Q"] == 4  # 8 VFs list it, the GPU fits 4
    type_id = next(i for i, n in a.creatable_on(vfs[2]) if n == "L40S-12Q")
    a.set_vf_type(vfs[2], type_id)
    hold(d, vfs[2], 5150, vm="web-1")
    state = a.read(L40S)
    sim = load(d)
    assert [(dv.vf, dv.type_id) for dv in state.devices] == [
        (vf.address, vf.vgpu_type) for vf in sim.vgpu[L40S].vfs if vf.vgpu_type]
    (dev,) = state.devices
    assert dev.type == "L40S-12Q" and dev.vfio_group == sim.functions[vfs[2]].iommu_group
    assert [(h.pid, h.vm) for h in dev.holders] == [(5150, "web-1")]
    assert [(o.type, o.creatable) for o in state.offers] == [("L40S-12Q", 3)]
    # a daemon restart on a full GPU still names the type: learnt from the lists, kept in names.json
    assert os.path.exists(d / "names.json")
    assert adapter(d).read(L40S).devices[0].type == "L40S-12Q"


def test_mdev_devices_and_offers(tmp_path) -> None:
    d = tmp_path / "h"
    create(d, ["t4"], vgpu="mdev")
    a = adapter(d)
    pf = "0000:18:00.0"
    tdir, avail = a.mdev_types(pf)["T4-8Q"]
    assert (tdir, avail) == ("nvidia-233", 2)
    a.create_mdev(pf, tdir, "0b5e4c1a-7d0e-4f0a-9a3e-2d5f6a7b8c90")
    state = a.read(pf)
    assert [(x.type, x.uuid, x.parent) for x in state.devices] == [
        ("T4-8Q", m.uuid, m.parent) for m in load(d).vgpu[pf].mdevs]
    assert {o.type: o.creatable for o in state.offers}["T4-8Q"] == 1
    assert {o.type: o.creatable for o in state.offers}["T4-1Q"] == 0
    a.remove_mdev("0b5e4c1a-7d0e-4f0a-9a3e-2d5f6a7b8c90")
    assert load(d).vgpu[pf].mdevs == []


def test_current_vgpu_type_eio_and_eperm_say_what_to_check(tmp_path) -> None:
    """Errors the simulator never makes, as hardware returns them: each has its own meaning."""
    import errno as errno_mod

    from gpud.host.nvidia.vgpu_sysfs import VgpuError

    d = tmp_path / "h"
    create(d, ["l40s"], vgpu="vfio")
    set_vfs(d, L40S, 2)
    vf = load(d).vgpu[L40S].vfs[0].address
    h = sim_paths(d)
    for code, words in ((errno_mod.EIO, "GPU instance exists"), (errno_mod.EPERM, "MIG mode on")):
        def store(path, data, code=code):
            raise OSError(code, os.strerror(code), str(path))

        a = VgpuSysfs(Sysfs(str(h.sys_root), store=store), Procs(str(h.proc_root), str(h.dev_root)))
        with pytest.raises(VgpuError) as info:
            a.set_vf_type(vf, 1145)
        assert info.value.errno == code and words in str(info.value), str(info.value)
