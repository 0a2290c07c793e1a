"""GPU health for the DRA pool: the Xids the nvidia driver reports, as device taints.

NVIDIA's DRA driver (kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin/device_health.go)
taints a device on an Xid with the key `<driver>/xid`, the Xid as value and the effect NoSchedule,
or None (a mark the scheduler ignores) for the Xids its list calls application errors: 13, 31,
43, 45, 68, 109 (NVIDIA's Xid catalogue: the GPU stays healthy). gpud does the same for every
device of the GPU the report names (the driver prints the GPU's PCI domain:bus:device).

A mark stays until the kernel initialises the GPU afresh: gpud sees it off the nvidia driver or
off the bus (an unbind and bind, a hot-unplug, a reboot), and the marks are forgotten when it
comes back. NVIDIA's driver keeps its taints until its plugin restarts; whether an Xid's cause
survives a reset is not documented, so the kinder rule (the GPU is offered again) is chosen.
A GPU lost (gone from the bus, or stuck in a driver write) is withdrawn from the pool altogether
(gpud.engine.dra.driver.UNHEALTHY_STATES): nothing could be prepared on it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from msgspec import Struct

from gpud.host.kernel.kmsg import Xid
from gpud.model import Gpu

# Xids NVIDIA's DRA driver (and device plugin) leave schedulable: application errors
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})


class XidMark(Struct, frozen=True):
    pci: str
    code: int
    text: str

    @property
    def fatal(self) -> bool:
        return self.code not in APPLICATION_XIDS


class XidHealth:
    def __init__(self) -> None:
        self.marks: dict[str, XidMark] = {}

    def record(self, xid: Xid, gpus: Iterable[Gpu]) -> XidMark | None:
        """Mark the GPU the report names (None: no such GPU on nvidia). A fatal mark is not
        replaced by a later application error."""
        for gpu in gpus:
            if gpu.present and gpu.function.driver == "nvidia" and gpu.pci.rsplit(".", 1)[0] == xid.slot:
                old = self.marks.get(gpu.pci)
                mark = XidMark(gpu.pci, xid.code, xid.text)
                if old is None or mark.fatal or not old.fatal:
                    self.marks[gpu.pci] = mark
                return self.marks[gpu.pci]
        return None

    def observe(self, gpus: Iterable[Gpu]) -> list[XidMark]:
        """Forget the marks of GPUs seen off the nvidia driver or off the bus; returns them."""
        on = {g.pci for g in gpus if g.present and g.function.driver == "nvidia"}
        gone = [m for pci, m in self.marks.items() if pci not in on]
        for m in gone:
            del self.marks[m.pci]
        return gone

    def taints(self, driver: str) -> Mapping[str, tuple[dict, ...]]:
        return {pci: ({"key": f"{driver}/xid", "value": str(m.code),
                       "effect": "NoSchedule" if m.fatal else "None"},)
                for pci, m in self.marks.items()}
