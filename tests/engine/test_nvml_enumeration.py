"""NVML enumerates GPUs at nvmlInit only (docs/hardware/nvml-enumeration.md), so gpud re-initialises
its session when the GPUs on nvidia change: a GPU coming back from vfio-pci, or hot-added, is in
the observation with its NVML identity and MIG state right after the change. Compared with the
simulator's own state file (the GPU's UUID and MIG state as the simulated hardware holds them)."""

from __future__ import annotations

from gpud.sim import kernel
from gpud.sim import state as simstate
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig


def _truth(rig: SimRig, pci: str) -> tuple[str, int, int]:
    gpu = simstate.load(rig.dir).gpus[pci]
    return gpu.uuid, gpu.mig_mode, len(gpu.gis)


async def test_a_gpu_back_from_vfio_pci_gets_its_mig_layout_and_identity(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        pci = rig.rec.refresh().gpus[1].pci
        for layout_back in (layout(mig([1], {"3g.40gb": 2})), layout(mig([1], {"4g.40gb": 1}))):
            # twice: the second trip must be seen as well as the first
            assert await rig.apply(layout({"devices": [1], "workload": "vm-passthrough"}))
            assert simstate.load(rig.dir).functions[pci].driver == "vfio-pci"
            assert await rig.apply(layout_back)
            assert rig.rec.gpu_states[pci].state == "converged", rig.rec.gpu_states[pci]
            uuid, mode, gis = _truth(rig, pci)
            seen = next(g for g in rig.rec.observation.gpus if g.pci == pci)
            assert seen.function.driver == "nvidia" and mode == 1
            assert seen.nvml is not None and seen.nvml.uuid == uuid
            assert seen.nvml.mig_mode == 1 and len(seen.nvml.instances) == gis
        assert gis == 1
    finally:
        rig.close()


async def test_a_hot_added_gpu_is_seen_by_the_next_read(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        pci = rig.rec.refresh().gpus[1].pci
        kernel.unplug(rig.dir, pci)
        assert [g.pci for g in rig.rec.refresh().gpus] == [rig.rec.observation.gpus[0].pci]
        inits = rig.calls()["nvmlInitWithFlags"]
        kernel.plug(rig.dir, pci)
        seen = next(g for g in rig.rec.refresh().gpus if g.pci == pci)
        assert seen.nvml is not None and seen.nvml.uuid == _truth(rig, pci)[0]
        assert rig.calls()["nvmlInitWithFlags"] == inits + 1  # one re-initialisation, not one per read
        rig.rec.refresh()
        assert rig.calls()["nvmlInitWithFlags"] == inits + 1
    finally:
        rig.close()
