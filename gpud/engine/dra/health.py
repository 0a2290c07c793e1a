"""GPU health for the DRA pool: the Xids the nvidia driver reports, as device taints.

NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/device_health.go)
taints a device on an Xid with the key `<driver>/xid`, the Xid as value and the effect NoSchedule,
or None (a mark the scheduler ignores) for the Xids its list calls application errors: 13, 31,
43, 45, 68, 109 (NVIDIA's Xid catalogue: the GPU stays healthy). gpud does the same for every
device of the GPU the report names (the driver prints the GPU's PCI domain:bus:device).

A mark stays until the kernel initialises the GPU afresh: gpud sees it off the nvidia driver or
off the bus (an unbind and bind, a hot-unplug), or the host rebooted; the marks are forgotten
then. They are kept in STATE_DIR/dra-xids.json with the boot id, so a restarted gpud (which
reads the kernel log from its end) still taints the GPU; a file of another boot is dropped.
NVIDIA's driver keeps its taints until its plugin restarts; whether an Xid's cause survives a
re-initialisation is not documented, so the kinder rule (the GPU is offered again) is chosen.
A GPU lost (gone from the bus, or stuck in a driver write) is withdrawn from the pool altogether
(gpud.engine.dra.driver.UNHEALTHY_STATES): nothing could be prepared on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import msgspec
from msgspec import Struct

from gpud.host.files import state_files
from gpud.host.kernel.kmsg import Xid
from gpud.model import Gpu

XID_FILE = "dra-xids.json"

# Xids NVIDIA's DRA driver (and device plugin) leave schedulable: application errors
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class XidMark(Struct, frozen=True):
    pci: str
    code: int
    text: str

    @property
    def fatal(self) -> bool:
        return self.code not in APPLICATION_XIDS


class _Saved(Struct, frozen=True):
    boot_id: str
    marks: tuple[XidMark, ...]


class XidHealth:
    def __init__(self, path: str | None = None, boot_id: str | None = None) -> None:
        """`path`: where the marks are kept (None: not kept); `boot_id`: this boot's (None: unknown,
        nothing is kept, since a file could not be told from an earlier boot's)."""
        self.path = path if boot_id else None
        self.boot_id = boot_id or ""
        self.marks: dict[str, XidMark] = {}
        if self.path is not None:
            saved = state_files.load(self.path, lambda b: msgspec.json.decode(b, type=_Saved), what="Xid marks")
            if saved is not None and saved.boot_id == self.boot_id:
                self.marks = {m.pci: m for m in saved.marks}

    def _save(self) -> None:
        if self.path is not None:
            state_files.save(self.path, msgspec.json.encode(_Saved(self.boot_id, tuple(self.marks.values()))),
                             mode=0o600)

    def record(self, xid: Xid, gpus: Iterable[Gpu]) -> XidMark | None:
        """Mark the GPU the report names (None: no such GPU on nvidia). A fatal mark is not
        replaced by a later application error."""
        for gpu in gpus:
            if gpu.present and gpu.function.driver == "nvidia" and gpu.pci.rsplit(".", 1)[0] == xid.slot:
                old = self.marks.get(gpu.pci)
                mark = XidMark(gpu.pci, xid.code, xid.text)
                if old is None or mark.fatal or not old.fatal:
                    self.marks[gpu.pci] = mark
                    self._save()
                return self.marks[gpu.pci]
        return None

    def observe(self, gpus: Iterable[Gpu]) -> list[XidMark]:
        """Forget the marks of GPUs seen off the nvidia driver or off the bus; returns them."""
        on = {g.pci for g in gpus if g.present and g.function.driver == "nvidia"}
        gone = [m for pci, m in self.marks.items() if pci not in on]
        for m in gone:
            del self.marks[m.pci]
        if gone:
            self._save()
        return gone

    def taints(self, driver: str) -> Mapping[str, tuple[dict, ...]]:
        return {pci: ({"key": f"{driver}/xid", "value": str(m.code),
                       "effect": "NoSchedule" if m.fatal else "None"},)
                for pci, m in self.marks.items()}
