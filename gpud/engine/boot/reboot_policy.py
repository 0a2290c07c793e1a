"""`policy.reboot: allow`: when only a reboot can settle a MIG mode change, ask logind for one
reboot, and never a second one for a change the first did not fix. The marker in the state dir
(written by the rebooter) remembers the request across the reboot; after it, gpud says whether the
reboot settled what it was for, and clears the marker once the host converged."""

from __future__ import annotations

from gpud.engine.events import EventBus
from gpud.engine.gpu_state import GpuState, Phase
from gpud.engine.ports import Rebooter
from gpud.host.files.state_files import Problems
from gpud.host.systemd.logind import BOOT_ID_PATH, clear_reboot_request, reboot_outcome
from gpud.layout.schema import Policy


class RebootRefused(Exception):
    """The rebooter will not ask for the reboot (a precondition failed); the message says why."""


class RebootPolicy:
    """`rebooter` is None where logind is not reachable; `state_dir` holds the marker."""

    def __init__(self, *, rebooter: Rebooter | None, state_dir: str | None, read_only: bool,
                 bus: EventBus, boot_id_path: str = BOOT_ID_PATH, problems: Problems | None = None) -> None:
        self.rebooter = rebooter
        self.state_dir = state_dir
        self.read_only = read_only
        self.bus = bus
        self.boot_id_path = boot_id_path  # the simulator's own on a simulated host
        self.problems = problems if problems is not None else Problems(lambda m: bus.publish("error", m))
        self._reported: tuple | None = None  # (request time, phase) last reported after a reboot

    async def settle(self, pci: str, st: GpuState, policy: Policy | None) -> GpuState:
        """The GPU's state after the policy had its say: a reboot is asked for only when the
        state is reboot-required and the policy allows it; the message says what happened."""
        if st.state != "reboot-required" or policy is None or policy.reboot != "allow":
            return st
        if self.rebooter is None or self.state_dir is None or self.read_only:
            return GpuState(st.state, f"{st.message}; policy allows a reboot, but logind is not reachable", st.holders)
        try:
            asked = await self.rebooter(self.state_dir, f"{pci}: {st.message}")
        except RebootRefused as e:
            self.bus.publish("reboot", f"reboot not requested: {e}", gpu=pci)
            return GpuState(st.state, f"{st.message}; policy allows a reboot, but {e}", st.holders)
        if asked:
            self.bus.publish("reboot", f"reboot requested from logind: {st.message}", gpu=pci)
            return GpuState(st.state, f"{st.message}; reboot requested", st.holders)
        return GpuState(st.state, f"{st.message}; an earlier reboot did not settle it, not rebooting again "
                                  f"(remove {self.state_dir}/reboot-request.json after fixing the cause)", st.holders)

    def after_pass(self, phase: Phase) -> None:
        """After a pass: say whether the reboot gpud asked for settled what it was for; clear the
        marker once the host converged, keep it (no second reboot) while it did not."""
        if self.state_dir is None or self.read_only:
            return
        record = reboot_outcome(self.state_dir, boot_id_path=self.boot_id_path, problems=self.problems)
        if record is not None and record.set_aside is not None:
            self.bus.publish("reboot", "no reboot gpud asked for is on record (the marker was not gpud's and "
                                       "was set aside): nothing is claimed about a reboot")
            return
        if record is None or not record.rebooted or self._reported == (record.requested_at, phase):
            return
        self._reported = (record.requested_at, phase)
        if phase == "converged":
            clear_reboot_request(self.state_dir)
            self.bus.publish("reboot", f"the reboot settled it: {record.reason}")
        else:
            self.bus.publish("reboot", f"the reboot did not settle it: {record.reason}")
