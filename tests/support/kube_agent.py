"""The operator's label protocol driven in process: the operand DaemonSets of a GPU Operator node,
an engine stand-in, the agent over the API emulator, and the node's label history read back
(tests/kube's agent, operator and real-apiserver tests)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Collection
from typing import Any

from gpud.engine.kube.agent import (
    Impact,
    KubeAgent,
    Outcome,
)
from gpud.engine.kube.operands import OperandsNotPaused
from gpud.host.kube.node_api import KubeApi, load_config
from tests.support.kube_cluster import (
    NODE,
    OPERATOR_NS,
    PAUSE_IMAGE,
    DaemonSet,
)
from tests.support.kube_emulator import ApiServer
from tests.support.present import present

DP = "nvidia.com/gpu.deploy.device-plugin"
GFD = "nvidia.com/gpu.deploy.gpu-feature-discovery"
DCGM_EXP = "nvidia.com/gpu.deploy.dcgm-exporter"
DCGM = "nvidia.com/gpu.deploy.dcgm"
NVSM = "nvidia.com/gpu.deploy.nvsm"
CLIENT = "nvidia.com/gpu.deploy.client"
SANDBOX_DP = "nvidia.com/gpu.deploy.sandbox-device-plugin"
SANDBOX_VAL = "nvidia.com/gpu.deploy.sandbox-validator"
CONTAINER = (DP, GFD, DCGM_EXP, DCGM, CLIENT)

SETS = [
    DaemonSet("nvidia-device-plugin-daemonset", OPERATOR_NS, "nvidia-device-plugin-daemonset", {DP: "true"}),
    DaemonSet("gpu-feature-discovery", OPERATOR_NS, "gpu-feature-discovery", {GFD: "true"}),
    DaemonSet("nvidia-dcgm-exporter", OPERATOR_NS, "nvidia-dcgm-exporter", {DCGM_EXP: "true"}),
    DaemonSet("nvidia-dcgm", OPERATOR_NS, "nvidia-dcgm", {DCGM: "true"}),
    DaemonSet("inference-sidecar", "apps", "inference-sidecar", {CLIENT: "true"}),  # a third-party GPU client
    DaemonSet("nvidia-sandbox-device-plugin-daemonset", OPERATOR_NS, "nvidia-sandbox-device-plugin-daemonset",
              {SANDBOX_DP: "true"}),
    DaemonSet("nvidia-sandbox-validator", OPERATOR_NS, "nvidia-sandbox-validator", {SANDBOX_VAL: "true"}),
]
# the operator's own GPU agents, which gpud keeps off its node (gpud.engine.kube.other_agents)
MIG_MANAGER = "nvidia.com/gpu.deploy.mig-manager"
VGPU_DM = "nvidia.com/gpu.deploy.vgpu-device-manager"
VFIO_MANAGER = "nvidia.com/gpu.deploy.vfio-manager"
AGENT_SETS = [
    DaemonSet("nvidia-mig-manager", OPERATOR_NS, "nvidia-mig-manager", {MIG_MANAGER: "true"}),
    DaemonSet("nvidia-vgpu-device-manager", OPERATOR_NS, "nvidia-vgpu-device-manager", {VGPU_DM: "true"}),
    DaemonSet("nvidia-vfio-manager", OPERATOR_NS, "nvidia-vfio-manager", {VFIO_MANAGER: "true"}),
]

# a pass changing the first GPU, seen by the container operands
CHANGE = Impact(changed=("0000:18:00.0",), container=("0000:18:00.0",))

VALIDATORS = ("nvidia-cuda-validator", "nvidia-device-plugin-validator", "nvidia-operator-validator")

BASE_LABELS = {DP: "true", GFD: "true", DCGM_EXP: "true", DCGM: "true", NVSM: "false", CLIENT: "true",
               SANDBOX_DP: "true", SANDBOX_VAL: "true", "kubernetes.io/hostname": NODE}


class EngineStandIn:
    """The engine's side of the contract, as the reconciler keeps it, scripted per layout: a pass
    for a layout runs its changes inside the agent's `operands_paused(impact)`; a pass that needs a
    reboot calls `before_reboot` and returns "rebooting" when the reboot is allowed and not yet
    tried. At each change it records what the API server holds at that moment."""

    def __init__(self, api: ApiServer | None, impacts: dict[str, Impact], *, needs_reboot: Collection[str] = frozenset(),
                 reboot: bool = False, rebooted_before: bool = False, mig_capable: bool = True) -> None:
        self.api, self.impacts, self.needs_reboot = api, impacts, needs_reboot
        self.allow_reboot, self.rebooted_before, self.capable = reboot, rebooted_before, mig_capable
        self.agent: KubeAgent | None = None
        self.applied: list[tuple[str, list[str], dict[str, str]]] = []
        self.selected: list[str | None] = []
        self.reboots: list[str] = []

    def layouts(self):
        return list(self.impacts)

    async def apply(self, layout):
        self.selected.append(layout)
        if layout is None:
            return Outcome("success")
        impact = self.impacts[layout]
        try:
            return await self._pass(layout, impact)
        except OperandsNotPaused as e:  # the reconciler fails the pass's GPUs with the reason
            return Outcome("failed", str(e))

    async def _pass(self, layout, impact):
        async with present(self.agent).operands_paused(impact):
            if impact.changed:
                self.applied.append((layout, *self.snapshot()))
            if layout in self.needs_reboot:
                if self.allow_reboot and not self.rebooted_before:  # the engine's reboot policy and marker
                    await present(self.agent).before_reboot("GPU 0: MIG mode change pending until a reboot")
                    self.reboots.append(layout)
                    return Outcome("rebooting", "reboot requested")
                why = "an earlier reboot did not settle it" if self.rebooted_before else "policy.reboot is never"
                return Outcome("failed", f"GPU 0: reboot required; {why}")
        return Outcome("success", "converged")

    def mig_capable(self):
        return self.capable

    def snapshot(self) -> tuple[list[str], dict[str, str]]:
        """The pods on the node and its labels, as the API server holds them at this moment."""
        assert self.api is not None  # None: a subclass reads another server (tests/support/kube_real_agent)
        pods = sorted(f"{ns}/{name}" for (p, ns, name), o in self.api._store.items()
                      if p == "pods" and o["spec"].get("nodeName") == NODE)
        return pods, dict(present(self.api.get("nodes", NODE))["metadata"]["labels"])


async def _node(api: ApiServer, labels: dict[str, str]) -> None:
    await api.put_object("nodes", {"metadata": {"name": NODE, "labels": labels}})
    for app in VALIDATORS:
        await api.put_object("pods", {"metadata": {"name": f"{app}-x1", "namespace": OPERATOR_NS, "labels": {"app": app}},
                                      "spec": {"nodeName": NODE, "containers": [{"name": "v", "image": PAUSE_IMAGE}]}})


def _labels(api: ApiServer) -> dict[str, str]:
    return present(api.get("nodes", NODE))["metadata"]["labels"]


def _pods(api: ApiServer) -> list[str]:
    return sorted(f"{ns}/{name}" for (p, ns, name) in api._store if p == "pods")


@contextlib.asynccontextmanager
async def running(agent: KubeAgent, *, close_api: bool = False) -> AsyncIterator[asyncio.Task]:
    """The agent's run loop as a task for the body; cancelled after it (and its API client closed
    with `close_api`)."""
    task = asyncio.create_task(agent.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if close_api:
            await agent.api.close()


def _agent(kubeconfig: str, engine: EngineStandIn, api_cls: type[KubeApi] = KubeApi, **kw: Any) -> KubeAgent:
    agent = KubeAgent(api_cls(NODE, load_config(kubeconfig)), engine, **kw)
    engine.agent = agent
    return agent


def _changes(history: list[dict[str, str]], key: str) -> list[str | None]:
    """The successive distinct values of one label over the node's versions."""
    out: list[str | None] = []
    for labels in history:
        v = labels.get(key)
        if not out or out[-1] != v:
            out.append(v)
    return out
