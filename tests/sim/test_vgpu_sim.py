"""The simulated vGPU host: SR-IOV VFs, vendor-VFIO attributes and mdevs, written through the real
Sysfs adapter and checked against the simulator's state file (and the kernel's rules: the errnos
of drivers/pci/iov.c and drivers/vfio/mdev in Debian's 6.1 source)."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest

from gpud.host.kernel.sysfs import Sysfs
from gpud.sim import host as sim_host_paths
from gpud.sim.cli import SimCliError, create, hold, main, release
from gpud.sim.kernel import Store
from gpud.sim.state import SimGi, load, locked
from gpud.sim.sysfs_tree import render
from tests.sim.vfs import set_vfs, write_err

L40S, A100, H200, T4 = "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0", "0000:5d:00.0"
MDEV_UUID = "5d7c1b0e-2c8a-4a55-8a52-0c3d6c9e1f01"


@pytest.fixture
def vfio_host(tmp_path):
    d = tmp_path / "host"
    create(d, ["l40s", "a100-pcie-40gb", "h200", "t4"], vgpu="vfio")
    return d


@pytest.fixture
def mdev_host(tmp_path):
    d = tmp_path / "mdev-host"
    create(d, ["l40s", "a100-pcie-40gb", "h200", "t4"], vgpu="mdev")
    return d


def sysfs(d) -> Sysfs:
    h = sim_host_paths(d)
    return Sysfs(str(h.sys_root), store=h.store, dev_root=str(h.dev_root))


def read(d, rel: str) -> str:
    with open(os.path.join(d, "sys", rel)) as f:
        return f.read()


def creatable(d, vf: str) -> list[tuple[int, str]]:
    lines = read(d, f"bus/pci/devices/{vf}/nvidia/creatable_vgpu_types").splitlines()
    assert lines[0] == "ID    : vGPU Name"
    return [(int(a), b.strip()) for a, b in (line.split(":", 1) for line in lines[1:])]


def test_create_lays_out_each_interface(vfio_host, mdev_host) -> None:
    st = load(vfio_host)
    assert {pf: v.interface for pf, v in st.vgpu.items()} == {L40S: "vfio", A100: "vfio", H200: "vfio", T4: "mdev"}
    assert {pf: v.interface for pf, v in load(mdev_host).vgpu.items()} == {L40S: "mdev", A100: "mdev", H200: "mdev",
                                                                          T4: "mdev"}
    assert read(vfio_host, f"bus/pci/devices/{L40S}/sriov_totalvfs") == "32\n"
    assert read(vfio_host, f"bus/pci/devices/{A100}/sriov_totalvfs") == "16\n"
    assert read(vfio_host, f"bus/pci/devices/{L40S}/sriov_numvfs") == "0\n"
    assert not os.path.exists(os.path.join(vfio_host, "sys/bus/pci/devices", T4, "sriov_totalvfs"))
    # T4: mdev on the GPU itself, type names as the driver prints them
    assert read(vfio_host, f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-230/name") == "GRID T4-1Q\n"
    assert read(vfio_host, f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-230/available_instances") == "16\n"
    assert read(vfio_host, f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-230/device_api") == "vfio-pci\n"


def test_cli_refuses_a_host_without_vgpu_gpus(tmp_path, capsys) -> None:
    assert main(["create", str(tmp_path / "h"), "--gpu", "h100-80gb", "--vgpu", "vfio"]) == 1
    assert "none of these GPUs offers vGPU types" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["create", str(tmp_path / "h2"), "--gpu", "l40s", "--vgpu", "sriov"])
    assert usage.value.code == 2


def _to_pf_stub(d, fs: Sysfs, pf: str) -> None:
    from gpud.sim.kernel import modprobe

    fs.write("bus/pci/drivers/nvidia/unbind", pf)
    modprobe(d, "pci-pf-stub")
    fs.write("bus/pci/drivers/pci-pf-stub/new_id", "10de 26b9")
    assert load(d).functions[pf].driver == "pci-pf-stub"


def test_sriov_numvfs_kernel_rules(vfio_host) -> None:
    """drivers/pci/iov.c sriov_numvfs_store on a PF whose driver has sriov_configure (pci-pf-stub)."""
    fs = sysfs(vfio_host)
    rel = f"bus/pci/devices/{L40S}/sriov_numvfs"
    _to_pf_stub(vfio_host, fs, L40S)
    assert write_err(fs, rel, "33") == errno.ERANGE
    assert write_err(fs, rel, "four") == errno.EINVAL
    fs.write(rel, "4")
    st = load(vfio_host)
    vfs = [vf.address for vf in st.vgpu[L40S].vfs]
    assert vfs == ["0000:18:00.4", "0000:18:00.5", "0000:18:00.6", "0000:18:00.7"]
    for i, vf in enumerate(vfs):
        assert os.readlink(os.path.join(vfio_host, "sys/bus/pci/devices", L40S, f"virtfn{i}")) == f"../{vf}"
        assert os.readlink(os.path.join(vfio_host, "sys/bus/pci/devices", vf, "physfn")) == f"../{L40S}"
        assert st.functions[vf].driver == "nvidia" and st.functions[vf].device == 0x26B9
    fs.write(rel, "4")  # the same count: nothing to do
    assert write_err(fs, rel, "8") == errno.EBUSY  # a non-zero count changes only through 0
    fs.write(rel, "0")
    st = load(vfio_host)
    assert st.vgpu[L40S].vfs == [] and not any(a.startswith("0000:18:00.") and a != L40S for a in st.functions)
    # VFs are not GPUs to manage: the adapter's GPU scan leaves them out
    fs.write(rel, "2")
    assert [f.address for f in fs.functions() if f.address.startswith("0000:18")] == [L40S]


def test_sriov_numvfs_needs_a_driver_with_sriov_configure(vfio_host) -> None:
    """nvidia has no sriov_configure (nv-pci.c): ENOENT while it is bound, and with no driver."""
    fs = sysfs(vfio_host)
    rel = f"bus/pci/devices/{L40S}/sriov_numvfs"
    assert write_err(fs, rel, "4") == errno.ENOENT
    fs.write(rel, "0")  # the count it has: the kernel returns before asking the driver
    fs.write("bus/pci/drivers/nvidia/unbind", L40S)
    assert write_err(fs, rel, "4") == errno.ENOENT
    assert load(vfio_host).vgpu[L40S].vfs == []


def test_sriov_manage_enables_through_the_stub_and_refuses_while_held(vfio_host, capsys) -> None:
    """NVIDIA's sriov-manage: the unbind lock first (refused while a process or an NVML session holds
    the GPU), the PF via pci-pf-stub, all VFs, nvidia back, persistence on, VFs on nvidia."""
    from gpud.sim.sriov_manage import run

    hold(vfio_host, L40S, 7001, name="dcgm")
    before = load(vfio_host)
    assert run(vfio_host, "-e", L40S) == 1
    assert "Cannot obtain unbindLock for 0000:18:00.0" in capsys.readouterr().err
    after = load(vfio_host)
    assert after.vgpu[L40S].vfs == [] and after.functions[L40S].driver == "nvidia"
    assert after.functions[L40S].nvidia_probes == before.functions[L40S].nvidia_probes
    release(vfio_host, L40S, 7001)
    assert run(vfio_host, "-e", L40S) == 0
    st = load(vfio_host)
    assert len(st.vgpu[L40S].vfs) == 32 and st.functions[L40S].driver == "nvidia"
    assert st.functions[L40S].nvidia_probes == before.functions[L40S].nvidia_probes + 1
    assert all(st.functions[vf.address].driver == "nvidia" for vf in st.vgpu[L40S].vfs)
    assert L40S in st.persistent and st.persistence == "legacy"
    assert run(vfio_host, "-e", L40S) == 0 and "already has VFs enabled" in capsys.readouterr().out
    assert run(vfio_host, "-d", L40S) == 0
    assert load(vfio_host).vgpu[L40S].vfs == [] and read(vfio_host, f"bus/pci/devices/{L40S}/sriov_numvfs") == "0\n"


def test_vendor_vfio_creatable_list_shrinks_then_header_only(vfio_host) -> None:
    fs = sysfs(vfio_host)
    set_vfs(vfio_host, L40S, 6)
    vfs = [vf.address for vf in load(vfio_host).vgpu[L40S].vfs]
    offered = creatable(vfio_host, vfs[0])
    names = [n for _, n in offered]
    assert names[:3] == ["NVIDIA L40S-1B", "NVIDIA L40S-1Q", "NVIDIA L40S-2Q"]
    assert (1145, "NVIDIA L40S-1B") in offered and (1159, "NVIDIA L40S-48Q") in offered  # sourced ids
    type_12q = next(i for i, n in offered if n == "NVIDIA L40S-12Q")
    fs.write(f"bus/pci/devices/{vfs[0]}/nvidia/current_vgpu_type", str(type_12q))
    # siblings now offer only the same type (time-sliced vGPUs on one GPU are one type)
    assert creatable(vfio_host, vfs[1]) == [(type_12q, "NVIDIA L40S-12Q")]
    assert creatable(vfio_host, vfs[0]) == []  # a VF with a vGPU offers nothing more
    for vf in vfs[1:4]:
        fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(type_12q))
    # 4 x 12Q fill 48 GB: the remaining free VFs show the header only
    assert read(vfio_host, f"bus/pci/devices/{vfs[4]}/nvidia/creatable_vgpu_types") == "ID    : vGPU Name\n"
    assert write_err(fs, f"bus/pci/devices/{vfs[4]}/nvidia/current_vgpu_type", str(type_12q)) == errno.EINVAL
    assert write_err(fs, f"bus/pci/devices/{vfs[0]}/nvidia/current_vgpu_type", str(type_12q)) == errno.EBUSY
    assert [vf.vgpu_type for vf in load(vfio_host).vgpu[L40S].vfs] == [type_12q] * 4 + [0, 0]
    # echo 0 frees a VF; the list comes back
    fs.write(f"bus/pci/devices/{vfs[3]}/nvidia/current_vgpu_type", "0")
    assert read(vfio_host, f"bus/pci/devices/{vfs[3]}/nvidia/current_vgpu_type") == "0\n"
    assert creatable(vfio_host, vfs[4]) == [(type_12q, "NVIDIA L40S-12Q")]
    # VFs with vGPUs cannot be disabled
    with pytest.raises(OSError) as info:
        set_vfs(vfio_host, L40S, 0)
    assert info.value.errno == errno.EBUSY


def test_held_vf_cannot_be_freed_and_shows_a_vfio_group(vfio_host) -> None:
    fs = sysfs(vfio_host)
    set_vfs(vfio_host, L40S, 2)
    vf = load(vfio_host).vgpu[L40S].vfs[0].address
    type_id = next(i for i, n in creatable(vfio_host, vf) if n == "NVIDIA L40S-24Q")
    fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(type_id))
    hold(vfio_host, vf, 4242, vm="web-1")
    group = load(vfio_host).functions[vf].iommu_group
    fd_link = os.readlink(os.path.join(vfio_host, "proc/4242/fd/4"))
    assert fd_link.endswith(f"/dev/vfio/{group}") and os.path.exists(fd_link)
    with open(os.path.join(vfio_host, "proc/4242/cmdline"), "rb") as f:
        assert b"-name\0guest=web-1," in f.read()
    assert write_err(fs, f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", "0") == errno.EBUSY
    release(vfio_host, vf, 4242)
    fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", "0")


def test_mig_backed_types_need_mig_and_an_instance(vfio_host) -> None:
    fs = sysfs(vfio_host)
    set_vfs(vfio_host, H200, 4)
    vfs = [vf.address for vf in load(vfio_host).vgpu[H200].vfs]
    names = [n for _, n in creatable(vfio_host, vfs[0])]
    assert "NVIDIA H200X-141C" in names and not any("-1-18C" in n for n in names)  # MIG off: time-sliced only
    with locked(vfio_host) as st:  # the hardware gets MIG on with two 1g.18gb and one 3g.71gb instances
        gpu = st.gpus[H200]
        gpu.mig_mode = gpu.mig_pending = 1
        gpu.gis = [SimGi(id=9, profile_id=19, start=0, size=1), SimGi(id=10, profile_id=19, start=1, size=1),
                   SimGi(id=2, profile_id=9, start=4, size=4)]
        render(vfio_host, st)
    offered = creatable(vfio_host, vfs[0])
    assert (1414, "NVIDIA H200X-1-18C") in offered
    assert sorted(n for _, n in offered) == ["NVIDIA H200X-1-18C", "NVIDIA H200X-3-71C"]
    for vf in vfs[:2]:
        fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", "1414")
    st = load(vfio_host)
    assert [(v.vgpu_type, v.gpu_instance_id) for v in st.vgpu[H200].vfs[:2]] == [(1414, 9), (1414, 10)]
    assert read(vfio_host, f"bus/pci/devices/{vfs[1]}/nvidia/gpu_instance_id") == "10\n"
    assert read(vfio_host, f"bus/pci/devices/{vfs[1]}/nvidia/placement_id") == "1\n"
    assert [n for _, n in creatable(vfio_host, vfs[2])] == ["NVIDIA H200X-3-71C"]  # both 1g instances taken
    assert write_err(fs, f"bus/pci/devices/{vfs[2]}/nvidia/current_vgpu_type", "1414") == errno.EINVAL


def test_mdev_on_a_card_without_sriov(vfio_host) -> None:
    fs = sysfs(vfio_host)
    types = f"bus/pci/devices/{T4}/mdev_supported_types"
    assert write_err(fs, f"{types}/nvidia-231/create", "not-a-uuid") == errno.EINVAL
    fs.write(f"{types}/nvidia-231/create", MDEV_UUID)  # T4-2Q
    assert write_err(fs, f"{types}/nvidia-231/create", MDEV_UUID) == errno.EEXIST
    assert read(vfio_host, f"{types}/nvidia-231/available_instances") == "7\n"
    assert read(vfio_host, f"{types}/nvidia-230/available_instances") == "0\n"  # one type per GPU
    assert write_err(fs, f"{types}/nvidia-230/create", "6f1e2d3c-0000-4000-8000-000000000001") == errno.ENOSPC
    mdev = os.path.join(vfio_host, "sys/bus/mdev/devices", MDEV_UUID)
    assert os.path.basename(os.readlink(os.path.join(mdev, "mdev_type"))) == "nvidia-231"
    assert os.path.islink(os.path.join(vfio_host, "sys/class/mdev_bus", T4))
    st = load(vfio_host)
    assert [(m.uuid, m.parent, m.type_id) for m in st.vgpu[T4].mdevs] == [(MDEV_UUID, T4, 231)]
    group = st.vgpu[T4].mdevs[0].iommu_group
    assert os.path.basename(os.readlink(os.path.join(mdev, "iommu_group"))) == str(group)
    assert os.path.exists(os.path.join(vfio_host, "dev/vfio", str(group)))
    fs.write(f"bus/mdev/devices/{MDEV_UUID}/remove", "1")
    assert load(vfio_host).vgpu[T4].mdevs == [] and not os.path.exists(mdev)


def test_mdev_parents_are_vfs_on_sriov_gpus(mdev_host) -> None:
    fs = sysfs(mdev_host)
    assert not os.path.exists(os.path.join(mdev_host, "sys/bus/pci/devices", A100, "mdev_supported_types"))
    set_vfs(mdev_host, A100, 16)
    vfs = [vf.address for vf in load(mdev_host).vgpu[A100].vfs]
    tdir = next(t for t in os.listdir(os.path.join(mdev_host, "sys/bus/pci/devices", vfs[0], "mdev_supported_types"))
                if read(mdev_host, f"bus/pci/devices/{vfs[0]}/mdev_supported_types/{t}/name") == "NVIDIA A100-20C\n")
    fs.write(f"bus/pci/devices/{vfs[0]}/mdev_supported_types/{tdir}/create", MDEV_UUID)
    # one vGPU per VF parent
    assert read(mdev_host, f"bus/pci/devices/{vfs[0]}/mdev_supported_types/{tdir}/available_instances") == "0\n"
    assert read(mdev_host, f"bus/pci/devices/{vfs[1]}/mdev_supported_types/{tdir}/available_instances") == "1\n"
    fs.write(f"bus/pci/devices/{vfs[1]}/mdev_supported_types/{tdir}/create", "6f1e2d3c-0000-4000-8000-000000000002")
    # A100-20C fits twice: the other VFs are full for it
    assert read(mdev_host, f"bus/pci/devices/{vfs[2]}/mdev_supported_types/{tdir}/available_instances") == "0\n"


def test_removing_a_held_mdev_blocks_until_the_vm_lets_go(vfio_host) -> None:
    """6.1's vfio_unregister_group_dev waits for the device to be released: the write returns only
    after the holder closes (here released from the store's on_block callback, no timing)."""
    fs = sysfs(vfio_host)
    fs.write(f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-232/create", MDEV_UUID)
    hold(vfio_host, MDEV_UUID, 777, vm="db-1")
    blocked = []

    def on_block(name: str) -> None:
        blocked.append(name)
        assert load(vfio_host).vgpu[T4].mdevs  # still there while held
        release(vfio_host, MDEV_UUID, 777)

    store = Store(vfio_host, poll_interval=0.001, on_block=on_block)
    store(os.path.join(vfio_host, "sys/bus/mdev/devices", MDEV_UUID, "remove"), b"1\n")
    assert blocked == [MDEV_UUID]
    assert load(vfio_host).vgpu[T4].mdevs == []


def test_hold_names_mdevs_and_vfs(vfio_host, capsys) -> None:
    fs = sysfs(vfio_host)
    fs.write(f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-232/create", MDEV_UUID)
    assert main(["hold", str(vfio_host), MDEV_UUID.upper(), "--pid", "31337", "--vm", "win-7"]) == 0
    procs = json.loads(Path(vfio_host, "state.json").read_text())["processes"]
    assert procs == [{"pid": 31337, "name": "qemu-system-x86", "device": MDEV_UUID, "used_mb": 256, "real": False,
                      "vm": "win-7", "cdev": False}]


def test_nvml_refuses_mig_changes_under_vgpus(tmp_path) -> None:
    """A GPU instance carrying a MIG-backed vGPU cannot be destroyed, and MIG mode does not change
    under vGPUs: the fake NVML answers IN_USE, as it does for compute instances."""
    import pynvml

    from gpud import sim

    d = tmp_path / "nvml-host"
    create(d, ["h200", "l40s"], vgpu="vfio")
    fs = sysfs(d)
    set_vfs(d, "0000:18:00.0", 2)
    with locked(d) as st:
        gpu = st.gpus["0000:18:00.0"]
        gpu.mig_mode = gpu.mig_pending = 1
        gpu.gis = [SimGi(id=1, profile_id=19, start=0, size=1), SimGi(id=2, profile_id=19, start=1, size=1)]
        render(d, st)
    fs.write("bus/pci/devices/0000:18:00.4/nvidia/current_vgpu_type", "1414")
    sim.install(d)
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        placed_gi = load(d).vgpu["0000:18:00.0"].vfs[0].gpu_instance_id
        for gi_id, expect_in_use in ((placed_gi, True), (3 - placed_gi, False)):
            gi = pynvml.nvmlDeviceGetGpuInstanceById(h, gi_id)
            if expect_in_use:
                with pytest.raises(pynvml.NVMLError_InUse):
                    pynvml.nvmlGpuInstanceDestroy(gi)
            else:
                pynvml.nvmlGpuInstanceDestroy(gi)
        assert [g.id for g in load(d).gpus["0000:18:00.0"].gis] == [placed_gi]
        pynvml.nvmlShutdown()
    finally:
        sim.uninstall()


def test_clear_for_reboot_drops_vfs_vgpus_and_their_vms(vfio_host) -> None:
    """What `gpud-sim reboot` calls: every VF, vendor-VFIO type and mdev gone, with the VMs that held
    them; a process on the GPU itself and the GPUs' MIG state are not the vGPU side's to clear.
    Checked on the state file and on the rendered sysfs tree the adapter reads."""
    from gpud.sim import vgpu as sim_vgpu

    fs = sysfs(vfio_host)
    set_vfs(vfio_host, L40S, 2)
    vf = load(vfio_host).vgpu[L40S].vfs[0].address
    type_id = next(i for i, n in creatable(vfio_host, vf) if n == "NVIDIA L40S-24Q")
    fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(type_id))
    fs.write(f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-232/create", MDEV_UUID)
    hold(vfio_host, vf, 4242, vm="web-1")
    hold(vfio_host, MDEV_UUID, 4343, vm="db-1")
    hold(vfio_host, H200, 4444, name="cuda-app")
    with locked(vfio_host) as st:
        sim_vgpu.clear_for_reboot(st)
        render(vfio_host, st)
    raw = json.loads(Path(vfio_host, "state.json").read_text())
    assert all(v["vfs"] == [] and v["mdevs"] == [] for v in raw["vgpu"].values())
    assert vf not in raw["functions"] and L40S in raw["functions"]
    assert [(p["pid"], p["device"]) for p in raw["processes"]] == [(4444, H200)]
    assert read(vfio_host, f"bus/pci/devices/{L40S}/sriov_numvfs") == "0\n"
    assert not os.path.exists(os.path.join(vfio_host, "sys/bus/pci/devices", vf))
    assert not os.path.exists(os.path.join(vfio_host, "sys/bus/pci/devices", L40S, "virtfn0"))
    assert not os.path.exists(os.path.join(vfio_host, "sys/bus/mdev/devices", MDEV_UUID))
    # the host works on after it: VFs come back empty, the T4 offers every type again
    set_vfs(vfio_host, L40S, 2)
    assert [v.vgpu_type for v in load(vfio_host).vgpu[L40S].vfs] == [0, 0]
    assert read(vfio_host, f"bus/pci/devices/{T4}/mdev_supported_types/nvidia-230/available_instances") == "16\n"


def test_vfio_devices_have_a_cdev_and_hold_cdev_opens_only_it(vfio_host) -> None:
    """Kernels 6.8+: `<dev>/vfio-dev/vfioN` and /dev/vfio/devices/vfioN beside the group node."""
    fs = sysfs(vfio_host)
    set_vfs(vfio_host, L40S, 2)
    vf = load(vfio_host).vgpu[L40S].vfs[1].address
    assert not os.path.exists(os.path.join(vfio_host, "sys/bus/pci/devices", vf, "vfio-dev"))  # no type: no vfio device
    with pytest.raises(SimCliError):
        hold(vfio_host, vf, 4242, vm="web-1", cdev=True)
    type_id = next(i for i, n in creatable(vfio_host, vf) if n == "NVIDIA L40S-24Q")
    fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(type_id))
    assert os.listdir(os.path.join(vfio_host, "sys/bus/pci/devices", vf, "vfio-dev")) == ["vfio0"]
    assert os.path.exists(os.path.join(vfio_host, "dev/vfio/devices/vfio0"))
    hold(vfio_host, vf, 4242, vm="web-1", cdev=True)
    fd = os.path.join(vfio_host, "proc/4242/fd")
    assert [os.readlink(os.path.join(fd, n)).rsplit("/dev/", 1)[1] for n in os.listdir(fd)] == ["vfio/devices/vfio0"]
    assert write_err(fs, f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", "0") == errno.EBUSY  # held all the same


def test_vfio_pci_refuses_a_pf_with_vfs_enabled(vfio_host) -> None:
    """vfio_pci_probe: "Cannot bind to PF with SR-IOV enabled" -> EBUSY; with the VFs gone it binds."""
    fs = sysfs(vfio_host)
    set_vfs(vfio_host, L40S, 2)
    fs.write(f"bus/pci/devices/{L40S}/driver_override", "vfio-pci")
    fs.write("bus/pci/drivers/nvidia/unbind", L40S)
    from gpud.sim.kernel import modprobe

    modprobe(vfio_host, "vfio-pci")
    assert load(vfio_host).functions[L40S].driver is None  # the module's probe did not take it
    assert write_err(fs, "bus/pci/drivers/vfio-pci/bind", L40S) == errno.EBUSY


def test_sriov_manage_rebind_destroys_instances_and_mig_off_waits_for_the_vfs(tmp_path) -> None:
    """The PF's rebind to nvidia is a new probe: no GPU instance survives it, MIG mode does; NVML
    refuses to turn MIG off while VFs exist (as `nvidia-smi -mig 0` does)."""
    import pynvml

    from gpud import sim
    from gpud.sim.sriov_manage import run

    d = tmp_path / "host"
    create(d, ["h200"], vgpu="vfio", persistence="off")
    pf = "0000:18:00.0"
    with locked(d) as st:
        st.gpus[pf].mig_mode = st.gpus[pf].mig_pending = 1
        st.gpus[pf].gis = [SimGi(id=1, profile_id=19, start=0, size=1)]
        render(d, st)
    assert run(d, "-e", pf) == 0
    st = load(d)
    assert st.gpus[pf].gis == [] and st.gpus[pf].mig_mode == 1 and len(st.vgpu[pf].vfs) == 32
    sim.install(d)
    try:
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByPciBusId(pf)
        with pytest.raises(pynvml.NVMLError) as info:
            pynvml.nvmlDeviceSetMigMode(h, 0)
        assert info.value.value == pynvml.NVML_ERROR_IN_USE
        pynvml.nvmlShutdown()
        assert run(d, "-d", pf) == 0
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByPciBusId(pf)
        pynvml.nvmlDeviceSetMigMode(h, 0)
        pynvml.nvmlShutdown()
    finally:
        sim.uninstall()
    assert load(d).gpus[pf].mig_pending == 0


def test_unplug_of_a_card_whose_vf_carries_a_vgpu_type(vfio_host) -> None:
    """Issue 33 item 12: `gpud-sim unplug` failed (a vfio cdev rendered under the removed VF's
    directory) for a GPU one of whose VFs carried a vGPU type. The card goes whole: PF and VFs
    leave the bus and sysfs, with their cdevs; the other cards stay."""
    from gpud.sim.kernel import plug, unplug

    fs = sysfs(vfio_host)
    set_vfs(vfio_host, L40S, 4)
    vfs = [vf.address for vf in load(vfio_host).vgpu[L40S].vfs]
    type_12q = next(i for i, n in creatable(vfio_host, vfs[0]) if n == "NVIDIA L40S-12Q")
    fs.write(f"bus/pci/devices/{vfs[0]}/nvidia/current_vgpu_type", str(type_12q))
    unplug(vfio_host, L40S)
    st = load(vfio_host)
    assert not any(st.functions[a].present for a in [L40S, *vfs])
    assert st.functions[H200].present
    for a in [L40S, *vfs]:
        assert not os.path.lexists(os.path.join(vfio_host, "sys", "bus/pci/devices", a))
    assert os.path.isdir(os.path.join(vfio_host, "sys", "bus/pci/devices", H200))
    plug(vfio_host, L40S)
    assert load(vfio_host).functions[L40S].present
