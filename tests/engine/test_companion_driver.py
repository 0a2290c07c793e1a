"""A rebind cut short leaves the GPU's HD-audio companion on no driver (gpud killed between its
unbind and its probe). For a container layout that is not converged: the next pass probes it, and
when no driver takes it, the GPU says so instead of `converged`. Read back from the simulator's
state file."""

from __future__ import annotations

from gpud.sim.state import load, locked
from gpud.sim.sysfs_tree import render
from tests.support.clock import SteppedClock
from tests.support.simrig import SimRig

GPU, AUDIO = "0000:18:00.0", "0000:18:00.1"
CONTAINER = "version: v1\nlayouts:\n  a:\n    - {devices: all, workload: container}\n"


def _unbind_audio(rig: SimRig) -> None:
    rig.host.store(str(rig.host.sys_root / "bus/pci/drivers/snd_hda_intel/unbind"), AUDIO.encode())
    assert load(rig.dir).functions[AUDIO].driver is None


async def test_a_companion_left_on_no_driver_is_probed_back(tmp_path):
    rig = SimRig(tmp_path, ("rtx6000-ada:1",))
    try:
        _unbind_audio(rig)
        assert await rig.apply(CONTAINER)
        assert load(rig.dir).functions[AUDIO].driver == "snd_hda_intel"
        assert rig.rec.gpu_states[GPU].state == "converged"
    finally:
        rig.close()


async def test_a_companion_no_driver_takes_is_not_converged(tmp_path):
    clock = SteppedClock()  # the binder waits its full verify deadline for a driver that never comes
    rig = SimRig(tmp_path, ("rtx6000-ada:1",), clock=clock)
    try:
        _unbind_audio(rig)
        with locked(rig.dir) as st:  # its driver is gone from the kernel: nothing can take it
            st.loaded_modules.remove("snd_hda_intel")
            render(rig.dir, st)
        assert await rig.apply(CONTAINER)
        gst = rig.rec.gpu_states[GPU]
        assert load(rig.dir).functions[AUDIO].driver is None
        assert gst.state != "converged" and AUDIO in gst.message and "no driver" in gst.message, gst
        assert clock.slept >= 10.0  # it waited out the binder's verify deadline, in no real time
    finally:
        rig.close()
