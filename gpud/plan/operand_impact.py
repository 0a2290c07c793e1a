"""Which of a cluster's GPU operands a change disrupts: so gpud pauses only those.

The GPU Operator runs two families of node agents ("operands"). The container side (device
plugin, GFD, DCGM and its exporter, third-party GPU clients) works through the nvidia driver: it
sees a GPU while the GPU is on nvidia, and a GPU arriving there is only advertised once the
device plugin restarts. The sandbox side (KubeVirt's device plugin and its validator) sees the
GPUs on vfio-pci and the vGPUs of vm-vgpu GPUs, and also scans them only when it starts. A change
to a GPU disrupts a side if the GPU belongs to it before or after the change; a pass that changes
no GPU disrupts nothing (mig-manager pauses every operand whatever the change).

Pure: observed GPUs and what the layout wants of them in, an Impact out.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from msgspec import Struct

from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu
from gpud.pci import is_vfio

_TARGET_DRIVER = {"container": "nvidia", "vm-vgpu": "nvidia", "vm-passthrough": "vfio-pci"}


class Impact(Struct, frozen=True):
    """What applying a layout would change, by the side of the operands that see it."""

    changed: tuple[str, ...] = ()  # GPUs (PCI addresses) the pass changes
    container: tuple[str, ...] = ()  # of those, GPUs on nvidia before or after
    sandbox: tuple[str, ...] = ()  # of those, GPUs on vfio-pci or serving vGPUs before or after

    def sides(self) -> set[str]:
        return {side for side, gpus in (("container", self.container), ("sandbox", self.sandbox)) if gpus}


def impact(gpus: Sequence[Gpu], desired: Mapping[str, DesiredGpu], changing: Iterable[str]) -> Impact:
    """`changing`: the GPUs the plan has steps for (MIG or binding)."""
    by_pci = {g.pci: g for g in gpus}
    changed = sorted(set(changing), key=lambda pci: by_pci[pci].index if pci in by_pci else 1 << 30)
    container, sandbox = [], []
    for pci in changed:
        gpu, want = by_pci.get(pci), desired.get(pci)
        now = gpu.function.driver if gpu is not None else None
        target = _TARGET_DRIVER.get(want.workload) if want is not None else now
        if "nvidia" in (now, target):
            container.append(pci)
        if is_vfio(now) or is_vfio(target) or (want is not None and want.workload == "vm-vgpu"):
            sandbox.append(pci)
    return Impact(tuple(changed), tuple(container), tuple(sandbox))
