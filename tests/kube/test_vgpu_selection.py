"""Item: nvidia.com/vgpu.config on a GPU Operator node: it wins over the operator's automatic
`mig.config=all-disabled`, reports on nvidia.com/vgpu.config.state, and a vm-vgpu node without it
gets the default vGPU layout, as vgpu-device-manager applies DEFAULT_VGPU_CONFIG.

The agent runs against the API emulator through the real client; what is checked is the node as
the server stored it, version by version, and which layout the engine was asked for.
"""

from __future__ import annotations

import pytest

from gpud.engine.kube.agent import Impact
from gpud.engine.kube.selection import (
    MIG_CONFIG,
    MIG_STATE,
    VGPU_CONFIG,
    VGPU_STATE,
    WORKLOAD_CONFIG,
    Selection,
    selection,
)
from tests.support.kube_agent import (
    BASE_LABELS,
    EngineStandIn,
    _agent,
    _changes,
    _labels,
    _node,
    running,
)
from tests.support.kube_cluster import NODE, until
from tests.support.present import present

CHANGE = Impact(changed=("0000:18:00.0",), sandbox=("0000:18:00.0",))


@pytest.mark.parametrize(("labels", "layouts", "layout", "states"), [
    ({MIG_CONFIG: "all-disabled", VGPU_CONFIG: "l40s-12q"}, (), "l40s-12q", (VGPU_STATE,)),
    ({VGPU_CONFIG: "l40s-12q"}, (), "l40s-12q", (VGPU_STATE,)),
    ({MIG_CONFIG: "x", VGPU_CONFIG: "x"}, (), "x", (MIG_STATE, VGPU_STATE)),
    ({WORKLOAD_CONFIG: "vm-vgpu"}, ("default", "b"), "default", (VGPU_STATE,)),
    ({WORKLOAD_CONFIG: "vm-vgpu", MIG_CONFIG: "all-disabled"}, ("default",), "default", (VGPU_STATE,)),
    ({WORKLOAD_CONFIG: "vm-vgpu", MIG_CONFIG: "all-disabled"}, ("b",), "all-disabled", (MIG_STATE,)),  # no default
    ({WORKLOAD_CONFIG: "container", MIG_CONFIG: "all-disabled"}, ("default",), "all-disabled", (MIG_STATE,)),
    ({WORKLOAD_CONFIG: "vm-vgpu", MIG_CONFIG: "mixed"}, ("default",), "mixed", (MIG_STATE,)),  # chosen by a person
    ({}, ("default",), None, ()),
])
def test_selection(labels, layouts, layout, states):
    got = selection(labels, layouts=layouts)
    assert (got.layout, got.state_labels, got.error) == (layout, states, None)


def test_two_names_neither_all_disabled_are_an_error():
    got = selection({MIG_CONFIG: "a", VGPU_CONFIG: "b"})
    assert got.layout is None and "name different layouts" in present(got.error)
    assert selection({WORKLOAD_CONFIG: "vm-vgpu"}, layouts=("default",), default_vgpu=None) == Selection(None, ())


async def test_vgpu_config_wins_over_the_operators_all_disabled(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "all-disabled", VGPU_CONFIG: "l40s-12q"})
    engine = EngineStandIn(api, {"all-disabled": Impact(), "l40s-12q": CHANGE})
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(VGPU_STATE) == "success", "vgpu state success")
    await agent.api.close()
    assert engine.selected == ["l40s-12q"]
    history = api.node_history(NODE)
    assert _changes(history, VGPU_STATE) == [None, "pending", "success"]
    assert _changes(history, MIG_STATE) == [None]  # MIG is the vGPU layout's business here


async def test_unlabelled_vgpu_node_gets_the_default_then_follows_the_label(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, WORKLOAD_CONFIG: "vm-vgpu", MIG_CONFIG: "all-disabled"})
    engine = EngineStandIn(api, {"all-disabled": Impact(), "default": CHANGE, "a10-4q": CHANGE})
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(VGPU_STATE) == "success", "default applied")
        assert engine.selected == ["default"]
        await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {VGPU_CONFIG: "a10-4q"}}})
        await until(api, lambda: engine.selected == ["default", "a10-4q"] and _labels(api).get(VGPU_STATE) == "success"
                    and len(engine.applied) == 2, "a10-4q applied")
    await agent.api.close()
    assert _changes(api.node_history(NODE), VGPU_STATE) == [None, "pending", "success", "pending", "success"]
    assert MIG_STATE not in _labels(api)
