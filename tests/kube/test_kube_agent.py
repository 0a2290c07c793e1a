"""The operator's label protocol through the real client (lightkube) against the API emulator.

What is checked is the node as the API server stored it, version by version (its watch log), and
the pods on it: not the agent's own account. The DaemonSet controller stand-in removes an
operand's pod only when its deploy label stops matching, so "the pods are gone before the apply"
holds only if the agent really paused and waited.
"""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from gpud.engine.kube.agent import (
    MIG_CAPABLE,
    MIG_CONFIG,
    MIG_STATE,
    PAUSED_MIG,
    PAUSED_VGPU,
    VGPU_CONFIG,
    VGPU_STATE,
    Impact,
    KubeAgent,
    Outcome,
)
from gpud.host.kube.node_api import KubeApi, load_config
from tests.support.kube_agent import (
    BASE_LABELS,
    CLIENT,
    CONTAINER,
    DCGM,
    DCGM_EXP,
    DP,
    GFD,
    NVSM,
    SANDBOX_DP,
    SANDBOX_VAL,
    SETS,
    VALIDATORS,
    EngineStandIn,
    _agent,
    _changes,
    _labels,
    _node,
    _pods,
    running,
)
from tests.support.kube_cluster import (
    NODE,
    OPERATOR_NS,
    DaemonSetController,
    client_for,
    until,
    write_kubeconfig,
)


async def test_mig_change_pauses_container_operands_waits_applies_restores(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "partial-mig"})
    engine = EngineStandIn(api, {"partial-mig": Impact(changed=("0000:18:00.0",), container=("0000:18:00.0",)),
                                 "all-disabled": Impact()})
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, SETS) as dsc:
        dsc.terminating.clear()  # hold every pod's termination until the agent is seen waiting
        events: list[str] = []
        waiting = asyncio.Event()

        def on_event(kind, message):
            events.append(message)
            if message.startswith("waiting for"):
                waiting.set()

        agent = _agent(kubeconfig, engine, on_event=on_event)
        async with running(agent):
            await asyncio.wait_for(waiting.wait(), 20)
            assert engine.applied == []  # pods still there: nothing applied yet
            dsc.terminating.set()
            await until(api, lambda: _labels(api).get(MIG_STATE) == "success", "state success")
        await agent.api.close()
        # the controller brings every operand back once its label is true again
        await until(api, lambda: all(f"{ds.namespace}/{ds.name}-{NODE}" in _pods(api) for ds in SETS), "operands back")
    await controller_client.close()

    history = api.node_history(NODE)
    assert _changes(history, MIG_STATE) == [None, "pending", "success"]
    for label in CONTAINER:
        assert _changes(history, label) == ["true", PAUSED_MIG, "true"], label
    for label in (NVSM, SANDBOX_DP, SANDBOX_VAL):  # false stays false; the sandbox side is not touched
        assert len(_changes(history, label)) == 1, label
    assert _labels(api)[MIG_CAPABLE] == "true"
    # at the apply: every container operand pod and both pre-change validators gone, sandbox pods kept
    (layout, pods_at_apply, labels_at_apply), = engine.applied
    assert layout == "partial-mig"
    assert pods_at_apply == [f"{OPERATOR_NS}/nvidia-operator-validator-x1",
                             f"{OPERATOR_NS}/nvidia-sandbox-device-plugin-daemonset-{NODE}",
                             f"{OPERATOR_NS}/nvidia-sandbox-validator-{NODE}"]
    assert labels_at_apply[MIG_STATE] == "pending"
    # after: operands back (the controller re-created them), the operator validator removed to re-run
    assert f"{OPERATOR_NS}/nvidia-operator-validator-x1" not in _pods(api)
    assert f"{OPERATOR_NS}/nvidia-device-plugin-daemonset-{NODE}" in _pods(api)
    assert "apps/inference-sidecar-" + NODE in _pods(api)


async def test_a_pass_that_changes_nothing_pauses_nothing(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "all-disabled"})
    engine = EngineStandIn(api, {"all-disabled": Impact()})
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "success", "state success")
    await agent.api.close()
    history = api.node_history(NODE)
    assert _changes(history, MIG_STATE) == [None, "success"]
    for label in BASE_LABELS:
        assert len(_changes(history, label)) == 1, label
    assert engine.selected == ["all-disabled"] and engine.applied == []
    assert all(f"{OPERATOR_NS}/{v}-x1" in _pods(api) for v in VALIDATORS)  # no validator removed either


