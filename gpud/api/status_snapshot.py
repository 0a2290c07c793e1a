"""The `status` reply, built once per view and answered from memory.

Fifty clients asking many times a second must not each rebuild the same reply: the engine hands
out the same EngineView object while nothing in it changed (gpud.engine.view), so the reply is
rebuilt only for a new view; only its age is new in each answer.
"""

from __future__ import annotations

from typing import Any

import msgspec

from gpud.api import replies
from gpud.engine.gpu_state import GpuState
from gpud.engine.view import EngineView
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu
from gpud.plan.node_labels import Advertised, advertised
from gpud.wire import replies as wire_replies


class StatusSnapshot:
    def __init__(self) -> None:
        self._view: EngineView | None = None
        self._reply: wire_replies.StatusReply | None = None
        self.builds = 0  # replies built (not reused): for tests and the stats op
        self._advertised: tuple[tuple[Gpu, ...], str, Advertised] | None = None
        self._gpus: dict[str, tuple[Any, ...]] = {}  # PCI address -> (inputs..., its GpuStatus)

    def advertised(self, gpus: tuple[Gpu, ...], mig_strategy: str) -> Advertised:
        """What the device plugins advertise for these GPUs, worked out once per observation (each
        answer costs a pass over every GPU and MIG device otherwise: 64 GPUs x 7 under 50 clients)."""
        kept = self._advertised
        if kept is None or kept[0] is not gpus or kept[1] != mig_strategy:
            kept = self._advertised = (gpus, mig_strategy, advertised(gpus, mig_strategy=mig_strategy))
        return kept[2]

    def _gpu_status(self, gpu: Gpu, desired: DesiredGpu | None, state: GpuState | None, rebuilt: list[str] | None,
                    leases: list[Any], lease_free: Any) -> wire_replies.GpuStatus:
        """replies.gpu_status, kept per GPU while its inputs stay the same: during an apply each
        step's re-read makes a new view, and rebuilding every GPU's answer for it held the loop
        3 ms at 64 GPUs. The observer keeps an unchanged GPU's record as the same object
        (discovery.keep_unchanged); its desired entry comes from a new resolution after each re-read,
        so it is compared by value. A GPU with leases is built afresh (its answer carries their ages)."""
        kept = self._gpus.get(gpu.pci)
        if (kept is not None and not leases and kept[0] is gpu and kept[1] == desired and kept[2] == state
                and kept[3] == rebuilt and kept[4] == lease_free):
            return kept[5]
        out = replies.gpu_status(gpu, desired, state, rebuilt, leases, lease_free)
        self._gpus[gpu.pci] = (gpu, desired, state, rebuilt, lease_free, out)
        return out

    def _current(self, view: EngineView) -> wire_replies.StatusReply:
        if self._reply is None or view is not self._view:
            present = {g.pci for g in view.observation.gpus}
            for pci in [p for p in self._gpus if p not in present]:
                del self._gpus[pci]
            self._reply = replies.status_reply(view, status_of=self._gpu_status)
            self._view = view
            self.builds += 1
        return self._reply

    def reply(self, view: EngineView, *, observed_at: float, age: float,
              kubernetes: wire_replies.KubernetesStatus | None = None) -> wire_replies.StatusReply:
        """The reply as of now: the snapshot, stamped with the observation's time and age, and
        `kubernetes` (what the device plugins advertise, the label protocol's state) as of now."""
        return msgspec.structs.replace(self._current(view), observed_at=round(observed_at, 3),
                                       observation_age=round(age, 4), kubernetes=kubernetes)
