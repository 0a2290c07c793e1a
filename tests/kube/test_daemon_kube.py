"""A gpud process with --kube-node on a simulated host, against the API emulator and a real
kube-apiserver (tests/support/kube_real_server.py).

Checked against sources gpud does not write itself: the simulator's state file (DIR/state.json:
what the "hardware" really has), the node's versions as the API server stored them, the NFD file
read the way nfd-worker reads it, and the device plugins' naming rules.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.support.daemon import Daemon, wait_until
from tests.support.kube_cluster import (
    NODE,
    OPERATOR_NS,
    DaemonSet,
    DaemonSetController,
    EmulatorThread,
    client_for,
    write_kubeconfig,
)
from tests.support.kube_real_cluster import KmockNode, LoopThread, RealNode
from tests.support.nfd import nfd_read

pytestmark = pytest.mark.daemon

DP = "nvidia.com/gpu.deploy.device-plugin"
GFD = "nvidia.com/gpu.deploy.gpu-feature-discovery"
DCGM = "nvidia.com/gpu.deploy.dcgm"
SANDBOX_DP = "nvidia.com/gpu.deploy.sandbox-device-plugin"
STATE = "nvidia.com/mig.config.state"
CONFIG = "nvidia.com/mig.config"
GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"

LAYOUT = """version: v1
selected: whole
layouts:
  whole:
    - devices: all
      mig-enabled: false
  partial-mig:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.10gb": 4, "3g.40gb": 1}
    - devices: [1]
      mig-enabled: false
  vms:
    - devices: [0]
      mig-enabled: false
    - devices: [1]
      workload: vm-passthrough
  wrong-model:
    - devices: [0]
      mig-enabled: true
      mig-devices: {"1g.18gb": 7}
"""

SETS = [
    DaemonSet("nvidia-device-plugin-daemonset", OPERATOR_NS, "nvidia-device-plugin-daemonset", {DP: "true"}),
    DaemonSet("gpu-feature-discovery", OPERATOR_NS, "gpu-feature-discovery", {GFD: "true"}),
    DaemonSet("nvidia-dcgm", OPERATOR_NS, "nvidia-dcgm", {DCGM: "true"}),
    DaemonSet("nvidia-sandbox-device-plugin-daemonset", OPERATOR_NS, "nvidia-sandbox-device-plugin-daemonset",
              {SANDBOX_DP: "true"}),
]


@pytest.fixture(params=["kmock", pytest.param("real", marks=pytest.mark.apiserver)])
def cluster(request, tmp_path):
    """The node on the API emulator or on a real kube-apiserver (gpud as the documented
    ServiceAccount), the DaemonSet controller stand-in running on it; yields (view, kubeconfig)."""
    seed = {DP: "true", GFD: "true", DCGM: "true", SANDBOX_DP: "true", CONFIG: "whole"}
    view: RealNode | KmockNode
    loop: LoopThread | EmulatorThread
    if request.param == "real":
        server = request.getfixturevalue("real_server")
        view = RealNode(server, tmp_path, NODE)
        view.put_node(seed)
        loop, kubeconfig, admin = LoopThread(), view.kubeconfig, view.admin_kubeconfig
    else:
        emu = EmulatorThread()
        emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": seed}}))
        kubeconfig = admin = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        view, loop = KmockNode(emu, kubeconfig, NODE), emu
    holder: dict[str, Any] = {}

    async def start_controller():
        holder["client"] = client_for(admin)
        holder["dsc"] = DaemonSetController(holder["client"], NODE, SETS)
        await holder["dsc"].__aenter__()

    async def stop_controller():
        await holder["dsc"].__aexit__(None, None, None)
        await holder["client"].close()

    loop.call(start_controller())
    try:
        yield view, kubeconfig
    finally:
        loop.call(stop_controller())
        if isinstance(view, RealNode):
            view.close()
            loop.close()
            # every request gpud made was allowed by the documented role
            refused = [ev for ev in view.server.audit("system:serviceaccount:kube-system:gpud")
                       if ev.get("responseStatus", {}).get("code", 0) == 403]
            assert refused == [], refused[:3]
        else:
            emu.close()


def _labels(view) -> dict[str, str]:
    return view.labels()


def _changes(view, key: str, since: int = 0) -> list[str | None]:
    view.settle()
    out: list[str | None] = []
    for labels in view.history()[since:]:
        if not out or out[-1] != labels.get(key):
            out.append(labels.get(key))
    return out


def _relabel(view, value: str) -> int:
    """Set mig.config as an administrator would; returns the node's history length before."""
    view.settle()
    before = len(view.history())
    view.merge_labels({CONFIG: value})
    return before


