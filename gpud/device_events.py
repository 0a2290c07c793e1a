"""What a device event source hands the daemon, whichever kernel it listens to: udev's netlink
monitor on a host (gpud.host.kernel.udev) or the simulator's datagram socket (gpud.sim.uevents). The
daemon picks one at start; both deliver DeviceEvent through the same callback.

Events are hints that make the daemon re-read sysfs/NVML, never state: netlink drops events when
its buffer overflows (ENOBUFS), and in containers often none arrive at all. So after any loss a
source delivers RESCAN and the receiver re-reads everything.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import msgspec

from gpud.model import Gpu

log = logging.getLogger(__name__)

SUBSYSTEMS = ("pci", "vfio")


class DeviceEvent(msgspec.Struct, frozen=True):
    action: str  # add remove bind unbind change ... or "rescan" after lost events
    subsystem: str | None = None  # pci | vfio
    address: str | None = None  # kernel name: BDF for pci, group number for vfio
    driver: str | None = None  # DRIVER= on bind


RESCAN = DeviceEvent("rescan")

_ACTION_WORDS = {"add": "added", "remove": "removed", "bind": "bound", "unbind": "unbound", "change": "changed",
                 "move": "moved", "online": "online", "offline": "offline"}


def describe_device_event(event: DeviceEvent, gpus: Sequence[Gpu]) -> tuple[str | None, str]:
    """(the GPU it concerns, one line for `gpudctl events`). A vfio event names an IOMMU group, not
    a PCI device: it is told as `/dev/vfio/<group>` and put on the GPU whose group it is."""
    if event.action == "rescan":
        return None, "device events were lost: re-reading every device"
    done = _ACTION_WORDS.get(event.action, event.action)
    if event.subsystem == "vfio":
        owner = next((g.pci for g in gpus if event.address is not None
                      and str(g.function.iommu_group) == event.address), None)
        return owner, f"/dev/vfio/{event.address} {done} (IOMMU group {event.address})"
    text = f"PCI device {event.address or '?'} {done}"
    if event.action == "bind" and event.driver:
        text += f" to {event.driver}"
    return event.address, text


DeviceEventCallback = Callable[[DeviceEvent], Any]


class DeviceEventSource(Protocol):
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None: ...
    def stop(self) -> None: ...


# What the daemon gets from its one seam (daemon.build_hardware): UdevEvents or SimEvents.
DeviceEventSourceFactory = Callable[[DeviceEventCallback], DeviceEventSource]


class Delivery:
    """Hands events to the callback on the loop; a coroutine callback runs as a task that is kept
    referenced until done. A failing callback is logged, never allowed to stop the source."""

    def __init__(self, callback: DeviceEventCallback) -> None:
        self.callback = callback
        self.loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, event: DeviceEvent) -> None:
        try:
            res = self.callback(event)
            if inspect.isawaitable(res):
                task = asyncio.ensure_future(res, loop=self.loop)
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        except Exception:
            log.exception("device event callback failed for %s", event)
