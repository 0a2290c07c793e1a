"""systemd's STATUS= line counts the GPUs on the bus by state and the gone ones apart: a GPU that
left the bus is not one of "3 GPUs" ("3 GPUs: 3 converged, 1 gone" would read as four states of
three GPUs). The GPUs present are taken from the simulator's state file."""

from __future__ import annotations

from gpud.engine import status_line
from gpud.sim import kernel
from gpud.sim import state as simstate
from tests.scenarios.definitions import layout
from tests.support.simrig import SimRig


async def test_a_gone_gpu_is_counted_apart_from_the_converged_ones(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:4",), state_dir=str(tmp_path / "state"))
    try:
        assert await rig.apply(layout({"devices": "all", "mig-enabled": False}))
        assert status_line.of(rig.rec.view()) == "4/4 GPUs converged"
        gone = sorted(simstate.load(rig.dir).gpus)[3]
        kernel.unplug(rig.dir, gone)
        await rig.rec.converge()
        present = [a for a, f in simstate.load(rig.dir).functions.items() if f.present and a in rig.rec.gpu_states]
        assert len(present) == 3 and rig.rec.gpu_states[gone].state == "gone"
        assert status_line.of(rig.rec.view()) == "3/3 GPUs converged, 1 gone"
    finally:
        rig.close()


def test_not_all_converged_lists_each_state(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        rig.rec.refresh()
        assert status_line.of(rig.rec.view()) == "2 GPUs: starting"
    finally:
        rig.close()
