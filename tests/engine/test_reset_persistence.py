"""Persistence mode around a reset: the simulator refuses `nvidia-smi -r` while persistence is on
for the GPU (legacy flag or nvidia-persistenced), as the real tool does (NVSentinel#1690); gpud
turns it off for that GPU, resets, and turns it on again. Outcomes from the simulator's state file."""

from __future__ import annotations

import pytest

from gpud.sim.state import load
from tests.scenarios.definitions import layout, mig
from tests.scenarios.harness import SimRig

GPU0, GPU1 = "0000:18:00.0", "0000:2a:00.0"
MIG_ON = layout(mig([0], {"7g.80gb": 1}))


@pytest.mark.parametrize("mode", ["legacy", "daemon"])
async def test_persistence_is_off_only_for_the_reset_of_that_gpu(tmp_path, mode):
    rig = SimRig(tmp_path, ("a100-80gb:2",), persistence=mode)
    try:
        assert await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "converged", st.message
        sim = load(rig.dir)
        assert {p: dict(m) for p, m in sim.resets.items()} == {GPU0: {"nvidia-smi": 1}}
        assert sim.gpus[GPU0].mig_mode == 1
        assert sorted(sim.persistent) == [GPU0, GPU1] and sim.persistence == mode  # on again, both
        assert not (tmp_path / "state" / "persistence-restore.json").exists()
    finally:
        rig.close()


async def test_without_persistence_nothing_is_toggled(tmp_path):
    rig = SimRig(tmp_path, ("a100-80gb",), persistence="off")
    try:
        assert await rig.apply(MIG_ON)
        assert rig.rec.gpu_states[GPU0].state == "converged"
        assert load(rig.dir).persistent == [] and load(rig.dir).resets[GPU0] == {"nvidia-smi": 1}
    finally:
        rig.close()
