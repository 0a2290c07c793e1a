"""What a GPU Operator cluster needs from gpud, against a real kube-apiserver (v1.34.12 on etcd
v3.6.4), with gpud running as the ServiceAccount of packaging/kube/gpud-rbac.yaml applied as is.

The emulator variants of these items are in tests/kube/test_operator_*.py, test_workload_config.py,
test_nfd_defaults.py, test_vgpu_selection.py and test_node_visibility.py; here the server's own
storage, field selectors, RBAC and admission decide. Independent sources: fresh admin reads of the
node, its pods and its Events (queried the way `kubectl describe node` queries them), the node's
versions as an admin watch streamed them, the simulator's state file, and the feature file read
the way nfd-worker reads it.
"""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import pytest

from gpud.engine.kube.agent import LAST_ERROR, MIG_CONFIG, MIG_STATE, VGPU_CONFIG, VGPU_STATE, WORKLOAD_CONFIG, Impact
from tests.support.daemon import Daemon, wait_until
from tests.support.kube_agent import AGENT_SETS, BASE_LABELS, CHANGE, MIG_MANAGER, SETS, VFIO_MANAGER, VGPU_DM, _changes
from tests.support.kube_cluster import NODE, OPERATOR_NS, PAUSE_IMAGE, DaemonSetController, client_for
from tests.support.kube_real_agent import RealEngine, running, until_true
from tests.support.kube_real_agent import agent as _agent
from tests.support.kube_real_agent import seed as _seed
from tests.support.kube_real_cluster import RealNode
from tests.support.kube_real_server import narrowed_role
from tests.support.nfd import nfd_read
from tests.support.operator_fixtures import FIXTURES, PASSTHROUGH_SERVED, WITHOUT_ALL_DISABLED, WORKLOAD_LAYOUT

pytestmark = pytest.mark.apiserver

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
GFD = "nvidia.com/gpu.deploy.gpu-feature-discovery"
STRATEGY = "nvidia.com/mig.strategy"


# --- a gpud process under --kube-node against the real server ------------------------------

def _daemon(tmp_path: Path, node: RealNode, layout: str, features: Path | None = None) -> Daemon:
    features = features or tmp_path / "none" / "gpud"
    return Daemon(tmp_path / "d", ["h100-80gb:2"], layout,
                  ["--kube-node", NODE, "--kubeconfig", node.kubeconfig, "--nfd-features", str(features)])


def _sim(d: Daemon, pci: str) -> tuple[int, list[int]]:
    gpu = json.loads((d.host / "state.json").read_text())["gpus"][pci]
    return gpu["mig_mode"], sorted(gi["profile_id"] for gi in gpu["gis"])


def _stop(d: Daemon) -> None:
    d.stop()
    assert d.proc.returncode == 0, d.log.read_text()


@pytest.mark.daemon
def test_item0_nvidias_configmap_unchanged_label_selects(tmp_path, real_node):
    """mig-manager's default ConfigMap (no `selected`, many entries) as gpud's layout file: the node
    label selects. Fails if a file without `selected` is refused under --kube-node (no state label is
    ever success, the GPUs stay unchanged)."""
    node = real_node
    node.put_node({MIG_CONFIG: "all-1g.10gb"})
    d = _daemon(tmp_path, node, (FIXTURES / "config-default.yaml").read_text())
    try:
        node.wait(lambda labels: labels.get(MIG_STATE) == "success", "all-1g.10gb applied")
        assert _sim(d, GPU0) == _sim(d, GPU1) == (1, [19] * 7)  # H100 80GB: 1g.10gb is GI profile 19
        node.merge_labels({MIG_CONFIG: "all-3g.40gb"})
        wait_until(lambda: node.labels().get(MIG_STATE) == "success" and _sim(d, GPU0) == (1, [9, 9]), timeout=120,
                   what="all-3g.40gb applied")
        assert _sim(d, GPU1) == (1, [9, 9])
    finally:
        _stop(d)
    assert _changes(node.history(), MIG_STATE) == [None, "pending", "success", "pending", "success"]


@pytest.mark.daemon
def test_item1_operators_all_disabled_on_a_file_without_it(tmp_path, real_node):
    """The operator sets mig.config=all-disabled by itself; the file has no such entry. Fails if
    gpud does not treat all-disabled as MIG off on every GPU (state failed, "no layout named")."""
    node = real_node
    node.put_node({MIG_CONFIG: "half"})
    d = _daemon(tmp_path, node, WITHOUT_ALL_DISABLED)
    try:
        node.wait(lambda labels: labels.get(MIG_STATE) == "success", "half applied")
        assert _sim(d, GPU0) == (1, [9, 9]) and _sim(d, GPU1) == (0, [])
        node.merge_labels({MIG_CONFIG: "all-disabled"})
        wait_until(lambda: node.labels().get(MIG_STATE) == "success" and _sim(d, GPU0)[0] == 0, timeout=120,
                   what="all-disabled applied")
        assert _sim(d, GPU0) == _sim(d, GPU1) == (0, [])
        assert json.loads(d.ctl("status", "--json").stdout)["kubernetes"]["agent"]["selected"] == "all-disabled"
    finally:
        _stop(d)


