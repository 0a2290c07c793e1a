"""MIG transitions applied by gpud's reconciler to simulated A100, H100 and H200 hosts.

Each scenario asserts the final state, that every instance present before and after at the same
place kept its MIG UUID (nothing that survives is destroyed), and its scenario-specific promises:
no-op re-applies, untouched hardware on refusal, resets only where a mode changes.
"""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from gpud.api.plan_replies import plan_reply
from gpud.engine.engine import Engine
from gpud.sim import cli as simcli
from tests.scenarios.definitions import SCENARIOS, Scenario
from tests.support.present import present
from tests.support.simrig import SimRig


def _pick(devs: dict[str, tuple[str, int, int]], profile: str, nth: int) -> str:
    matching = sorted((v[1], v[2], u) for u, v in devs.items() if v[0] == profile)
    return matching[nth][2]


@pytest.mark.parametrize("sc", SCENARIOS, ids=lambda s: s.name)
async def test_scenario(sc: Scenario, tmp_path):
    rig = SimRig(tmp_path, sc.gpus)
    runner = None
    try:
        if sc.before:
            assert await rig.apply(sc.before), rig.rec.layout_issues
            assert rig.rec.phase == "converged", rig.rec.gpu_states
        before = rig.mig_devices()
        children = []
        for h in sc.holds:
            child = rig.hold(_pick(before[h.gpu], h.profile, h.nth))
            children.append((h, child))
        for fn, nth, err in sc.faults:
            simcli.fault(rig.dir, fn, nth, err)
        calls0 = rig.calls()
        rig.resets.clear()

        runner = asyncio.create_task(rig.rec.run(debounce=0))
        rig.config.write_text(sc.after)
        assert rig.rec.load_config(), rig.rec.layout_issues
        assert await rig.rec.wait_for(rig.rec.kick("scenario"), 60)

        gpus = rig.rec.observation.gpus
        for h, child in children:
            if h.release_after:
                pci = gpus[h.gpu].pci
                st = rig.rec.gpu_states[pci]
                assert st.state == "waiting", st
                assert child.pid in {x.pid for x in st.holders}
                child.kill()
                child.wait()
                assert await rig.wait_state(pci, {"converged", "failed"}) == "converged", rig.rec.gpu_states[pci]

        after = rig.mig_devices()
        failed = [i for i in sc.fails_one_of if rig.rec.gpu_states[gpus[i].pci].state == sc.state]
        if sc.fails_one_of:
            assert len(failed) == 1, {i: rig.rec.gpu_states[gpus[i].pci] for i in sc.fails_one_of}
        for idx, want in sc.expect.items():
            if idx in failed:
                continue
            pci = gpus[idx].pci
            counts = Counter(name for name, _, _ in after[idx].values())
            if want is None:
                assert rig.mig_mode(idx) == 0 and not counts, (idx, counts)
            else:
                assert rig.mig_mode(idx) == 1 and counts == Counter(want), (idx, counts)
            assert rig.rec.gpu_states[pci].state == "converged", rig.rec.gpu_states[pci]

        if sc.state != "converged":
            matching = [s for s in rig.rec.gpu_states.values() if s.state == sc.state]
            assert matching, rig.rec.gpu_states
            if sc.message:
                assert any(sc.message in s.message for s in matching), matching

        # Survivors keep their MIG UUIDs: a device at the same place with the same profile after
        # the change must be the very same device.
        for idx, devs in after.items():
            for uuid, where in devs.items():
                previous = [u for u, v in before.get(idx, {}).items() if v == where]
                if previous:
                    assert uuid == previous[0], f"GPU {idx}: {where} was destroyed and re-created"

        if sc.unchanged or sc.before == sc.after:
            assert after == before
            assert rig.mutating(calls0) == 0, rig.calls() - calls0
        if sc.resets is not None:
            assert sum(rig.resets.values()) == sc.resets, rig.resets

        # Converged means converged: planning again yields no step for any converged GPU.
        rig.rec.refresh()
        view = rig.rec.view()
        for entry in plan_reply(view.resolution, Engine(rig.rec).preview(present(view.resolution), view.observation)).gpus:
            if rig.rec.gpu_states[entry.pci].state == "converged":
                assert entry.steps == [], entry
    finally:
        if runner is not None:
            runner.cancel()
        rig.close()
