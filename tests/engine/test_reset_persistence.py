"""Persistence mode around a reset, under every variant the simulator models
(docs/hardware/persistence.md): legacy `-pm 1` and nvidia-persistenced that nvidia-smi reaches:
gpud turns persistence off for that GPU, resets, and turns it on again, so persistence ends as it
began; nvidia-persistenced out of nvidia-smi's sight (gpu-operator#118) holds the GPU against the
reset while persistence reads Off (dgx-selinux#3): gpud changes nothing, waits, and names the
holder. Outcomes from the simulator's state file."""

from __future__ import annotations

import pytest

from gpud.sim.state import load
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig

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


async def test_a_daemon_out_of_sight_keeps_the_reset_waiting_with_its_name(tmp_path):
    rig = SimRig(tmp_path, ("a100-80gb:2",), persistence="daemon", persistenced_socket="hidden")
    try:
        await rig.apply(MIG_ON)
        st = rig.rec.gpu_states[GPU0]
        assert st.state == "waiting" and "held by pid 870 nvidia-persiste" in st.message, st.message
        sim = load(rig.dir)
        assert sim.resets == {} and sim.gpus[GPU0].mig_pending == 1 and sim.gpus[GPU0].mig_mode == 0
        assert sorted(sim.persistent) == [GPU0, GPU1]  # nothing toggled: nvidia-smi reports it Off
        assert not (tmp_path / "state" / "persistence-restore.json").exists()
    finally:
        rig.close()
