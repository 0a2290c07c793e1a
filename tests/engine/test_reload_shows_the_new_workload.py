"""Right after a reload takes a new layout, before its pass runs, the engine's resolution is the new
layout's: status must not show a GPU's old workload beside a GPU state that already says it is
pending a change to the new one. The GPU's workload before and after is read from the simulator's
own state file (the driver it binds), not from gpud."""

from __future__ import annotations

from gpud.sim import state as simstate
from tests.scenarios.definitions import layout
from tests.support.present import present
from tests.support.simrig import SimRig


async def test_reload_async_resolves_the_new_layout_before_the_pass(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:1",))
    try:
        assert await rig.apply(layout({"devices": "all", "workload": "container", "mig-enabled": False}))
        (pci,) = simstate.load(rig.dir).gpus
        assert simstate.load(rig.dir).functions[pci].driver == "nvidia"  # on the container driver
        assert present(rig.rec.resolution).desired[pci].workload == "container"

        rig.config.write_text(layout({"devices": "all", "workload": "vm-passthrough"}))
        assert await rig.rec.reload_async("test edit")

        state = rig.rec.gpu_states[pci]
        assert state.state == "pending" and "vfio-pci" in state.message
        assert present(rig.rec.resolution).desired[pci].workload == "vm-passthrough"
        assert simstate.load(rig.dir).functions[pci].driver == "nvidia"  # nothing applied yet
    finally:
        rig.close()
