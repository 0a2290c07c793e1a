"""After a reboot: what gpud's first pass rebuilt, said once in an event and kept in status.

Why: nothing gpud builds survives a reboot (GPU and compute instances, a Hopper GPU's MIG mode,
driver_override; docs/hardware/reboot.md), so the first pass after a boot rebuilds the layout
before the GPUs' consumers start, and an operator must be able to see that it did and what. A
restart of gpud within the same boot is not a reboot: the boot id (/proc/sys/kernel/random/boot_id)
of the last start whose first pass ended is kept in STATE_DIR/boot.json, and only a different one
means the host rebooted since. A first start ever (no file) claims nothing.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from gpud.engine.events import EventBus
from gpud.engine.gpu_state import GpuState, Phase
from gpud.host.files import state_files
from gpud.host.systemd.logind import current_boot_id

log = logging.getLogger(__name__)

BOOT_FILE = "boot.json"


def boot_id(path: str | None) -> str | None:
    """This boot's id, or None when it cannot be read (nothing is then claimed about a reboot);
    `path` None: this boot is not told apart from the last (tests without a host's boot id)."""
    if path is None:
        return None
    try:
        return current_boot_id(path)
    except OSError as e:
        log.warning("boot id unreadable at %s: %s", path, e)
        return None


class BootRebuild:
    """`boot_id` is this boot's id (None: unknown, nothing is claimed)."""

    def __init__(self, state_dir: str | None, boot_id: str | None, bus: EventBus, *, read_only: bool = False,
                 problems: state_files.Problems | None = None):
        self.bus = bus
        self.problems = problems if problems is not None else state_files.Problems(lambda m: bus.publish("error", m))
        self.boot_id = boot_id
        self.read_only = read_only
        self.path = Path(state_dir) / BOOT_FILE if state_dir and boot_id else None
        previous = self._previous()
        self.after_boot = previous is not None and previous != boot_id
        self.summary: str | None = None  # "rebuilt after boot: ..." once the first pass ended
        self._changed: dict[str, str] = {}  # pci -> "GPU <index> (<pci>)" of GPUs the passes changed
        if previous is None:
            self._remember()

    def _previous(self) -> str | None:
        if self.path is None:
            return None
        path = str(self.path)
        previous = state_files.load(path, _decode, self.problems, what="boot record")
        if previous is None and path in self.problems.by_file:
            return self.boot_id  # set aside: not claiming a reboot
        return previous

    def _remember(self) -> None:
        if self.path is None or self.read_only:
            return
        try:
            state_files.save(str(self.path), json.dumps({"boot_id": self.boot_id}).encode() + b"\n")
        except OSError as e:
            self.problems.say(str(self.path), f"{self.path}: the boot id not recorded ({e})")

    def will_change(self, gpus: Mapping[str, str]) -> None:
        """The GPUs a pass is about to change (pci -> how status names it)."""
        if self.after_boot:
            self._changed.update(gpus)

    def pass_ended(self, states: Mapping[str, GpuState], phase: Phase) -> None:
        """After a pass: the first one that settles after a boot (any phase but applying/pending)
        is reported; the boot id is then remembered, so a restart in this boot claims nothing."""
        if not self.after_boot or phase in ("applying", "pending", "starting"):
            return
        if self._changed:
            parts = []
            for pci in sorted(self._changed):
                st = states.get(pci)
                what = st.message if st is not None and st.converged else (
                    f"{st.state}: {st.message}" if st is not None else "no result")
                parts.append(f"{self._changed[pci]}: {what}")
            self.summary = "rebuilt after boot: " + "; ".join(parts)
        else:
            self.summary = "rebuilt after boot: nothing, the host came up as the layout wants"
        self.after_boot = False
        self.bus.publish("rebuilt-after-boot", self.summary)
        self._remember()


def _decode(data: bytes) -> str:
    record = json.loads(data)
    if not isinstance(record, dict) or not isinstance(record.get("boot_id"), str) or not record["boot_id"]:
        raise state_files.BadStateFile('expected {"boot_id": "<id>"}')
    return record["boot_id"]
