"""vm-vgpu end to end: a real gpud on a simulated host with an L40S (vendor VFIO) and a T4 (mdev),
driven by the real gpudctl; results compared with the simulator's state file."""

from __future__ import annotations

import json

import pytest

from gpud.sim import vgpu as sim_vgpu
from gpud.sim.state import load, locked
from gpud.sim.sysfs_tree import render
from tests.support.daemon import start_until_ready, wait_until
from tests.support.vgpu_host import sim_vgpus
from tests.support.vgpu_layouts import L40S, T4
from tests.support.vgpu_layouts import L40S_AND_T4 as LAYOUT

pytestmark = pytest.mark.daemon


def status_vgpus(status: dict, pf: str) -> list[tuple[str, str]]:
    g = next(g for g in status["gpus"] if g["pci"] == pf)
    return sorted((d["type"], d["uuid"] or d["vf"]) for d in g["vgpu"]["devices"])


def test_vm_vgpu_converges_and_reports(daemon) -> None:
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    r = d.ctl("apply", "--wait", "--timeout", "120")
    assert r.returncode == 0, r.stdout + r.stderr + d.log.read_text()[-3000:]
    st = d.status()
    assert [g["state"] for g in st["gpus"]] == ["converged", "converged"]
    l40s, t4 = st["gpus"]
    assert l40s["vgpu"]["interface"] == "vfio" and l40s["vgpu"]["vfs"] == 32
    assert t4["vgpu"]["interface"] == "mdev"
    assert status_vgpus(st, L40S) == sim_vgpus(d.host, L40S) and len(sim_vgpus(d.host, L40S)) == 4
    assert status_vgpus(st, T4) == sim_vgpus(d.host, T4) == [("T4-4Q", u) for _, u in sim_vgpus(d.host, T4)]
    table = d.ctl("status").stdout
    assert "4xL40S-12Q" in table and "2xT4-4Q" in table
    detail = d.ctl("status", "1").stdout  # one GPU in detail: each vGPU by its mdev UUID
    assert all(f"T4-4Q          mdev {u}" in detail for _, u in sim_vgpus(d.host, T4)), detail
    assert all(f"VF {vf}" in d.ctl("status", L40S).stdout for _, vf in sim_vgpus(d.host, L40S))
    events = d.ctl("events").stdout
    for vtype, ident in sim_vgpus(d.host, L40S) + sim_vgpus(d.host, T4):
        assert f"vGPU created: {vtype} {ident}" in events
    # re-applying changes nothing
    before = sim_vgpus(d.host, T4)
    assert d.ctl("apply", "--wait", "--timeout", "60").returncode == 0
    assert sim_vgpus(d.host, T4) == before


def test_inventory_and_types(daemon) -> None:
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    inv = json.loads(d.ctl("passthrough", "--json").stdout)
    mdevs = {v["uuid"]: v for v in inv["vgpus"] if v["uuid"]}
    vfs = {v["vf"]: v for v in inv["vgpus"] if v["vf"]}
    assert set(mdevs) == {u for _, u in sim_vgpus(d.host, T4)}
    assert set(vfs) == {vf for _, vf in sim_vgpus(d.host, L40S)}
    some = next(iter(mdevs.values()))
    assert f"uuid='{some['uuid']}'" in some["libvirt_hostdev"]
    assert some["kubevirt"] == {"mediatedDevices": [{"mdevNameSelector": "GRID T4-4Q", "resourceName": "nvidia.com/GRID_T4-4Q",
                                                     "externalResourceProvider": True}]}
    types = json.loads(d.ctl("vgpu", "types", "--json").stdout)
    t4 = next(g for g in types["gpus"] if g["pci"] == T4)
    creatable = {t["name"]: t["creatable"] for t in t4["types"]}
    assert creatable["T4-4Q"] == 2 and creatable["T4-1Q"] == 0  # 16 GB: 2 of 4 left; one type per GPU
    assert "T4-4Q" in d.ctl("vgpu", "types", "--gpu", "1").stdout