async def test_passthrough_change_pauses_only_the_sandbox_operands(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, VGPU_CONFIG: "vms"})
    engine = EngineStandIn(api, {"vms": Impact(changed=("0000:2a:00.0",), sandbox=("0000:2a:00.0",))})
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, SETS):
        agent = _agent(kubeconfig, engine)
        async with running(agent):
            await until(api, lambda: _labels(api).get(VGPU_STATE) == "success", "vgpu state success")
        await agent.api.close()
    await controller_client.close()
    history = api.node_history(NODE)
    assert _changes(history, VGPU_STATE) == [None, "pending", "success"]
    assert MIG_STATE not in _labels(api)
    for label in (SANDBOX_DP, SANDBOX_VAL):
        assert _changes(history, label) == ["true", PAUSED_VGPU, "true"], label
    for label in CONTAINER:
        assert len(_changes(history, label)) == 1, label
    (_, pods_at_apply, _), = engine.applied
    assert not any("sandbox" in p for p in pods_at_apply)
    assert f"{OPERATOR_NS}/nvidia-device-plugin-daemonset-{NODE}" in pods_at_apply


async def test_stale_patch_gets_409_and_a_concurrent_false_is_kept(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "partial-mig"})
    engine = EngineStandIn(api, {"partial-mig": Impact(changed=("0000:18:00.0",), container=("0000:18:00.0",))})
    raced: list[str] = []

    async def admin_turns_dcgm_off(verb, plural, name, body):
        meta = (body or {}).get("metadata", {}) if isinstance(body, dict) else {}
        if not raced and plural == "nodes" and "resourceVersion" in meta and PAUSED_MIG in meta["labels"].values():
            raced.append(meta["resourceVersion"])  # the agent read the node at this version
            await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {DCGM: "false"}}})

    api.before_write = admin_turns_dcgm_off
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, SETS):
        agent = _agent(kubeconfig, engine)
        async with running(agent):
            await until(api, lambda: _labels(api).get(MIG_STATE) == "success", "state success")
        await agent.api.close()
    await controller_client.close()
    assert len(api.conflicts) == 1 and api.conflicts[0]["metadata"]["resourceVersion"] == raced[0]
    assert agent.conflicts == 1
    history = api.node_history(NODE)
    assert _changes(history, DCGM) == ["true", "false"]  # never paused, never restored to true
    for label in (DP, GFD, DCGM_EXP, CLIENT):
        assert _changes(history, label) == ["true", PAUSED_MIG, "true"], label


async def test_reboot_once_then_failed_never_a_second_reboot(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "all-balanced"})
    impact = {"all-balanced": Impact(changed=("0000:18:00.0",), container=("0000:18:00.0",))}
    engine = EngineStandIn(api, impact, needs_reboot={"all-balanced"}, reboot=True)
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "rebooting", "state rebooting")
    await agent.api.close()
    assert engine.reboots == ["all-balanced"]
    assert all(_labels(api)[label] == PAUSED_MIG for label in CONTAINER)  # stay paused across the reboot

    # the node comes back: a new gpud process; the change is still not settled, and the engine's
    # reboot marker refuses a second reboot
    engine2 = EngineStandIn(api, impact, needs_reboot={"all-balanced"}, reboot=True, rebooted_before=True)
    agent2 = _agent(kubeconfig, engine2)
    async with running(agent2):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "failed", "state failed")
    await agent2.api.close()
    assert engine2.reboots == []
    assert "still not settled after the reboot" in agent2.status.message
    assert all(_labels(api)[label] == "true" for label in CONTAINER)  # the leftover pause is restored
    # after the reboot: pending again while gpud re-applies, then failed
    assert _changes(api.node_history(NODE), MIG_STATE) == [None, "pending", "rebooting", "pending", "failed"]


async def test_reboot_settles_it(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "all-balanced", MIG_STATE: "rebooting",
                      **{label: PAUSED_MIG for label in CONTAINER}})
    engine = EngineStandIn(api, {"all-balanced": Impact(changed=("0000:18:00.0",), container=("0000:18:00.0",))},
                           reboot=True, rebooted_before=True)
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "success", "state success")
    await agent.api.close()
    assert engine.reboots == []
    assert all(_labels(api)[label] == "true" for label in CONTAINER)


async def test_reboot_not_allowed_fails_and_restores(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "x"})
    engine = EngineStandIn(api, {"x": Impact(changed=("0000:18:00.0",), container=("0000:18:00.0",))},
                           needs_reboot={"x"}, reboot=False)
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "failed", "state failed")
    await agent.api.close()
    assert engine.reboots == [] and "policy.reboot is never" in agent.status.message
    assert all(_labels(api)[label] == "true" for label in CONTAINER)
    assert _changes(api.node_history(NODE), MIG_STATE) == [None, "pending", "failed"]