@pytest.mark.daemon
def test_item2_workload_config_from_the_layout(tmp_path, real_node):
    """gpu.workload.config follows the layout when its GPUs serve one workload; a mixed layout leaves
    the operator's value and says what is not served. Fails if gpud stops writing either label."""
    node = real_node
    node.put_node({MIG_CONFIG: "whole"})
    d = _daemon(tmp_path, node, WORKLOAD_LAYOUT)
    try:
        node.wait(lambda labels: labels.get(WORKLOAD_CONFIG) == "container", "workload config container")
        assert PASSTHROUGH_SERVED not in node.labels()
        node.merge_labels({MIG_CONFIG: "mixed"})
        node.wait(lambda labels: labels.get(PASSTHROUGH_SERVED) == "false", "the unserved label")
        assert node.labels()[WORKLOAD_CONFIG] == "container"
        shown = d.ctl("status", "--kube").stdout
        assert "not served: vm-passthrough GPU(s) 0000:2a:00.0:" in shown and "sandbox-device-plugin" in shown
        node.merge_labels({MIG_CONFIG: "vms"})
        node.wait(lambda labels: labels.get(WORKLOAD_CONFIG) == "vm-passthrough" and PASSTHROUGH_SERVED not in labels,
                  "a vm-passthrough node")
    finally:
        _stop(d)
    assert _changes(node.history(), WORKLOAD_CONFIG) == [None, "container", "vm-passthrough"]


@pytest.mark.daemon
def test_item3_gfd_and_the_mig_strategy_from_the_node(tmp_path, real_node):
    """While GFD is deployed gpud writes only its own labels, with the node's mig.strategy; once the
    node says GFD is off, GFD's labels too. Fails if gpud keeps its `all`/`mixed` defaults under
    --kube-node (GFD's labels written while GFD runs, strategy mixed)."""
    node = real_node
    features = tmp_path / "features.d"
    features.mkdir()
    node.put_node({GFD: "true", STRATEGY: "single", MIG_CONFIG: "all-disabled"})
    layout = "version: v1\nlayouts:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n"
    d = _daemon(tmp_path, node, layout, features / "gpud")
    try:
        wait_until(lambda: nfd_read(str(features)).get("nvidia.com/gpud.layout") == "all-disabled", timeout=120,
                   what="gpud's labels")
        labels = nfd_read(str(features))
        assert not any(k.startswith(("nvidia.com/gpu.", "nvidia.com/cuda.")) for k in labels), labels
        assert "mig-strategy=single" in d.ctl("status", "--kube").stdout
        node.merge_labels({GFD: "false"})
        wait_until(lambda: nfd_read(str(features)).get("nvidia.com/gpu.count") == "2", timeout=60, what="GFD's labels")
        assert nfd_read(str(features))[STRATEGY] == "single"
    finally:
        _stop(d)


# --- the agent through the real client, the engine scripted ---------------------------------

async def test_item1_operator_agents_turned_off_and_gone_before_a_change(real_server, real_node):
    """The operator's labelling leaves mig-manager and vgpu-device-manager deployed; gpud sets their
    deploy labels (and vfio-manager's) to false, the DaemonSets remove their pods, and only then do
    GPUs change. Fails if gpud leaves the labels (the pods would still be there at the change)."""
    node = real_node
    _seed(node, {**BASE_LABELS, MIG_MANAGER: "true", VGPU_DM: "true", MIG_CONFIG: "partial"})
    engine = RealEngine(node, {"partial": CHANGE})
    controller = client_for(node.admin_kubeconfig)
    async with DaemonSetController(controller, NODE, SETS + AGENT_SETS):
        await until_true(lambda: f"{OPERATOR_NS}/nvidia-mig-manager-{NODE}" in node.pods(), "mig-manager's pod")
        agent = _agent(node.kubeconfig, engine)
        async with running(agent):
            await node.until(lambda labels: labels.get(MIG_STATE) == "success", "state success")
    await controller.close()
    history = node.history()
    assert _changes(history, MIG_MANAGER) == ["true", "false"]
    assert _changes(history, VGPU_DM) == ["true", "false"]
    assert _changes(history, VFIO_MANAGER) == [None, "false"]
    (_, pods_at_change, labels_at_change), = engine.applied
    assert not any(a.name in p for a in AGENT_SETS for p in pods_at_change), pods_at_change
    assert labels_at_change[MIG_MANAGER] == "false"


