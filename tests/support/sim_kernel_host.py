"""A simulated host of two H200s (one with its HD-audio companion in an IOMMU group, one alone) and
one without an IOMMU, written straight to DIR; the sysfs adapter over its kernel, and the driver
moves the kernel tests make (tests/sim, tests/host)."""

from __future__ import annotations

import functools
import os

from gpud.host.kernel.sysfs import Sysfs
from gpud.sim import kernel
from gpud.sim.kernel import Store
from gpud.sim.state import SimFunction, SimGpu, SimProcess, SimState, locked, save
from gpud.sim.sysfs_tree import render
from tests.support.present import present

GPU, AUDIO, GPU2, NOGROUP = "0000:3b:00.0", "0000:3b:00.1", "0000:5d:00.0", "0000:00:06.0"
UUID = "GPU-d187104d-6f24-f22c-6f22-72835236781d"


def make_state() -> SimState:
    """Two H200s: one with an HD-audio companion sharing IOMMU group 20, one alone in group 30,
    and a third without IOMMU (like the fixture host)."""
    def gpu_fn(addr, group):
        return SimFunction(addr, 0x10DE, 0x2335, 0x10DE, 0x18BF, 0x030200, native_driver="nvidia",
                           driver="nvidia", iommu_group=group)

    st = SimState(loaded_modules=["nvidia", "snd_hda_intel"])
    st.functions = {
        GPU: gpu_fn(GPU, 20),
        AUDIO: SimFunction(AUDIO, 0x10DE, 0x22BA, 0x10DE, 0x18BF, 0x040300, native_driver="snd_hda_intel",
                           driver="snd_hda_intel", iommu_group=20),
        GPU2: gpu_fn(GPU2, 30),
        NOGROUP: gpu_fn(NOGROUP, None),
    }
    st.gpus = {
        GPU: SimGpu(GPU, "h200", UUID, 0),
        GPU2: SimGpu(GPU2, "h200", "GPU-22222222-0000-0000-0000-000000000002", 1),
        NOGROUP: SimGpu(NOGROUP, "h200", "GPU-33333333-0000-0000-0000-000000000003", 2),
    }
    return st


def make_host(path, state: SimState | None = None) -> str:
    d = os.fspath(path)
    os.makedirs(d, exist_ok=True)
    st = state or make_state()
    save(d, st)
    render(d, st)
    return d


def adapter(d, **kw) -> Sysfs:
    return Sysfs(os.path.join(d, "sys"), store=Store(d, poll_interval=0.005, **kw),
                 modprobe=functools.partial(kernel.modprobe, d))


def add_process(d, proc: SimProcess) -> None:
    with locked(d) as st:
        st.processes.append(proc)
        render(d, st)


def drop_processes(d) -> None:
    with locked(d) as st:
        st.processes.clear()
        render(d, st)


def to_vfio(s: Sysfs, addr: str) -> None:
    s.write(f"bus/pci/devices/{addr}/driver_override", "vfio-pci")
    f = s.function(addr)
    if present(f).driver:
        s.write(f"bus/pci/drivers/{present(f).driver}/unbind", addr)
    s.write("bus/pci/drivers_probe", addr)


def to_native(s: Sysfs, addr: str) -> None:
    s.write(f"bus/pci/devices/{addr}/driver_override", "\n")
    if present(s.function(addr)).driver:
        s.write(f"bus/pci/devices/{addr}/driver/unbind", addr)  # through the device's driver link
    s.write("bus/pci/drivers_probe", addr)
