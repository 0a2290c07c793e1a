"""The GPU Operator's pods on gpud's node, owned by one object (`OperatorPods`) the kube agent
(gpud.engine.kube.agent) holds: its operands paused around a change and restored after, and its own
GPU agents kept off the node.

Operands (device plugin, GFD, DCGM, the sandbox plugins...): a change's operands are paused the way
mig-manager pauses them (its deploy label set to `paused-for-mig-change` / `paused-for-vgpu-change`,
the DaemonSets, which select on `=true`, remove their pods), waited for, and restored (`true`)
afterwards; label writes carry the resourceVersion they were computed from, so a concurrent change
by someone else is re-read, never overwritten.

Other agents: publishing `nvidia.com/mig.capable=true` makes the operator deploy mig-manager
(controllers/nodelabeling_controller.go); the operator keeps a deploy label's existing value
(controllers/state_manager.go), so `false` written by gpud stays, and the agents' DaemonSets remove
their pods. Two agents must never reconfigure the same GPUs, so no GPU changes while one of those
pods is still on the node.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Protocol

from msgspec import Struct

from gpud.engine.ports import OperandsNotPaused
from gpud.host.kube.node_api import Conflict, Gone, KubeApi, KubeError, NodeView, PodView

log = logging.getLogger(__name__)

PAUSED_MIG = "paused-for-mig-change"
PAUSED_VGPU = "paused-for-vgpu-change"
PAUSED = (PAUSED_MIG, PAUSED_VGPU)
DEFAULT_NAMESPACE = "gpu-operator"
CLIENT = "*client*"  # the operand whose pods are any DaemonSet's that select on its label


class Operand(Struct, frozen=True):
    label: str  # nvidia.com/gpu.deploy.<name>
    app: str | None  # pods' `app` label in the operator's namespace; None: not waited for; CLIENT
    side: str  # "container" | "sandbox"

    @property
    def paused(self) -> str:
        return PAUSED_MIG if self.side == "container" else PAUSED_VGPU


OPERANDS = (
    Operand("nvidia.com/gpu.deploy.device-plugin", "nvidia-device-plugin-daemonset", "container"),
    Operand("nvidia.com/gpu.deploy.gpu-feature-discovery", "gpu-feature-discovery", "container"),
    Operand("nvidia.com/gpu.deploy.dcgm-exporter", "nvidia-dcgm-exporter", "container"),
    Operand("nvidia.com/gpu.deploy.dcgm", "nvidia-dcgm", "container"),
    Operand("nvidia.com/gpu.deploy.nvsm", None, "container"),
    Operand("nvidia.com/gpu.deploy.client", CLIENT, "container"),
    Operand("nvidia.com/gpu.deploy.sandbox-device-plugin", "nvidia-sandbox-device-plugin-daemonset", "sandbox"),
    Operand("nvidia.com/gpu.deploy.sandbox-validator", "nvidia-sandbox-validator", "sandbox"),
)
BY_LABEL = {op.label: op for op in OPERANDS}

VALIDATORS_BEFORE = ("nvidia-cuda-validator", "nvidia-device-plugin-validator")
VALIDATOR_AFTER = "nvidia-operator-validator"


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


class PodsStatus(Protocol):
    """The part of the agent's status (gpud.engine.kube.agent.AgentStatus) these pods keep."""

    paused: list[str]  # operand labels paused now
    other_agents: list[str]  # pods of mig-manager & co. seen on the node at the last change


