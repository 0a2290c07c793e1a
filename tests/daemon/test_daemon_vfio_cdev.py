"""A VMM that opens a vfio device through its cdev (/dev/vfio/devices/vfioN, iommufd, kernels 6.8+)
and not through /dev/vfio/<group>: gpud sees it as a holder of a passthrough GPU and of a vGPU VF.
A real gpud on a simulated host (`gpud-sim hold --cdev`), checked against the simulator's state."""

from __future__ import annotations

import json

import pytest

from gpud.sim.state import load
from tests.scenarios.definitions import layout
from tests.support.daemon import wait_until
from tests.support.vgpu_layouts import L40S
from tests.support.vgpu_layouts import L40S_ONLY as VGPU

pytestmark = pytest.mark.daemon

PASS = layout({"devices": [0], "workload": "vm-passthrough"})
BACK = layout({"devices": [0], "workload": "container"})


def test_passthrough_gpu_held_through_its_cdev_is_not_taken_from_the_vm(daemon, tmp_path):
    d = daemon(["rtx6000-ada:1"], PASS, "--unbind-timeout", "10")
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    pci = d.status()["gpus"][0]["pci"]
    assert d.sim("hold", pci, "--pid", "6001", "--vm", "win-1", "--cdev").returncode == 0
    fd = d.host / "proc" / "6001" / "fd"
    assert [str(p.readlink()).rsplit("/dev/", 1)[1] for p in fd.iterdir()] == ["vfio/devices/vfio0"]
    (tmp_path / "back.yaml").write_text(BACK)
    plan = json.loads(d.ctl("plan", "--json", str(tmp_path / "back.yaml")).stdout)
    assert [h["pid"] for r in plan["disruption"]["rebinds"] for h in r["holders"]] == [6001], plan["disruption"]
    d.config.write_text(BACK)
    wait_until(lambda: d.status()["gpus"][0]["state"] == "waiting", 60, "waiting on the VM")
    assert load(d.host).functions[pci].driver == "vfio-pci"
    assert any(h["pid"] == 6001 for h in d.status()["gpus"][0]["holders"])
    assert d.sim("release", pci, "--pid", "6001").returncode == 0
    d.ctl("apply")
    wait_until(lambda: load(d.host).functions[pci].driver == "nvidia", 60, "back on nvidia after the VM let go")


def test_vgpu_vf_held_through_its_cdev_blocks_its_removal(daemon):
    d = daemon(["l40s"], VGPU, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    vf = next(vf.address for vf in load(d.host).vgpu[L40S].vfs if vf.vgpu_type)
    assert d.sim("hold", vf, "--pid", "6002", "--vm", "web-1", "--cdev").returncode == 0
    d.config.write_text(VGPU.replace('"L40S-12Q": 4', '"L40S-24Q": 2'))
    wait_until(lambda: next(g for g in d.status()["gpus"] if g["pci"] == L40S)["state"] == "waiting", 60, "waiting")
    g = next(g for g in d.status()["gpus"] if g["pci"] == L40S)
    assert "web-1" in g["message"] and vf in g["message"], g["message"]
    held = next(x for x in load(d.host).vgpu[L40S].vfs if x.address == vf)
    assert held.vgpu_type != 0  # not freed under the VM