def _sim_gis(d: Daemon, pci: str) -> list[tuple[int, int, int]]:
    st = json.loads((d.host / "state.json").read_text())
    return sorted((gi["profile_id"], gi["start"], len(gi["cis"])) for gi in st["gpus"][pci]["gis"])


def _sim_driver(d: Daemon, pci: str) -> str | None:
    return json.loads((d.host / "state.json").read_text())["functions"][pci]["driver"]


def test_node_label_selects_the_layout_through_the_operator_protocol(cluster, tmp_path):
    view, kubeconfig = cluster
    features = tmp_path / "features.d"
    features.mkdir()
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], LAYOUT, ["--kube-node", NODE, "--kubeconfig", kubeconfig,
                                                          "--nfd-features", str(features / "gpud"),
                                                          "--nfd-labels", "all"])  # GFD's labels too, though GFD runs
    try:
        wait_until(lambda: _labels(view).get(STATE) == "success", timeout=120, what="state success for 'whole'")
        labels = _labels(view)
        assert labels["nvidia.com/mig.capable"] == "true"
        nfd = nfd_read(str(features))
        assert nfd["nvidia.com/gpud.layout"] == "whole" and nfd["nvidia.com/gpu.count"] == "2"
        assert nfd["nvidia.com/gpu.product"] == "NVIDIA-H100-80GB-HBM3"
        # NVML's compute capability (H100: 9.0 -> GFD's "hopper") and versions reach the labels
        assert (nfd["nvidia.com/gpu.family"], nfd["nvidia.com/gpu.compute.major"]) == ("hopper", "9")
        assert nfd["nvidia.com/cuda.driver-version.full"] == json.loads(d.ctl("version", "--json").stdout)["driver"]
        assert "nvidia.com/mig.capable" not in nfd  # with --kube-node gpud patches it on the node itself

        # 1. the seed's partial MIG layout on GPU 0
        since = _relabel(view, "partial-mig")
        wait_until(lambda: _labels(view).get(STATE) == "success" and _sim_gis(d, GPU0), timeout=120,
                   what="partial-mig applied")
        # H100 80GB: 1g.10gb is GI profile 19 at starts 0-3, 3g.40gb is profile 9 at 4 (gpud.profiles' source:
        # nvidia-smi mig -lgip); every GI with one full compute instance
        assert _sim_gis(d, GPU0) == [(9, 4, 1), (19, 0, 1), (19, 1, 1), (19, 2, 1), (19, 3, 1)]
        assert _changes(view, STATE, since) == ["success", "pending", "success"]
        for label in (DP, GFD, DCGM):
            assert _changes(view, label, since) == ["true", "paused-for-mig-change", "true"], label
        assert _changes(view, SANDBOX_DP, since) == ["true"]  # GPU 0 is on nvidia before and after
        wait_until(lambda: nfd_read(str(features)).get("nvidia.com/mig-1g.10gb.count") == "4", timeout=120, what="labels")
        nfd = nfd_read(str(features))
        assert nfd["nvidia.com/mig-3g.40gb.count"] == "1" and nfd["nvidia.com/gpud.layout"] == "partial-mig"
        assert nfd["nvidia.com/gpud.layout.state"] == "success"
        kube = d.ctl("status", "--kube")
        assert kube.returncode == 0, kube.stderr
        assert "  nvidia.com/gpu: 1\n  nvidia.com/mig-1g.10gb: 4\n  nvidia.com/mig-3g.40gb: 1" in kube.stdout
        assert "layout selected by label: partial-mig" in kube.stdout
        shown = d.ctl("labels")
        assert shown.returncode == 0 and "nvidia.com/mig-1g.10gb.count=4" in shown.stdout.splitlines()

        # 2. a passthrough GPU: both sides see GPU 1 change, so both are paused
        since = _relabel(view, "vms")
        wait_until(lambda: _labels(view).get(STATE) == "success" and _sim_driver(d, GPU1) == "vfio-pci",
                   timeout=120, what="vms applied")
        assert _sim_gis(d, GPU0) == []
        assert _changes(view, SANDBOX_DP, since) == ["true", "paused-for-vgpu-change", "true"]
        assert _changes(view, DP, since) == ["true", "paused-for-mig-change", "true"]
        inventory = json.loads(d.ctl("passthrough", "--json").stdout)["devices"]
        # kubevirt-gpu-device-plugin's pci.ids: "2330  GH100 [H100 SXM5 80GB]"
        assert [dev["resource_name"] for dev in inventory] == ["nvidia.com/GH100_H100_SXM5_80GB"]
        status = json.loads(d.ctl("status", "--json").stdout)
        assert status["kubernetes"]["advertised"]["sandbox"] == {"nvidia.com/GH100_H100_SXM5_80GB": 1}
        assert status["kubernetes"]["advertised"]["resources"] == {"nvidia.com/gpu": 1}
        wait_until(lambda: nfd_read(str(features)).get("nvidia.com/gpud.workload.vm-passthrough.count") == "1",
                   timeout=120, what="workload labels")

        # 3. a layout the host refuses (H200 profiles on an H100): failed, nothing touched, nothing paused
        since = _relabel(view, "wrong-model")
        wait_until(lambda: _labels(view).get(STATE) == "failed", timeout=120, what="state failed")
        assert "1g.18gb is not a MIG profile of NVIDIA H100 80GB HBM3" in json.loads(
            d.ctl("status", "--json").stdout)["kubernetes"]["agent"]["message"]
        assert _changes(view, DP, since) == ["true"]
        assert _sim_gis(d, GPU0) == [] and _sim_driver(d, GPU1) == "vfio-pci"

        # 4. a name the file does not have
        _relabel(view, "nope")
        wait_until(lambda: _labels(view).get(STATE) == "failed" and "nope" in json.loads(
            d.ctl("status", "--json").stdout)["kubernetes"]["agent"]["message"], timeout=120, what="unknown layout reported")
    finally:
        d.stop()
    assert d.proc.returncode == 0, d.log.read_text()


