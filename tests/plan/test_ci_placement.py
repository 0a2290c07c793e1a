"""Compute-instance placements in the plan: kept CIs stay at their slots, Nc. keys share GIs.

Judged against tests/plan/hwmodel.py, which enforces CI slots on its own (0, c, 2c ...), and
against the simulator's state file in test_sim_keeps_the_surviving_ci."""

from __future__ import annotations

from gpud.engine.mig.executor import execute
from gpud.host.nvidia.nvml import Nvml
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu, PciFunction, Placement
from gpud.plan.ci_placement import ExistingCi, place_cis
from gpud.plan.mig import plan_gpu
from gpud.profiles import MODELS
from gpud.sim.state import load
from tests.plan.hwmodel import FakeNvml, apply_steps, build, gpu_of, hold, make_hw

H100 = {p.name: p for p in MODELS["h100-80gb"].profiles}


def plan(hw, devs):
    return plan_gpu(gpu_of(hw), DesiredGpu(hw.pci, 0, "layouts.t[0]", mig_enabled=True, mig_devices=devs))


def ci_slots(hw) -> list[tuple[int, list[tuple[int, int]]]]:
    """(GI start, sorted [(CI slices, CI start)]) of every GI of the model GPU."""
    return sorted((g.placement.start, sorted((c.slices, c.start) for c in g.cis.values())) for g in hw.gis.values())


def test_a_2c_fits_only_at_slot_0_of_a_3g():
    ci = {c.slices: c for c in H100["3g.40gb"].ci_profiles}
    assert (ci[1].starts, ci[2].starts, ci[3].starts) == ((0, 1, 2), (0,), (0,))
    layout = place_cis(H100["3g.40gb"].ci_profiles, [ci[1].id, ci[2].id])
    assert layout is not None and layout.placed == ((ci[1].id, 2), (ci[2].id, 0))
    assert place_cis(H100["3g.40gb"].ci_profiles, [ci[2].id, ci[2].id]) is None


def test_kept_ci_is_the_one_whose_slot_survives():
    ci1 = next(c for c in H100["3g.40gb"].ci_profiles if c.slices == 1)
    ci2 = next(c for c in H100["3g.40gb"].ci_profiles if c.slices == 2)
    existing = [ExistingCi(0, ci1.id, 0), ExistingCi(1, ci1.id, 1), ExistingCi(2, ci1.id, 2)]
    layout = place_cis(H100["3g.40gb"].ci_profiles, [ci1.id, ci2.id], existing)
    assert layout is not None
    assert (layout.kept, layout.doomed, layout.create) == ((2,), (0, 1), ((ci2.id, 0),))


def test_nc_keys_of_one_gi_profile_share_a_gi_and_apply_on_strict_hardware():
    hw = make_hw()
    p = plan(hw, {"2c.3g.40gb": 1, "1c.3g.40gb": 1})
    assert p.infeasible is None, p.infeasible
    assert [s.action for s in p.steps] == ["create-gi", "create-ci", "create-ci"]
    assert [(s.profile, s.ci_placement) for s in p.steps[1:]] == [
        ("2c.3g.40gb", Placement(0, 2)), ("1c.3g.40gb", Placement(2, 1))]
    assert str(p.steps[2]) == "create-ci 1c.3g.40gb@0:4 at compute 2:1"
    apply_steps(hw, p.steps)
    assert ci_slots(hw) == [(p.steps[0].placement.start, [(1, 2), (2, 0)])]


def test_changing_one_ci_keeps_its_busy_neighbour_in_place():
    hw = make_hw()
    build(hw, [("3g.40gb", 4, ["1c.3g.40gb"] * 3)])
    gi = next(iter(hw.gis.values()))
    survivor = next(c for c in gi.cis.values() if c.start == 2)
    holder = hold(hw, 4)
    for c in gi.cis.values():  # only the CI at slot 2 is busy
        if c is not survivor:
            c.holders = ()
    p = plan(hw, {"2c.3g.40gb": 1, "1c.3g.40gb": 1})
    assert p.infeasible is None and p.blocked_by == [], (p.infeasible, p.blocked_by)
    assert p.kept == [survivor.uuid]
    assert [s.action for s in p.steps] == ["destroy-ci", "destroy-ci", "create-ci"]
    result = execute(FakeNvml([hw]), p, sleep=lambda s: None)
    assert result.state == "converged", result.message
    assert survivor.holders == (holder,) and ci_slots(hw) == [(4, [(1, 2), (2, 0)])]