class OperatorPods:
    """The operator's pods on one node: `pause`/`restore` its operands, `agents_off`/
    `other_agents_gone` for its own GPU agents. `event(kind, message)` says what happens."""

    def __init__(self, api: KubeApi, status: PodsStatus, event: Callable[[str, str], None], *,
                 namespace: str = DEFAULT_NAMESPACE, pod_timeout: float = 300.0, max_conflicts: int = 8) -> None:
        self.api = api
        self.status = status
        self.event = event
        self.namespace = namespace
        self.pod_timeout = pod_timeout
        self.max_conflicts = max_conflicts
        self.paused: set[str] = set()  # operand labels this agent (or a crashed run) left paused
        self.conflicts = 0  # 409s met and retried (for status and tests)

    # --- operands ----------------------------------------------------------------------------
    def found_paused(self, node: NodeView) -> None:
        """Operand labels a crashed run (or the reboot) left paused: restored with the next restore."""
        self.paused |= {k for k, v in node.labels.items() if k in BY_LABEL and v in PAUSED}

    async def pause(self, sides: set[str]) -> None:
        """Pause the operands of `sides` ("container", "sandbox") and wait for their pods to go;
        KubeError or TimeoutError when they cannot be taken off the node."""
        def compute(node: NodeView) -> dict[str, str]:
            return {op.label: op.paused for op in OPERANDS if op.side in sides and node.labels.get(op.label) == "true"}

        paused = await self._patch_from_fresh(compute)
        self.paused |= set(paused)
        self.status.paused = sorted(self.paused)
        if paused:
            self.event("kube-pause", f"paused {', '.join(sorted(paused))}")
        waiting = {BY_LABEL[label] for label in self.paused}
        await asyncio.wait_for(self._pods_gone_where(lambda p: self._is_operand_pod(p, waiting), "operand"), self.pod_timeout)
        if "container" in sides:
            # The validators run CUDA on the GPUs: deleted pods must be gone (a graceful delete only
            # marks a pod until the kubelet stopped it) before the GPUs change, as `kubectl delete`
            # waits in mig-manager's script.
            removed = await self._delete_pods(VALIDATORS_BEFORE)
            if removed:
                await asyncio.wait_for(self._pods_gone_where(lambda p: (p.namespace, p.name) in removed, "validator"),
                                       self.pod_timeout)

    async def restore(self) -> None:
        def compute(node: NodeView) -> dict[str, str]:
            return {label: "true" for label in self.paused if node.labels.get(label) in PAUSED}

        restored = await self._patch_from_fresh(compute)
        was = set(self.paused)
        self.paused.clear()
        self.status.paused = []
        if restored:
            self.event("kube-pause", f"restored {', '.join(sorted(restored))}")
        if any(BY_LABEL[label].side == "container" for label in was):
            await self._delete_pods((VALIDATOR_AFTER,))

    async def restore_quietly(self) -> None:
        try:
            await self.restore()
        except KubeError as e:  # the labels stay paused; the next pass restores them
            self.event("kube", f"could not restore the operand labels yet: {e}")

    async def _patch_from_fresh(self, compute: Callable[[NodeView], dict[str, str]]) -> dict[str, str]:
        """Read the node, compute a label change from it, write it only if the node is still at the
        version read; on 409 read again and recompute."""
        for _ in range(self.max_conflicts):
            node = await self.api.node()
            change = compute(node)
            if not change:
                return {}
            try:
                await self.api.patch_labels(change, resource_version=node.resource_version)
                return change
            except Conflict:
                self.conflicts += 1
        raise KubeError(409, "Conflict", f"node {self.api.node_name} kept changing under {self.max_conflicts} attempts")

    def _is_operand_pod(self, pod: PodView, operands: set[Operand]) -> bool:
        for op in operands:
            if op.app == CLIENT:
                if pod.controller_kind == "DaemonSet" and op.label in pod.node_selector:
                    return True
            elif op.app is not None and pod.namespace == self.namespace and pod.labels.get("app") == op.app:
                return True
        return False

    async def _pods_gone_where(self, matches: Callable[[PodView], bool], what: str) -> None:
        """Until no pod `matches` names is left on the node (deleted, not merely terminating): one
        list, then its watch."""
        while True:
            pods, rv = await self.api.pods()
            left = {(p.namespace, p.name) for p in pods if matches(p)}
            if not left:
                return
            self.event("kube-pause", f"waiting for {len(left)} {what} pod(s) to leave: "
                                     f"{', '.join(f'{ns}/{n}' for ns, n in sorted(left))}")
            try:
                async with contextlib.aclosing(self.api.watch_pods(rv)) as events:
                    async for kind, pod in events:
                        key = (pod.namespace, pod.name)
                        if kind == "DELETED":
                            left.discard(key)
                        elif matches(pod):
                            left.add(key)
                        if not left:
                            return
            except Gone:
                continue

    async def _delete_pods(self, apps: Sequence[str]) -> set[tuple[str, str]]:
        """Delete the operator's pods of `apps` on the node; returns those deleted."""
        pods, _ = await self.api.pods()
        removed = set()
        for p in pods:
            if p.namespace == self.namespace and p.labels.get("app") in apps:
                if await self.api.delete_pod(p.namespace, p.name):
                    removed.add((p.namespace, p.name))
                    self.event("kube-pause", f"removed {p.namespace}/{p.name}")
        return removed

    # --- the operator's own GPU agents ---------------------------------------------------------
    def agents_off(self, node: NodeView) -> dict[str, str]:
        """The deploy labels of the operator's own GPU agents that are not `false` yet."""
        change = {a.label: "false" for a in OTHER_AGENTS if node.labels.get(a.label) != "false"}
        if change:
            self.event("kube", f"set {', '.join(f'{k}=false' for k in sorted(change))}: gpud reconfigures "
                               "this node's GPUs, the operator's agents must not")
        return change

    async def keep_agents_off(self, node: NodeView) -> None:
        change = self.agents_off(node)
        if change:
            await self.api.patch_labels(change)

    def _is_other_agent_pod(self, pod: PodView) -> bool:
        for a in OTHER_AGENTS:
            if pod.namespace == self.namespace and pod.labels.get("app") == a.app:
                return True
            if pod.controller_kind == "DaemonSet" and a.label in pod.node_selector:
                return True
        return False

    async def other_agents_gone(self) -> None:
        """Before any GPU changes: no pod of mig-manager, vgpu-device-manager or vfio-manager may
        be on the node (their deploy labels are false, so their DaemonSets remove them; wait for
        that). Raises OperandsNotPaused naming them when they stay: two agents must never
        reconfigure the same GPUs."""
        try:
            await self.keep_agents_off(await self.api.node())
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
            self.event("kube", why)
            raise OperandsNotPaused(why) from e
