"""Hand-written planner cases: the layouts people actually ask for and where mig-parted fails."""

from __future__ import annotations

import msgspec
import pytest

from gpud.layout.desired import DesiredGpu
from gpud.model import Holder, Placement
from gpud.plan.mig import GpuPlan, plan_gpu
from gpud.plan.placement import ExistingGi, GiSpec, Infeasible, solve
from gpud.profiles import MODELS
from tests.plan.hwmodel import apply_steps, build, gpu_of, hold, make_hw
from tests.support.present import present

PCI = "0000:3b:00.0"


def want(devs: dict[str, int] | None = None, enabled: bool | None = True) -> DesiredGpu:
    return DesiredGpu(PCI, 0, "layouts.test[0]", mig_enabled=enabled, mig_devices=devs or {})


def plan(hw, devs=None, enabled=True) -> GpuPlan:
    return plan_gpu(gpu_of(hw), want(devs, enabled))


def creates(p: GpuPlan) -> list[tuple[str, int]]:
    return [(present(s.profile), present(s.placement).start) for s in p.steps if s.action == "create-gi"]


def actions(p: GpuPlan) -> list[str]:
    return [s.action for s in p.steps]


def converge(hw, devs=None, enabled=True) -> GpuPlan:
    p = plan(hw, devs, enabled)
    assert p.infeasible is None, p.infeasible
    apply_steps(hw, p.steps)
    again = plan(hw, devs, enabled)
    assert again.steps == [], "not idempotent"
    return p


@pytest.mark.parametrize("devs", [{"1g.10gb": 4, "3g.40gb": 1}, {"3g.40gb": 1, "1g.10gb": 4}])
def test_3g_plus_four_1g_any_order(devs):
    """The only H100 layout: 3g@4 + 1g@0..3 (mig-parted's `1g x4 then 3g` order fails)."""
    hw = make_hw()
    p = converge(hw, devs)
    assert sorted(creates(p)) == [("1g.10gb", 0), ("1g.10gb", 1), ("1g.10gb", 2), ("1g.10gb", 3), ("3g.40gb", 4)]
    assert hw.layout() == [(9, (2,)), (19, (0,)), (19, (0,)), (19, (0,)), (19, (0,))]


def test_step_order_and_explicit_placements():
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    p = plan(hw, {"1g.10gb": 4, "3g.40gb": 1})
    assert actions(p) == ["destroy-ci", "destroy-gi"] + ["create-gi"] * 5 + ["create-ci"] * 5
    assert all(s.placement is not None for s in p.steps if s.action.startswith("create"))
    assert [d.profile for d in p.destroyed] == ["7g.80gb"]


def test_seven_1g_to_3g_plus_four_keeps_four():
    hw = make_hw()
    build(hw, [("1g.10gb", s) for s in range(7)])
    before = hw.uuids()
    p = converge(hw, {"3g.40gb": 1, "1g.10gb": 4})
    assert len(p.kept) == 4 and len(p.destroyed) == 3
    assert {before[u][1].start for u in p.kept} == {0, 1, 2, 3}
    assert creates(p) == [("3g.40gb", 4)]
    assert all(u in hw.uuids() for u in p.kept)


