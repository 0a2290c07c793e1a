"""Hand-made hosts: Gpu records built from the known model tables (layout, plan and engine tests)."""

from __future__ import annotations

import uuid as _uuid

from gpud.model import Gpu, NvmlGpu, PciFunction
from gpud.profiles import MODELS, NVIDIA


def make_gpu(model: str, index: int, address: str | None = None, *, nvml: bool = True,
             mig_mode: int = 0) -> Gpu:
    """A managed GPU of a known model; `nvml=False` is a GPU NVML cannot see (e.g. on vfio-pci)."""
    info = MODELS[model]
    address = address or f"0000:{0x18 + 0x10 * index:02x}:00.0"
    function = PciFunction(
        address=address,
        vendor=NVIDIA,
        device=info.device,
        subsystem_vendor=NVIDIA,
        subsystem_device=info.subsystem_device or 0,
        class_code=0x030200,
        driver="nvidia" if nvml else "vfio-pci",
    )
    nv = None
    if nvml:
        nv = NvmlGpu(
            pci=address,
            uuid=gpu_uuid(address),
            name=info.name,
            minor=index,
            memory_mb=info.memory_mb,
            mig_capable=info.mig_capable,
            mig_mode=mig_mode if info.mig_capable else None,
            mig_pending=mig_mode if info.mig_capable else None,
            profiles=info.profiles,
        )
    return Gpu(index=index, function=function, nvml=nv)


def gpu_uuid(address: str) -> str:
    return "GPU-" + str(_uuid.uuid5(_uuid.NAMESPACE_URL, address))


def host(*models: str, nvml: bool = True) -> list[Gpu]:
    """GPUs of the given models at 0000:18:00.0, 0000:28:00.0, ... with indices 0, 1, ..."""
    return [make_gpu(m, i, nvml=nvml) for i, m in enumerate(models)]
