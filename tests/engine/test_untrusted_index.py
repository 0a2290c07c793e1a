"""The kept index map lost (garbage in gpu-index.json) while GPU 0 is unplugged: a restarted gpud
must not give GPU 0's layout to the former GPU 1. Index-based entries are refused, PCI-address and
UUID entries still apply, the gone GPU stays listed from the map's copy, and status and events say
why. Checked in the simulator's state file."""

from __future__ import annotations

import json

from gpud.api.replies import status_reply
from gpud.engine.apply_lock import ApplyLock
from gpud.engine.reconciler import Reconciler
from gpud.sim import kernel
from gpud.sim.state import load
from tests.support.simrig import SimRig

BY_INDEX = ("version: v1\nlayouts:\n  a:\n    - {devices: [0], mig-enabled: true, mig-devices: {7g.80gb: 1}}\n"
            "    - {devices: [1], mig-enabled: false}\n")


def _restart(rig: SimRig, state) -> Reconciler:
    """What a new gpud process has: its own NVML session and reconciler, the same state dir."""
    rig.new_process(str(state))
    rig.rec = Reconciler(rig.hw, config_path=str(rig.config), apply_lock=ApplyLock(rig.dir / "apply.lock"),
                         bus=rig.bus, state_dir=str(state))
    return rig.rec


async def _setup(tmp_path, *, copy: bool):
    state = tmp_path / "state"
    state.mkdir()
    rig = SimRig(tmp_path, ("h100-80gb:2",), state_dir=str(state))
    gpu0, gpu1 = (g.pci for g in rig.rec.refresh().gpus)
    assert await rig.apply("version: v1\nlayouts:\n  a:\n    - {devices: all, mig-enabled: false}\n")
    assert (state / "gpu-index.json").exists() and (state / "gpu-index.prev.json").exists()
    kernel.unplug(rig.dir, gpu0)
    (state / "gpu-index.json").write_text("{ this is not json")
    if not copy:
        (state / "gpu-index.prev.json").unlink()
    return rig, state, gpu0, gpu1


async def test_index_entries_are_refused_and_the_other_gpu_is_untouched(tmp_path):
    rig, state, gpu0, gpu1 = await _setup(tmp_path, copy=True)
    try:
        rec = _restart(rig, state)
        rig.config.write_text(BY_INDEX)
        assert not rec.load_config()  # refused: the entries name GPUs by index
        await rec.converge()
        assert load(rig.dir).gpus[gpu1].mig_mode == 0  # the former GPU 1 was not switched to MIG
        status = status_reply(rec.view())
        errors = " ".join(status.layout.errors)
        assert "named by its index" in errors and "could not be used" in errors and gpu0 in errors
        listed = {g.pci: (g.index, g.state) for g in status.gpus}
        assert listed[gpu0] == (0, "gone") and listed[gpu1][0] == 1  # numbered from the copy
        assert any("gpu-index.json" in m and "set aside" in m for m in status.state_files)
        assert any(e["kind"] == "state-file" for e in rig.bus.recent())
        assert any(e["kind"] == "layout-invalid" for e in rig.bus.recent())
    finally:
        rig.close()


async def test_pci_address_entries_still_apply(tmp_path):
    rig, state, gpu0, gpu1 = await _setup(tmp_path, copy=False)
    try:
        rec = _restart(rig, state)
        rig.config.write_text(f"version: v1\nlayouts:\n  a:\n    - {{devices: ['{gpu1}'], mig-enabled: true, "
                              "mig-devices: {7g.80gb: 1}}\n")
        assert rec.load_config()
        await rec.converge()
        assert load(rig.dir).gpus[gpu1].mig_mode == 1
        assert rec.gpu_states[gpu1].state == "converged"
        rig.config.write_text(BY_INDEX)
        assert not rec.load_config()  # no copy of the map: indices cannot be trusted either
        assert "no copy of the map" in " ".join(rec.layout_issues[0])
    finally:
        rig.close()


async def test_the_same_gpus_as_the_copy_take_the_copy_as_the_map(tmp_path):
    rig, state, gpu0, gpu1 = await _setup(tmp_path, copy=True)
    try:
        kernel.plug(rig.dir, gpu0)  # nothing changed but the map's bytes
        rec = _restart(rig, state)
        rig.config.write_text(BY_INDEX)
        assert rec.load_config()
        await rec.converge()
        assert load(rig.dir).gpus[gpu0].mig_mode == 1 and load(rig.dir).gpus[gpu1].mig_mode == 0
        assert (state / "gpu-index.json").exists()  # written again from the copy
    finally:
        rig.close()


async def test_a_candidates_match_never_makes_gpud_trust_a_set_aside_map(tmp_path):
    """Issue 33 item 6: the map (and its copy) were written under a layout managing GPU A only; the
    map is then lost and the layout in force manages A and B, so indices are untrusted. A group
    member's `check` of a text whose own `match:` selects only A read "the same GPUs as the copy"
    and made gpud trust the copy: status then said the map was rebuilt and root's next index
    layout was applied. A read-only request changes no daemon state."""
    from gpud.api.handlers import RequestHandler
    from gpud.engine.engine import Engine

    state = tmp_path / "state"
    state.mkdir()
    rig = SimRig(tmp_path, ("h100-80gb:1", "a100-40gb:1"), state_dir=str(state))
    try:
        a, b = rig.rec.refresh().gpus
        only_a = f"match:\n  - {{vendor: \"0x10de\", device: \"0x{int(a.pci_id.split(':')[1], 16):04x}\"}}\n"
        assert await rig.apply("version: v1\nlayouts:\n  a:\n    - {devices: all, mig-enabled: false}\n" + only_a)
        copy = json.loads((state / "gpu-index.prev.json").read_text())
        copy["gpus"] = [g for g in copy["gpus"] if g["pci"] == a.pci]  # as written when gpud saw A alone
        (state / "gpu-index.prev.json").write_text(json.dumps(copy))
        (state / "gpu-index.json").write_text("{ this is not json")
        rec = _restart(rig, state)
        rig.config.write_text(BY_INDEX)
        assert not rec.load_config()  # A and B against a copy that knows A only: index entries refused
        before = status_reply(rec.view())
        assert rec.gpu_index.untrusted is not None
        reply = await RequestHandler(Engine(rec)).op_check(BY_INDEX.replace("mig-devices: {7g.80gb: 1}}",
                                                                            "mig-devices: {7g.80gb: 1}}\n") + only_a,
                                                           "member.yaml")
        assert reply is not None
        assert rec.gpu_index.untrusted is not None
        after = status_reply(rec.view())
        assert after.state_files == before.state_files and not any("rebuilt" in m for m in after.state_files)
        assert not rec.load_config()  # root's index layout still refused
        await rec.converge()
        sim = load(rig.dir).gpus
        assert sim[a.pci].mig_mode == 0 and sim[b.pci].mig_mode == 0  # nothing changed on either GPU
    finally:
        rig.close()
