"""Item: why a change failed is where `kubectl describe node` shows it: a Warning Event about the
Node and the node annotation nvidia.com/gpud.last-error (removed once a change succeeds).

Checked on the objects the API server stored (events by their involvedObject, the node's
annotations), through the real client.
"""

from __future__ import annotations

from gpud.engine.kube.agent import LAST_ERROR, MIG_CONFIG, MIG_STATE, Impact
from tests.kube.test_kube_agent import (
    BASE_LABELS,
    EngineStandIn,
    _agent,
    _labels,
    _node,
    running,
)
from tests.support.kube_cluster import NODE, until


def _node_events(api):
    return [o for (p, _, _), o in api._store.items() if p == "events"
            and o["involvedObject"].get("kind") == "Node" and o["involvedObject"].get("name") == NODE]


def _annotations(api):
    return api.get("nodes", NODE)["metadata"].get("annotations") or {}


async def test_failure_is_an_event_and_an_annotation_until_a_success(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "x"})
    engine = EngineStandIn(api, {"x": Impact(changed=("g",), container=("g",)), "ok": Impact()},
                           needs_reboot={"x"}, reboot=False)
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "failed" and _node_events(api)
                    and LAST_ERROR in _annotations(api), "failure recorded")
        (event,) = _node_events(api)
        assert event["metadata"]["namespace"] == "default" and event["type"] == "Warning"
        assert event["reason"] == "GPULayoutFailed" and "policy.reboot is never" in event["message"]
        assert event["involvedObject"]["uid"] == api.get("nodes", NODE)["metadata"]["uid"]
        assert event["source"]["component"] == "gpud"
        assert _annotations(api)[LAST_ERROR] == agent.status.message
        await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {MIG_CONFIG: "ok"}}})
        await until(api, lambda: _labels(api).get(MIG_STATE) == "success" and LAST_ERROR not in _annotations(api),
                    "annotation removed")
    await agent.api.close()
    assert len(_node_events(api)) == 1  # a success is no warning
