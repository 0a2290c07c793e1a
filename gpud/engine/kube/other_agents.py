"""The GPU Operator's own GPU agents (mig-manager, vgpu-device-manager, vfio-manager) kept off a
node gpud manages: part of the kube agent (gpud.engine.kube.agent.KubeAgent mixes this in).

Publishing `nvidia.com/mig.capable=true` makes the operator deploy mig-manager
(controllers/nodelabeling_controller.go); the operator keeps a deploy label's existing value
(controllers/state_manager.go), so `false` written by gpud stays, and the agents' DaemonSets, which
select on `=true`, remove their pods. Two agents must never reconfigure the same GPUs, so no GPU
changes while one of those pods is still on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Protocol

from msgspec import Struct

from gpud.engine.kube.operands import OperandsNotPaused
from gpud.engine.kube.selection import Selection
from gpud.host.kube.node_api import KubeApi, KubeError, NodeView, PodView


class OtherAgent(Struct, frozen=True):
    """An operator agent that reconfigures GPUs itself: gpud keeps its deploy label `false` on its
    node (the operator keeps a value it finds: state_manager.go) and changes no GPU while one of its
    pods is still on the node."""

    label: str  # nvidia.com/gpu.deploy.<name>; its DaemonSet selects on `<label>=true`
    app: str  # its pods' `app` label (gpu-operator assets/state-<name>/*_daemonset.yaml)


OTHER_AGENTS = (
    OtherAgent("nvidia.com/gpu.deploy.mig-manager", "nvidia-mig-manager"),
    OtherAgent("nvidia.com/gpu.deploy.vgpu-device-manager", "nvidia-vgpu-device-manager"),
    OtherAgent("nvidia.com/gpu.deploy.vfio-manager", "nvidia-vfio-manager"),
)


class _Status(Protocol):
    """The part of the agent's status (gpud.engine.kube.agent.AgentStatus) this mixin keeps."""

    other_agents: list[str]


class OtherAgentsOff:
    """Mixed into KubeAgent, whose members these are."""

    api: KubeApi
    namespace: str
    pod_timeout: float
    status: _Status
    _active: Selection | None
    _event: Callable[[str, str], None]
    _set_state: Callable[..., Awaitable[None]]
    _pods_gone_where: Callable[[Callable[[PodView], bool], str], Awaitable[None]]

    def _agents_off(self, node: NodeView) -> dict[str, str]:
        """The deploy labels of the operator's own GPU agents that are not `false` yet."""
        change = {a.label: "false" for a in OTHER_AGENTS if node.labels.get(a.label) != "false"}
        if change:
            self._event("kube", f"set {', '.join(f'{k}=false' for k in sorted(change))}: gpud reconfigures "
                                "this node's GPUs, the operator's agents must not")
        return change

    async def _keep_agents_off(self, node: NodeView) -> None:
        change = self._agents_off(node)
        if change:
            await self.api.patch_labels(change)

    def _is_other_agent_pod(self, pod: PodView) -> bool:
        for a in OTHER_AGENTS:
            if pod.namespace == self.namespace and pod.labels.get("app") == a.app:
                return True
            if pod.controller_kind == "DaemonSet" and a.label in pod.node_selector:
                return True
        return False

    async def _other_agents_gone(self) -> None:
        """Before any GPU changes: no pod of mig-manager, vgpu-device-manager or vfio-manager may
        be on the node (their deploy labels are false, so their DaemonSets remove them; wait for
        that). Raises OperandsNotPaused naming them when they stay: two agents must never
        reconfigure the same GPUs."""
        try:
            await self._keep_agents_off(await self.api.node())
            await asyncio.wait_for(self._pods_gone_where(self._is_other_agent_pod, "GPU agent"), self.pod_timeout)
            self.status.other_agents = []
        except (KubeError, TimeoutError) as e:
            pods, _ = await self.api.pods() if isinstance(e, TimeoutError) else ([], "")
            left = sorted(f"{p.namespace}/{p.name}" for p in pods if self._is_other_agent_pod(p))
            self.status.other_agents = left
            why = (f"the GPU Operator's own GPU agent(s) still run on this node: {', '.join(left)}; gpud changes "
                   f"no GPU while another agent may (set {', '.join(a.label for a in OTHER_AGENTS)}=false, or "
                   "migManager/vgpuDeviceManager/vfioManager.enabled=false in the ClusterPolicy)"
                   if isinstance(e, TimeoutError) else f"could not check for the operator's GPU agents: {e}")
            self._event("kube", why)
            if self._active is not None:
                with contextlib.suppress(KubeError):
                    await self._set_state(self._active, "failed", why)
            raise OperandsNotPaused(why) from e
