"""The GPU Operator's node-label protocol, spoken by gpud in place of mig-manager and
vgpu-device-manager (`gpud --kube-node NAME`).

The contract (NVIDIA/mig-parted pkg/mig/reconfigure/reconfigure.go, cmd/nvidia-mig-manager;
NVIDIA/vgpu-device-manager cmd/nvidia-k8s-vgpu-dm), as gpud follows it:

1. The node label `nvidia.com/mig.config` names the layout in force (an entry of `layouts` in
   layout.yaml, as mig-manager's names a mig-parted config); `nvidia.com/vgpu.config` likewise for a
   vGPU node; `vgpu.config` wins over the operator's automatic `mig.config=all-disabled`, and on a
   `gpu.workload.config=vm-vgpu` node without it the default vGPU layout applies
   (gpud.engine.kube.selection). Two other, different names are an error: one layout is in force.
2. A pass that changes something: `<label>.state=pending`; each `nvidia.com/gpu.deploy.<operand>`
   label of the operands the change disrupts that is `true` becomes `paused-for-mig-change`
   (container operands) or `paused-for-vgpu-change` (sandbox operands); `false` or absent stays as it
   is; gpud waits until their pods have left the node and removes the validator pods.
3. Apply. A mode change only a reboot can settle: with `policy.reboot: allow` the engine asks for
   one reboot and `before_reboot` sets `state=rebooting` first (operands stay paused across it);
   after the reboot, if the change is still not settled, `failed` (the engine's reboot marker
   refuses a second reboot).
4. Restore exactly what is still paused to `true` (a label someone set to `false` meanwhile stays
   `false`), remove the operator-validator pod so it re-validates, `state=success` or `failed`.

The engine calls `operands_paused(impact)` around every pass that changes hardware, whoever
started it (a label, an edit of the file, a udev event), so gpud pauses only what a change
disrupts: a pass that changes nothing, or only GPUs no running operand sees, pauses nothing.
Container operands see the GPUs on nvidia, sandbox operands (KubeVirt's device plugin) those on
vfio-pci (`gpud.plan.operand_impact`). Paused labels found at start (a crash in the middle of a
change, gpud's or mig-manager's) are restored after the first settled pass.
`nvidia.com/mig.capable` is published (the operator reads it to decide what to deploy).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Protocol

from msgspec import Struct

from gpud.engine.kube.operands import (  # noqa: F401 - the operator's names, re-exported
    DEFAULT_NAMESPACE,
    OPERANDS,
    OTHER_AGENTS,
    PAUSED,
    PAUSED_MIG,
    PAUSED_VGPU,
    Operand,
    OperatorPods,
    OtherAgent,
)
from gpud.engine.kube.selection import (  # noqa: F401 - the protocol's names, re-exported
    DEFAULT_VGPU_CONFIG,
    MIG_CAPABLE,
    MIG_CONFIG,
    MIG_STATE,
    VGPU_CONFIG,
    VGPU_STATE,
    WORKLOAD_CONFIG,
    Selection,
    selection,
)
from gpud.engine.kube.workload import plan_workload
from gpud.engine.ports import OperandsNotPaused
from gpud.host.kube.node_api import Gone, KubeApi, KubeError, NodeView
from gpud.plan.operand_impact import Impact

log = logging.getLogger(__name__)

LAST_ERROR = "nvidia.com/gpud.last-error"  # node annotation: the last failure, until a success


class Outcome(Struct, frozen=True):
    """How the passes for a layout ended once settled."""

    state: str  # "success" | "failed" | "rebooting" (the engine asked for a reboot)
    message: str = ""


class Applier(Protocol):
    """What the agent needs from the engine (gpud's reconciler, in the daemon). The engine's passes
    call the agent's `operands_paused` around every change, and `before_reboot` before a reboot."""

    def layouts(self) -> Sequence[str]: ...
    async def apply(self, layout: str | None) -> Outcome: ...  # select it (None: the file's) and settle
    def mig_capable(self) -> bool: ...


class AgentStatus(Struct):
    node: str
    selected: str | None = None
    state: str | None = None
    message: str = ""
    paused: list[str] = []
    connected: bool = False
    other_agents: list[str] = []  # pods of mig-manager & co. seen on the node at the last change
    workload_config: str | None = None  # nvidia.com/gpu.workload.config as the operator applies it
    unserved: list[str] = []  # GPUs of a mixed layout the operator's operands will not serve, and why


class KubeAgent:
    def __init__(self, api: KubeApi, applier: Applier, *, namespace: str = DEFAULT_NAMESPACE, pod_timeout: float = 300.0,
                 on_event: Callable[[str, str], None] | None = None, retry_delay: float = 1.0,
                 max_conflicts: int = 8, default_vgpu: str | None = DEFAULT_VGPU_CONFIG,
                 on_node: Callable[[dict[str, str]], None] | None = None) -> None:
        self.api = api
        self.applier = applier
        self.namespace = namespace
        self.on_event = on_event or (lambda kind, message: None)
        self.retry_delay = retry_delay
        self.default_vgpu = default_vgpu  # applied on a vm-vgpu node without vgpu.config (kube.selection)
        self.on_node = on_node or (lambda labels: None)  # every version of the node's labels
        self._node_uid = ""
        # First start after a reboot, the label's last layout in force: until the API server first
        # answers, passes change GPUs without pausing operands. No operand pod can run yet: the
        # kubelet starts after gpud (gpud.service is ordered Before=kubelet.service).
        self.boot_window = False
        self._last_error_shown = False  # the node carries LAST_ERROR (a success removes it)
        self.status = AgentStatus(node=api.node_name)
        # the operator's pods: operands paused and restored, its own GPU agents kept off
        self.pods = OperatorPods(api, self.status, self._event, namespace=namespace, pod_timeout=pod_timeout,
                                 max_conflicts=max_conflicts)
        self._active: Selection | None = None  # the label selection in force (None: the file's)
        self._changed = False  # a pass changed hardware since the state was last reported
        self._rebooting = False
        self._handling = False  # handle() is applying a selection (it reports the outcome itself)
        # Set once the node's labels first chose what is in force (a layout, or the file's own
        # `selected`); until then the daemon runs no pass, so a bad label at start touches nothing.
        self.selected_once = asyncio.Event()
        self._handled: tuple[str | None, ...] | None = None
        self._refresh = asyncio.Event()

    @property
    def conflicts(self) -> int:
        """409s met and retried (for status and tests)."""
        return self.pods.conflicts

    # --- the loop ----------------------------------------------------------------------------
    async def run(self) -> None:
        """Follow the node until cancelled. API errors are reported and retried with backoff;
        they never stop the daemon."""
        delay = self.retry_delay
        while True:
            try:
                node = await self.api.node()
                self._node_uid = node.uid
                self.boot_window = False
                self._last_error_shown = LAST_ERROR in node.annotations
                self.status.connected = True
                if self.status.message.startswith("Kubernetes API:"):
                    self.status.message = ""  # answered again; the protocol's own messages stay
                delay = self.retry_delay
                self.pods.found_paused(node)
                node = await self._publish_capable(node)
                await self._follow(node)
            except Gone:
                continue  # the watch fell behind the server's history: read the node again
            except KubeError as e:
                self.status.connected = False
                self.status.message = f"Kubernetes API: {e}"
                self._event("kube", f"Kubernetes API: {e}; retrying in {delay:.0f}s")
                await asyncio.sleep(delay)
                delay = min(delay * 2, 60.0)

    async def _follow(self, node: NodeView) -> None:
        """Handle the node as it is, then each newer version its watch brings (only the newest of
        those that piled up during a change); refresh() makes it read the node again."""
        versions: asyncio.Queue[NodeView] = asyncio.Queue()
        # From the node as it is when the watch opens, not from `node`'s own resourceVersion: an
        # object unchanged for long has a version older than the server's watch history (etcd
        # compacted it, a restarted server's watch cache starts later), which gets 410 every time.
        watcher = asyncio.create_task(self._pump(None, versions))
        try:
            await self._maybe_handle(node)
            while True:
                nxt = asyncio.ensure_future(versions.get())
                refresh = asyncio.ensure_future(self._refresh.wait())
                done, _ = await asyncio.wait({nxt, refresh, watcher}, return_when=asyncio.FIRST_COMPLETED)
                for t in (nxt, refresh):
                    if t not in done:
                        t.cancel()
                if watcher in done:
                    watcher.result()  # the watch failed (Gone, KubeError): run() reads the node again
                if nxt in done:
                    node = nxt.result()
                    while not versions.empty():
                        node = versions.get_nowait()
                    await self._maybe_handle(node)
                if refresh in done:
                    self._refresh.clear()
                    self._handled = None
                    await self._maybe_handle(await self.api.node())
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError, KubeError):
                await watcher

    async def _pump(self, rv: str | None, versions: asyncio.Queue) -> None:
        async with contextlib.aclosing(self.api.watch_node(rv)) as stream:
            async for node in stream:
                versions.put_nowait(node)

    def refresh(self) -> None:
        """Handle the current selection again (the layout file changed under the same label)."""
        self._refresh.set()

    async def _maybe_handle(self, node: NodeView) -> None:
        await self.pods.keep_agents_off(node)  # someone set one back to true: false again
        self.on_node(node.labels)
        chosen = selection(node.labels, layouts=self.applier.layouts(), default_vgpu=self.default_vgpu).layout
        # The uid is part of the key: a node deleted and created again under this name is new to
        # the protocol (no state label, no mig.capable) even when it carries the same selection.
        key = (node.uid, node.labels.get(MIG_CONFIG), node.labels.get(VGPU_CONFIG), chosen)
        if key != self._handled:
            if self._handled is not None and node.uid != self._handled[0]:
                node = await self._publish_capable(node)
            await self.handle(node)  # an API error propagates: run() reads the node again and retries
            self._handled = key

    # --- one selection -----------------------------------------------------------------------
    async def handle(self, node: NodeView) -> str | None:
        """Apply what the node's labels select, following the protocol; returns the state reported."""
        sel = selection(node.labels, layouts=self.applier.layouts(), default_vgpu=self.default_vgpu)
        self.status.selected = sel.layout
        if sel.why:
            self._event("kube", f"layout {sel.layout!r} selected: {sel.why}")
        if sel.error:
            self._active = None
            return await self._finish(sel, "failed", sel.error)
        if sel.layout is None:
            self._active = None
            self.selected_once.set()
            await self.applier.apply(None)
            await self.pods.restore_quietly()
            return None
        layouts = list(self.applier.layouts())
        if sel.layout not in layouts:
            self._active = None
            return await self._finish(sel, "failed", f"no layout named {sel.layout!r} in layout.yaml "
                                                     f"(layouts: {', '.join(layouts) or 'none'})")
        self._active = sel
        after_reboot = any(node.labels.get(s) == "rebooting" for s in sel.state_labels)
        self._rebooting = False
        self._handling = True
        self.selected_once.set()
        try:
            outcome = await self.applier.apply(sel.layout)
            return await self._settle(sel, outcome, after_reboot=after_reboot)
        finally:
            self._handling = False

    async def settled(self, outcome: Outcome) -> str | None:
        """A pass the agent did not start (file edit, udev, a holder that exited) has settled: report
        it on the active selection's state labels."""
        if self._active is None or not self._changed or self._handling:
            return None
        try:
            return await self._settle(self._active, outcome, after_reboot=False)
        except KubeError as e:  # reported again once the API answers: the next pass or label change
            self._event("kube", f"could not report the outcome on the node: {e}")
            return None

    async def _settle(self, sel: Selection, outcome: Outcome, *, after_reboot: bool) -> str:
        self._changed = False
        if outcome.state == "rebooting":
            return "rebooting"  # before_reboot reported it; operands stay paused until after the reboot
        message = outcome.message
        if outcome.state != "success" and after_reboot:
            message = f"{message}; still not settled after the reboot gpud asked for"
        await self.pods.restore_quietly()  # what a crash or the reboot left paused
        return await self._finish(sel, "success" if outcome.state == "success" else "failed", message)

    # --- what the engine calls around its passes -------------------------------------------
    @contextlib.asynccontextmanager
    async def operands_paused(self, impact: Impact) -> AsyncIterator[None]:
        """Around a pass's changes: pending, pause the operands that see a changing GPU and wait for
        their pods to go; afterwards restore them (not when a reboot was asked for). Raises
        OperandsNotPaused (restoring what it paused) when the operands cannot be taken off the
        node: the engine must not change the GPUs under them then."""
        if not impact.changed:
            yield
            return
        if self.boot_window and not self.status.connected:
            self._event("kube", f"{len(impact.changed)} GPU(s) rebuilt after the reboot before the API server answered "
                                "(the kubelet starts after gpud: no operand runs yet)")
            yield
            return
        self._changed = True
        if self._active is not None:
            await self._set_state(self._active, "pending",
                                  f"{len(impact.changed)} GPU(s) change: {', '.join(impact.changed)}")
        try:
            await self.pods.other_agents_gone()
        except OperandsNotPaused as e:
            if self._active is not None:
                with contextlib.suppress(KubeError):
                    await self._set_state(self._active, "failed", str(e))
            raise
        sides = impact.sides()
        if sides:
            try:
                await self.pods.pause(sides)
            except (KubeError, TimeoutError) as e:
                await self.pods.restore_quietly()
                reason = "they did not leave in time" if isinstance(e, TimeoutError) else str(e)
                raise OperandsNotPaused(f"could not take the GPU operands off the node: {reason}") from e
        try:
            yield
        finally:
            if not self._rebooting:
                await self.pods.restore_quietly()

    async def before_reboot(self, reason: str) -> None:
        """The engine is about to ask for a reboot: say so on the node first; keep operands paused."""
        self._rebooting = True
        if self._active is not None:
            await self._set_state(self._active, "rebooting", reason)

    def reboot_cancelled(self) -> None:
        """The reboot was not requested after all: the pass restores the operands as usual."""
        self._rebooting = False

    async def _finish(self, sel: Selection, state: str, message: str) -> str:
        await self._set_state(sel, state, message)
        await self._describe(state, message)
        return state

    async def _describe(self, state: str, message: str) -> None:
        """Where `kubectl describe node` shows it: a failure as a Warning Event on the Node and in
        the annotation LAST_ERROR (removed on success). Best effort: the state label is the protocol.
        The Event and the annotation are separate requests with separate verbs (events create, nodes
        patch): one refused leaves the other written, and the refusal is reported with its verb."""
        if state == "failed":
            try:
                await self.api.node_event("GPULayoutFailed", message or "failed", uid=self._node_uid)
            except KubeError as e:
                self._event("kube", f"could not record the failure as an Event on the Node "
                                    f"(the role needs events create): {e}")
        try:
            if state == "failed":
                await self.api.patch_annotations({LAST_ERROR: message or "failed"})
            elif state == "success" and self._last_error_shown:
                await self.api.patch_annotations({LAST_ERROR: None})
            self._last_error_shown = state == "failed"
        except KubeError as e:
            self._event("kube", f"could not write the node annotation {LAST_ERROR} (the role needs nodes patch): {e}")

    async def _set_state(self, sel: Selection, state: str, message: str) -> None:
        self.status.state, self.status.message = state, message
        self._event("kube-state", f"{'/'.join(sel.state_labels) or 'state'}={state}" + (f": {message}" if message else ""))
        if sel.state_labels:
            await self.api.patch_labels({label: state for label in sel.state_labels})

    async def _publish_capable(self, node: NodeView) -> NodeView:
        value = "true" if self.applier.mig_capable() else "false"
        change = {MIG_CAPABLE: value} if node.labels.get(MIG_CAPABLE) != value else {}
        change |= self.pods.agents_off(node)
        if change:
            node = await self.api.patch_labels(change)
        return node

    async def publish_workloads(self, workloads: dict[str, str]) -> None:
        """After a pass: `nvidia.com/gpu.workload.config` from the layout in force when its GPUs
        serve one workload, and gpud's `nvidia.com/gpud.workload.<w>.served` labels
        (gpud.engine.kube.workload). API errors are reported; the next pass writes again."""
        if not workloads:
            return
        try:
            node = await self.api.node()
            plan = plan_workload(workloads, node.labels.get(WORKLOAD_CONFIG))
            change = {k: v for k, v in plan.served_labels().items() if node.labels.get(k) != v}
            if plan.label is not None and node.labels.get(WORKLOAD_CONFIG) != plan.label:
                change[WORKLOAD_CONFIG] = plan.label
            if change:
                await self.api.patch_labels(change)
        except KubeError as e:
            self._event("kube", f"could not publish the node's workload labels yet: {e}")
            return
        if plan.messages != self.status.unserved:
            for m in plan.messages:
                self._event("kube", m)
        self.status.workload_config, self.status.unserved = plan.effective, plan.messages

    def _event(self, kind: str, message: str) -> None:
        log.info("%s", message)
        self.on_event(kind, message)