def test_check_all_layouts_reports_a_layout_this_host_cannot_take(tmp_path):
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], LAYOUT)
    try:
        f = tmp_path / "candidate.yaml"
        f.write_text(LAYOUT)
        only_selected = d.ctl("check", str(f))
        assert only_selected.returncode == 0, only_selected.stdout
        every = d.ctl("check", "--all-layouts", str(f))
        assert every.returncode == 4
        assert "1g.18gb is not a MIG profile of NVIDIA H100 80GB HBM3" in every.stdout
        checked = json.loads(d.ctl("check", "--all-layouts", "--json", str(f)).stdout)["checked"]
        assert checked == ["whole", "partial-mig", "vms", "wrong-model"]
    finally:
        d.stop()


def test_a_bad_label_at_start_touches_nothing(cluster, tmp_path):
    """The file's own `selected` (partial-mig) would change GPU 0; the node's label names a layout
    the file lacks. No pass may run on the file's choice: failed, and the hardware as it was."""
    view, kubeconfig = cluster
    _relabel(view, "nope")
    d = Daemon(tmp_path / "d", ["h100-80gb:2"], LAYOUT.replace("selected: whole", "selected: partial-mig"),
               ["--kube-node", NODE, "--kubeconfig", kubeconfig, "--nfd-features", str(tmp_path / "none" / "gpud")])
    try:
        wait_until(lambda: _labels(view).get(STATE) == "failed", timeout=120, what="state failed")
        assert json.loads(d.ctl("status", "--json").stdout)["phase"] == "starting"  # no pass ran
        assert _sim_gis(d, GPU0) == []
        _relabel(view, "whole")
        wait_until(lambda: _labels(view).get(STATE) == "success", timeout=120, what="state success")
        assert _sim_gis(d, GPU0) == [] and json.loads(d.ctl("status", "--json").stdout)["phase"] == "converged"
    finally:
        d.stop()
