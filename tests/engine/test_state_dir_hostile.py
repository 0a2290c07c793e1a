"""Whatever sits at gpud's state files (a FIFO, a directory, a link, garbage) is set aside with an
event and never acted on; start never blocks on it; a full disk during a vGPU apply says what was
done and leaves no temp file. Outcomes are read from the state directory and the simulator's state
file, not from gpud's word alone."""

from __future__ import annotations

import errno
import json
import os
import threading
from types import SimpleNamespace
from typing import cast

import pytest

from gpud.engine.gpu_state import VgpuAction
from gpud.engine.vgpu.keeper import RECORD_FILE, VgpuKeeper
from gpud.host.files import safe_file
from gpud.layout.desired import DesiredGpu
from gpud.model import Gpu
from gpud.plan.vgpu import plan_vgpu
from gpud.sim.state import load
from gpud.vgpu_types import by_device
from tests.scenarios.definitions import layout, mig
from tests.scenarios.vgpu_definitions import SCENARIOS
from tests.scenarios.vgpu_harness import VgpuRig
from tests.support.simrig import SimRig

FILES = ("gpu-index.json", "boot.json", "vgpu-record.json", "vgpu-names.json", "reboot-request.json")


def _plant(path, kind):
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "directory":
        os.mkdir(path)
        (path / "x").write_text("x")
    elif kind == "symlink":
        secret = path.parent.parent / "secret.json"
        secret.write_text(json.dumps({"boot_id": "elsewhere", "version": 1, "gpus": []}))
        path.symlink_to(secret)
    else:
        path.write_bytes(b"\x00garbage{[")


def _unblock_all(state):
    for name in FILES:
        p = state / name
        if p.exists() and not p.is_file() and not p.is_dir():
            try:
                os.close(os.open(p, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass


def _start(tmp_path, state):
    """A reconciler started on the state dir, in a thread that must finish within 20 s."""
    out: list = []

    def run():
        try:
            out.append(SimRig(tmp_path, ("h100-80gb:2",), state_dir=str(state), boot_id_path=str(tmp_path / "boot_id")))
        except BaseException as e:  # noqa: BLE001 - checked below
            out.append(e)
    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout=20)
    if t.is_alive():
        _unblock_all(state)
        t.join(timeout=5)
        pytest.fail("start blocked on a state file")
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink", "garbage"])
async def test_every_state_file_that_is_not_gpuds_is_set_aside_and_start_goes_on(tmp_path, kind):
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "boot_id").write_text("boot-1\n")
    for name in FILES:
        _plant(state / name, kind)
    rig = _start(tmp_path, state)
    try:
        # devices: all: with the index map and its copy both unusable, indices cannot be trusted
        assert await rig.apply("version: v1\nlayouts:\n  a:\n    - {devices: all, mig-enabled: true, "
                               "mig-devices: {7g.80gb: 1}}\n")
        pci0 = rig.rec.observation.gpus[0].pci
        assert rig.rec.gpu_states[pci0].state == "converged"
        assert load(rig.dir).gpus[pci0].mig_mode == 1  # the pass ran: nothing blocked it
        said = [e["message"] for e in rig.bus.recent() if e["kind"] == "state-file"]
        for name in FILES:
            if name == "vgpu-names.json":
                continue  # a cache of names, read by the vGPU adapter only when a GPU has vGPUs
            assert any(str(state / name) in m and "set aside" in m for m in said), (name, said)
            assert list(state.glob(f"{name}.set-aside-*")), name
        assert not any("settled it" in e["message"] for e in rig.bus.recent())
        from gpud.api.replies import status_reply
        assert any("gpu-index.json" in m for m in status_reply(rig.rec.view()).state_files)
        if kind == "symlink":
            assert json.loads((tmp_path / "secret.json").read_text())["boot_id"] == "elsewhere"
    finally:
        rig.close()


async def test_a_garbage_reboot_marker_is_never_read_as_a_reboot(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (tmp_path / "boot_id").write_text("boot-1\n")
    (state / "reboot-request.json").write_text('{"reason": 7}')
    rig = SimRig(tmp_path, ("h100-80gb:1",), state_dir=str(state), boot_id_path=str(tmp_path / "boot_id"))
    try:
        assert await rig.apply(layout(mig([0], {"7g.80gb": 1})))
        reboot_events = [e["message"] for e in rig.bus.recent() if e["kind"] == "reboot"]
        assert not any("settled" in m for m in reboot_events), reboot_events
        assert any("set aside" in m for m in reboot_events)
        assert list(state.glob("reboot-request.json.set-aside-*"))
    finally:
        rig.close()


def test_a_full_disk_during_a_vgpu_apply_says_what_was_done(tmp_path, monkeypatch):
    sc = next(s for s in SCENARIOS if s.name == "t4-mdev-seed-3x4Q")
    rig = VgpuRig(tmp_path, sc)
    state = tmp_path / "state"
    state.mkdir()
    keeper = VgpuKeeper(rig.vgpu, str(state))
    gpu = cast(Gpu, SimpleNamespace(nvml=None, pci=rig.pf, index=sc.gpu))  # the fields the keeper reads
    st = load(rig.dir)
    desired = DesiredGpu(pci=rig.pf, index=sc.gpu, entry="layouts.x[0]", workload="vm-vgpu",
                         vgpu_devices={"T4-4Q": 3})
    plan = plan_vgpu(pci=rig.pf, index=sc.gpu, gpu_key=rig.pf, where=rig.pf, state=rig.vgpu.read(rig.pf),
                     desired=desired, model=by_device(st.functions[rig.pf].device), record=keeper.record(gpu),
                     gi_profiles=None)
    assert len(plan.creations) == 3

    def full(fd, data):
        os.write(fd, data[:0])
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(safe_file, "write_all", full)
    result = keeper.run(gpu, VgpuAction(plan, "creations", "3 x create"), on_step=lambda s: None)
    created = set(rig.devices())
    assert len(created) == 3  # the vGPUs exist: the simulator's state says so
    assert result.state == "failed"
    assert "created" in result.message and all(u in result.message for u in created)
    assert "could not be recorded" in result.message and "No space left" in result.message
    assert os.listdir(state) == []  # no temp file left, no half record
    assert str(state / RECORD_FILE) in keeper.problems.by_file
