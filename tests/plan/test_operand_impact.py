"""Which operand side a GPU change disrupts, on hand-made observed GPUs."""

from __future__ import annotations

from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, PciFunction
from gpud.plan.operand_impact import impact


def _gpu(index: int, driver: str | None) -> Gpu:
    return Gpu(index=index, function=PciFunction(address=f"0000:{0x18 + index:02x}:00.0", vendor=0x10DE,
                                                 device=0x2335, subsystem_vendor=0x10DE, subsystem_device=0x18BF,
                                                 class_code=0x030200, driver=driver))


def _want(gpu: Gpu, workload: str) -> DesiredGpu:
    return DesiredGpu(pci=gpu.pci, index=gpu.index, entry="layouts.x[0]", workload=workload)


def test_sides_follow_the_driver_before_and_after():
    mig, to_vfio, to_nvidia, vfio_stays, vgpu, untouched = (
        _gpu(0, "nvidia"), _gpu(1, "nvidia"), _gpu(2, "vfio-pci"), _gpu(3, "vfio-pci"), _gpu(4, "nvidia"),
        _gpu(5, "nvidia"))
    gpus = [mig, to_vfio, to_nvidia, vfio_stays, vgpu, untouched]
    desired = {mig.pci: _want(mig, "container"), to_vfio.pci: _want(to_vfio, "vm-passthrough"),
               to_nvidia.pci: _want(to_nvidia, "container"), vfio_stays.pci: _want(vfio_stays, "vm-passthrough"),
               vgpu.pci: _want(vgpu, "vm-vgpu"), untouched.pci: _want(untouched, "container")}
    got = impact(gpus, desired, [vgpu.pci, to_nvidia.pci, to_vfio.pci, mig.pci])
    assert got.changed == (mig.pci, to_vfio.pci, to_nvidia.pci, vgpu.pci)  # index order
    assert got.container == (mig.pci, to_vfio.pci, to_nvidia.pci, vgpu.pci)
    assert got.sandbox == (to_vfio.pci, to_nvidia.pci, vgpu.pci)
    assert got.sides() == {"container", "sandbox"}


def test_nothing_changing_disrupts_nothing():
    g = _gpu(0, "nvidia")
    got = impact([g], {g.pci: _want(g, "container")}, [])
    assert got.changed == () and got.sides() == set()


def test_a_passthrough_only_change_is_sandbox_only():
    a, b = _gpu(0, "vfio-pci"), _gpu(1, "nvidia")
    got = impact([a, b], {a.pci: _want(a, "vm-passthrough")}, [a.pci])
    assert (got.container, got.sandbox) == ((), (a.pci,))