def test_all_1g_to_balanced_keeps_two():
    hw = make_hw()
    build(hw, [("1g.10gb", s) for s in range(7)])
    p = converge(hw, {"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1})
    assert len(p.kept) == 2 and len(p.destroyed) == 5
    assert ("3g.40gb", 4) in creates(p)


def test_media_extensions_only_one():
    hw = make_hw()
    p = plan(hw, {"1g.10gb+me": 2})
    assert p.infeasible == "2 x 1g.10gb+me exceeds the 1 instance allowed on NVIDIA H100 80GB HBM3 0000:3b:00.0"
    assert p.steps == []
    converge(hw, {"1g.10gb+me": 1, "1g.10gb": 6})


def test_memory_slices_reason_names_model_and_gpu():
    hw = make_hw("h200")
    p = plan(hw, {"3g.71gb": 2, "4g.71gb": 1})
    assert p.infeasible == "1 x 4g.71gb + 2 x 3g.71gb needs 12 of 8 memory slices on NVIDIA H200 0000:3b:00.0"


def test_placement_conflict_reason_says_what_fits():
    p = plan(make_hw(), {"4g.40gb": 1, "1g.10gb": 4})
    assert p.infeasible is not None
    assert p.infeasible.startswith("1 x 4g.40gb + 4 x 1g.10gb cannot be placed on NVIDIA H100 80GB HBM3 0000:3b:00.0")
    assert "the most that fits is 1 x 4g.40gb + 3 x 1g.10gb" in p.infeasible


def test_unknown_name_lists_offered_profiles():
    p = plan(make_hw("h200"), {"1g.10gb": 1})  # an H100 name on an H200 (mig-parted #157)
    assert p.infeasible is not None and "1g.10gb is not a MIG profile of NVIDIA H200" in p.infeasible
    assert "1g.18gb" in p.infeasible


def test_ci_subdivision_packs_into_one_gi():
    hw = make_hw()
    converge(hw, {"1c.3g.40gb": 3})
    assert hw.layout() == [(9, (0, 0, 0))]


def test_ci_subdivision_overflows_into_second_gi():
    hw = make_hw()
    converge(hw, {"1c.3g.40gb": 4})
    assert hw.layout() == [(9, (0,)), (9, (0, 0, 0))]


def test_ci_packing_over_count_explains_packing():
    p = plan(make_hw(), {"1c.4g.40gb": 5})
    assert p.infeasible is not None and "1c.4g.40gb: 5 packs into 2 x 4g.40gb (4 per GI)" in p.infeasible


def test_ci_change_keeps_the_gi_and_touches_only_differing_cis():
    hw = make_hw()
    ids = build(hw, [("3g.40gb", 4, ["1c.3g.40gb"] * 3)])
    p = converge(hw, {"1c.3g.40gb": 2})
    assert actions(p) == ["destroy-ci"]
    assert p.steps[0].gi == ids[4] and len(p.kept) == 2
    p = converge(hw, {"3g.40gb": 1})
    assert actions(p) == ["destroy-ci", "destroy-ci", "create-ci"]
    assert hw.layout() == [(9, (2,))] and list(hw.gis) == [ids[4]]


def test_busy_instance_is_kept_when_a_layout_allows():
    hw = make_hw()
    build(hw, [("1g.10gb", s) for s in range(7)])
    h = hold(hw, 5)
    p = plan(hw, {"2g.20gb": 1, "1g.10gb": 4})
    assert p.blocked_by == []
    assert h.device in p.kept
    assert ("2g.20gb", 4) not in creates(p)


def test_busy_instance_destroyed_blocks_the_plan():
    hw = make_hw()
    build(hw, [("1g.10gb", s) for s in range(7)])
    h = hold(hw, 5)
    p = plan(hw, {"3g.40gb": 1, "1g.10gb": 4})
    assert p.blocked_by == [h]
    busy = [d for d in p.destroyed if d.holders]
    assert [d.uuid for d in busy] == [h.device] and busy[0].holders == [h]


def test_idempotent_when_observed_equals_desired():
    hw = make_hw()
    build(hw, [("3g.40gb", 4), ("1g.10gb", 0), ("1g.10gb", 1)])
    p = plan(hw, {"3g.40gb": 1, "1g.10gb": 2})
    assert p.steps == [] and p.destroyed == [] and not p.mode_change and len(p.kept) == 3


def test_mig_enabled_none_does_nothing():
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    assert plan(hw, {"1g.10gb": 1}, enabled=None).steps == []


def test_disable_destroys_cis_then_gis_then_mode_off():
    hw = make_hw()
    build(hw, [("3g.40gb", 0), ("3g.40gb", 4)])
    p = converge(hw, enabled=False)
    assert actions(p) == ["destroy-ci", "destroy-ci", "destroy-gi", "destroy-gi", "set-mig-mode"]
    assert p.mode_change and p.steps[-1].enabled is False and hw.mode == 0


def test_enable_from_off_sets_mode_then_creates():
    hw = make_hw(mode=0)
    p = converge(hw, {"7g.80gb": 1})
    assert actions(p) == ["set-mig-mode", "create-gi", "create-ci"]
    assert p.mode_change and not p.reset  # Hopper applies the mode when idle


def test_ampere_mode_change_predicts_reset():
    hw = make_hw("a100-40gb", mode=0)
    p = plan(hw, {"7g.40gb": 1})
    assert p.mode_change and p.reset


def test_mode_change_with_processes_running_is_blocked():
    hw = make_hw(mode=0)
    proc = Holder(77, "train", PCI)
    hw.processes = (proc,)
    p = plan(hw, {"7g.80gb": 1})
    assert p.blocked_by == [proc]


def test_pending_mode_is_repeated_and_flags_reset():
    hw = make_hw("a100-80gb", mode=0)
    hw.pending = 1
    p = plan(hw, {"7g.80gb": 1})
    assert actions(p)[0] == "set-mig-mode" and p.reset


def test_cancelling_a_pending_flip_is_no_mode_change_under_a_job():
    """A100 at mode 0 / pending 1 (MIG on was asked, the reset never came) with a running job, and
    the layout now says MIG off: one set-mig-mode(off) clears the pending flip. The job does not
    block it and no reset is planned (issue 9: it used to plan a blocked reset)."""
    hw = make_hw("a100-80gb", mode=0)
    hw.pending = 1
    job = Holder(77, "train", PCI)
    hw.processes = (job,)
    p = plan(hw, enabled=False)
    assert actions(p) == ["set-mig-mode"] and p.steps[0].enabled is False
    assert p.reset is False and p.blocked_by == []
    apply_steps(hw, p.steps)
    assert (hw.mode, hw.pending) == (0, 0)
    assert plan(hw, enabled=False).steps == []


def test_non_mig_gpu():
    from gpud.model import Gpu, NvmlGpu, PciFunction

    m = MODELS["l40s"]
    g = Gpu(0, PciFunction(PCI, 0x10DE, m.device, 0x10DE, present(m.subsystem_device), 0x030200, "nvidia"),
            nvml=NvmlGpu(PCI, "GPU-1", m.name))
    assert plan_gpu(g, want({"1g.10gb": 1})).infeasible == f"NVIDIA L40S {PCI} does not support MIG"
    assert plan_gpu(g, want(enabled=False)).steps == []


def test_gpu_invisible_to_nvml_is_reported():
    g = msgspec.structs.replace(gpu_of(make_hw()), nvml=None)
    p = plan_gpu(g, want({"7g.80gb": 1}))
    assert p.infeasible is not None and "NVML does not see the GPU" in p.infeasible


def test_plan_is_deterministic_and_serialisable():
    hw = make_hw("h200")
    build(hw, [("1g.18gb", s) for s in range(7)])
    a = plan(hw, {"2g.35gb": 2, "1g.18gb": 3})
    b = plan(hw, {"1g.18gb": 3, "2g.35gb": 2})
    assert a == b
    assert msgspec.json.decode(msgspec.json.encode(a), type=GpuPlan) == a


def test_solver_prefers_low_starts_on_ties():
    profiles = MODELS["h100-80gb"].profiles
    got = solve(profiles, [GiSpec(19, (0,))] * 3)
    assert [a.placement.start for a in got] == [0, 1, 2]


def test_solver_keeps_existing_gi_even_with_other_cis():
    profiles = MODELS["h100-80gb"].profiles
    ex = [ExistingGi(5, 9, Placement(4, 4), (0, 0, 0))]
    got = solve(profiles, [GiSpec(9, (2,)), GiSpec(14, (1,))], ex)
    assert [(a.spec.profile_id, a.placement.start, a.keep) for a in got] == [(9, 4, 5), (14, 0, None)]


def test_solver_unknown_profile_id():
    with pytest.raises(Infeasible, match="profile id 42 is not offered by this GPU"):
        solve(MODELS["h200"].profiles, [GiSpec(42, ())])
