"""The engine's GPU state table tells its view that it changed by a counter (GpuStates.version):
every way a dict can be changed must move it, or `status` would keep showing a state the engine
has left. The view is checked against the table itself, not against the counter."""

from __future__ import annotations

import pytest

from gpud.engine.gpu_state import GpuState, GpuStates
from tests.scenarios.definitions import layout
from tests.support.simrig import SimRig

A, B = "0000:18:00.0", "0000:2a:00.0"
OK, BUSY = GpuState("converged", "whole GPU"), GpuState("waiting", "held")


@pytest.mark.parametrize("change", [
    lambda t: t.__setitem__(A, BUSY),
    lambda t: t.__delitem__(A),
    lambda t: t.update({B: OK}),
    lambda t: t.update(b=OK),
    lambda t: t.__ior__({B: OK}),
    lambda t: t.setdefault(B, OK),
    lambda t: t.pop(A),
    lambda t: t.popitem(),
    lambda t: t.clear(),
], ids=["set", "del", "update", "update-kw", "ior", "setdefault", "pop", "popitem", "clear"])
def test_every_change_moves_the_version(change):
    table = GpuStates()
    table[A] = OK
    before = (table.version, dict(table))
    change(table)
    assert dict(table) != before[1] and table.version != before[0]


def test_reads_and_a_setdefault_that_finds_the_key_do_not_move_it():
    table = GpuStates({A: OK})
    v = table.version
    _ = (table.get(A), list(table.items()), A in table, len(table), table.setdefault(A, BUSY))
    assert table.version == v and table[A] == OK


async def test_the_view_follows_the_table(tmp_path):
    rig = SimRig(tmp_path, ("h100-80gb:2",))
    try:
        assert await rig.apply(layout({"devices": "all", "mig-enabled": False}))
        rec = rig.rec
        first = rec.view()
        assert rec.view() is first  # nothing changed: the same record
        pci = sorted(rec.gpu_states)[0]
        rec.gpu_states[pci] = GpuState("applying", "a step is running")
        after = rec.view()
        assert after is not first
        assert after.gpu_states[pci].state == "applying" and after.phase_now == "applying"
        assert dict(after.gpu_states) == dict(rec.gpu_states)
        rec.gpu_states.update({pci: GpuState("converged", "whole GPU")})
        assert rec.view().gpu_states[pci].state == "converged" and rec.view().phase_now == rec.phase
    finally:
        rig.close()
