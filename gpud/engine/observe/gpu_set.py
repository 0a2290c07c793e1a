"""Saying that the set of GPUs changed: a GPU left the bus, came back or is new.

Said (an event each, and a note status shows) before the pass that follows applies anything, so
an `all` or `device-filter` entry never silently covers a different set of GPUs. A gone GPU's
note stays until it is back; a new GPU's until a good layout file is read after it joined.
"""

from __future__ import annotations

from collections.abc import Iterable

from gpud.engine.events import EventBus
from gpud.engine.observe.gpu_index import SetChange
from gpud.model import KnownGpu


def gone_message(known: KnownGpu) -> str:
    return (f"GPU {known.index} ({known.pci}, {known.model}"
            + (f", {known.uuid}" if known.uuid else "")
            + f") is gone from the PCI bus; it keeps index {known.index} and no other GPU takes its entry")


class GpuSetNotes:
    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.notes: dict[str, str] = {}  # PCI -> what changed in the GPU set, for status

    def acknowledge(self, present: Iterable[str]) -> None:
        """A good file was read: the GPUs on the bus now are the ones it was written for."""
        for pci in set(present) & set(self.notes):
            del self.notes[pci]

    def report(self, change: SetChange) -> None:
        for known in change.gone:
            note = gone_message(known)
            self.notes[known.pci] = note
            self.bus.publish("gpu-gone", note, gpu=known.pci, index=known.index)
        for known in change.returned:
            self.notes.pop(known.pci, None)
            self.bus.publish("gpu-returned", f"GPU {known.index} ({known.pci}, {known.model}) is back on the PCI "
                                             f"bus with its index {known.index}", gpu=known.pci, index=known.index)
        for known in change.joined:
            note = (f"GPU {known.index} ({known.pci}, {known.model}) is new on this host: it gets index "
                    f"{known.index} (indices of GPUs gpud has seen before do not change); entries with "
                    "`devices: all` or `device-filter` may now select it")
            self.notes[known.pci] = note
            self.bus.publish("gpu-added", note, gpu=known.pci, index=known.index)
        self.bus.publish("gpu-set-changed", "the set of GPUs changed: " + ", ".join(
            [f"gone {k.index} ({k.pci})" for k in change.gone]
            + [f"back {k.index} ({k.pci})" for k in change.returned]
            + [f"new {k.index} ({k.pci})" for k in change.joined]) + "; reported before anything is applied",
            gone=[k.pci for k in change.gone], returned=[k.pci for k in change.returned],
            joined=[k.pci for k in change.joined])
