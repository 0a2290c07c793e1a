"""Executor against the pure hardware model (tests/plan/hwmodel.py), with injected NVML faults."""

from __future__ import annotations

import msgspec
import pytest

from gpud.engine.mig.executor import execute
from gpud.layout.desired import DesiredGpu
from gpud.model import Holder
from gpud.plan.mig import GpuPlan, Step, plan_gpu
from tests.plan.hwmodel import FakeNvml, build, gpu_of, hold, make_hw

PCI = "0000:3b:00.0"
OTHER = "0000:5e:00.0"


def plan_for(hw, devs=None, enabled=True) -> GpuPlan:
    p = plan_gpu(gpu_of(hw), DesiredGpu(hw.pci, 0, "layouts.t[0]", mig_enabled=enabled, mig_devices=devs or {}))
    assert p.infeasible is None, p.infeasible
    return p


class Sleeps(list):
    def __call__(self, s: float) -> None:
        self.append(s)


def run(nvml, plan, **kw):
    sleeps = Sleeps()
    steps: list[tuple[str, str]] = []
    out = execute(nvml, plan, sleep=sleeps, on_step=lambda s, r="done": steps.append((s.action, r)), **kw)
    return out, sleeps, steps


def test_converges_and_reports_each_step():
    hw = make_hw()
    nvml = FakeNvml([hw])
    p = plan_for(hw, {"1g.10gb": 4, "3g.40gb": 1})
    out, sleeps, steps = run(nvml, p)
    assert out.state == "converged" and out.done == len(p.steps) == 10
    assert [a for a, _ in steps] == [s.action for s in p.steps] and all(r == "done" for _, r in steps)
    assert sleeps == []
    assert plan_for(hw, {"1g.10gb": 4, "3g.40gb": 1}).steps == []


def test_nothing_to_do():
    hw = make_hw()
    out, _, _ = run(FakeNvml([hw]), plan_for(hw, {}))
    assert (out.state, out.message) == ("converged", "nothing to do")


def test_blocked_plan_waits_without_touching_the_gpu():
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    h = hold(hw, 0)
    nvml = FakeNvml([hw])
    p = plan_for(hw, {"1g.10gb": 1})
    out, _, _ = run(nvml, p)
    assert out.state == "waiting" and out.holders == [h] and "pid 4242 python3" in out.message
    assert nvml.calls == []


def test_infeasible_plan_fails():
    hw = make_hw()
    p = plan_gpu(gpu_of(hw), DesiredGpu(PCI, 0, "e", mig_enabled=True, mig_devices={"1g.10gb": 8}))
    out, _, _ = run(FakeNvml([hw]), p)
    assert out.state == "failed" and "exceeds" in out.message


def test_transient_errors_are_retried_with_backoff():
    hw = make_hw()
    nvml = FakeNvml([hw])
    nvml.faults["create_gpu_instance"] = [(10, False), (999, False)]
    out, sleeps, _ = run(nvml, plan_for(hw, {"7g.80gb": 1}))
    assert out.state == "converged"
    assert sleeps == [0.2, 0.4]


def test_retries_exhausted_fail_with_function_and_code():
    hw = make_hw()
    nvml = FakeNvml([hw])
    nvml.faults["create_gpu_instance"] = [(10, False)] * 4
    out, sleeps, steps = run(nvml, plan_for(hw, {"7g.80gb": 1}), retries=3)
    assert out.state == "failed" and out.done == 0
    assert "create_gpu_instance failed with NVML error 10: Timeout" in out.message
    assert sleeps == [0.2, 0.4, 0.8]
    assert steps == [("create-gi", "failed")]


def test_timeout_that_hid_a_success_is_not_repeated():
    hw = make_hw()
    nvml = FakeNvml([hw])
    nvml.faults["create_gpu_instance"] = [(10, True)]
    nvml.faults["create_compute_instance"] = [(10, True)]
    out, sleeps, _ = run(nvml, plan_for(hw, {"7g.80gb": 1}))
    assert out.state == "converged" and sleeps == []
    assert hw.layout() == [(0, (4,))]


