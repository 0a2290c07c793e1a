"""Item: the GPU Operator's own GPU agents (mig-manager, vgpu-device-manager, vfio-manager) stay
off a node gpud manages, and gpud changes no GPU while one of their pods is still there.

Checked on the node as the API server stored it (its versions) and on the pods it holds; the
DaemonSet stand-in removes a pod only when its deploy label stops matching, as the real
controller does, so "gone before the change" holds only if gpud really turned the label off.
"""

from __future__ import annotations

from gpud.engine.kube.agent import MIG_CONFIG, MIG_STATE, Impact
from tests.support.kube_agent import (
    AGENT_SETS,
    BASE_LABELS,
    CHANGE,
    MIG_MANAGER,
    SETS,
    VFIO_MANAGER,
    VGPU_DM,
    EngineStandIn,
    _agent,
    _changes,
    _labels,
    _node,
    _pods,
    running,
)
from tests.support.kube_cluster import NODE, OPERATOR_NS, DaemonSetController, client_for, until


async def test_operator_agents_are_turned_off_kept_off_and_gone_before_a_change(cluster):
    api, kubeconfig = cluster
    # what the operator's node-labeling controller leaves on a MIG-capable node
    await _node(api, {**BASE_LABELS, MIG_MANAGER: "true", VGPU_DM: "true", MIG_CONFIG: "all-disabled"})
    engine = EngineStandIn(api, {"all-disabled": Impact(), "partial": CHANGE})
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, SETS + AGENT_SETS):
        assert f"{OPERATOR_NS}/nvidia-mig-manager-{NODE}" in _pods(api)
        agent = _agent(kubeconfig, engine)
        async with running(agent):
            await until(api, lambda: _labels(api).get(MIG_STATE) == "success", "first pass")
            assert {_labels(api)[k] for k in (MIG_MANAGER, VGPU_DM, VFIO_MANAGER)} == {"false"}
            # an administrator (or an older operator) turns mig-manager back on
            await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {MIG_MANAGER: "true"}}})
            await until(api, lambda: _labels(api).get(MIG_MANAGER) == "false", "mig-manager off again")
            await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {MIG_CONFIG: "partial"}}})
            await until(api, lambda: len(engine.applied) == 1 and _labels(api).get(MIG_STATE) == "success", "change")
        await agent.api.close()
    await controller_client.close()
    history = api.node_history(NODE)
    assert _changes(history, MIG_MANAGER) == ["true", "false", "true", "false"]
    assert _changes(history, VGPU_DM) == ["true", "false"]
    assert _changes(history, VFIO_MANAGER) == [None, "false"]
    (_, pods_at_change, labels_at_change), = engine.applied
    assert not any(a.name in p for a in AGENT_SETS for p in pods_at_change), pods_at_change
    assert labels_at_change[MIG_MANAGER] == "false"


async def test_no_gpu_changes_while_an_operator_agent_pod_stays(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_MANAGER: "true", MIG_CONFIG: "partial"})
    engine = EngineStandIn(api, {"partial": CHANGE})
    events: list[str] = []
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, AGENT_SETS[:1]) as dsc:
        dsc.terminating.clear()  # mig-manager's pod hangs in termination
        agent = _agent(kubeconfig, engine, pod_timeout=0.5, on_event=lambda k, m: events.append(m))
        async with running(agent):
            await until(api, lambda: _labels(api).get(MIG_STATE) == "failed", "state failed")
        await agent.api.close()
        dsc.terminating.set()
    await controller_client.close()
    assert engine.applied == []  # no GPU changed
    pod = f"{OPERATOR_NS}/nvidia-mig-manager-{NODE}"
    assert agent.status.other_agents == [pod]
    assert f"the GPU Operator's own GPU agent(s) still run on this node: {pod}" in agent.status.message
    assert any(pod in e and "gpud changes no GPU" in e for e in events)
    assert _labels(api)[MIG_MANAGER] == "false"
    # what `gpudctl status --kube` prints from the agent's status
    from gpud.api.replies import kubernetes_status
    from gpud.cli.render import render_kubernetes

    shown = render_kubernetes(kubernetes_status((), mig_strategy="mixed", agent=agent.status))
    assert f"the operator's GPU agents on this node (gpud changes no GPU until they leave): {pod}" in shown
