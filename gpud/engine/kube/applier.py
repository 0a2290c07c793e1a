"""The kube agent's view of the engine (`gpud.engine.kube.agent.Applier`), over the engine's boundary.

A label selects a layout: the layout file is read again with that layout chosen (as `selected`
would choose it, mig-parted's `-c`), checked against this host, and passes run until the GPUs
settle: converged, or a state that only a person, a holder's exit or a reboot can change. A
layout the host refuses (a profile its GPUs do not have) fails without touching anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
from typing import Protocol

from gpud.engine import status_line
from gpud.engine.boot.reboot_policy import RebootRefused
from gpud.engine.engine import Engine
from gpud.engine.gpu_state import SETTLING_PHASES
from gpud.engine.kube.agent import Outcome
from gpud.engine.ports import Rebooter
from gpud.host.files import state_files
from gpud.host.files.safe_file import write_file
from gpud.host.systemd.logind import reboot_outcome
from gpud.profiles import by_device

log = logging.getLogger(__name__)


REMEMBERED = "kube-layout.json"  # in the state dir: the layout the node's label last selected


class ReconcilerApplier:
    """`state_dir`: where the label's layout is kept for the next start, so that after a reboot
    the GPUs are rebuilt before the API server answers (the network, the control plane, or the
    node's own registration may take minutes; the device plugins start once the node is Ready)."""

    def __init__(self, state_dir: str | None = None) -> None:
        self.state_dir = state_dir
        self.reboot_requested = False  # set by the daemon's rebooter when it asked logind
        self._changed = asyncio.Event()
        self._engine: Engine | None = None

    def bind(self, engine: Engine) -> None:
        """The engine this applier drives, given once. The one cycle of the wiring: the engine is
        built with the kube agent as its operand guard, and the agent is built with this applier."""
        if self._engine is not None:
            raise RuntimeError("the applier is bound to an engine already")
        self._engine = engine
        engine.subscribe(self._changed.set)

    @property
    def engine(self) -> Engine:
        if self._engine is None:
            raise RuntimeError("the applier is not bound to an engine yet")
        return self._engine

    def layouts(self) -> list[str]:
        return self.engine.view.layout_names

    async def apply(self, layout: str | None) -> Outcome:
        self.reboot_requested = False
        if not await self.engine.choose_layout(layout):
            errors = self.engine.view.layout_errors
            return Outcome("failed", "; ".join(errors[:3]) + (f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""))
        self._remember(layout)
        ticket = self.engine.kick(f"layout {layout!r} selected by node label")
        self.engine.mark_pending()  # as for a reload: status must not call the new layout in place yet
        await self.engine.wait(ticket)
        while self.engine.view.phase in SETTLING_PHASES and not self.reboot_requested:
            self._changed.clear()
            await self._changed.wait()
        return self.outcome()

    def _remember(self, layout: str | None) -> None:
        if self.state_dir is None:
            return
        path = os.path.join(self.state_dir, REMEMBERED)
        try:
            if layout is None:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            else:
                write_file(path, json.dumps({"layout": layout}).encode())
        except OSError as e:
            log.warning("the node label's layout not kept for the next start (%s): %s", path, e)

    def remembered(self) -> str | None:
        """The layout the node's label selected before this start (None: none, or unreadable)."""
        if self.state_dir is None:
            return None
        # the one safe reader: a FIFO here hung the start (and SIGTERM with it), a link was followed
        return state_files.load(os.path.join(self.state_dir, REMEMBERED), _decode_remembered, limit=4096,
                                what="remembered node-label layout")

    def outcome(self) -> Outcome:
        if self.reboot_requested:
            return Outcome("rebooting", "a reboot was requested to settle a MIG mode change")
        view = self.engine.view
        if view.phase == "converged":
            return Outcome("success", status_line.of(view))
        problems = [f"GPU {pci}: {st.state}: {st.message}" for pci, st in sorted(view.gpu_states.items())
                    if not st.converged]
        if view.phase == "invalid-layout" or not problems:
            problems = list(view.layout_errors) or [f"phase {view.phase}"]
        return Outcome("failed", "; ".join(problems))

    def mig_capable(self) -> bool:
        for gpu in self.engine.view.observation.gpus:
            if gpu.nvml is not None and gpu.nvml.mig_capable:
                return True
            known = by_device(gpu.function.device)
            if gpu.nvml is None and known is not None and known.mig_capable:
                return True
        return False


class RebootAnnouncer(Protocol):
    """The part of the kube agent a reboot needs (gpud.engine.kube.agent.KubeAgent)."""

    async def before_reboot(self, reason: str) -> None: ...

    def reboot_cancelled(self) -> None: ...


class RebootFlag(Protocol):
    """Where the rebooter says a reboot was asked for (ReconcilerApplier)."""

    reboot_requested: bool


class KubeRebooter:
    """The engine's rebooter with --kube-node: `state=rebooting` on the node before logind is asked
    (the operator's contract), nothing on the node when the reboot marker refuses a second one."""

    def __init__(self, agent: RebootAnnouncer, applier: RebootFlag, reboot: Rebooter) -> None:
        self.agent, self.applier, self.reboot = agent, applier, reboot

    async def __call__(self, state_dir: str, reason: str) -> bool:
        prior = reboot_outcome(state_dir)
        if prior is not None and prior.rebooted:
            return await self.reboot(state_dir, reason)  # refuses: an earlier reboot did not settle it
        try:
            await self.agent.before_reboot(reason)
        except Exception as e:
            # mig-manager's contract: the node says `rebooting` before the reboot, or there is none
            # (a node rebooting unannounced looks failed to the cluster, and its operands paused)
            self.agent.reboot_cancelled()
            log.warning("could not mark the node rebooting: %s", e)
            raise RebootRefused(f"nvidia.com/mig.config.state=rebooting could not be written ({e}); "
                                "no reboot without it") from e
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


def _decode_remembered(data: bytes) -> str | None:
    record = json.loads(data)
    value = record.get("layout") if isinstance(record, dict) else None
    if not isinstance(value, str) or not value:
        raise state_files.BadStateFile('expected {"layout": "<name>"}')
    return value