def test_kubevirt_configuration_is_one_entry_per_resource(daemon) -> None:
    """Four L40S-12Q VFs and two T4-4Q mdevs (counted in the simulator's state file) are two
    resources: `gpudctl passthrough` prints the KubeVirt CR's configuration once, with one entry
    each, and mediatedDevicesConfiguration.enabled=false (KubeVirt >= 1.8: gpud makes the vGPUs)
    instead of the deprecated DisableMDEVConfiguration gate."""
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    assert len(sim_vgpus(d.host, L40S)) == 4 and len(sim_vgpus(d.host, T4)) == 2
    cfg = json.loads(d.ctl("passthrough", "--json").stdout)["kubevirt_configuration"]
    assert cfg == {
        "mediatedDevicesConfiguration": {"enabled": False},
        "permittedHostDevices": {
            # KubeVirt's own PCI device plugin serves VFs on nvidia with a vGPU type (kubevirt#16890)
            "pciHostDevices": [{"pciVendorSelector": "10DE:26B9", "resourceName": "nvidia.com/NVIDIA_L40S-12Q",
                                "externalResourceProvider": False}],
            "mediatedDevices": [{"mdevNameSelector": "GRID T4-4Q", "resourceName": "nvidia.com/GRID_T4-4Q",
                                 "externalResourceProvider": True}]}}
    text = d.ctl("passthrough").stdout
    assert text.count("KubeVirt permittedHostDevices") == 1 and text.count('"resourceName"') == 2
    assert 'mediatedDevicesConfiguration (gpud makes the vGPUs' in text and '  {"enabled":false}' in text
    assert "DisableMDEVConfiguration" in text


def test_busy_vgpu_waits_names_the_vm_and_plan_shows_the_disruption(daemon) -> None:
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    held = sim_vgpus(d.host, T4)[0][1]
    assert d.sim("hold", held, "--pid", "4242", "--vm", "web-1").returncode == 0
    changed = LAYOUT.replace('{"GRID T4-4Q": 2}', '{"T4-8Q": 2}')
    (d.tmp / "candidate.yaml").write_text(changed)
    plan = json.loads(d.ctl("plan", "--json", str(d.tmp / "candidate.yaml")).stdout)
    t4 = next(g for g in plan["gpus"] if g["pci"] == T4)
    assert [h["vm"] for h in t4["blocked_by"]] == ["web-1"]
    d.config.write_text(changed)
    wait_until(lambda: next(g for g in d.status()["gpus"] if g["pci"] == T4)["state"] == "waiting", 60, "waiting")
    g = next(g for g in d.status()["gpus"] if g["pci"] == T4)
    assert "web-1" in g["message"] and held in g["message"]
    assert sim_vgpus(d.host, T4)[0][1] == held and len(sim_vgpus(d.host, T4)) == 2  # nothing removed
    assert d.sim("release", held, "--pid", "4242").returncode == 0
    d.ctl("apply")
    wait_until(lambda: [t for t, _ in sim_vgpus(d.host, T4)] == ["T4-8Q", "T4-8Q"], 60, "T4-8Q x2")


def test_reboot_rebuilds_the_same_identities(daemon) -> None:
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    before_t4, before_l40s = sim_vgpus(d.host, T4), sim_vgpus(d.host, L40S)
    d.stop()
    with locked(d.host) as st:  # what a reboot does to vGPUs: VFs and mdevs gone
        sim_vgpu.clear_for_reboot(st)
        render(d.host, st)
    assert sim_vgpus(d.host, T4) == [] and sim_vgpus(d.host, L40S) == []
    d.start()
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    assert sim_vgpus(d.host, T4) == before_t4  # libvirt domains naming these UUIDs keep working
    assert sim_vgpus(d.host, L40S) == before_l40s  # each VF got its type back
    st = d.status()
    t4 = next(g for g in st["gpus"] if g["pci"] == T4)
    assert sorted(t4["vgpu"]["rebuilt"]) == sorted(f"T4-4Q {u}" for _, u in before_t4)


def test_leaving_vm_vgpu_removes_vgpus_and_vfs(daemon) -> None:
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    d.config.write_text(LAYOUT.replace("""      workload: vm-vgpu
      vgpu-devices: {"L40S-12Q": 4}""", "      workload: container"))
    wait_until(lambda: not load(d.host).vgpu[L40S].vfs, 60, "VFs disabled")
    assert sim_vgpus(d.host, L40S) == []
    wait_until(lambda: next(g for g in d.status()["gpus"] if g["pci"] == L40S)["state"] == "converged", 60, "converged")


H200_LAYOUT = """\
version: v1
layouts:
  vms:
    - devices: [0]
      workload: vm-vgpu
      vgpu-devices: {"H200X-1-18C": 3, "H200X-3-71C": 1}
"""


def test_mig_backed_vgpus_get_their_instances_first(daemon) -> None:
    d = daemon(["h200"], H200_LAYOUT, vgpu="vfio")
    r = d.ctl("apply", "--wait", "--timeout", "180")
    assert r.returncode == 0, r.stdout + r.stderr + d.log.read_text()[-3000:]
    st = load(d.host)
    gpu = st.gpus["0000:18:00.0"]
    assert gpu.mig_mode == 1
    profile_of = {gi.id: gi.profile_id for gi in gpu.gis}
    on = sorted(profile_of[vf.gpu_instance_id] for vf in st.vgpu["0000:18:00.0"].vfs if vf.vgpu_type)
    assert on == [9, 19, 19, 19]  # each vGPU on a GPU instance of its profile (3g = 9, 1g = 19)
    assert sorted(profile_of.values()) == [9, 19, 19, 19]
    # the order: MIG mode, then the VFs (their rebind destroys instances), then instances, then types
    order = []
    for e in d.events():
        text = e.get("message", "")
        if e["kind"] == "step" and text.startswith(("set-mig-mode", "create-")):
            order.append("mode" if text.startswith("set-mig-mode") else "instances")
        elif e["kind"] == "vgpu":
            order.append("vfs" if text.startswith("enabled VFs") else "types")
    order = [k for i, k in enumerate(order) if i == 0 or order[i - 1] != k]
    assert order == ["mode", "vfs", "instances", "types"], order


