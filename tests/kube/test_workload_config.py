"""Item: nvidia.com/gpu.workload.config from the layout in force, and what the GPU Operator will
not serve when a layout mixes workloads per GPU.

Oracles: the operator's per-workload operand families as its state_manager.go lists them (copied
here by hand, not from gpud), the node as the API server stored it, and `gpudctl status --kube`
of a real gpud process.
"""

from __future__ import annotations

import json

import pytest

from gpud.engine.kube.workload import plan_workload
from tests.support.daemon import Daemon, wait_until
from tests.support.kube_cluster import NODE, EmulatorThread, write_kubeconfig
from tests.support.operator_fixtures import PASSTHROUGH_SERVED
from tests.support.operator_fixtures import WORKLOAD_LAYOUT as LAYOUT
from tests.support.present import present

WORKLOAD = "nvidia.com/gpu.workload.config"
CONFIG, STATE = "nvidia.com/mig.config", "nvidia.com/mig.config.state"
# gpu-operator controllers/state_manager.go gpuStateLabels (operands only)
SANDBOX_FAMILY = {"sandbox-device-plugin", "sandbox-validator"}



@pytest.mark.parametrize(("workloads", "node", "label", "unserved"), [
    ({"a": "container", "b": "container"}, None, "container", {}),
    ({"a": "vm-vgpu"}, "container", "vm-vgpu", {}),
    ({"a": "container", "b": "vm-passthrough"}, None, None, {"vm-passthrough": ["b"]}),
    ({"a": "container", "b": "vm-passthrough"}, "vm-passthrough", None, {"container": ["a"]}),
    ({"a": "container", "b": "vm-passthrough", "c": "vm-vgpu"}, "vm-vgpu", None,
     {"container": ["a"], "vm-passthrough": ["b"]}),
])
def test_plan(workloads, node, label, unserved):
    plan = plan_workload(workloads, node)
    assert (plan.label, plan.unserved) == (label, unserved)


def test_mixed_message_names_the_missing_operands():
    plan = plan_workload({"0000:18:00.0": "container", "0000:2a:00.0": "vm-passthrough"}, "container")
    (message,) = plan.messages
    assert message.startswith("vm-passthrough GPU(s) 0000:2a:00.0:")
    assert all(op in message for op in SANDBOX_FAMILY)
    assert plan.served_labels() == {"nvidia.com/gpud.workload.container.served": None,
                                    PASSTHROUGH_SERVED: "false", "nvidia.com/gpud.workload.vm-vgpu.served": None}


@pytest.mark.daemon
def test_daemon_sets_the_workload_config_and_says_what_a_mixed_layout_leaves_unserved(tmp_path):
    emu = EmulatorThread()
    try:
        emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": {CONFIG: "whole"}}}))
        kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", emu.url)
        d = Daemon(tmp_path / "d", ["h100-80gb:2"], LAYOUT, ["--kube-node", NODE, "--kubeconfig", kubeconfig,
                                                             "--nfd-features", str(tmp_path / "none" / "gpud")])

        def labels():
            return emu.read(lambda: present(emu.api.get("nodes", NODE))["metadata"]["labels"])

        def relabel(value):
            emu.call(emu.api.put_object("nodes", {"metadata": {"name": NODE, "labels": {CONFIG: value}}}))

        try:
            wait_until(lambda: labels().get(WORKLOAD) == "container", timeout=120, what="workload config")
            assert PASSTHROUGH_SERVED not in labels()
            relabel("mixed")
            wait_until(lambda: labels().get(PASSTHROUGH_SERVED) == "false", timeout=120, what="unserved label")
            assert labels()[WORKLOAD] == "container"  # a mixed layout leaves the operator's choice as it is
            shown = d.ctl("status", "--kube").stdout
            assert "gpu.workload.config: container" in shown
            assert "not served: vm-passthrough GPU(s) 0000:2a:00.0:" in shown and "sandbox-device-plugin" in shown
            agent = json.loads(d.ctl("status", "--json").stdout)["kubernetes"]["agent"]
            assert agent["workload_config"] == "container" and len(agent["unserved"]) == 1
            relabel("vms")
            wait_until(lambda: labels().get(WORKLOAD) == "vm-passthrough" and PASSTHROUGH_SERVED not in labels(),
                       timeout=120, what="vm-passthrough node")
            wait_until(lambda: "not served" not in d.ctl("status", "--kube").stdout, timeout=60, what="status")
        finally:
            d.stop()
        assert d.proc.returncode == 0, d.log.read_text()
    finally:
        emu.close()
