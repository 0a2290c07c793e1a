"""Issue 33 item 1, pass level: two GPUs in one IOMMU group (a PCIe switch without ACS) were moved
between nvidia and vfio-pci forever, and status said `on vfio-pci` for a GPU on nvidia. Here the
pair (with their HD-audio functions, four endpoints in one group) is driven through passes both
ways; every rebind is counted by the simulated kernel itself (`SimFunction.binds`, one per driver
bind in state.json), never by gpud: a change binds each endpoint once, and the passes after
convergence bind nothing. What status says is compared with the driver the simulator holds."""

from __future__ import annotations

from gpud.api import replies
from gpud.sim.state import load, locked
from gpud.sim.sysfs_tree import render
from tests.support.simrig import SimRig

PASSTHROUGH = "version: v1\nlayouts:\n  a:\n    - {devices: all, workload: vm-passthrough}\n"
CONTAINER = "version: v1\nlayouts:\n  a:\n    - {devices: all, workload: container}\n"
PASSES = 4


def _one_group(rig: SimRig) -> list[str]:
    """Every function of both GPUs in the first GPU's group; the group's members, sorted."""
    with locked(rig.dir) as st:
        gpus = sorted(st.gpus)
        group = st.functions[gpus[0]].iommu_group
        members = sorted(a for a, f in st.functions.items() if a[:-1] in {g[:-1] for g in gpus})
        for a in members:
            st.functions[a].iommu_group = group
        render(rig.dir, st)
    return members


def _binds(rig: SimRig, members: list[str]) -> dict[str, int]:
    fns = load(rig.dir).functions
    return {a: fns[a].binds for a in members}


def _drivers(rig: SimRig, members: list[str]) -> dict[str, str | None]:
    fns = load(rig.dir).functions
    return {a: fns[a].driver for a in members}


def _status(rig: SimRig) -> dict[str, tuple[str, str, str | None]]:
    return {g.pci: (g.state, g.message, g.driver) for g in replies.status_reply(rig.rec.view()).gpus}


async def _moved_once_then_still(rig: SimRig, members: list[str], text: str, want: dict[str, str]) -> None:
    before = _binds(rig, members)
    assert await rig.apply(text)
    assert _drivers(rig, members) == want
    assert {a: n - before[a] for a, n in _binds(rig, members).items()} == dict.fromkeys(members, 1), \
        "a change binds each endpoint of the group exactly once"
    settled = _binds(rig, members)
    for _ in range(PASSES):
        await rig.rec.converge()
    assert _binds(rig, members) == settled, "a pass after convergence rebinds nothing"
    assert _drivers(rig, members) == want


async def test_a_shared_group_moves_once_and_then_stays(tmp_path):
    rig = SimRig(tmp_path, ("rtx6000-ada:2",))
    try:
        members = _one_group(rig)
        gpus = [a for a in members if a.endswith(".0")]
        assert len(members) == 4 and len(gpus) == 2
        await _moved_once_then_still(rig, members, PASSTHROUGH, dict.fromkeys(members, "vfio-pci"))
        for pci in gpus:  # the driver status names is the kernel's
            state, message, driver = _status(rig)[pci]
            assert (state, driver) == ("converged", "vfio-pci") and message.startswith("on vfio-pci"), (state, message)
        native = {a: ("nvidia" if a in gpus else "snd_hda_intel") for a in members}
        await _moved_once_then_still(rig, members, CONTAINER, native)
        for pci in gpus:
            state, message, driver = _status(rig)[pci]
            assert (state, driver) == ("converged", "nvidia") and "vfio" not in message, (state, message)
    finally:
        rig.close()


async def test_a_group_member_moved_back_behind_gpud_is_not_called_on_vfio(tmp_path):
    """Another tool puts one GPU of the passthrough pair back on nvidia: status names the driver the
    kernel shows (drift, not `converged: on vfio-pci`); the pass after it binds that GPU once and
    the next passes nothing."""
    rig = SimRig(tmp_path, ("rtx6000-ada:2",))
    try:
        members = _one_group(rig)
        gpu1 = [a for a in members if a.endswith(".0")][1]
        assert await rig.apply(PASSTHROUGH)
        with locked(rig.dir) as st:  # as `echo > driver_override; echo > unbind; drivers_probe` leaves it
            f = st.functions[gpu1]
            f.driver_override, f.driver = None, "nvidia"
            render(rig.dir, st)
        await rig.rec.refresh_async()  # status --fresh
        state, message, driver = _status(rig)[gpu1]
        assert driver == "nvidia" and state != "converged" and "on vfio-pci" not in message, (state, message)
        before = _binds(rig, members)
        await rig.rec.converge()
        after = _binds(rig, members)
        assert {a: after[a] - before[a] for a in members} == {a: int(a == gpu1) for a in members}
        assert _drivers(rig, members) == dict.fromkeys(members, "vfio-pci")
        for _ in range(PASSES):
            await rig.rec.converge()
        assert _binds(rig, members) == after
        assert _status(rig)[gpu1][:1] == ("converged",)
    finally:
        rig.close()


async def test_the_attacks_split_layout_moves_nothing_over_passes(tmp_path):
    """The attack's walk: passthrough for GPU 0 and containers for GPU 1 of one group (the layout
    that made the GPUs move between the drivers forever). Refused when loaded, and passes after it,
    asked for or not, bind nothing."""
    rig = SimRig(tmp_path, ("rtx6000-ada:2",))
    try:
        members = _one_group(rig)
        assert await rig.apply(CONTAINER)
        before = _binds(rig, members)
        split = ("version: v1\nlayouts:\n  a:\n    - {devices: [0], workload: vm-passthrough}\n"
                 "    - {devices: [1], workload: container}\n")
        assert not await rig.apply(split)
        for _ in range(PASSES):
            await rig.rec.converge()
        assert _binds(rig, members) == before
        errors = replies.status_reply(rig.rec.view()).layout.errors
        assert any("would be split across drivers" in e for e in errors), errors
    finally:
        rig.close()
