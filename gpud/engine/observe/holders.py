"""Who holds a GPU, read from the host: the processes a step waits for or a plan names.

Three questions with three answers, because each step is kept waiting by different things: a
reset by whoever has the device node open (nvidia-persistenced aside: the reset turns persistence
off for the GPU, which ends its hold); sriov-manage's unbind lock by the same, and by the known
GPU services even where /proc does not show their device node; a rebind off the driver by every
process that loses the GPU (device node, the IOMMU group's /dev/vfio node or its VFIO cdev, and
NVML's processes on the GPU and its MIG devices). gpud's own NVML session is never a holder.
"""

from __future__ import annotations

import os

from gpud.host.kernel.procs import Procs
from gpud.host.kernel.sysfs import Sysfs
from gpud.host.nvidia.gpu_reset import KNOWN_HOLDERS, PERSISTENCED
from gpud.host.nvidia.vgpu_sysfs import vfio_cdevs
from gpud.model import Gpu, Holder
from gpud.pci import is_vfio


def device_holders(procs: Procs, pci: str) -> list[Holder]:
    """Processes with the GPU's device node open (persistenced, DCGM, X, CUDA)."""
    minor = procs.nvidia_minor(pci)
    if minor is None:
        return []
    return [h for h in procs.holders([f"/dev/nvidia{minor}"]) if h.pid != os.getpid()]


def reset_holders(procs: Procs, pci: str) -> list[Holder]:
    """Holders a reset waits for: not nvidia-persistenced, whose hold on this GPU ends when the
    reset turns persistence off for it (`nvidia-smi -pm 0 -i <PCI>`, gpud.host.nvidia.gpu_reset)."""
    return [h for h in device_holders(procs, pci) if not PERSISTENCED.startswith(h.name or "-")]


def lock_holders(procs: Procs, pci: str) -> list[Holder]:
    """What keeps the driver's unbind lock (a refused reset, sriov-manage): device node holders,
    then the known GPU services that run."""
    holders = device_holders(procs, pci)
    seen = {h.pid for h in holders}
    return holders + [h for h in procs.running(KNOWN_HOLDERS) if h.pid not in seen]


def rebind_holders(sysfs: Sysfs, procs: Procs, gpu: Gpu) -> tuple[Holder, ...]:
    """Who loses the GPU when it leaves its driver (for `gpudctl plan`), by pid."""
    found: dict[int, Holder] = {}
    paths = []
    minor = procs.nvidia_minor(gpu.pci) if gpu.function.driver == "nvidia" else None
    if minor is not None:
        paths.append(f"/dev/nvidia{minor}")
    if is_vfio(gpu.function.driver):
        if gpu.function.iommu_group is not None:
            paths.append(f"/dev/vfio/{gpu.function.iommu_group}")
        device_dir = os.path.join(sysfs.root, "bus/pci/devices", gpu.pci)
        paths += [f"/dev/vfio/devices/{n}" for n in vfio_cdevs(device_dir)]  # an iommufd VMM's
    listed = list(procs.holders(paths)) if paths else []
    if gpu.nvml is not None:
        listed += list(gpu.nvml.processes) + [h for gi in gpu.nvml.instances for h in gi.holders]
    for h in listed:
        if h.pid != os.getpid():
            found.setdefault(h.pid, h)
    return tuple(found[pid] for pid in sorted(found))