async def test_item1_no_gpu_changes_while_a_mig_manager_pod_runs_on_the_node(real_server, real_node):
    """A mig-manager pod bound to the node (created through the API as its DaemonSet would; no
    controller removes it): gpud changes no GPU, fails the state, and names the pod. Fails if gpud
    does not look for the operator's agents before a change (the engine would apply)."""
    node = real_node
    _seed(node, {**BASE_LABELS, MIG_MANAGER: "true", MIG_CONFIG: "partial"})
    node.put_pod({"metadata": {"name": f"nvidia-mig-manager-{NODE}", "namespace": OPERATOR_NS,
                               "labels": {"app": "nvidia-mig-manager"}},
                  "spec": {"nodeName": NODE, "nodeSelector": {MIG_MANAGER: "true"},
                           "containers": [{"name": "m", "image": PAUSE_IMAGE}]}})
    engine = RealEngine(node, {"partial": CHANGE})
    events: list[str] = []
    agent = _agent(node.kubeconfig, engine, pod_timeout=1.0, on_event=lambda k, m: events.append(m))
    async with running(agent):
        await node.until(lambda labels: labels.get(MIG_STATE) == "failed", "state failed")
    assert engine.applied == []
    pod = f"{OPERATOR_NS}/nvidia-mig-manager-{NODE}"
    assert pod in node.pods()  # the server still holds it: gpud waited, it did not delete another agent
    assert agent.status.other_agents == [pod]
    assert f"the GPU Operator's own GPU agent(s) still run on this node: {pod}" in agent.status.message
    assert any(pod in e and "gpud changes no GPU" in e for e in events)
    assert node.labels()[MIG_MANAGER] == "false"
    assert _changes(node.history(), MIG_STATE) == [None, "pending", "failed"]


async def test_item5_vgpu_config_wins_over_the_operators_all_disabled(real_server, real_node):
    """vgpu.config=X beside the operator's mig.config=all-disabled selects X and reports on
    vgpu.config.state. Fails if both labels must name one layout (state failed, nothing applied)."""
    node = real_node
    _seed(node, {**BASE_LABELS, MIG_CONFIG: "all-disabled", VGPU_CONFIG: "l40s-12q"})
    engine = RealEngine(node, {"all-disabled": Impact(), "l40s-12q": Impact(changed=(GPU0,), sandbox=(GPU0,))})
    agent = _agent(node.kubeconfig, engine)
    async with running(agent):
        await node.until(lambda labels: labels.get(VGPU_STATE) == "success", "vgpu state success")
    assert engine.selected == ["l40s-12q"] and [a[0] for a in engine.applied] == ["l40s-12q"]
    node.settle()
    history = node.history()
    assert _changes(history, VGPU_STATE) == [None, "pending", "success"]
    assert _changes(history, MIG_STATE) == [None]


async def test_item5_unlabelled_vm_vgpu_node_gets_the_default(real_server, real_node):
    """A vm-vgpu node without vgpu.config gets the default vGPU layout, as vgpu-device-manager
    applies DEFAULT_VGPU_CONFIG; a label set later wins. Fails if the default is not applied."""
    node = real_node
    _seed(node, {**BASE_LABELS, WORKLOAD_CONFIG: "vm-vgpu", MIG_CONFIG: "all-disabled"})
    sandbox = Impact(changed=(GPU0,), sandbox=(GPU0,))
    engine = RealEngine(node, {"all-disabled": Impact(), "default": sandbox, "a10-4q": sandbox})
    agent = _agent(node.kubeconfig, engine)
    async with running(agent):
        await node.until(lambda labels: labels.get(VGPU_STATE) == "success", "default applied")
        assert engine.selected == ["default"]
        node.merge_labels({VGPU_CONFIG: "a10-4q"})
        await until_true(lambda: len(engine.applied) == 2 and node.labels().get(VGPU_STATE) == "success",
                          "a10-4q applied")
    assert engine.selected == ["default", "a10-4q"]
    node.settle()
    assert _changes(node.history(), VGPU_STATE) == [None, "pending", "success", "pending", "success"]
    assert MIG_STATE not in node.labels()


