"""policy.reboot: a reboot is asked for once, only when allowed, and only when a reset cannot
settle a mode change; after the reboot the marker is cleared when the host converged."""

from __future__ import annotations

import pytest

from gpud.engine.mig import executor as mig_executor
from gpud.engine.mig.executor import Outcome
from gpud.host.systemd import logind
from tests.scenarios.definitions import layout, mig
from tests.support.simrig import SimRig


class _Rig(SimRig):
    asked: list[str]  # the reboots asked for, in order


@pytest.fixture
def rig(tmp_path, monkeypatch):
    asked: list[str] = []

    (tmp_path / "boot_id").write_text("boot-before\n")

    async def fake_logind(state_dir: str, reason: str) -> bool:
        # the real request_reboot minus the D-Bus call: its marker logic is what is under test
        if not logind.mark_reboot(state_dir, reason, boot_id_path=str(tmp_path / "boot_id")):
            return False
        asked.append(reason)
        return True

    (tmp_path / "state").mkdir()
    r = _Rig(tmp_path, ("a100-40gb:2",), state_dir=str(tmp_path / "state"), rebooter=fake_logind)
    r.asked = asked

    def reboot_needed(nvml, plan, **kw):
        return Outcome("reboot-required", f"MIG mode stays pending on {plan.pci} after a reset")

    monkeypatch.setattr(mig_executor, "execute", reboot_needed)
    yield r
    r.close()


async def test_never_does_not_reboot(rig):
    await rig.apply(layout(mig([0], {"7g.40gb": 1}), policy={"reboot": "never"}))
    st = rig.rec.gpu_states[rig.rec.observation.gpus[0].pci]
    assert st.state == "reboot-required" and rig.asked == []


async def test_allow_reboots_once_and_not_again_after_a_reboot_that_did_not_help(rig, tmp_path, monkeypatch):
    await rig.apply(layout(mig([0], {"7g.40gb": 1}), policy={"reboot": "allow"}))
    pci = rig.rec.observation.gpus[0].pci
    assert len(rig.asked) == 1 and "reboot requested" in rig.rec.gpu_states[pci].message
    # the machine "rebooted" (another boot id) and the mode is still pending
    (tmp_path / "boot_id").write_text("boot-after\n")
    monkeypatch.setattr(logind.reboot_outcome, "__kwdefaults__", {"boot_id_path": str(tmp_path / "boot_id")})
    await rig.rec.converge()
    assert len(rig.asked) == 1, "a second reboot for the same change"
    assert "not rebooting again" in rig.rec.gpu_states[pci].message
    assert any("did not settle" in e["message"] for e in rig.bus.recent())


async def test_marker_cleared_once_the_host_converged_after_the_reboot(rig, tmp_path, monkeypatch):
    await rig.apply(layout(mig([0], {"7g.40gb": 1}), policy={"reboot": "allow"}))
    marker = tmp_path / "state" / logind.REBOOT_MARKER
    assert marker.exists()
    (tmp_path / "boot_id").write_text("boot-after\n")
    monkeypatch.setattr(logind.reboot_outcome, "__kwdefaults__", {"boot_id_path": str(tmp_path / "boot_id")})
    await rig.apply(layout(mig([0, 1], None), policy={"reboot": "allow"}))  # nothing left to do
    assert rig.rec.phase == "converged"
    assert not marker.exists()
    assert any("the reboot settled it" in e["message"] for e in rig.bus.recent())