async def test_a_pass_the_agent_did_not_start_is_reported_too(cluster):
    """An edit of the file under the same label: the engine's pass pauses through the guard and
    the agent reports the settled outcome on the active selection."""
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "a"})
    engine = EngineStandIn(api, {"a": Impact()})
    agent = _agent(kubeconfig, engine)
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, SETS), running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "success", "first success")
        engine.impacts["a"] = Impact(changed=("g",), container=("g",))  # the file now asks for more
        assert await engine.apply("a") == Outcome("success", "converged")  # the engine's own pass
        assert await agent.settled(Outcome("success", "converged")) == "success"
        assert await agent.settled(Outcome("success", "converged")) is None  # nothing changed since
    await agent.api.close()
    await controller_client.close()
    history = api.node_history(NODE)
    assert _changes(history, MIG_STATE) == [None, "success", "pending", "success"]
    assert _changes(history, DP) == ["true", PAUSED_MIG, "true"]
    (_, pods_at_apply, _), = engine.applied
    assert f"{OPERATOR_NS}/nvidia-device-plugin-daemonset-{NODE}" not in pods_at_apply
    assert f"{OPERATOR_NS}/nvidia-sandbox-device-plugin-daemonset-{NODE}" in pods_at_apply


@pytest.mark.parametrize(("labels", "message"), [
    ({MIG_CONFIG: "nope"}, "no layout named 'nope' in layout.yaml (layouts: a)"),
    ({MIG_CONFIG: "a", VGPU_CONFIG: "b"}, "name different layouts"),
])
async def test_bad_selection_fails_without_touching_anything(cluster, labels, message):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, **labels})
    engine = EngineStandIn(api, {"a": Impact(changed=("x",), container=("x",))})
    agent = _agent(kubeconfig, engine)
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "failed", "state failed")
    await agent.api.close()
    assert message in agent.status.message
    assert engine.selected == [] and engine.applied == []
    for label in BASE_LABELS:
        assert len(_changes(api.node_history(NODE), label)) == 1


async def test_label_change_is_followed_across_a_dropped_watch_and_a_short_history(cluster):
    api, kubeconfig = cluster
    api.history = 5  # a short history: the agent's watch will fall behind it and get 410 Gone
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "a"})
    engine = EngineStandIn(api, {"a": Impact(), "b": Impact(changed=("g",), container=("g",))})
    events = []
    agent = _agent(kubeconfig, engine, on_event=lambda k, m: events.append(m))
    async with running(agent):
        await until(api, lambda: _labels(api).get(MIG_STATE) == "success" and len(engine.selected) == 1, "first")
        # the connection drops; while it is down, others' writes push the version the agent saw last
        # out of the retained history, and the label changes
        await api.interrupt_watches()
        for i in range(12):
            await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {"noise": str(i)}}})
        await api.put_object("nodes", {"metadata": {"name": NODE, "labels": {MIG_CONFIG: "b"}}})
        api.resume_watches()
        await until(api, lambda: len(engine.applied) == 1 and _labels(api).get(MIG_STATE) == "success", "second")
    await agent.api.close()
    # The agent watches from the node as it is when a watch opens, never from a version it read
    # earlier, so a dropped watch does not leave it asking for history the server no longer has
    # (the 410 path itself: tests/kube/test_real_apiserver.py, against etcd's compaction).
    assert engine.selected == ["a", "b"]


async def test_operand_pods_that_never_leave_fail_the_change(cluster):
    api, kubeconfig = cluster
    await _node(api, {**BASE_LABELS, MIG_CONFIG: "a"})
    engine = EngineStandIn(api, {"a": Impact(changed=("g",), container=("g",))})
    controller_client = client_for(kubeconfig)
    async with DaemonSetController(controller_client, NODE, SETS) as dsc:
        dsc.terminating.clear()  # the pods hang in termination
        agent = _agent(kubeconfig, engine, pod_timeout=0.5)
        async with running(agent):
            await until(api, lambda: _labels(api).get(MIG_STATE) == "failed", "state failed")
        await agent.api.close()
        dsc.terminating.set()
    await controller_client.close()
    assert engine.applied == []  # the engine never changed the GPUs under the operands
    assert "could not take the GPU operands off the node: they did not leave in time" in agent.status.message
    assert all(_labels(api)[label] == "true" for label in CONTAINER)


async def test_unreachable_api_is_retried_not_fatal(tmp_path):
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", "http://127.0.0.1:9")  # discard port: refused
    events = []
    agent = KubeAgent(KubeApi(NODE, load_config(kubeconfig)), EngineStandIn(None, {}),
                      on_event=lambda k, m: events.append(m), retry_delay=0.01)
    task = asyncio.create_task(agent.run())
    try:
        while len(events) < 2:
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await agent.api.close()
    assert not agent.status.connected
    assert all("Kubernetes API" in e and "retrying" in e for e in events)