async def test_item7_rebooting_is_on_the_server_before_the_reboot(real_server, real_node):
    """At the moment the engine reboots, a fresh read of the server already says state=rebooting
    (mig-manager aborts a reboot it cannot announce). Fails if before_reboot does not write it
    (the read would say pending)."""
    node = real_node
    _seed(node, {**BASE_LABELS, MIG_CONFIG: "all-balanced"})
    seen_at_reboot: list[str | None] = []

    class Recorded(list):
        def append(self, layout):
            seen_at_reboot.append(node.labels().get(MIG_STATE))  # a GET from the server, at the reboot
            super().append(layout)

    engine = RealEngine(node, {"all-balanced": CHANGE}, needs_reboot={"all-balanced"}, reboot=True)
    engine.reboots = Recorded()
    agent = _agent(node.kubeconfig, engine)
    async with running(agent):
        await until_true(lambda: engine.reboots == ["all-balanced"], "the reboot")
    assert seen_at_reboot == ["rebooting"]


def _describe_events(server, node_name: str, uid: str) -> list[dict]:
    """The Events `kubectl describe node` lists: all namespaces, involvedObject the Node by name
    and uid (kubectl's NodeDescriber also queries uid=name, as the kubelet records them)."""
    found = []
    for u in (uid, node_name):
        sel = urllib.parse.quote(f"involvedObject.kind=Node,involvedObject.name={node_name},"
                                 f"involvedObject.namespace=,involvedObject.uid={u}")
        found += server.admin("GET", f"/api/v1/events?fieldSelector={sel}")["items"]
    return found


def _annotations(server) -> dict[str, str]:
    return server.admin("GET", f"/api/v1/nodes/{NODE}")["metadata"].get("annotations") or {}


def _failing_engine(node):
    return RealEngine(node, {"x": CHANGE, "ok": Impact()}, needs_reboot={"x"}, reboot=False)


async def test_item7_failure_is_an_event_and_an_annotation_on_the_real_node(real_server, real_node):
    """A failed layout is a Warning Event about the Node (as kubectl describe node finds it) and the
    annotation nvidia.com/gpud.last-error, removed by a success. Fails if either is not written."""
    node = real_node
    _seed(node, {**BASE_LABELS, MIG_CONFIG: "x"})
    uid = real_server.admin("GET", f"/api/v1/nodes/{NODE}")["metadata"]["uid"]
    engine = _failing_engine(node)
    agent = _agent(node.kubeconfig, engine)
    async with running(agent):
        await until_true(lambda: bool(node.labels().get(MIG_STATE) == "failed" and _describe_events(real_server, NODE, uid)
                                      and LAST_ERROR in _annotations(real_server)), "the failure recorded")
        (event,) = _describe_events(real_server, NODE, uid)
        assert event["type"] == "Warning" and event["reason"] == "GPULayoutFailed"
        assert event["metadata"]["namespace"] == "default" and event["source"]["component"] == "gpud"
        assert "policy.reboot is never" in event["message"]
        assert _annotations(real_server)[LAST_ERROR] == agent.status.message == event["message"]
        node.merge_labels({MIG_CONFIG: "ok"})
        await until_true(lambda: node.labels().get(MIG_STATE) == "success" and LAST_ERROR not in
                          _annotations(real_server), "the annotation removed")
    assert len(_describe_events(real_server, NODE, uid)) == 1  # a success is no warning


async def test_item7_without_events_create_the_annotation_is_still_written(real_server, real_node, tmp_path):
    """The documented role less `events create`: the Event is refused (403), the annotation is still
    written, and gpud says which verb it lacks. Fails if the annotation depends on the Event."""
    node = real_node
    name = "gpud-without-events"
    kubeconfig = narrowed_role(real_server, tmp_path / f"{name}.kubeconfig", name,
                               lambda rules: [r for r in rules if "events" not in r["resources"]])
    _seed(node, {**BASE_LABELS, MIG_CONFIG: "x"})
    uid = real_server.admin("GET", f"/api/v1/nodes/{NODE}")["metadata"]["uid"]
    events: list[str] = []
    agent = _agent(kubeconfig, _failing_engine(node), on_event=lambda k, m: events.append(m))
    async with running(agent):
        await until_true(lambda: node.labels().get(MIG_STATE) == "failed" and LAST_ERROR in _annotations(real_server),
                          "the annotation without the Event")
        await until_true(lambda: any("events create" in e for e in events), "the missing verb reported")
    assert _annotations(real_server)[LAST_ERROR] == agent.status.message
    assert _describe_events(real_server, NODE, uid) == []
    (said,) = [e for e in events if "events create" in e]
    assert 'cannot create resource "events"' in said
    audit = [(ev["verb"], ev.get("objectRef", {}).get("resource", ""), ev.get("responseStatus", {}).get("code", 0))
             for ev in real_server.audit(f"system:serviceaccount:kube-system:{name}")]
    assert ("create", "events", 403) in audit

