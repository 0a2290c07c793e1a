"""The kube agent's view of the engine (`gpud.engine.kube.agent.Applier`), over the reconciler.

A label selects a layout: the layout file is read again with that layout chosen (as `selected`
would choose it, mig-parted's `-c`), checked against this host, and passes run until the GPUs
settle: converged, or a state that only a person, a holder's exit or a reboot can change. A
layout the host refuses (a profile its GPUs do not have) fails without touching anything.
"""

from __future__ import annotations

import asyncio
import logging

from gpud.engine.gpu_state import SETTLING_PHASES
from gpud.engine.kube.agent import KubeAgent, Outcome
from gpud.engine.ports import Rebooter
from gpud.host.logind import reboot_outcome
from gpud.profiles import by_device

log = logging.getLogger(__name__)


class ReconcilerApplier:
    def __init__(self, rec) -> None:
        self.rec = rec
        self.reboot_requested = False  # set by the daemon's rebooter when it asked logind
        self._changed = asyncio.Event()
        rec.on_change(self._changed.set)

    def layouts(self) -> list[str]:
        return self.rec.layout_file.layout_names()

    async def apply(self, layout: str | None) -> Outcome:
        self.reboot_requested = False
        if not await self.rec.choose_layout_async(layout):
            errors = self.rec.layout_issues[0]
            return Outcome("failed", "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))
        ticket = self.rec.kick(f"layout {layout!r} selected by node label")
        self.rec.mark_pending()  # as for a reload: status must not call the new layout in place yet
        await self.rec.wait_for(ticket)
        while self.rec.phase in SETTLING_PHASES and not self.reboot_requested:
            self._changed.clear()
            await self._changed.wait()
        return self.outcome()

    def outcome(self) -> Outcome:
        if self.reboot_requested:
            return Outcome("rebooting", "a reboot was requested to settle a MIG mode change")
        if self.rec.phase == "converged":
            return Outcome("success", self.rec.summary())
        problems = [f"GPU {pci}: {st.state}: {st.message}" for pci, st in sorted(self.rec.gpu_states.items())
                    if not st.converged]
        if self.rec.phase == "invalid-layout" or not problems:
            problems = self.rec.layout_issues[0] or [f"phase {self.rec.phase}"]
        return Outcome("failed", "; ".join(problems))

    def mig_capable(self) -> bool:
        for gpu in self.rec.observation.gpus:
            if gpu.nvml is not None and gpu.nvml.mig_capable:
                return True
            known = by_device(gpu.function.device)
            if gpu.nvml is None and known is not None and known.mig_capable:
                return True
        return False


class KubeRebooter:
    """The engine's rebooter with --kube-node: `state=rebooting` on the node before logind is asked
    (the operator's contract), nothing on the node when the reboot marker refuses a second one."""

    def __init__(self, agent: KubeAgent, applier: ReconcilerApplier, reboot: Rebooter) -> None:
        self.agent, self.applier, self.reboot = agent, applier, reboot

    async def __call__(self, state_dir: str, reason: str) -> bool:
        prior = reboot_outcome(state_dir)
        if prior is not None and prior.rebooted:
            return await self.reboot(state_dir, reason)  # refuses: an earlier reboot did not settle it
        try:
            await self.agent.before_reboot(reason)
        except Exception as e:  # noqa: BLE001 - an unreachable API server must not block the reboot
            log.warning("could not mark the node rebooting: %s", e)
        try:
            ok = await self.reboot(state_dir, reason)
        except Exception:
            self.agent.reboot_cancelled()
            raise
        if ok:
            self.applier.reboot_requested = True
        else:
            self.agent.reboot_cancelled()
        return ok
