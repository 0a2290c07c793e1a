"""The simulated RTX PRO 6000 Blackwell vGPU host: vendor-specific VFIO over SR-IOV only, type names
printed with the board's four-word prefix, and several MIG-backed vGPUs on one `+gfx` GPU instance.

Written through the real Sysfs adapter, read back from the simulator's state file. The expected
numbers come from NVIDIA's sources, not from gpud's table: 32 DC-1-3Q per GPU over the 4 GPU
instances of 1g.24gb+gfx (vgpu-device-manager v0.5.0 examples/config-example.yaml; the instance
count of profile 47 in tests/fixtures/captures/rtx-pro-6000/nvidia-smi-mig-lgip.txt) is 8 to an
instance; MIG-backed types sit only on `+gfx` instances (vgpu-device-manager v0.5.0
pkg/vgpu/config.go).
"""

from __future__ import annotations

import errno
import os

import pytest

from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.vgpu_sysfs import VgpuSysfs
from gpud.sim import host as sim_host_paths
from gpud.sim.cli import create
from gpud.sim.state import SimGi, load, locked
from gpud.sim.sysfs_tree import render
from tests.sim.vfs import set_vfs, write_err

RTX = "0000:18:00.0"
PREFIX = "NVIDIA RTX Pro 6000 Blackwell "


def sysfs(d) -> Sysfs:
    h = sim_host_paths(d)
    return Sysfs(str(h.sys_root), store=h.store, dev_root=str(h.dev_root))


def creatable(d, vf: str) -> dict[str, int]:
    """Printed name -> type id, from the VF's `nvidia/creatable_vgpu_types`."""
    with open(os.path.join(d, "sys/bus/pci/devices", vf, "nvidia/creatable_vgpu_types")) as f:
        lines = f.read().splitlines()
    assert lines[0] == "ID    : vGPU Name"
    return {b.strip(): int(a) for a, b in (line.split(":", 1) for line in lines[1:])}


@pytest.fixture
def rtx(tmp_path):
    """An RTX PRO 6000 with its VFs enabled and MIG on: two 1g.24gb+gfx instances (profile 47) and a
    plain 1g.24gb one (profile 14), at placements of the captured -lgipp."""
    d = tmp_path / "host"
    create(d, ["rtx-pro-6000"], vgpu="mdev")  # asks for mdev: the Blackwell board has only vendor VFIO
    sysfs(d)
    set_vfs(d, RTX, 48)
    with locked(d) as st:
        gpu = st.gpus[RTX]
        gpu.mig_mode = gpu.mig_pending = 1
        gpu.gis = [SimGi(id=1, profile_id=47, start=0, size=3), SimGi(id=2, profile_id=47, start=3, size=3),
                   SimGi(id=3, profile_id=14, start=6, size=3)]
        render(d, st)
    return d


def test_the_board_shows_vendor_vfio_with_its_printed_names(tmp_path) -> None:
    d = tmp_path / "host"
    create(d, ["rtx-pro-6000"], vgpu="mdev")
    st = load(d)
    assert st.vgpu[RTX].interface == "vfio"
    with open(os.path.join(d, "sys/bus/pci/devices", RTX, "sriov_totalvfs")) as f:
        assert f.read() == "48\n"
    assert not os.path.exists(os.path.join(d, "sys/bus/pci/devices", RTX, "mdev_supported_types"))
    set_vfs(d, RTX, 2)
    vf = load(d).vgpu[RTX].vfs[0].address
    offered = creatable(d, vf)
    assert offered[PREFIX + "DC-4Q"] == 1521 and offered[PREFIX + "DC-8C"] == 1527  # cubecos#312's ids
    assert PREFIX + "DC-96Q" in offered and not any("-1-" in n for n in offered)  # MIG off: time-sliced
    # gpud's reader keys them by the last token
    state = VgpuSysfs(sysfs(d), Procs(os.path.join(d, "proc"))).read(RTX)
    assert state.interface == "vfio"
    assert {o.type for o in state.offers} >= {"DC-4Q", "DC-96Q", "DC-8C"}


def test_eight_dc_1_3q_share_one_gfx_instance_then_the_next(rtx) -> None:
    fs = sysfs(rtx)
    vfs = [vf.address for vf in load(rtx).vgpu[RTX].vfs]
    offered = creatable(rtx, vfs[0])
    assert PREFIX + "DC-1-3Q" in offered and PREFIX + "DC-1-24Q" in offered
    assert not any(n.startswith(PREFIX + "DC-2-") or n.startswith(PREFIX + "DC-4-") for n in offered)
    q3, q24 = offered[PREFIX + "DC-1-3Q"], offered[PREFIX + "DC-1-24Q"]
    for vf in vfs[:8]:
        fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(q3))
    st = load(rtx)
    assert {vf.gpu_instance_id for vf in st.vgpu[RTX].vfs[:8]} == {1}  # one instance holds all eight
    with open(os.path.join(rtx, "sys/bus/pci/devices", vfs[7], "nvidia/gpu_instance_id")) as f:
        assert f.read() == "1\n"
    # the ninth goes to the other +gfx instance; the plain 1g.24gb instance never takes a vGPU
    fs.write(f"bus/pci/devices/{vfs[8]}/nvidia/current_vgpu_type", str(q3))
    assert load(rtx).vgpu[RTX].vfs[8].gpu_instance_id == 2
    # instance 2 now carries DC-1-3Q: a DC-1-24Q has no instance left (one type to an instance)
    assert PREFIX + "DC-1-24Q" not in creatable(rtx, vfs[9])
    assert write_err(fs, f"bus/pci/devices/{vfs[9]}/nvidia/current_vgpu_type", str(q24)) == errno.EINVAL
    for vf in vfs[9:16]:  # instance 2 fills up to eight as well
        fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", str(q3))
    assert [vf.gpu_instance_id for vf in load(rtx).vgpu[RTX].vfs[:16]] == [1] * 8 + [2] * 8
    assert creatable(rtx, vfs[16]) == {}  # both +gfx instances full: header only
    assert write_err(fs, f"bus/pci/devices/{vfs[16]}/nvidia/current_vgpu_type", str(q3)) == errno.EINVAL
    # freeing every vGPU of instance 2 lets another type take it
    for vf in vfs[8:16]:
        fs.write(f"bus/pci/devices/{vf}/nvidia/current_vgpu_type", "0")
    fs.write(f"bus/pci/devices/{vfs[8]}/nvidia/current_vgpu_type", str(q24))
    assert load(rtx).vgpu[RTX].vfs[8].gpu_instance_id == 2
    assert PREFIX + "DC-1-24Q" not in creatable(rtx, vfs[9])  # DC-1-24Q: one to an instance
