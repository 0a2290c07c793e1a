"""The seam between a pass and the cluster's GPU operands: what the reconciler calls around the
GPUs a pass changes, and how a refusal reaches it. Without Kubernetes there is no guard; with
`--kube-node` it is the kube agent (gpud.engine.kube.agent), which this module does not import
(that would pull in the Kubernetes client)."""

from __future__ import annotations

import contextlib
from typing import Protocol

from gpud.plan.operand_impact import Impact


class OperandsNotPaused(Exception):
    """The operands that see the changing GPUs could not be taken off the node: change nothing."""


class OperandGuard(Protocol):
    def operands_paused(self, impact: Impact) -> contextlib.AbstractAsyncContextManager[None]:
        """The body runs with the operands that see `impact`'s GPUs paused (none for no change);
        raises OperandsNotPaused before the body when they cannot be."""

    async def before_reboot(self, reason: str) -> None:
        """Called before the engine asks for a reboot."""
