"""The `status` reply, built once per view and answered from memory.

Fifty clients asking many times a second must not each rebuild the same reply: the engine hands
out the same EngineView object while nothing in it changed (gpud.engine.view), so the reply is
rebuilt only for a new view; only its age is new in each answer.
"""

from __future__ import annotations

import msgspec

from gpud.api import replies
from gpud.engine.view import EngineView
from gpud.model import Gpu
from gpud.plan.node_labels import Advertised, advertised
from gpud.wire import replies as wire_replies


class StatusSnapshot:
    def __init__(self) -> None:
        self._view: EngineView | None = None
        self._reply: wire_replies.StatusReply | None = None
        self.builds = 0  # replies built (not reused): for tests and the stats op
        self._advertised: tuple[tuple[Gpu, ...], str, Advertised] | None = None

    def advertised(self, gpus: tuple[Gpu, ...], mig_strategy: str) -> Advertised:
        """What the device plugins advertise for these GPUs, worked out once per observation (each
        answer costs a pass over every GPU and MIG device otherwise: 64 GPUs x 7 under 50 clients)."""
        kept = self._advertised
        if kept is None or kept[0] is not gpus or kept[1] != mig_strategy:
            kept = self._advertised = (gpus, mig_strategy, advertised(gpus, mig_strategy=mig_strategy))
        return kept[2]

    def _current(self, view: EngineView) -> wire_replies.StatusReply:
        if self._reply is None or view is not self._view:
            self._reply = replies.status_reply(view)
            self._view = view
            self.builds += 1
        return self._reply

    def reply(self, view: EngineView, *, observed_at: float, age: float,
              kubernetes: wire_replies.KubernetesStatus | None = None) -> wire_replies.StatusReply:
        """The reply as of now: the snapshot, stamped with the observation's time and age, and
        `kubernetes` (what the device plugins advertise, the label protocol's state) as of now."""
        return msgspec.structs.replace(self._current(view), observed_at=round(observed_at, 3),
                                       observation_age=round(age, 4), kubernetes=kubernetes)
