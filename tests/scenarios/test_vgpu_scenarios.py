"""vGPU transitions applied by gpud's vGPU pipeline to simulated L40S, A100, H200 and T4 hosts on
both interfaces. Each scenario checks the final types on the GPU (from the simulator's state file),
that the last step keeps the identities (VF or mdev UUID) it promises to keep, that a refused or
blocked step changed nothing and wrote nothing, and a re-apply writes nothing."""

from __future__ import annotations

from collections import Counter

import pytest

from tests.scenarios.vgpu_definitions import SCENARIOS, VgpuScenario
from tests.scenarios.vgpu_harness import VgpuRig, outcome


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
def test_vgpu_scenario(sc: VgpuScenario, tmp_path) -> None:
    rig = VgpuRig(tmp_path, sc)
    for step in sc.steps[:-1]:
        rig.prepare(step)
        rig.gpud_apply(step)
    last = sc.steps[-1]
    identities = rig.devices()  # before a reboot too: what the rebuilt vGPUs must be again
    rig.prepare(last)
    before = rig.devices()
    writes0 = rig.store.writes
    plan = rig.gpud_apply(last)
    after = rig.devices()
    assert outcome(plan) == sc.outcome, plan.infeasible or plan.blocked_by
    assert Counter(after.values()) == Counter(sc.expect)
    if sc.outcome != "done":
        assert after == before and rig.store.writes == writes0  # refused or waiting: untouched
    if sc.uuids_kept:
        kept = {i: t for i, t in identities.items() if sc.expect.get(t)}
        assert kept
        survivors = {i for i in kept if i in after}
        # every vGPU the target still has room for kept its identity (or, after a reboot, got it back)
        per_type = Counter(after.values())
        assert len(survivors) == sum(min(n, Counter(kept.values())[t]) for t, n in per_type.items())
    if sc.vfs_after is not None:
        assert rig.num_vfs() == sc.vfs_after
    if sc.outcome == "done":  # converged: applying again writes nothing
        writes1 = rig.store.writes
        again = rig.gpud_apply(last)
        assert again.steps == [] and rig.store.writes == writes1
    for dev in after:  # a busy vGPU is never removed: whatever was held is still there
        if dev in rig.held:
            assert dev in after