def test_a_busy_ci_in_the_only_slot_of_the_new_one_blocks_the_plan():
    hw = make_hw()
    build(hw, [("3g.40gb", 4, ["1c.3g.40gb"] * 3)])
    gi = next(iter(hw.gis.values()))
    holder = hold(hw, 4)
    for c in gi.cis.values():
        c.holders = (holder,) if c.start == 0 else ()
    p = plan(hw, {"2c.3g.40gb": 1, "1c.3g.40gb": 1})
    assert p.blocked_by == [holder]  # the 2c can only sit at 0: counting slices alone misses this


def test_sim_keeps_the_surviving_ci(sim_host):
    """Through the real adapter and the simulated NVML: the state file shows the CI at slot 2 with
    its MIG UUID unchanged, and the new 2c at slot 0."""
    host = sim_host("h100-80gb", mig_on=[0])
    nvml = Nvml()
    try:
        gi = nvml.create_gpu_instance("0000:18:00.0", 9, 4)
        for start in (0, 1, 2):
            nvml.create_compute_instance("0000:18:00.0", gi, 0, start)
        before = {c.start: c.uuid for c in load(host.host_dir).gpus["0000:18:00.0"].gis[0].cis}
        model = MODELS["h100-80gb"]
        fn = PciFunction("0000:18:00.0", 0x10DE, model.device, 0x10DE, model.subsystem_device or 0, 0x030200, "nvidia")
        gpu = Gpu(0, fn, nvml=nvml.gpu("0000:18:00.0"))
        p = plan_gpu(gpu, DesiredGpu(gpu.pci, 0, "layouts.t[0]", mig_enabled=True,
                                     mig_devices={"2c.3g.40gb": 1, "1c.3g.40gb": 1}))
        assert p.kept == [before[2]]
        result = execute(nvml, p, sleep=lambda s: None)
        assert result.state == "converged", result.message
    finally:
        nvml.close()
    (sim_gi,) = load(host.host_dir).gpus["0000:18:00.0"].gis
    after = sorted((c.start, c.profile_id, c.uuid) for c in sim_gi.cis)
    assert [(s, pid) for s, pid, _ in after] == [(0, 1), (2, 0)]
    assert after[1][2] == before[2]


def test_gi_choice_counts_only_cis_whose_slot_survives():
    """Two 3g GIs, each with one 1c: at slot 2 in the GI at 0, at slot 0 (busy) in the GI at 4.
    `2c + 1c` in one GI and `3 x 1c` in the other: per-profile counting sees a tie and may put the
    2c where the busy 1c sits (slot 0 is the 2c's only one); with slots, each GI keeps its 1c."""
    hw = make_hw()
    ci1 = next(c for c in H100["3g.40gb"].ci_profiles if c.slices == 1)
    at0, at4 = hw.create_gi(9, 0), hw.create_gi(9, 4)
    hw.create_ci(at0, ci1.id, 2)
    busy_id = hw.create_ci(at4, ci1.id, 0)
    holder = hold(hw, 4)
    busy_uuid = hw.gis[at4].cis[busy_id].uuid
    p = plan(hw, {"2c.3g.40gb": 1, "1c.3g.40gb": 4})
    assert p.infeasible is None and p.blocked_by == [], (p.infeasible, p.blocked_by)
    assert sorted(p.kept) == sorted([hw.gis[at0].cis[0].uuid, busy_uuid])
    apply_steps(hw, p.steps)
    assert ci_slots(hw) == [(0, [(1, 2), (2, 0)]), (4, [(1, 0), (1, 1), (1, 2)])]
    assert hw.gis[at4].cis[busy_id].holders == (holder,)
