"""`gpud-sim reboot DIR` does what a host reboot does (docs/hardware/reboot.md). Each expectation is
written here from the documented rule, not from the simulator's code, and checked in the simulator's
own state file and rendered trees:
- GPU and compute instances are gone; a pending MIG mode takes effect;
- the MIG mode persists on Ampere ("similar to ECC mode ... persistent across reboots", NVIDIA MIG
  user guide, Deployment Considerations) and is lost on Hopper;
- driver_override is lost; a udev rule on ACTION=="add" sets it again before the driver probes;
- processes are gone; the boot id changes."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gpud.engine.binding.udev_rules import render as render_rules
from gpud.sim import cli as simcli
from gpud.sim.reboot import RuleError, reboot
from gpud.sim.state import SimCi, SimGi, SimProcess, load, locked
from tests.sim.vfs import set_vfs

A100, H100, H100_PT = "0000:18:00.0", "0000:2a:00.0", "0000:3a:00.0"


@pytest.fixture
def host(tmp_path):
    d = tmp_path / "host"
    simcli.create(d, ["a100-40gb:1", "h100-80gb:2"], mig_on=[0, 1])
    with locked(d) as st:
        assert sorted(st.gpus) == [A100, H100, H100_PT]
        st.gpus[A100].gis = [SimGi(id=1, profile_id=9, start=0, size=4, cis=[SimCi(0, 2, "MIG-a")])]
        st.gpus[H100].gis = [SimGi(id=2, profile_id=19, start=0, size=1, cis=[SimCi(0, 0, "MIG-b")])]
        st.gpus[A100].mig_pending = 0  # a disable waiting for a reset
        st.gpus[H100_PT].mig_pending = 1  # an enable that a busy GPU kept pending
        st.functions[H100].driver_override = "nvidia"
        st.processes.append(SimProcess(pid=4242, name="train.py", device="MIG-b"))
        st.hangs.append(H100)
    return d


def test_instances_modes_overrides_and_processes_after_a_reboot(host):
    before = load(host)
    reboot(host)
    st = load(host)
    assert all(not g.gis for g in st.gpus.values())
    assert (st.gpus[A100].mig_mode, st.gpus[A100].mig_pending) == (0, 0)  # the pending disable took effect
    assert (st.gpus[H100].mig_mode, st.gpus[H100].mig_pending) == (0, 0)  # Hopper: not kept
    assert (st.gpus[H100_PT].mig_mode, st.gpus[H100_PT].mig_pending) == (0, 0)  # took effect, then not kept
    assert all(f.driver_override is None for f in st.functions.values())
    assert all(f.driver == f.native_driver for f in st.functions.values() if f.present)
    assert st.processes == [] and st.hangs == []
    assert st.boot_id != before.boot_id and st.boots == 1
    assert (host / "proc/sys/kernel/random/boot_id").read_text().strip() == st.boot_id
    assert not (host / "proc/4242").exists()


def test_ampere_keeps_its_mig_mode(tmp_path):
    d = tmp_path / "host"
    simcli.create(d, ["a100-80gb:1", "h200:1"], mig_on=[0, 1])
    reboot(d)
    modes = {a: (g.model, g.mig_mode) for a, g in load(d).gpus.items()}
    assert sorted(modes.values()) == [("a100-80gb", 1), ("h200", 0)]


def test_the_udev_rules_pin_a_passthrough_gpu_at_boot(host):
    rules = host / "etc/udev/rules.d/70-gpud-vfio.rules"
    rules.parent.mkdir(parents=True)
    rules.write_text(render_rules([H100_PT]))  # what gpud writes for a vm-passthrough GPU
    reboot(host)
    st = load(host)
    assert (st.functions[H100_PT].driver, st.functions[H100_PT].driver_override) == ("vfio-pci", "vfio-pci")
    assert st.functions[H100].driver == "nvidia" and st.functions[A100].driver == "nvidia"
    assert "vfio_pci" in st.loaded_modules
    assert (host / f"sys/bus/pci/devices/{H100_PT}/driver").resolve().name == "vfio-pci"


def test_a_rule_the_simulated_udevd_does_not_know_changes_nothing(host):
    rules = host / "etc/udev/rules.d/99-other.rules"
    rules.parent.mkdir(parents=True)
    rules.write_text('ACTION=="add", SUBSYSTEM=="pci", PROGRAM="/bin/true"\n')
    before = (host / "state.json").read_bytes()
    with pytest.raises(RuleError, match=r"99-other.rules:1: .*PROGRAM"):
        reboot(host)
    assert (host / "state.json").read_bytes() == before


def test_the_command_line(host):
    out = subprocess.run([sys.executable, "-m", "gpud.sim.cli", "reboot", str(host)],
                         capture_output=True, text=True, check=True).stdout
    assert f"{H100}: MIG mode lost (hopper)" in out
    assert load(host).boots == 1


def test_vfs_and_vgpus_are_gone_after_a_reboot(tmp_path):
    """VFs (their PCI functions too) and mdev vGPUs do not survive a reboot (docs/vgpu.md): a host
    with a vendor-VFIO L40S (4 VFs, one with a vGPU type) and an mdev T4 (one vGPU) comes back
    with sriov_numvfs 0 and no mdev, as its state file and sysfs tree show."""
    from gpud.host.kernel.sysfs import Sysfs
    from gpud.sim import host as sim_host_paths

    d = tmp_path / "host"
    simcli.create(d, ["l40s", "t4"], vgpu="vfio")
    l40s, t4 = sorted(load(d).gpus)
    h = sim_host_paths(d)
    fs = Sysfs(str(h.sys_root), store=h.store, dev_root=str(h.dev_root))
    set_vfs(d, l40s, 4)
    vfs = [vf.address for vf in load(d).vgpu[l40s].vfs]
    fs.write(f"bus/pci/devices/{vfs[0]}/nvidia/current_vgpu_type", "1145")
    uuid = "5d7c1b0e-2c8a-4a55-8a52-0c3d6c9e1f01"
    fs.write(f"bus/pci/devices/{t4}/mdev_supported_types/nvidia-230/create", uuid)
    st = load(d)
    assert len(st.vgpu[l40s].vfs) == 4 and len(st.vgpu[t4].mdevs) == 1 and vfs[0] in st.functions

    reboot(d)
    st = load(d)
    assert st.vgpu[l40s].vfs == [] and st.vgpu[t4].mdevs == []
    assert not any(vf in st.functions for vf in vfs)
    assert (d / "sys" / "bus" / "pci" / "devices" / l40s / "sriov_numvfs").read_text() == "0\n"
    assert not (d / "sys" / "bus" / "mdev" / "devices" / uuid).exists()