def test_vm_vgpu_to_passthrough_undoes_vgpus_then_binds(daemon) -> None:
    d = daemon(["l40s"], LAYOUT.replace("""    - devices: [1]
      workload: vm-vgpu
      vgpu-devices: {"GRID T4-4Q": 2}
""", ""), vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    (d.tmp / "pt.yaml").write_text(d.config.read_text().replace("""      workload: vm-vgpu
      vgpu-devices: {"L40S-12Q": 4}""", "      workload: vm-passthrough"))
    plan = json.loads(d.ctl("plan", "--json", str(d.tmp / "pt.yaml")).stdout)
    assert len(plan["disruption"]["vgpus_removed"]) == 4 and plan["disruption"]["vfs_disabled"] == [L40S]
    d.config.write_text((d.tmp / "pt.yaml").read_text())
    wait_until(lambda: load(d.host).functions[L40S].driver == "vfio-pci", 90, "L40S on vfio-pci")
    assert load(d.host).vgpu[L40S].vfs == []


def test_check_reports_vgpu_problems_with_exit_4(daemon) -> None:
    """`check` plans every GPU: a vGPU count the GPU cannot hold (L40S-12Q: 48 GB / 12 GB = 4, NVIDIA's
    L40S vGPU table) and a type the GPU does not offer are errors, exit 4, and nothing changes."""
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    before = sim_vgpus(d.host, L40S), sim_vgpus(d.host, T4)
    too_many = d.tmp / "too-many.yaml"
    too_many.write_text(LAYOUT.replace('{"L40S-12Q": 4}', '{"L40S-12Q": 5}'))
    r = d.ctl("check", str(too_many))
    assert r.returncode == 4, r.stdout + r.stderr
    assert "5 x L40S-12Q" in r.stdout + r.stderr and "at most 4" in r.stdout + r.stderr
    bogus = d.tmp / "bogus.yaml"
    bogus.write_text(LAYOUT.replace('{"GRID T4-4Q": 2}', '{"BOGUS-TYPE": 1}'))
    r = d.ctl("check", str(bogus))
    assert r.returncode == 4 and "BOGUS-TYPE is not a vGPU type" in r.stdout + r.stderr
    mixed = d.tmp / "mixed.yaml"
    mixed.write_text(LAYOUT.replace('{"L40S-12Q": 4}', '{"L40S-12Q": 2, "L40S-24Q": 1}'))
    r = d.ctl("check", str(mixed))
    assert r.returncode == 4 and "must all be one type" in r.stdout + r.stderr
    assert (sim_vgpus(d.host, L40S), sim_vgpus(d.host, T4)) == before


def test_kubevirt_device_plugin_resources_for_mdev_vgpus(daemon) -> None:
    """kubevirt-gpu-device-plugin advertises each mdev as `nvidia.com/` + its type's name with spaces
    as `_` (KubeVirt's docs: "GRID T4-1Q" -> nvidia.com/GRID_T4-1Q); it reads only
    /sys/bus/mdev/devices, so the L40S's VF vGPUs are KubeVirt's own PCI plugin's (v1.9), under the
    pciHostDevices entry `gpudctl passthrough` prints (tests/daemon/test_passthrough_entries.py)."""
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    mdevs = [u for _, u in sim_vgpus(d.host, T4)]
    vfs = [vf for _, vf in sim_vgpus(d.host, L40S)]
    sandbox = d.status()["kubernetes"]["advertised"]["sandbox"]
    assert sandbox == {"nvidia.com/GRID_T4-4Q": len(mdevs), "nvidia.com/NVIDIA_L40S-12Q": len(vfs)}
    assert (len(mdevs), len(vfs)) == (2, 4)
    assert "nvidia.com/GRID_T4-4Q: 2" in d.ctl("status", "--kube").stdout


def test_ready_waits_for_the_vgpus_a_reboot_took(daemon) -> None:
    """After a reboot (VFs and mdevs gone), READY=1 (what starts units ordered after gpud, such as
    libvirtd) comes only once the first pass has put every vGPU back with its identity: read from
    the simulator's state file when the READY datagram arrives."""
    d = daemon(["l40s", "t4"], LAYOUT, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    before = sim_vgpus(d.host, L40S), sim_vgpus(d.host, T4)
    d.stop()
    with locked(d.host) as st:
        sim_vgpu.clear_for_reboot(st)
        render(d.host, st)
    messages = start_until_ready(d)
    at_ready = sim_vgpus(d.host, L40S), sim_vgpus(d.host, T4)
    assert at_ready == before
    assert any("STATUS=rebuilding vGPUs of 2 GPU(s)" in m for m in messages)


def test_moves_container_mig_to_mig_backed_vgpus_and_back(daemon) -> None:
    """container with MIG -> vm-vgpu on MIG-backed types -> plain container. The GPU instances the
    vGPUs need are the ones the container layout already had; enabling the VFs destroys them (the
    rebind), so they are made again after the VFs, at the same places; leaving vm-vgpu removes the vGPUs and disables the VFs before MIG
    goes off (the fake NVML refuses a mode change or a GI destruction under a vGPU, so a wrong order
    fails the pass)."""
    container_mig = """\
version: v1
layouts:
  c:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.18gb": 3, "3g.71gb": 1}
"""
    d = daemon(["h200"], container_mig, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "180").returncode == 0
    pf = "0000:18:00.0"
    gis_before = sorted((gi.id, gi.profile_id, gi.start) for gi in load(d.host).gpus[pf].gis)
    assert [p for _, p, _ in gis_before].count(19) == 3 and len(gis_before) == 4
    d.config.write_text(H200_LAYOUT)
    r = d.ctl("apply", "--wait", "--timeout", "180")
    assert r.returncode == 0, r.stdout + r.stderr
    st = load(d.host)
    # enabling the VFs (sriov-manage rebinds the GPU) destroyed the instances; they were made again
    # after the VFs, at the same places
    assert sorted((gi.id, gi.profile_id, gi.start) for gi in st.gpus[pf].gis) == gis_before
    carried = sorted(vf.gpu_instance_id for vf in st.vgpu[pf].vfs if vf.vgpu_type)
    assert carried == sorted(gi for gi, _, _ in gis_before)
    seen = len(d.events())
    d.config.write_text(container_mig.replace("""      mig-enabled: true
      mig-devices: {"1g.18gb": 3, "3g.71gb": 1}""", "      mig-enabled: false"))
    r = d.ctl("apply", "--wait", "--timeout", "180")
    assert r.returncode == 0, r.stdout + r.stderr + d.log.read_text()[-3000:]
    st = load(d.host)
    assert st.vgpu[pf].vfs == [] and st.gpus[pf].gis == [] and st.gpus[pf].mig_mode == 0
    # the last move's order, from the events: every vGPU step (removals, VFs off) before its MIG steps
    kinds = [e["kind"] for e in d.events()[seen:] if e.get("gpu") == pf and e["kind"] in ("vgpu", "step")]
    first_vgpu, last_vgpu = kinds.index("vgpu"), max(i for i, k in enumerate(kinds) if k == "vgpu")
    mig_after_vgpus = [i for i, k in enumerate(kinds) if k == "step" and i > first_vgpu]
    assert mig_after_vgpus and min(mig_after_vgpus) > last_vgpu, kinds


def test_busy_vgpu_with_on_busy_fail_fails_that_gpu_only(daemon) -> None:
    """`policy.on-busy: fail`: a held vGPU the new layout would remove fails its GPU (naming the VM)
    and nothing is removed; the other GPU's change still applies."""
    layout = LAYOUT + "policy: {on-busy: fail}\n"
    d = daemon(["l40s", "t4"], layout, vgpu="vfio")
    assert d.ctl("apply", "--wait", "--timeout", "120").returncode == 0
    held = sim_vgpus(d.host, T4)[0][1]
    assert d.sim("hold", held, "--pid", "4242", "--vm", "web-1").returncode == 0
    d.config.write_text(layout.replace('{"GRID T4-4Q": 2}', '{"T4-8Q": 2}').replace('{"L40S-12Q": 4}', '{"L40S-12Q": 2}'))
    r = d.ctl("apply", "--wait", "--timeout", "120")
    assert r.returncode == 5, r.stdout + r.stderr
    g = next(g for g in d.status()["gpus"] if g["pci"] == T4)
    assert g["state"] == "failed" and "on-busy: fail" in g["message"] and "web-1" in g["message"]
    assert [t for t, _ in sim_vgpus(d.host, T4)] == ["T4-4Q", "T4-4Q"] and held in dict(
        (u, t) for t, u in sim_vgpus(d.host, T4))
    assert [t for t, _ in sim_vgpus(d.host, L40S)] == ["L40S-12Q", "L40S-12Q"]
