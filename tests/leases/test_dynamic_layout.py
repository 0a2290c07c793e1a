"""A dynamic GPU (`mig-devices: dynamic`) under the static pass, checked on the simulator's own
state file: its instances are never touched by an apply; its MIG mode is set only where leases
cannot set it (Ampere, which needs a reset) or the policy keeps it on."""

from __future__ import annotations

import pytest

from gpud.sim import state as simstate
from tests.leases.rig import dynamic_layout, foreign_gi
from tests.support.simrig import SimRig


@pytest.fixture
def hopper(tmp_path):
    r = SimRig(tmp_path, ("h100-80gb:1",))
    yield r
    r.close()


async def test_an_apply_never_touches_a_dynamic_gpus_instances(hopper):
    with simstate.locked(hopper.dir) as state:
        for g in state.gpus.values():
            g.mig_mode = g.mig_pending = 1
    foreign_gi(hopper, "3g.40gb")
    before, calls = simstate.load(hopper.dir).gpus, hopper.calls()
    assert await hopper.apply(dynamic_layout())
    assert hopper.mutating(calls) == 0
    assert simstate.load(hopper.dir).gpus == before
    st = hopper.rec.gpu_states[next(iter(before))]
    assert st.state == "converged" and "MIG on demand (leases)" in st.message


async def test_hopper_mode_follows_leases_unless_kept_on(hopper):
    calls = hopper.calls()
    assert await hopper.apply(dynamic_layout())
    assert hopper.mutating(calls) == 0 and hopper.mig_mode(0) == 0  # leases turn it on
    assert await hopper.apply(dynamic_layout(**{"lease-mig-mode": "keep-on"}))
    assert hopper.mig_mode(0) == 1


async def test_ampere_mode_stays_as_mig_enabled_says(tmp_path):
    rig = SimRig(tmp_path, ("a100-40gb:1",))
    try:
        assert await rig.apply(dynamic_layout())
        assert rig.mig_mode(0) == 1 and rig.mig_devices()[0] == {}
    finally:
        rig.close()
