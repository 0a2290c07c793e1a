"""VFs through NVIDIA's sriov-manage: a real gpud on a simulated host whose nvidia driver refuses a
raw sriov_numvfs write (no sriov_configure), driven by the real gpudctl; results compared with
the simulator's state file."""

from __future__ import annotations

import subprocess

import pytest

from gpud.sim.state import load
from tests.support.daemon import wait_until
from tests.support.vgpu_layouts import L40S
from tests.support.vgpu_layouts import L40S_ONLY as LAYOUT

pytestmark = pytest.mark.daemon


def _gpu(d) -> dict:
    return next(g for g in d.status()["gpus"] if g["pci"] == L40S)


def _waiting_message(d, text: str) -> str | None:
    g = _gpu(d)
    return g["message"] if g["state"] == "waiting" and text in g["message"] else None


def test_vfs_come_through_sriov_manage_and_a_holder_of_the_unbind_lock_is_named(daemon) -> None:
    holder = subprocess.Popen(["sleep", "600"])
    try:
        d = daemon(["l40s"], LAYOUT, vgpu="vfio")
        assert d.sim("hold", L40S, "--pid", str(holder.pid), "--name", "nv-hostengine").returncode == 0
        d.ctl("apply")
        # The message is taken from the very status read that showed the wait: a retry pass may
        # set the GPU applying again between two reads.
        msg = wait_until(lambda: _waiting_message(d, "unbindLock"), 90, "waiting on the unbind lock")
        assert "Cannot obtain unbindLock for 0000:18:00.0" in msg and f"pid {holder.pid} nv-hostengine" in msg, msg
        st = load(d.host)
        assert st.vgpu[L40S].vfs == [] and st.functions[L40S].driver == "nvidia"  # nothing changed
        holder.kill()
        holder.wait()
        wait_until(lambda: _gpu(d)["state"] == "converged", 120, "converged after the holder exited")
    finally:
        holder.kill()
        holder.wait()
    st = load(d.host)
    assert len(st.vgpu[L40S].vfs) == 32 and st.functions[L40S].driver == "nvidia"
    assert sum(1 for vf in st.vgpu[L40S].vfs if vf.vgpu_type) == 4
    assert L40S in st.persistent  # sriov-manage turned persistence on, as the real script does
    events = d.ctl("events").stdout
    assert "enabled VFs" in events



def test_a_vm_that_dies_without_release_lets_the_type_change_finish(daemon) -> None:
    """The walk: a VM holds a vGPU, a type change waits and names it, the VM process is killed (no
    `gpud-sim release`), the change finishes: its DIR/proc entry goes as the kernel closes its files."""
    d = daemon(["l40s"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    vf = next(vf.address for vf in load(d.host).vgpu[L40S].vfs if vf.vgpu_type)
    vm = subprocess.Popen(["sleep", "600"])
    try:
        assert d.sim("hold", vf, "--pid", str(vm.pid), "--vm", "web-1").returncode == 0
        assert (d.host / "proc" / str(vm.pid)).is_dir()
        d.config.write_text(LAYOUT.replace('"L40S-12Q": 4', '"L40S-24Q": 2'))
        wait_until(lambda: _gpu(d)["state"] == "waiting", 60, "waiting on the VM")
        assert "web-1" in _gpu(d)["message"] and vf in _gpu(d)["message"]
        vm.kill()
        vm.wait()
        wait_until(lambda: _gpu(d)["state"] == "converged", 60, "the change finished after the VM died")
    finally:
        vm.kill()
        vm.wait()
    assert not (d.host / "proc" / str(vm.pid)).exists()
    st = load(d.host)
    assert sum(1 for x in st.vgpu[L40S].vfs if x.vgpu_type) == 2 and st.processes == []