def test_non_transient_error_fails_at_once():
    hw = make_hw()
    nvml = FakeNvml([hw])
    nvml.faults["create_compute_instance"] = [(23, False)]
    out, sleeps, _ = run(nvml, plan_for(hw, {"7g.80gb": 1}))
    assert out.state == "failed" and "NVML error 23: Insufficient Resources" in out.message
    assert sleeps == [] and out.done == 1


def test_process_started_after_planning_turns_into_waiting():
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    p = plan_for(hw, {"1g.10gb": 1})
    h = hold(hw, 0)  # arrives between plan and execute
    nvml = FakeNvml([hw])
    out, _, _ = run(nvml, p)
    assert out.state == "waiting" and out.holders == [h]
    assert not any(c[0].startswith("destroy") for c in nvml.calls)


def test_in_use_with_a_device_node_holder_turns_into_waiting_on_it():
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    nvml = FakeNvml([hw])
    nvml.faults["destroy_compute_instance"] = [(19, False)]
    persistenced = Holder(900, "nvidia-persistenced", "/dev/nvidia0")
    out, _, _ = run(nvml, plan_for(hw, {"1g.10gb": 1}), holders=lambda pci: [persistenced])
    assert out.state == "waiting" and "in use" in out.message and out.holders == [persistenced]


def test_in_use_with_no_holder_is_retried_and_then_goes_on():
    """Issue 13 item 6: IN_USE that names nobody is not a wait on nothing; once it clears, the plan completes."""
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    nvml = FakeNvml([hw])
    nvml.faults["destroy_compute_instance"] = [(19, False), (19, False)]
    out, sleeps, _ = run(nvml, plan_for(hw, {"1g.10gb": 1}))
    assert out.state == "converged", out.message
    assert sleeps == [0.2, 0.4]
    assert [gi_profile for gi_profile, _ in hw.layout()] == [19]  # the hardware model holds one 1g instance


def test_in_use_with_no_holder_fails_after_a_bounded_time_with_the_reason():
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    nvml = FakeNvml([hw])
    nvml.faults["destroy_compute_instance"] = [(19, False)] * 100
    out, sleeps, steps = run(nvml, plan_for(hw, {"1g.10gb": 1}), in_use_window_s=5.0)
    assert out.state == "failed" and out.holders == []
    assert "no process holds" in out.message and "not waited for" in out.message
    assert sum(sleeps) == pytest.approx(5.0) and max(sleeps) <= 2.0
    assert sleeps == sorted(sleeps)  # backoff: never shorter than the one before
    assert steps == [("destroy-ci", "failed")]
    assert len(nvml.faults["destroy_compute_instance"]) == 100 - len(sleeps) - 1  # one try per sleep, plus the first


def test_reused_ids_are_not_destroyed():
    """The CI the plan saw was replaced by another with the same ids: leave it alone."""
    hw = make_hw()
    build(hw, [("7g.80gb", 0)])
    p = plan_for(hw, {"1g.10gb": 1})
    hw.destroy_ci(1, 0)
    hw.create_ci(1, 4)  # same GI id 1, CI id 0, new UUID
    nvml = FakeNvml([hw])
    out, _, _ = run(nvml, p)
    assert out.state == "failed" and "changed since planning" in out.message
    assert nvml.calls == []


def test_hopper_mode_change_when_idle_needs_no_reset():
    hw = make_hw(mode=0)
    out, _, _ = run(FakeNvml([hw]), plan_for(hw, {"3g.40gb": 2}))
    assert out.state == "converged" and not out.reset_due and hw.resets == 0


