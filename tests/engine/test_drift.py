"""Issue 33 item 5: after another tool changed MIG behind gpud, `status --fresh` showed the new
hardware and still said `converged`, and no pass ran. Each observation is now compared with the
layout: a converged GPU that no longer matches is `drift` with the step that would put it back,
a `drift` event, the `gpud_gpu_state{state="drift"}` metric; policy on-drift: converge (the
default) runs a pass, report only says so. The hardware is changed in the simulator's own state,
as another tool's NVML calls would leave it, and the outcome read back from there."""

from __future__ import annotations

import pytest

from gpud.api import metrics, replies
from gpud.sim.state import load, locked
from gpud.sim.sysfs_tree import render
from tests.support.simrig import SimRig

OFF = "version: v1\nlayouts:\n  a:\n    - {devices: all, mig-enabled: false}\n"


def _mig_on_behind_gpud(rig: SimRig, pci: str) -> None:
    with locked(rig.dir) as st:
        st.gpus[pci].mig_mode = st.gpus[pci].mig_pending = 1
        render(rig.dir, st)


@pytest.mark.parametrize("on_drift", ["converge", "report"])
async def test_hardware_changed_behind_gpud_is_drift(tmp_path, on_drift):
    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        text = OFF + (f"policy:\n  on-drift: {on_drift}\n" if on_drift == "report" else "")
        assert await rig.apply(text)
        gpu0, gpu1 = (g.pci for g in rig.rec.observation.gpus)
        assert replies.status_reply(rig.rec.view()).phase == "converged"
        _mig_on_behind_gpud(rig, gpu0)
        await rig.rec.refresh_async()  # what `status --fresh` does
        st = replies.status_reply(rig.rec.view())
        states = {g.pci: (g.state, g.message) for g in st.gpus}
        assert states[gpu0][0] == "drift" and "MIG" in states[gpu0][1], states
        assert states[gpu1][0] == "converged" and st.phase == "drift"
        assert [e["gpu"] for e in rig.bus.recent() if e["kind"] == "drift"] == [gpu0]
        prom = tmp_path / "gpud.prom"
        metrics.render(st, 1, str(prom))
        assert f'gpud_gpu_state{{index="0",model="{st.gpus[0].model}",pci="{gpu0}",state="drift"}} 1.0' \
            in prom.read_text()
        await rig.rec.refresh_async()  # judged again: said once
        assert [e["gpu"] for e in rig.bus.recent() if e["kind"] == "drift"] == [gpu0]
        if on_drift == "converge":
            await rig.rec.converge()  # the pass the drift asked for
            assert load(rig.dir).gpus[gpu0].mig_mode == 0
            assert replies.status_reply(rig.rec.view()).phase == "converged"
        else:
            assert load(rig.dir).gpus[gpu0].mig_mode == 1  # reported only
    finally:
        rig.close()
