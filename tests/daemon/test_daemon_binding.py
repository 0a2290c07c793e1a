"""Per-GPU driver binding through the real daemon on a simulated host: vfio-pci with the IOMMU
group's companions, the boot-time udev rule, the passthrough inventory, waiting on holders, and an
unbind that never returns while the daemon keeps serving."""

from __future__ import annotations

import json

import pytest

from gpud.sim.kernel import unhang
from tests.scenarios.definitions import layout
from tests.support.daemon import wait_until

pytestmark = pytest.mark.daemon

PASS = layout({"devices": [0], "workload": "vm-passthrough"}, {"devices": [1], "workload": "container"})
BACK = layout({"devices": [0, 1], "workload": "container"})


def test_passthrough_with_companion_and_back(daemon):
    d = daemon(["rtx6000-ada:2"], PASS, "--unbind-timeout", "10")
    r = d.ctl("apply", "--wait", "--timeout", "60")
    assert r.returncode == 0, r.stdout + r.stderr
    g0, g1 = d.status()["gpus"]
    assert g0["driver"] == "vfio-pci" and g0["workload"] == "vm-passthrough" and g0["converged"]
    assert g0["vfio_device"] == f"/dev/vfio/{g0['iommu_group']}"
    assert g0["group"] and all(m["driver"] == "vfio-pci" for m in g0["group"])  # the HD-audio function followed
    assert g1["driver"] == "nvidia" and all(m["driver"] == "snd_hda_intel" for m in g1["group"])
    rules = (d.host / "etc/udev/rules.d/70-gpud-vfio.rules").read_text()
    assert g0["pci"] in rules and g0["group"][0]["pci"] in rules and g1["pci"] not in rules
    inv = json.loads(d.ctl("passthrough", "--json").stdout)["devices"]
    assert [x["pci"] for x in inv] == [g0["pci"]]
    assert inv[0]["vendor_device"] == "10DE:26B1" and "<hostdev" in inv[0]["libvirt_hostdev"]
    assert inv[0]["vfio_device"] == g0["vfio_device"]
    # and back to the containers' driver
    d.config.write_text(BACK)
    wait_until(lambda: d.status()["layout"]["valid"] and d.status()["gpus"][0]["driver"] == "nvidia"
               and d.status()["gpus"][0]["converged"], what="GPU 0 back on nvidia")
    g0 = d.status()["gpus"][0]
    assert g0["vfio_device"] is None and all(m["driver"] == "snd_hda_intel" for m in g0["group"])
    assert not (d.host / "etc/udev/rules.d/70-gpud-vfio.rules").exists()


def test_holder_of_the_gpu_makes_the_rebind_wait(daemon):
    d = daemon(["h100-80gb:1"], layout({"devices": [0], "workload": "container"}))
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][0]["pci"]
    assert d.sim("hold", pci, "--pid", "777", "--name", "nvidia-persistenced").returncode == 0
    d.config.write_text(layout({"devices": [0], "workload": "vm-passthrough"}))
    wait_until(lambda: d.status()["gpus"][0]["state"] == "waiting", what="waiting on the holder")
    g = d.status()["gpus"][0]
    assert g["driver"] == "nvidia" and any(h["pid"] == 777 for h in g["holders"])
    assert d.sim("release", pci, "--pid", "777").returncode == 0
    wait_until(lambda: d.status()["gpus"][0]["driver"] == "vfio-pci" and d.status()["gpus"][0]["converged"],
               what="rebound after release")


def test_unbind_that_never_returns_is_reported_stuck_and_the_daemon_keeps_serving(daemon):
    d = daemon(["h100-80gb:2"], BACK, "--unbind-timeout", "2")
    assert d.ctl("apply", "--wait").returncode == 0
    pci = d.status()["gpus"][0]["pci"]
    assert d.sim("hang", pci).returncode == 0
    d.config.write_text(layout({"devices": [0], "workload": "vm-passthrough"}, {"devices": [1], "workload": "container"}))
    st = wait_until(lambda: (s := d.status())["gpus"][0]["state"] == "stuck" and s, what="stuck")
    assert "unbind" in st["gpus"][0]["message"]
    assert st["gpus"][1]["converged"], (st["gpus"][1]["state"], st["gpus"][1]["message"])  # the other GPU is not held up
    assert d.ctl("version").returncode == 0
    d.stop()
    unhang(d.host, pci)  # lets the abandoned writer finish, so no process outlives the test


def test_mig_gpu_going_to_passthrough_undoes_mig_first(daemon):
    d = daemon(["h100-80gb:1"], layout({"devices": [0], "mig-enabled": True, "mig-devices": {"3g.40gb": 2}}))
    assert d.ctl("apply", "--wait").returncode == 0
    uuid = d.status()["gpus"][0]["mig"]["instances"][0]["uuid"]
    assert d.sim("hold", uuid, "--pid", "5150", "--name", "infer").returncode == 0
    d.config.write_text(layout({"devices": [0], "workload": "vm-passthrough"}))
    st = wait_until(lambda: (s := d.status())["gpus"][0]["state"] == "waiting" and s, what="refused while busy")
    g = st["gpus"][0]
    assert g["driver"] == "nvidia" and g["mig"]["mode"] == "enabled" and "5150" in g["message"]
    assert d.sim("release", uuid, "--pid", "5150").returncode == 0
    wait_until(lambda: d.status()["gpus"][0]["driver"] == "vfio-pci" and d.status()["gpus"][0]["converged"],
               what="MIG undone, then bound to vfio-pci")
    # back to containers: MIG stays off as the entry says nothing about it
    d.config.write_text(layout({"devices": [0], "workload": "container", "mig-enabled": True,
                                "mig-devices": {"7g.80gb": 1}}))
    wait_until(lambda: (g := d.status()["gpus"][0])["driver"] == "nvidia" and g["converged"]
               and [i["profile"] for i in g["mig"]["instances"]] == ["7g.80gb"], what="back on nvidia with MIG")


def test_plan_names_every_endpoint_of_the_group(daemon, tmp_path):
    d = daemon(["rtx6000-ada:1"], layout({"devices": [0], "workload": "container"}))
    assert d.ctl("apply", "--wait").returncode == 0
    cand = tmp_path / "vm.yaml"
    cand.write_text(layout({"devices": [0], "workload": "vm-passthrough"}))
    g = d.status()["gpus"][0]
    audio = g["group"][0]["pci"]
    plan = json.loads(d.ctl("plan", "--json", str(cand)).stdout)
    steps = plan["gpus"][0]["steps"]
    assert {s["pci"] for s in steps if s["action"] == "unbind"} == {g["pci"], audio}
    assert any(s["action"] == "load-module" and s["module"] == "vfio-pci" for s in steps)
    text = d.ctl("plan", str(cand)).stdout
    assert all(f"unbind {pci} from " in text for pci in (g["pci"], audio)), text