def test_ampere_pending_mode_stops_for_a_reset_before_creates():
    """The executor never resets (that needs NVML closed, which only the reconciler can arrange):
    it stops with reset_due once the mode is pending, having created nothing."""
    hw, other = make_hw("a100-40gb", PCI, mode=0), make_hw("a100-40gb", OTHER, mode=1)
    build(other, [("7g.40gb", 0)])
    nvml = FakeNvml([hw, other])
    out, _, _ = run(nvml, plan_for(hw, {"1g.5gb": 7}))
    assert out.state == "reset-required" and out.reset_due, out.message
    assert (hw.mode, hw.pending) == (0, 1) and hw.resets == 0 and other.resets == 0
    assert out.done == 0  # set-mig-mode itself ends in the reset
    assert not any(c[0].startswith("create") for c in nvml.calls)


def test_pending_mode_with_reset_policy_off_stops_before_creates():
    hw = make_hw("a100-80gb", mode=0)
    nvml = FakeNvml([hw])
    out, _, _ = run(nvml, plan_for(hw, {"7g.80gb": 1}), policy_reset="never")
    assert out.state == "reset-required" and "pending" in out.message and out.done == 0 and not out.reset_due
    assert not any(c[0].startswith("create") for c in nvml.calls)


def test_pending_mode_with_device_holder_waits_naming_it():
    hw = make_hw("a100-80gb", mode=0)
    nvml = FakeNvml([hw])
    persistenced = Holder(900, "nvidia-persistenced", "/dev/nvidia0")
    out, _, _ = run(nvml, plan_for(hw, {"7g.80gb": 1}), holders=lambda pci: [persistenced])
    assert out.state == "waiting" and out.holders == [persistenced] and not out.reset_due
    assert "nvidia-persistenced" in out.message


def test_disable_then_verify_mode_off():
    hw = make_hw()
    build(hw, [("3g.40gb", 0), ("3g.40gb", 4)])
    out, _, _ = run(FakeNvml([hw]), plan_for(hw, enabled=False))
    assert out.state == "converged" and hw.mode == 0 and hw.gis == {}


def test_read_only_adapter_fails_cleanly():
    hw = make_hw()
    nvml = FakeNvml([hw], read_only=True)
    out, _, _ = run(nvml, plan_for(hw, {"7g.80gb": 1}))
    assert out.state == "failed" and "read-only mode" in out.message and hw.gis == {}


def test_gpu_vanishing_fails():
    hw = make_hw()
    nvml = FakeNvml([hw])
    p = plan_for(hw, {"7g.80gb": 1})
    del nvml.hw[PCI]
    out, sleeps, _ = run(nvml, p)
    assert out.state == "failed" and "no longer visible" in out.message and len(sleeps) == 3


def test_final_state_is_checked_against_the_target():
    """A plan whose steps do not produce its own target is caught at the end."""
    hw = make_hw()
    p = plan_for(hw, {"7g.80gb": 1})
    bad = msgspec.structs.replace(p, steps=[s for s in p.steps if s.action != "create-ci"])
    out, _, _ = run(FakeNvml([hw]), bad)
    assert out.state == "failed" and "the plan wanted" in out.message


def test_ci_change_in_kept_gi_converges():
    hw = make_hw("h200")
    build(hw, [("3g.71gb", 4, ["1c.3g.71gb"] * 3), ("1g.18gb", 0)])
    nvml = FakeNvml([hw])
    p = plan_for(hw, {"1c.3g.71gb": 2, "1g.18gb": 1, "2g.35gb": 1})
    assert [s.action for s in p.steps] == ["destroy-ci", "create-gi", "create-ci"]
    out, _, _ = run(nvml, p)
    assert out.state == "converged"
    assert plan_for(hw, {"1c.3g.71gb": 2, "1g.18gb": 1, "2g.35gb": 1}).steps == []


@pytest.mark.parametrize("action", ["frobnicate"])
def test_unknown_step_fails(action):
    hw = make_hw()
    p = GpuPlan(PCI, 0, steps=[Step(action, PCI)])
    out, _, _ = run(FakeNvml([hw]), p)
    assert out.state == "failed" and "unknown step" in out.message
