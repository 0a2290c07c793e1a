"""MIG-backed vGPUs on an RTX PRO 6000 Blackwell end to end: a real gpud on a simulated host (vendor
VFIO over SR-IOV), driven by the real gpudctl, with the layout naming the types as NVIDIA's tools
do (the last token of the driver's `NVIDIA RTX Pro 6000 Blackwell DC-1-3Q`). Results are read from
the simulator's state file: the MIG layout the types imply (1g.24gb+gfx instances, profile 47 in
the model's capture), eight DC-1-3Q on one instance (NVIDIA's 32 per GPU over 4 instances)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from gpud.sim import vgpu as sim_vgpu
from gpud.sim.state import load
from tests.support.present import present

pytestmark = pytest.mark.daemon

RTX = "0000:18:00.0"
LAYOUT = """\
version: v1
layouts:
  vms:
    - devices: [0]
      workload: vm-vgpu
      vgpu-devices: {"DC-1-3Q": 9, "NVIDIA RTX Pro 6000 Blackwell DC-1-24Q": 1}
"""


def test_mig_backed_vgpus_share_gfx_instances(daemon) -> None:
    d = daemon(["rtx-pro-6000"], LAYOUT, vgpu="vfio")
    r = d.ctl("apply", "--wait", "--timeout", "180")
    assert r.returncode == 0, r.stdout + r.stderr + d.log.read_text()[-3000:]
    st = load(d.host)
    gpu = st.gpus[RTX]
    assert gpu.mig_mode == 1 and sorted(gi.profile_id for gi in gpu.gis) == [47, 47, 47]
    names = {t.vfio_id: t.name for t in sim_vgpu.sim_types(present(sim_vgpu.vgpu_model(st, RTX)))}
    on: dict[int, Counter] = {}
    for vf in st.vgpu[RTX].vfs:
        if vf.vgpu_type:
            on.setdefault(vf.gpu_instance_id, Counter())[names[vf.vgpu_type]] += 1
    assert sorted(on.values(), key=lambda c: sorted(c.items())) == [
        Counter({"DC-1-24Q": 1}), Counter({"DC-1-3Q": 1}), Counter({"DC-1-3Q": 8})]
    status = d.status()
    g = status["gpus"][0]
    assert g["state"] == "converged", g
    assert sorted(dev["type"] for dev in g["vgpu"]["devices"]) == ["DC-1-24Q"] + ["DC-1-3Q"] * 9
    assert "9xDC-1-3Q" in d.ctl("status").stdout
    types = json.loads(d.ctl("vgpu", "types", "--json").stdout)["gpus"][0]["types"]
    dc13 = next(t for t in types if t["name"] == "DC-1-3Q")
    assert dc13["mig_profile"] == "1g.24gb+gfx" and dc13["max"] == 32
