"""After `gpud-sim reboot` and a daemon start (a new Reconciler on the same state dir, a new NVML
session), gpud rebuilds the layout with the fewest NVML mutating calls, says what it rebuilt, and
`policy.reboot: allow` never asks twice for the same reason.

The fewest calls are counted from the simulator's own state file, independently of gpud's planner:
one nvmlDeviceSetMigMode for each GPU whose MIG mode the reboot left off (Hopper; an Ampere GPU
keeps it), one create per GPU instance and per compute instance the layout holds afterwards, no
destroy and no reset."""

from __future__ import annotations

import json

import pytest

from gpud.engine.apply_lock import ApplyLock
from gpud.engine.binding.udev_rules import UdevRules
from gpud.engine.mig import executor as mig_executor
from gpud.engine.mig.executor import Outcome
from gpud.engine.reconciler import Reconciler
from gpud.host.systemd import logind
from gpud.sim import state as simstate
from gpud.sim.reboot import reboot
from tests.scenarios.definitions import layout, mig
from tests.support.present import present
from tests.support.simrig import SimRig

LAYOUT = layout(mig([0], {"3g.20gb": 2}), mig([1], {"1g.10gb": 4, "3g.40gb": 1}),
                {"devices": [2], "workload": "vm-passthrough"})


def _kw(tmp_path):
    host = tmp_path / "host"
    return dict(state_dir=str(tmp_path / "state"),
                boot_id_path=str(host / "proc/sys/kernel/random/boot_id"),
                udev_rules=UdevRules(str(host / "etc/udev/rules.d/70-gpud-vfio.rules")))


def _daemon_start(rig: SimRig, tmp_path, **extra) -> Reconciler:
    """What a new gpud process has: its own NVML session and reconciler, the same state dir."""
    kw = _kw(tmp_path) | extra
    rig.new_process(kw["state_dir"])
    rig.rec = Reconciler(rig.hw, config_path=str(rig.config), apply_lock=ApplyLock(rig.dir / "apply.lock"),
                         bus=rig.bus, **kw)
    assert rig.rec.load_config()
    return rig.rec


async def test_rebuilt_with_the_fewest_calls_and_said(tmp_path):
    (tmp_path / "state").mkdir()
    rig = SimRig(tmp_path, ("a100-40gb:1", "h100-80gb:2"), **_kw(tmp_path))
    try:
        assert await rig.apply(LAYOUT)
        assert rig.rec.phase == "converged", [s.message for s in rig.rec.gpu_states.values()]
        assert rig.rec.boot_rebuild.summary is None  # first start: no claim
        reboot(rig.dir)
        after_boot = simstate.load(rig.dir)
        a100, h100, passthrough = sorted(after_boot.gpus)
        assert after_boot.functions[passthrough].driver == "vfio-pci"  # gpud's udev rule at device add
        modes_off = sum(1 for a in (a100, h100) if after_boot.gpus[a].mig_mode != 1)
        assert modes_off == 1  # the H100 lost its mode, the A100 kept it

        rec = _daemon_start(rig, tmp_path)
        before = rig.calls()
        rig.resets.clear()
        await rec.converge()
        assert rec.phase == "converged", rec.gpu_states
        done = simstate.load(rig.dir)
        gis = sum(len(done.gpus[a].gis) for a in (a100, h100))
        cis = sum(len(gi.cis) for a in (a100, h100) for gi in done.gpus[a].gis)
        assert (gis, cis) == (7, 7)
        assert rig.mutating(before) == modes_off + gis + cis
        assert (rig.calls() - before)["nvmlGpuInstanceDestroy"] == 0
        assert sum(rig.resets.values()) == 0

        summary = rec.boot_rebuild.summary
        assert present(summary).startswith("rebuilt after boot: ")
        assert f"GPU 0 ({a100}): MIG on, 2 GPU instances" in present(summary)
        assert f"GPU 1 ({h100}): MIG on, 5 GPU instances" in present(summary)
        assert passthrough not in present(summary)  # the udev rule already had it where the layout wants it
        assert [e["message"] for e in rig.bus.recent() if e["kind"] == "rebuilt-after-boot"] == [summary]

        rec = _daemon_start(rig, tmp_path)  # a restart in the same boot claims nothing
        before = rig.calls()
        await rec.converge()
        assert rec.boot_rebuild.summary is None and rig.mutating(before) == 0
    finally:
        rig.close()


@pytest.fixture
def asked(tmp_path):
    asked: list[str] = []

    async def fake_logind(state_dir: str, reason: str) -> bool:
        """logind.request_reboot minus the D-Bus call, with the simulated host's boot id."""
        boot_id_path = _kw(tmp_path)["boot_id_path"]
        prior = logind.reboot_outcome(state_dir, boot_id_path=boot_id_path)
        if prior is not None and prior.rebooted:
            return False
        asked.append(reason)
        (tmp_path / "state" / logind.REBOOT_MARKER).write_text(json.dumps(
            {"reason": reason, "boot_id": logind.current_boot_id(boot_id_path), "requested_at": 1.0}))
        return True

    return asked, fake_logind


def _reset_does_not_apply_before(monkeypatch, boots: int) -> None:
    """A platform whose GPU reset does not apply the MIG mode (passthrough-like: NVML says a reboot
    is needed): until `boots` reboots, the mode change is left pending and the GPU reported
    reboot-required (with boots=99, a cause the reboot does not fix)."""
    real = mig_executor.execute

    def execute(nvml, plan, **kw):
        host = nvml_host_dir()
        if simstate.load(host).boots < boots:
            if any(s.action == "set-mig-mode" for s in plan.steps):
                nvml.set_mig_mode(plan.pci, True)
            return Outcome("reboot-required", f"MIG mode stays pending on {plan.pci} after a reset")
        return real(nvml, plan, **kw)

    monkeypatch.setattr(mig_executor, "execute", execute)


def nvml_host_dir():
    import pynvml

    return pynvml.nvmlLib.host_dir


@pytest.mark.parametrize("settles", [True, False])
async def test_allow_asks_for_one_reboot_and_never_again_after_it(tmp_path, monkeypatch, asked, settles):
    asked, fake_logind = asked
    (tmp_path / "state").mkdir()
    _reset_does_not_apply_before(monkeypatch, boots=1 if settles else 99)
    rig = SimRig(tmp_path, ("a100-40gb:1",), rebooter=fake_logind, **_kw(tmp_path))
    text = layout(mig([0], {"7g.40gb": 1}), policy={"reboot": "allow"})
    try:
        assert await rig.apply(text)
        pci = rig.rec.observation.gpus[0].pci
        assert len(asked) == 1 and rig.rec.gpu_states[pci].state == "reboot-required"
        assert simstate.load(rig.dir).gpus[pci].mig_pending == 1

        reboot(rig.dir)  # the reboot the policy asked for
        for _ in range(2):  # the daemon's start after it, then a restart in the same boot
            rec = _daemon_start(rig, tmp_path, rebooter=fake_logind)
            await rec.converge()
            await rec.converge()
            assert len(asked) == 1, "a second reboot asked for"
        st = rec.gpu_states[pci]
        if settles:
            assert st.state == "converged" and simstate.load(rig.dir).gpus[pci].mig_mode == 1
            assert not (tmp_path / "state" / logind.REBOOT_MARKER).exists()
        else:
            assert st.state == "reboot-required" and "not rebooting again" in st.message
            assert (tmp_path / "state" / logind.REBOOT_MARKER).exists()
    finally:
        rig.close()
